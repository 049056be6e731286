"""The edges of a circuit: the ⊕ over the whole paths that leave one component and enter
the next through the residual stream alone, split by the input they enter (DESIGN §3b).

Components are the sites of :func:`.nodes.circuit_nodes` other than the residual
stream: the token embedding, each attention head (its slice of the output projection's
input), each MLP (its output) and the target. A path passes a chain of them; between two
that follow each other it runs through the residual stream only (adds, norms, the output
projection, the lm head: nothing that is another component; the residual sites, the
layers' inputs, included). The edge ``u -> v`` is the ⊕ over the whole paths that pass
``u`` and then ``v``, entering ``v`` by

- ``"q"``, ``"k"``, ``"v"`` (a head): that head's columns of the query / key / value
  projection, i.e. the paths from the projection's input that reach the head's slice of
  the output projection's input (under grouped-query attention: the paths through the
  shared K/V columns that reach this query head);
- ``"mlp"`` (an MLP): the MLP's first ops;
- ``"target"``: the output itself.

Each entry point is a tensor ``x`` (the projection's input, the tensor the MLP reads, the
output) with ``D_e(x)``, the ⊕ over the paths from ``x`` that go on through that entry
alone. A reverse pass from ``x``, restricted to the nodes between the components (it
ends at every component's site and may not enter one), gives at a site ``u`` the ⊕ over
the residual-only paths from ``u`` to ``x`` times ``D_e``; ``alpha(u) ⊗`` that, ⊕-ed over
the hidden units of ``u`` at each position, is the edge. Residual paths keep their
position (norms mix the units of one position), so an edge's position is the position of
``u`` and of the entry both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..analysis.heads import QKV, only_columns
from ..engine.alpha import apply_rule
from ..engine.reverse import contributions, propagate
from ..rules import takes_rows
from ..semirings import MaxProduct
from .layout import (
    BATCH_BUDGET,
    EDGE_COLUMNS,
    SHORT_ROLES,
    Component,
    Layout,
    alpha_or_zero,
    check_semirings,
    circuit_alphas,
    head_plan,
    layout,
    pinned,
    residual_region,
    text_column,
)
from .nodes import readout, site_labels


def _layer_entry_d(res, lay: Layout, srs, layer: int) -> list:
    """Per head of a block, ``{(role, x): [D per semiring]}``: at the input ``x`` of each
    projection, ⊕ over the paths through that role's columns that reach the head's slice
    of the output projection's input (at every position).

    Where the block's heads are known to be apart (below), each head's D at a
    projection's output is the reverse pass's own D there, on the head's columns: every
    path from those columns passes that head's slice and no other. Otherwise, and to
    find out, one pass back from the heads' site for all heads at once: a leading head
    dim, the rules under ``torch.vmap`` (the heads share the site and the region between
    it and the projections; they differ in the columns their D starts from)."""
    comps = lay.heads[layer]
    plans = [head_plan(res, lay, srs, layer, c.head) for c in comps]
    first = plans[0]
    graph, values, needed = res.graph, res.values, res.needed
    apart = graph.__dict__.setdefault("_heads_apart", {})
    # (which columns a head's paths leave from depends on the graph, not on the length:
    # a graph with symbolic sizes finds it once for every length)
    key = (first.site.name, tuple(values[first.site].shape[-1:]), len(plans))
    masks = apart.get(key)
    if masks and _still_apart(res, srs, first, masks):
        ks = [res.semirings.index(sr) for sr in srs]
        got = {p.proj: [tuple(res._store[p.proj][k]) for k in ks] for p in first.projs
               if p.proj in res._store}  # fmt: skip

        def mine(h, proj, sr, v):
            return only_columns(sr, v, masks[proj.name][h], values[proj])

        sliced = _sliced_entry_d(res, srs, plans, masks, got)
        return sliced if sliced is not None else _entry_d(res, srs, plans, mine, got)
    seeds = [tuple(torch.stack(f) for f in zip(*(tuple(pl.d[s]) for pl in plans)))
             for s in range(len(srs))]  # fmt: skip

    projs = frozenset(p.proj for p in first.projs)

    def run(d):
        store = propagate(graph, values, srs, {first.site: list(d)}, needed,
                          within=first.region, start=graph.ids[first.site] + 1,
                          stop=first.stop, store_at=projs)  # fmt: skip
        return {p.proj: [tuple(v) for v in store[p.proj]] for p in first.projs
                if p.proj in store}  # fmt: skip

    with torch.no_grad():
        got = _per_head(run, seeds, len(comps)) if _compiles(srs) else None
        if got is None:
            per = sum(values[n].numel() for n in first.region) * 2 * len(srs)
            chunk = max(1, min(len(comps), BATCH_BUDGET // max(per, 1)))
            got = torch.vmap(run, chunk_size=chunk)(seeds)
    if key not in apart and any(isinstance(sr, MaxProduct) for sr in srs):
        apart[key] = _heads_apart(res, srs, plans, got)
    return _entry_d(res, srs, plans, lambda h, proj, sr, v: tuple(f[h] for f in v), got)


def _compiles(srs) -> bool:
    """Whether a semiring's contractions run compiled kernels (which a value batched by
    ``torch.vmap`` cannot run: there, one pass per head is faster)."""
    return any(isinstance(sr, MaxProduct) and sr.neuron for sr in srs)


def _per_head(run, seeds, heads: int):
    """``run`` on each head's seeds (the leading dim of ``seeds``, per semiring) in turn,
    its outputs stacked as ``torch.vmap(run)`` stacks them; None where the heads' outputs
    are not alike (then ``vmap`` runs)."""
    outs = [run([tuple(f[h] for f in s) for s in seeds]) for h in range(heads)]
    if any(o.keys() != outs[0].keys() for o in outs):
        return None
    return {
        p: [tuple(torch.stack(fs) for fs in zip(*(o[p][s] for o in outs)))
            for s in range(len(seeds))]
        for p in outs[0]
    }  # fmt: skip


def _sliced_entry_d(res, srs, plans, masks, got):
    """:func:`_entry_d` where each projection is a matmul ``x @ w`` (``addmm``, ``mm``,
    ``bmm``) and each head has as many columns of it: each head's D through it on its
    own columns and rows of ``w`` (the others hold its zero), the heads batched; None
    where the projections are not laid out so."""
    values, needed, ids = res.values, res.needed, res.graph.ids
    out = [{} for _ in plans]
    for p in plans[0].projs:
        if p.proj not in got:
            continue
        u = p.proj
        if u.target not in _PROJECTIONS or u.kwargs:
            return None
        x, w = u.args[1:3] if u.target is torch.ops.aten.addmm.default else u.args[:2]
        if x is not p.x or not isinstance(w, torch.fx.Node) or w in needed:
            return None
        cols = [masks[u.name][h] & plan.cols[p] for h, plan in enumerate(plans)]
        idx = [c.nonzero().reshape(-1) for c in cols]
        if len({len(i) for i in idx}) != 1 or not len(idx[0]):
            return None
        wt = torch.stack([values[w][..., i].transpose(-2, -1) for i in idx])
        for s, sr in enumerate(srs):
            d = tuple(torch.stack([f[..., i] for i in idx]) for f in got[u][s])
            with torch.no_grad():
                c = sr.leave(sr.inner.matmul(sr.enter(d, ids[u]), wt), ids[u])
            like = values[x]  # (in its dtype, as the rule's contribution would be)
            c = tuple(f.to(like.dtype) if f.is_floating_point() else f for f in c)
            for h in range(len(plans)):
                slot = out[h].setdefault((p.role, p.x), [None] * len(srs))
                slot[s] = sr.accumulate(slot[s], tuple(f[h] for f in c))
    return out


def _entry_d(res, srs, plans, pick, got) -> list:
    """Per head, ``{(role, x): [D per semiring]}`` from ``got`` (``{projection output:
    [value per semiring]}``, read for head ``h`` by ``pick(h, projection, semiring,
    value)``): D on the head's columns of each projection's output, through the
    projection to its input."""
    graph, values, needed = res.graph, res.values, res.needed
    out = []
    for h, plan in enumerate(plans):
        d_out: dict = {}
        for p in plan.projs:
            if p.proj not in got:
                continue
            pl = values[p.proj]
            dp = [only_columns(sr, pick(h, p.proj, sr, v), plan.cols[p], pl)
                  for sr, v in zip(srs, got[p.proj])]  # fmt: skip
            with torch.no_grad():
                for inp, s, c in contributions(graph, values, srs, graph.ids[p.proj], dp, needed):
                    if inp is p.x:
                        slot = d_out.setdefault((p.role, p.x), [None] * len(srs))
                        slot[s] = srs[s].accumulate(slot[s], c)
        out.append(d_out)
    return out


def _still_apart(res, srs, plan, masks) -> bool:
    """Whether this call's reverse pass has no path from a projection's columns that no
    head's are (checked under MaxProduct where the pass has it)."""
    k = next((res.semirings.index(sr) for sr in srs if isinstance(sr, MaxProduct)), None)
    if k is None:
        return True
    for p in plan.projs:
        if p.proj not in res._store:
            continue
        hi = res._store[p.proj][k][0]
        union = torch.stack(masks[p.proj.name]).any(0)
        if bool((hi.reshape(-1, hi.shape[-1])[:, ~union] != -math.inf).any()):
            return False
    return True


def _heads_apart(res, srs, plans, got):
    """``{projection output's name: [columns per head]}`` where the heads of a block are
    apart, else None: each head's paths leave each projection's output from columns of
    its own (no other head's paths leave there), and every path from the projection's
    output to the output passes a head's slice. Read off one call's passes from each
    head's slice (``got``, a leading head dim): under MaxProduct (whose zero is no path
    at all: a product of 0 is a path) the heads' D have disjoint columns and the reverse
    pass's D is the zero off them, and under every semiring each head's D equals the
    reverse pass's on its columns. That depends on the graph alone (which paths
    exist), so a later call of the same trace reads the reverse pass's D on each head's
    columns instead of passing back from each head."""
    m = next(i for i, sr in enumerate(srs) if isinstance(sr, MaxProduct))
    out = {}
    for p in plans[0].projs:
        if p.proj not in got or p.proj not in res._store:
            return None
        like = res.values[p.proj]
        n = like.shape[-1]
        hi = got[p.proj][m][0]
        cols = [(hi[h] != -math.inf).reshape(-1, n).any(0) for h in range(len(plans))]
        union = torch.stack(cols).sum(0)
        full_hi = res._store[p.proj][res.semirings.index(srs[m])][0]
        if bool((union > 1).any()) or bool((full_hi.reshape(-1, n)[:, union == 0]
                                           != -math.inf).any()):  # fmt: skip
            return None
        for s, sr in enumerate(srs):
            full = res._store[p.proj][res.semirings.index(sr)]
            for h in range(len(plans)):
                mine = only_columns(sr, tuple(f[h] for f in got[p.proj][s]), cols[h], like)
                theirs = only_columns(sr, full, cols[h], like)
                if not all(_same(a, b) for a, b in zip(mine, theirs)):
                    return None
        out[p.proj.name] = cols
    return out


def _same(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    tol = 1e-12 if a.dtype == torch.float64 else 1e-5
    return bool(torch.allclose(a, b, rtol=tol, atol=0.0, equal_nan=True))


def _mlp_entry_d(res, lay: Layout, srs, layer: int) -> dict:
    graph, values, needed = res.graph, res.values, res.needed
    ks = [res.semirings.index(sr) for sr in srs]
    out: dict = {}
    with torch.no_grad():
        for op, via in lay.mlp_entries[layer]:
            if op not in res._store:
                continue
            d = [res._store[op][k] for k in ks]
            for inp, s, c in contributions(graph, values, srs, graph.ids[op], d, needed):
                if inp is via:
                    slot = out.setdefault(via, [None] * len(srs))
                    slot[s] = srs[s].accumulate(slot[s], c)
    return out


# -- residual passes -------------------------------------------------------------------


def residual_pass(res, lay: Layout, srs, acc: dict) -> dict:
    """``{component node: [value per semiring]}``: from the entry values ``acc``
    (``{tensor: [D per semiring]}``), the ⊕ over the paths from each component's node
    that reach an entry through the residual stream alone, times its D."""
    needed = res.needed
    region = residual_region(res, lay, acc)
    graph = res.graph
    start = max(graph.ids[n] for n in acc) + 1
    with torch.no_grad():
        store = propagate(graph, res.values, srs, dict(acc), needed, within=region, start=start,
                          stop=min(graph.ids[n] for n in region), store_at=lay.stops)  # fmt: skip
    return {n: v for n, v in store.items() if n in lay.stops}


def _source_passes(res, lay: Layout, srs, al, entries: set, between: set):
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


_PROJECTIONS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default)  # fmt: skip
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
        if u.target in _PROJECTIONS:
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


def _by_position(res, lay: Layout, x) -> bool:
    """Whether ``x`` is laid out (…, positions, hidden) as the components are (a residual
    path keeps its position: its edge's position can be read at the entry)."""
    shape = res.values[x].shape
    lead = 1
    for d in shape[:-1]:
        lead *= int(d)
    return len(shape) >= 2 and lead == lay.positions and shape[-2] == lay.positions


def _backward_edge_values(res, lay: Layout, srs, acc, al):
    """Per semiring, (components, positions): the edges into the entries ``acc`` by one
    residual pass back from them, read at each component's nodes (zero where the pass
    does not reach them)."""
    store = residual_pass(res, lay, srs, acc)
    groups: dict = {}
    for c, comp in enumerate(lay.components):
        groups.setdefault(comp.nodes, []).append(c)
    parts = [None] * len(lay.components)
    like = res.values[lay.target]
    for cs in groups.values():
        comps = [lay.components[c] for c in cs]
        got = _per_group(res, lay, comps, srs, store, al)
        for i, c in enumerate(cs):
            if got is None:
                parts[c] = [sr.zero((lay.positions,), like) for sr in srs]
            else:
                parts[c] = [tuple(f[i] for f in v) for v in got]
    return [tuple(torch.stack(f) for f in zip(*(p[s] for p in parts))) for s in range(len(srs))]


def _meeting(res, lay: Layout, srs, meeting) -> dict:
    """``{entry: (rows, [per semiring: the D of the destinations there])}`` from
    ``meeting`` (``[(row, {entry: [D per semiring]})]``): the destinations that share an
    entry stacked once as (positions, destinations, hidden), where a D has no dims of its
    own (else a list, one D per destination, met one at a time). Each destination's own D
    is let go as its entry is stacked."""
    by_entry: dict = {}
    for r, acc in meeting:
        for x, slot in acc.items():
            by_entry.setdefault(x, []).append((r, slot))
        acc.clear()
    out = {}
    for x in list(by_entry):
        group = by_entry.pop(x)
        dim = res.values[x].dim()
        per = []
        for s in range(len(srs)):
            ds = [slot[s] for _, slot in group]
            if all(f.dim() == dim for d in ds for f in d):
                ds = tuple(torch.stack(fs).reshape(len(group), lay.positions, -1)
                           .transpose(0, 1).contiguous() for fs in zip(*ds))  # fmt: skip
            per.append(ds)
        out[x] = ([r for r, _ in group], per)
    return out


def _meet(res, lay: Layout, srs, fwd, dests, total) -> list:
    """``total`` (per semiring, (destinations, components, positions)) with the values
    of the components ``fwd`` (``{entry: (components, [stacked value per semiring])}``)
    met with the destinations' D at each entry (``dests``, from :func:`_meeting`)
    ⊕-added in. The destinations that share an entry at once, as one contraction of
    values per semiring (``Semiring.contract``: the components' values at the entry
    against the destinations' D, over the hidden units, per position), ⊕-added into the
    rows of those destinations and components at once."""
    positions = lay.positions
    like = res.values[lay.target]
    for x, (idx, rows) in fwd.items():
        if x not in dests or not idx:
            continue
        rws, ds = dests[x]
        at = (torch.as_tensor(rws, device=like.device)[:, None],
              torch.as_tensor(idx, device=like.device)[None, :])  # fmt: skip
        dim = res.values[x].dim()
        for s, sr in enumerate(srs):
            if isinstance(ds[s], tuple) and all(f.dim() == 1 + dim for f in rows[s]):
                a = tuple(f.reshape(len(idx), positions, -1).transpose(0, 1) for f in rows[s])
                b = tuple(f.transpose(-2, -1) for f in ds[s])  # (positions, hidden, dests)
                m = sr.contract(a, b)  # (positions, components, destinations)
                part = tuple(f.permute(2, 1, 0) for f in m)  # (dests, components, positions)
            else:  # (fields with dims of their own: one destination at a time)
                each = [_edge_value(res, lay, sr, rows[s], x, d) for d in _each(ds[s], x, res)]
                part = tuple(torch.stack(fs) for fs in zip(*each))
            new = sr.plus(tuple(t[at] for t in total[s]), part)
            for t, f in zip(total[s], new):
                t[at] = f.to(t.dtype)
    return total


def _each(ds, x, res) -> list:
    """The D of each destination at ``x``: ``ds`` itself (a list) or unstacked."""
    if isinstance(ds, list):
        return ds
    shape = res.values[x].shape
    return [tuple(f[:, i].reshape(shape) for f in ds) for i in range(ds[0].shape[1])]


def _edge_value(res, lay: Layout, sr, rows, x, d):
    """(components, positions): ⊕ over the elements at each position of the components'
    values ``rows`` at ``x`` ⊗ the destination's D there."""
    shape = res.values[x].shape
    n = rows[0].shape[0]
    m = sr.mul(rows, tuple(f.expand(n, *f.shape) for f in d))
    flat = tuple(f.reshape(n, lay.positions, -1, *f.shape[1 + len(shape) :]) for f in m)
    return sr.sum(flat, (2,))


def _per_group(res, lay: Layout, comps, srs, store, al):
    """The value at each position of components on the same nodes (the heads of one
    block), stacked: per semiring a value of shape (components, positions, …): the ⊕
    over the component's elements of ``alpha ⊗`` the residual pass's value (taken once
    per node); None where no node was reached."""
    nodes = comps[0].nodes
    if not any(n in store for n in nodes):
        return None
    out = []
    for s, sr in enumerate(srs):
        totals = [None] * len(comps)
        for node in nodes:
            if node not in store:
                continue
            like = res.values[node]
            m = sr.mul(alpha_or_zero(res, al, node, sr), store[node][s])
            flat = tuple(f.reshape(lay.positions, -1, *f.shape[like.dim() :]) for f in m)
            for c, comp in enumerate(comps):
                per = sr.sum(tuple(f[:, comp.cols or slice(None)] for f in flat), (1,))
                totals[c] = per if totals[c] is None else sr.plus(totals[c], per)
        zero = None
        for c, t in enumerate(totals):  # a node reached by none of this group's passes
            if t is None:
                like = res.values[lay.target]
                zero = zero or sr.zero((lay.positions,), like)
                totals[c] = zero
        out.append(tuple(torch.stack(fs) for fs in zip(*totals)))
    return out


def _has_path_rows(sr, value) -> torch.Tensor:
    """:func:`_has_path` of a stacked value: (components, positions)."""
    zero = sr.zero(value[0].shape, value[0])
    f = value[0]
    return (f != zero[0]).reshape(f.shape[0], f.shape[1], -1).any(-1)


def circuit_edges(res, semirings=None, seed="structural", baseline=None, tokens=None,
                  heads=None, roles=None):  # fmt: skip
    """Tidy DataFrame, one row per edge between two components and position: ``src_layer``,
    ``src_role``, ``src_head_index``, ``dst_layer``, ``dst_role``, ``dst_head_index``,
    ``input``, ``position``, ``token`` and one value column per semiring (named by it).

    Components (``src_role`` / ``dst_role``): ``"embedding"`` (layer -1, a source only),
    ``"head"``, ``"mlp"`` and ``"target"`` (layer = the number of layers, a destination
    only), as in :func:`.nodes.circuit_nodes`. The value of ``u -> v`` at position ``p``
    is the ⊕ over the whole paths (source to output, with ``seed`` and ``baseline`` as in
    ``res.marginal``) that pass ``u`` at ``p``, then only the residual stream, then enter
    ``v`` through ``input``: ``"q"``, ``"k"``, ``"v"`` (the head's columns of that
    projection), ``"mlp"``, ``"target"``. Readouts as in ``circuit_nodes``: under Real
    the flow, under MaxProduct the signed best path (-inf where none), under Entropy the
    entropy of the paths, under TopK the best of the k. Under Real, the edges into one
    input of ``v`` sum to that input's marginal (every path into it has one last
    component).

    Rows: the edges some path takes, i.e. those where a semiring's value is not its zero
    (a Real sum can be 0 where paths exist; MaxProduct, PathCount and TopK see them).
    ``tokens``, ``heads``, ``roles``: as for ``circuit_nodes``.
    """

    srs = check_semirings(res, semirings)
    res = pinned(res)
    lay = layout(res, heads, roles)
    al = circuit_alphas(res, srs, seed, baseline, lay)
    labels = site_labels(tokens, lay.positions)
    rows: list = []
    dests = list(_destinations(res, lay, srs))
    # (each region refuses a residual stream that enters a component)
    regions = [residual_region(res, lay, acc) for _, _, acc in dests]
    forward = [all(_by_position(res, lay, x) for x in acc) for _, _, acc in dests]
    reached = {x for (_, _, acc), f in zip(dests, forward) if f for x in acc}
    between = set().union(*(r for r, f in zip(regions, forward) if f))
    row = {i: r for r, i in enumerate(i for i, f in enumerate(forward) if f)}
    like = res.values[lay.target]
    met = [tuple(sr.zero((len(row), len(lay.components), lay.positions), like)) for sr in srs]
    meeting = _meeting(res, lay, srs, [(row[i], d[2]) for i, d in enumerate(dests) if forward[i]])
    for part in _source_passes(res, lay, srs, al, reached, between):
        met = _meet(res, lay, srs, part, meeting, met)
    comps = lay.components
    for i, ((dst, inp, acc), f) in enumerate(zip(dests, forward)):
        if f:
            values = [tuple(t[row[i]] for t in met[s]) for s in range(len(srs))]
        else:  # an entry without positions (the output): a pass back from it
            values = _backward_edge_values(res, lay, srs, acc, al)
        has = torch.stack([_has_path_rows(sr, v) for sr, v in zip(srs, values)]).any(0)
        c, p = (t.cpu().numpy() for t in has.nonzero(as_tuple=True))
        if len(c):
            read = [readout(sr, v).detach().cpu().double().numpy()[c, p]
                    for sr, v in zip(srs, values)]  # fmt: skip
            rows.append((c, p, dst, inp, read))
    return _frame(rows, comps, labels, srs)


def _frame(rows, comps, labels, srs):
    """One DataFrame of the edges found per destination (``rows``: per destination, the
    components' indices, positions, the destination, its input and the values per
    semiring), built once (a frame per destination cost more than the edges' ⊕)."""
    import numpy as np
    import pandas as pd

    columns = [*EDGE_COLUMNS, *(sr.name for sr in srs)]
    if not rows:
        frame = pd.DataFrame({c: pd.Series(dtype="object") for c in columns})
        for col in ("src_layer", "src_head_index", "dst_layer", "dst_head_index", "position"):
            frame[col] = frame[col].astype("Int64")
        return frame
    c = np.concatenate([r[0] for r in rows])
    p = np.concatenate([r[1] for r in rows])
    count = [len(r[0]) for r in rows]

    at_dst = np.repeat(np.arange(len(rows)), count)

    def ints(a):
        return pd.array(a, dtype="Int64")

    src_layer = np.array([x.layer for x in comps], dtype=np.int64)[c]
    src_head = pd.array([x.head for x in comps], dtype="Int64")[c]
    cols = {
        "src_layer": ints(src_layer),
        "src_role": text_column((x.role for x in comps), c),
        "src_head_index": src_head,
        "dst_layer": ints(np.repeat([r[2].layer for r in rows], count)),
        "dst_role": text_column((r[2].role for r in rows), at_dst),
        "dst_head_index": pd.array([r[2].head for r in rows], dtype="Int64").take(at_dst),
        "input": text_column((r[3] for r in rows), at_dst),
        "position": ints(p),
        "token": text_column(labels, p),
    }
    for s, sr in enumerate(srs):
        cols[sr.name] = np.concatenate([r[4][s] for r in rows])
    return pd.DataFrame(cols, copy=False)[columns]  # (its own arrays: not copied)


def _destinations(res, lay: Layout, srs):
    """``(component, input, {entry tensor: [D per semiring]})`` for every entry."""
    for layer in range(lay.layers):
        per_head = _layer_entry_d(res, lay, srs, layer)
        for comp, d in zip(lay.heads[layer], per_head):
            for role in QKV:
                acc = {x: v for (r, x), v in d.items() if r == role}
                if acc:
                    yield comp, SHORT_ROLES[role], _filled(res, srs, acc)
        acc = _mlp_entry_d(res, lay, srs, layer)
        if acc:
            yield Component("mlp", layer, ()), "mlp", _filled(res, srs, acc)
    out = lay.target
    like = res.values[out]
    yield (
        Component("target", lay.layers, ()),
        "target",
        {out: [sr.one(like.shape, like) for sr in srs]},
    )


def _filled(res, srs, acc):
    for x, slot in acc.items():
        like = res.values[x]
        for s, sr in enumerate(srs):
            if slot[s] is None:
                slot[s] = sr.zero(like.shape, like)
    return acc
