"""Where a circuit's edges start (:mod:`.edges`): every component's alpha carried
forward through the residual stream alone to the entries of the components after it,
the components in pieces of bounded size (:data:`HELD_BUDGET`), each piece in one sweep
over the nodes it reaches, a row per component.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..analysis.heads import only_columns
from ..engine.alpha import apply_rule
from ..rules import takes_rows
from .edge_entries import PROJECTIONS
from .layout import Layout, alpha_or_zero


def source_passes(res, lay: Layout, srs, al, entries: set, between: set):
    """``{entry: (components, [stacked value per semiring])}``, one entry at a time as
    the passes reach it: per component (indices in ``lay.components``, stacked along a
    new first dim) the ⊕ over the paths that pass the component (alpha at its nodes, its
    columns only) and reach the entry through the residual stream alone. A generator: the
    caller meets each with the entry's D and lets it go.

    The components go forward together, in pieces (:func:`_pieces`): one sweep over the
    nodes of ``between`` (those on a residual path to an entry) that a piece's components
    reach, in the graph's order. Each value carries a leading dim with a row per
    component of the piece that reaches the node (a contiguous range of the piece's
    rows: components are taken in the graph's order); each rule runs once per node for
    all those rows (given the rows directly where the rule takes them,
    :func:`..rules.takes_rows`, else under ``torch.vmap``, whose own work is more than
    a pointwise rule's), the inputs that fewer components reach padded with the
    semiring's zero (no path). A head's output projection is taken per head on
    its own columns and rows of the weight (:func:`_per_head_projection`): the other
    columns hold no path of that head. Values are let go once no later step reads
    them."""
    for piece in _pieces(res, srs, _units(res, lay, between)):
        yield from _sweep(res, lay, srs, al, piece, entries)


@dataclass
class _Unit:
    """Components on the same nodes (the heads of a block, or some of them), given rows
    ``rows`` of their piece, and the nodes of ``between`` they reach."""

    comps: list  #: indices in ``lay.components``
    nodes: tuple
    region: set
    rows: int = 0


def _units(res, lay: Layout, between: set) -> list:
    """The components grouped by their nodes, in the order the graph computes them."""
    groups: dict = {}
    for c, comp in enumerate(lay.components):
        groups.setdefault(comp.nodes, []).append(c)
    ids = res.graph.ids
    out = [_Unit(cs, nodes, _reached(set(nodes), between, lay.stops))
           for nodes, cs in groups.items()]  # fmt: skip
    return sorted(out, key=lambda u: min(ids[n] for n in u.nodes))


#: elements of one node's value in a source pass (a row per component that reaches it,
#: two fields per semiring): the components go forward in pieces (in the graph's order)
#: whose largest value holds at most this many (at least one component each)
HELD_BUDGET = 2**21


def _pieces(res, srs, units) -> list:
    """``units`` cut into pieces (lists of units) of at most :data:`HELD_BUDGET`
    elements per node, each filled before the next (a group of components cut where a
    piece is full), each unit given its first row in the piece."""
    per = max((res.values[n].numel() for u in units for n in u.region), default=1) * 2 * len(srs)
    k = max(1, HELD_BUDGET // max(per, 1))
    pieces, piece, rows = [], [], 0
    for u in units:
        i = 0
        while i < len(u.comps):  # (a group cut where the piece is full)
            if rows == k:
                pieces.append(piece)
                piece, rows = [], 0
            part = _Unit(u.comps[i : i + k - rows], u.nodes, u.region, rows)
            piece.append(part)
            rows += len(part.comps)
            i += len(part.comps)
    if piece:
        pieces.append(piece)
    return pieces


def _sweep(res, lay: Layout, srs, al, piece, entries):
    """One forward pass of a piece's components over the nodes they reach, yielding
    ``{entry: (components, [stacked value per semiring])}`` at each entry it computes."""
    values, ids = res.values, res.graph.ids
    comps = [c for u in piece for c in u.comps]
    region = set().union(*(u.region for u in piece))
    order = sorted(region, key=ids.__getitem__)
    last = {}  # node -> the last step of ``order`` that reads it
    for i, n in enumerate(order):
        for a in n.all_input_nodes:
            last[a] = i
    first = {}  # the step at which each unit's seeds are made
    for u in piece:
        first.setdefault(min(order.index(n) for n in u.nodes), []).append(u)
    seeds: dict = {}  # node -> [(first row, rows, [stacked value per semiring])]
    store: dict = {}  # node -> (first row, end row, [stacked value per semiring or None])
    with torch.no_grad():
        for i, n in enumerate(order):
            for u in first.get(i, ()):
                for node, vs in _unit_seeds(res, lay, srs, al, u).items():
                    seeds.setdefault(node, []).append((u.rows, len(u.comps), vs))
            got = _step(res, srs, n, store, seeds.pop(n, ()))
            if got is not None:
                store[n] = got
            for a in (*n.all_input_nodes, n):  # let go of what no later step reads
                if last.get(a, -1) <= i:
                    store.pop(a, None)
            if n in entries and got is not None:
                lo, hi, vs = got
                like = values[n]
                yield {n: (comps[lo:hi], [_or_zero_rows(sr, v, like, hi - lo)
                                          for sr, v in zip(srs, vs)])}  # fmt: skip
            del got


def _unit_seeds(res, lay, srs, al, unit) -> dict:
    """``{node: [stacked value per semiring]}``: a unit's alpha at its nodes (each
    component's columns only), or after the heads' output projection."""
    comps = [lay.components[c] for c in unit.comps]
    seeds = {n: _group_seed(res, srs, al, comps, n) for n in unit.nodes}
    proj = _per_head_projection(res, srs, comps, seeds, unit.region)
    return seeds if proj is None else proj


def _step(res, srs, n, store, seeds):
    """``(first row, end row, [value per semiring or None])`` at node ``n``: the forward
    rule over the rows of every component that reaches an input, each row of a unit
    seeded here its seed instead; None where nothing reaches ``n``."""
    graph, values, needed = res.graph, res.values, res.needed
    ins = {a: store[a] for a in n.all_input_nodes if a in store}
    spans = [(lo, hi) for lo, hi, _ in ins.values()] + [(r, r + k) for r, k, _ in seeds]
    if not spans:
        return None
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    out = [None] * len(srs)
    if ins:
        padded = {a: [None if v is None else _pad(sr, v, a_lo - lo, hi - a_hi, values[a])
                      for sr, v in zip(srs, vs)]
                  for a, (a_lo, a_hi, vs) in ins.items()}  # fmt: skip
        nid = graph.ids[n]
        if hi - lo == 1:  # one row: the rules on the values themselves (compiled kernels run)
            one = {a: [None if v is None else tuple(f[0] for f in v) for v in vs]
                   for a, vs in padded.items()}  # fmt: skip
            got = apply_rule(graph, values, srs, nid, one, needed)
            out = [None if v is None else tuple(f[None] for f in v) for v in got]
        elif takes_rows(n.target, srs):
            out = apply_rule(graph, values, srs, nid, padded, needed, rows=hi - lo)
        else:

            def rule(sub):
                got = apply_rule(graph, values, srs, nid, sub, needed)
                # (plain tuples: vmap returns no tuple subclass, such as a normalized value)
                return {s: tuple(v) for s, v in enumerate(got) if v is not None}

            dims = ({a: [None if v is None else 0 for v in vs] for a, vs in padded.items()},)
            got = torch.vmap(rule, in_dims=dims)(padded)
            out = [got.get(s) for s in range(len(srs))]
    like = values[n]
    for r, k, vs in seeds:  # (a unit never reaches its own seeds: they replace its rows)
        for s, sr in enumerate(srs):
            seed = _pad(sr, vs[s], r - lo, hi - r - k, like)
            if out[s] is None:
                out[s] = seed
                continue
            keep = torch.ones(hi - lo, dtype=torch.bool, device=like.device)
            keep[r - lo : r - lo + k] = False
            out[s] = tuple(torch.where(keep.view(-1, *[1] * (f.dim() - 1)), f, g)
                           for f, g in zip(out[s], seed))  # fmt: skip
    return lo, hi, out


def _pad(sr, value, before: int, after: int, like) -> tuple:
    """A stacked value with ``before`` and ``after`` rows of the semiring's zero added."""
    value = tuple(value)
    if not before and not after:
        return value
    zero = sr.zero(like.shape, like)
    out = []
    for f, z in zip(value, zero):
        z = z.to(f.dtype).expand(1, *f.shape[1:])
        out.append(torch.cat([z.expand(before, *f.shape[1:]), f, z.expand(after, *f.shape[1:])]))
    return tuple(out)


def _or_zero_rows(sr, value, like, rows: int) -> tuple:
    if value is None:
        return tuple(f.expand(rows, *f.shape) for f in sr.zero(like.shape, like))
    return tuple(value)


def _group_seed(res, srs, al, comps, node) -> list:
    """Per semiring, alpha at ``node`` for each component (its columns only), stacked."""
    like = res.values[node]
    out = []
    for sr in srs:
        a = alpha_or_zero(res, al, node, sr)
        per = []
        for comp in comps:
            v = a
            if comp.cols is not None:
                mask = torch.zeros(like.shape[-1], dtype=torch.bool, device=like.device)
                mask[comp.cols] = True
                v = only_columns(sr, a, mask, like)
            per.append(tuple(v))
        out.append(tuple(torch.stack(f) for f in zip(*per)))
    return out


def _reached(seeds, between, stops) -> set:
    region, todo = set(), list(seeds)
    while todo:
        n = todo.pop()
        if n in region:
            continue
        region.add(n)
        todo.extend(u for u in n.users if u in between and u not in stops)
    return region


_MOVES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default, torch.ops.aten.clone.default)  # fmt: skip


def _per_head_projection(res, srs, comps, seeds, region):
    """``{projection output: [stacked value per semiring]}``: where the heads' node is
    read only by the output projection (a matmul ``x @ w``, ``addmm(bias, x, w)``, after
    reshapes that keep the columns), each head's alpha through it computed on its own
    columns of ``x`` and rows of ``w`` (the rest holds the semiring's zero: no path of
    that head), the heads batched; None where it is not laid out so."""
    if len(seeds) != 1 or any(c.cols is None for c in comps):
        return None
    ((site, stacked),) = seeds.items()
    values, needed = res.values, res.needed
    n = site
    for _ in range(8):
        users = [u for u in n.users if u in region]
        if len(users) != 1:
            return None
        (u,) = users
        if u.target in PROJECTIONS:
            x, w = u.args[1:3] if u.target is torch.ops.aten.addmm.default else u.args[:2]
            ok = x is n and isinstance(w, torch.fx.Node) and w not in needed and not u.kwargs
            if not ok or values[n].dim() != values[w].dim():
                return None
            weight = values[w]
            out = []
            for sr, v in zip(srs, stacked):
                flat = tuple(f.reshape(len(comps), *values[n].shape) for f in v)
                a = tuple(torch.stack([f[i][..., c.cols] for i, c in enumerate(comps)])
                          for f in flat)  # fmt: skip
                wt = torch.stack([weight[..., c.cols, :] for c in comps])
                got = sr.leave(sr.inner.matmul(a, wt), res.graph.ids[u])
                out.append(tuple(got))
            return {u: out}
        if u.target not in _MOVES or values[u].shape[-1] != values[site].shape[-1]:
            return None
        n = u
    return None
