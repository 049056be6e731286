"""The edges of a circuit: the ⊕ over the whole paths that leave one component and enter
the next through the residual stream alone, split by the input they enter (DESIGN §3b).

Components are the sites of :func:`.circuit.circuit_nodes` other than the residual
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .. import rules
from ..engine import checkpoints
from ..engine.alpha import apply_rule
from ..engine.reverse import contributions, propagate
from ..errors import InputError, NotFoundError
from ..semirings import MaxProduct
from .branches import blocks
from .circuit import alpha_upto, find_sites, readout, site_labels
from .fanout import Roles, ancestors, descendants, entries, first_contraction
from .heads import QKV, only_columns
from .marginals import alphas

#: the ``input`` column: how a path enters its destination
INPUTS = ("q", "k", "v", "mlp", "target")
_SHORT = {"query": "q", "key": "k", "value": "v"}
aten = torch.ops.aten
#: the columns of :func:`circuit_edges` before the value columns (one per semiring)
EDGE_COLUMNS = ("src_layer", "src_role", "src_head_index", "dst_layer", "dst_role",
                "dst_head_index", "input", "position", "token")  # fmt: skip
#: the columns of :func:`attention_edges` before the value columns
ATTENTION_COLUMNS = ("layer", "head_index", "src_position", "dst_position", "src_token",
                     "dst_token")  # fmt: skip


@dataclass(frozen=True)
class Component:
    """A site of :func:`.circuit.find_sites` that a path passes between two residual
    segments: ``nodes`` (⊕-ed together) per position, ``cols`` of the columns."""

    role: str
    layer: int
    nodes: tuple
    head: int | None = None
    cols: slice | None = None


@dataclass(frozen=True)
class Projection:
    """One query, key or value projection of a block: the contraction ``proj`` whose
    output columns ``cols`` are that role's (all of them unless fused), reading ``x``."""

    role: str
    proj: torch.fx.Node
    x: torch.fx.Node
    cols: tuple


@dataclass
class Layout:
    """The components, the entries of each block and what residual passes may not cross."""

    positions: int
    components: list  #: sources of edges: embedding, heads, MLPs (in order)
    heads: dict  #: layer -> [Component per head]
    projections: dict  #: layer -> [Projection]
    mlp_entries: dict  #: layer -> [(entry op, the tensor it reads)]
    target: torch.fx.Node
    layers: int
    stops: frozenset  #: the components' nodes: residual passes end there
    blocked: frozenset  #: the components' first ops: residual passes never cross them
    upto: frozenset  #: where the circuit reads alpha (the forward pass goes no further)


def layout(res, heads=None, roles=None) -> Layout:
    """The components of ``res``'s model and the entries of each (InputError where the
    model's blocks are not laid out as this analysis needs)."""
    sites, positions = find_sites(res, heads, roles)
    found = blocks(res, roles)
    r = Roles(res, roles)
    comps = [Component(s.role, s.layer, s.nodes, s.head, s.cols) for s in sites
             if s.role in ("embedding", "head", "mlp")]  # fmt: skip
    by_head: dict = {}
    for c in comps:
        if c.role == "head":
            by_head.setdefault(c.layer, []).append(c)
    projections, mlp_entries = {}, {}
    for i, b in enumerate(found):
        projections[i] = _projections(res, r, b, roles)
        mlp_entries[i] = _mlp_entries(res, b, roles)
    stops = frozenset(n for c in comps for n in c.nodes)
    blocked = frozenset([p.proj for ps in projections.values() for p in ps]
                        + [op for es in mlp_entries.values() for op, _ in es])  # fmt: skip
    return Layout(positions, comps, by_head, projections, mlp_entries, res.graph.output_node,
                  len(found), stops, blocked, alpha_upto(sites))  # fmt: skip


def _expect(res, point, roles, allowed, block, what):
    try:
        _, ents = entries(res, point, roles)
    except NotFoundError:
        ents = []
    odd = [e for e in ents if e.role not in allowed]
    if odd:
        raise InputError(
            f"circuit edges: the {what} of {block.layer!r} (`{point.name}`) feeds "
            f"{[f'{e.consumer or e.op.name} ({e.role})' for e in odd]}, not only "
            f"{' / '.join(allowed)}: paths leaving there cannot be given to a component; "
            "pass roles={'module regex': role} if the model names its modules otherwise"
        )
    return ents


def _projections(res, r, block, roles) -> list:
    ents = _expect(res, block.points["attention"], roles, ("skip", *QKV), block, "residual stream")
    out: dict = {}
    for e in ents:
        if e.role not in QKV:
            continue
        proj = e.proj or first_contraction(r, e.op)
        if proj is None:
            raise InputError(
                f"circuit edges: no matmul follows the {e.role} branch of {block.layer!r} "
                f"({e.consumer!r}), so its heads' columns cannot be told apart"
            )
        xs = [a for a in proj.all_input_nodes if a in res.needed]
        if len(xs) != 1:
            raise InputError(
                f"circuit edges: the {e.role} projection `{proj.name}` of {block.layer!r} "
                f"reads {len(xs)} tensors that carry paths, not one input and weights"
            )
        cols = e.cols or tuple(range(res.values[proj].shape[-1]))
        out.setdefault((proj, e.role), Projection(e.role, proj, xs[0], cols))
    if {p.role for p in out.values()} != set(QKV):
        raise InputError(
            f"circuit edges: found {sorted({p.role for p in out.values()})} projections in "
            f"{block.layer!r}, not a query, a key and a value"
        )
    return list(out.values())


def _mlp_entries(res, block, roles) -> list:
    ents = _expect(res, block.points["mlp"], roles, ("skip", "mlp"), block, "MLP's input")
    out = [(e.op, e.via) for e in ents if e.role == "mlp"]
    if not out:
        raise InputError(f"circuit edges: found no MLP reading `{block.points['mlp'].name}`")
    return out


# -- one call's values -----------------------------------------------------------------


def pinned(res):
    """``res`` itself, or where its pass holds checkpoints, a shallow copy whose values
    and D keep every segment computed once for as long as the copy lives (the residual
    passes walk the whole stream once per entry: a cache of a few segments would compute
    each one again every time). The alphas are kept on ``res``."""
    if not isinstance(res.values, checkpoints._Values):
        return res
    ckpt = res.values.ckpt
    res.__dict__.setdefault("_alphas", {})
    new = type(res).__new__(type(res))
    new.__dict__.update(res.__dict__)
    new.values = _PinnedValues(ckpt)
    new._store = _PinnedStore(ckpt)
    return new


class _PinnedValues(Mapping):
    def __init__(self, ckpt):
        self.ckpt, self.segments = ckpt, {}

    def segment(self, s):
        got = self.segments.get(s)
        if got is None:
            got = self.segments[s] = self.ckpt.segment_values(s)
        return got

    def __getitem__(self, node):
        c = self.ckpt
        if node in c.held:
            return c.held[node]
        s = c.layout.segment.get(node)
        if s is None:
            raise KeyError(node)
        return self.segment(s)[node]

    def __contains__(self, node):
        return node in self.ckpt.held or node in self.ckpt.layout.segment

    def __iter__(self):
        return (n for n in self.ckpt.graph.nodes if n in self)

    def __len__(self):
        return sum(1 for _ in self)


class _PinnedStore(Mapping):
    def __init__(self, ckpt):
        self.ckpt, self.d = ckpt, {}

    def get_d(self, node, k):
        c = self.ckpt
        if node in c.held_store:
            return c.held_store[node][k]
        key = (c.layout.segment[node], k)
        got = self.d.get(key)
        if got is None:
            got = self.d[key] = c.segment_d(*key)
        return got[node]

    def __getitem__(self, node):
        if node not in self:
            raise KeyError(node)
        return _PinnedRow(self, node)

    def __contains__(self, node):
        return node in self.ckpt.reached

    def __iter__(self):
        return (n for n in self.ckpt.graph.nodes if n in self.ckpt.reached)

    def __len__(self):
        return len(self.ckpt.reached)


class _PinnedRow(Sequence):
    def __init__(self, store, node):
        self.store, self.node = store, node

    def __getitem__(self, k):
        n = len(self)
        if isinstance(k, slice):
            return [self[i] for i in range(n)[k]]
        if not -n <= k < n:
            raise IndexError(k)
        return self.store.get_d(self.node, k % n)

    def __len__(self):
        return len(self.store.ckpt.semirings)


# -- D at each entry -------------------------------------------------------------------


def head_entry_d(res, lay: Layout, srs, layer: int, head: int, position=None) -> dict:
    """``{(role, x): [D per semiring]}``: at the input ``x`` of each projection of head
    ``head``'s block, ⊕ over the paths through that role's columns that reach the head's
    slice of the output projection's input (at ``position`` only, if given)."""
    plan = _head_plan(res, lay, srs, layer, head)
    return _head_entry_d(res, lay, srs, plan, position)


@dataclass(frozen=True)
class _HeadPlan:
    """What every pass from one head's slice reads: its site, the D there masked to the
    head's columns, the projections followed and the nodes between them and the site."""

    site: torch.fx.Node
    d: list
    projs: list
    region: frozenset
    stop: int
    cols: dict  #: projection -> its columns, as a mask of the projection's output


def _head_plan(res, lay: Layout, srs, layer: int, head: int, roles=QKV) -> _HeadPlan:
    """The :class:`_HeadPlan` of a head, following the projections of ``roles`` only (the
    paths from the others' projections are never reached from these: leaving them out
    changes no value)."""
    comp = lay.heads[layer][head]
    (site,) = comp.nodes
    like = res.values[site]
    ks = [res.semirings.index(sr) for sr in srs]
    mask = torch.zeros(like.shape[-1], dtype=torch.bool, device=like.device)
    mask[comp.cols] = True
    d = [only_columns(sr, res._store[site][k], mask, like) for sr, k in zip(srs, ks)]
    projs = [p for p in lay.projections[layer] if p.role in roles]
    down = set().union(*(descendants(p.proj) for p in projs))
    region = frozenset(ancestors(site, down))
    ids = res.graph.ids
    cols = {}
    for p in projs:
        pl = res.values[p.proj]
        c = torch.zeros(pl.shape[-1], dtype=torch.bool, device=pl.device)
        c[list(p.cols)] = True
        cols[p] = c
    stop = min(ids[n] for n in region) if region else ids[site]
    return _HeadPlan(site, d, projs, region, stop, cols)


def _head_entry_d(res, lay: Layout, srs, plan: _HeadPlan, position=None) -> dict:
    site, d = plan.site, plan.d
    if position is not None:
        like = res.values[site]
        d = [_at_position(sr, v, like, lay.positions, position) for sr, v in zip(srs, d)]
    graph, values, needed = res.graph, res.values, res.needed
    with torch.no_grad():
        store = propagate(graph, values, srs, {site: d}, needed, within=plan.region,
                          start=graph.ids[site] + 1, stop=plan.stop)  # fmt: skip
    out: dict = {}
    for p in plan.projs:
        if p.proj not in store:
            continue
        pl = values[p.proj]
        dp = [only_columns(sr, v, plan.cols[p], pl) for sr, v in zip(srs, store[p.proj])]
        with torch.no_grad():
            for inp, s, c in contributions(graph, values, srs, graph.ids[p.proj], dp, needed):
                if inp is p.x:
                    slot = out.setdefault((p.role, p.x), [None] * len(srs))
                    slot[s] = srs[s].accumulate(slot[s], c)
    return out


def _layer_entry_d(res, lay: Layout, srs, layer: int) -> list:
    """:func:`head_entry_d` of every head of a block (all positions).

    Where the block's heads are known to be apart (below), each head's D at a
    projection's output is the reverse pass's own D there, on the head's columns: every
    path from those columns passes that head's slice and no other. Otherwise, and to
    find out, one pass back from the heads' site for all heads at once: a leading head
    dim, the rules under ``torch.vmap`` (the heads share the site and the region between
    it and the projections; they differ in the columns their D starts from)."""
    comps = lay.heads[layer]
    plans = [_head_plan(res, lay, srs, layer, c.head) for c in comps]
    first = plans[0]
    graph, values, needed = res.graph, res.values, res.needed
    apart = graph.__dict__.setdefault("_heads_apart", {})
    key = (first.site.name, tuple(values[first.site].shape), len(plans))
    masks = apart.get(key)
    if masks and _still_apart(res, srs, first, masks):
        ks = [res.semirings.index(sr) for sr in srs]
        got = {p.proj: [tuple(res._store[p.proj][k]) for k in ks] for p in first.projs
               if p.proj in res._store}  # fmt: skip

        def mine(h, proj, sr, v):
            return only_columns(sr, v, masks[proj.name][h], values[proj])

        return _entry_d(res, srs, plans, mine, got)
    seeds = [tuple(torch.stack(f) for f in zip(*(tuple(pl.d[s]) for pl in plans)))
             for s in range(len(srs))]  # fmt: skip

    def run(d):
        store = propagate(graph, values, srs, {first.site: list(d)}, needed,
                          within=first.region, start=graph.ids[first.site] + 1,
                          stop=first.stop)  # fmt: skip
        return {p.proj: [tuple(v) for v in store[p.proj]] for p in first.projs
                if p.proj in store}  # fmt: skip

    per = sum(values[n].numel() for n in first.region) * 2 * len(srs)
    chunk = max(1, min(len(comps), _BATCH_BUDGET // max(per, 1)))
    with torch.no_grad():
        got = torch.vmap(run, chunk_size=chunk)(seeds)
    if key not in apart and any(isinstance(sr, MaxProduct) for sr in srs):
        apart[key] = _heads_apart(res, srs, plans, got)
    return _entry_d(res, srs, plans, lambda h, proj, sr, v: tuple(f[h] for f in v), got)


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


def _at_position(sr, value, like, positions, p):
    """``value`` at position ``p`` of a (…, positions, hidden) tensor, the zero elsewhere."""
    keep = torch.zeros(positions, dtype=torch.bool, device=like.device)
    keep[p] = True
    return _at_positions(sr, value, like, positions, keep)


def _at_positions(sr, value, like, positions, keep):
    """``value`` at the positions ``keep`` (a bool mask) of a (…, positions, hidden)
    tensor, the zero elsewhere."""
    zero = sr.zero(like.shape, like)
    out = []
    for f, z in zip(value, zero):
        flat = f.reshape(positions, -1, *f.shape[like.dim() :])
        m = keep.reshape(positions, *(1,) * (flat.dim() - 1))
        out.append(torch.where(m, flat, z.reshape(flat.shape)).reshape(f.shape))
    return tuple(out)


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
    region = _residual_region(res, lay, acc)
    graph = res.graph
    start = max(graph.ids[n] for n in acc) + 1
    with torch.no_grad():
        store = propagate(graph, res.values, srs, dict(acc), needed, within=region, start=start,
                          stop=min(graph.ids[n] for n in region))  # fmt: skip
    return {n: v for n, v in store.items() if n in lay.stops}


def _residual_region(res, lay: Layout, acc: dict) -> set:
    """The nodes a residual pass from the entries ``acc`` goes through (InputError where
    the residual stream reads inside a component)."""
    needed = res.needed
    region, todo = set(), list(acc)
    while todo:
        n = todo.pop()
        if n in region:
            continue
        if n in lay.blocked:
            raise InputError(
                f"circuit edges: the residual stream before `{next(iter(acc)).name}` reads "
                f"`{n.name}` inside a component (its first op) without passing the "
                "component's output: the paths there cannot be given to one component"
            )
        region.add(n)
        if n not in lay.stops:
            todo.extend(a for a in n.all_input_nodes if a in needed)
    for s in region & lay.stops:
        inner = [a for a in s.all_input_nodes if a in region]
        if inner:
            raise InputError(
                f"circuit edges: `{inner[0].name}`, an input of the component `{s.name}`, "
                "is also read by the residual stream: paths through it pass no component"
            )
    return region


def _source_passes(res, lay: Layout, srs, al, entries: set, between: set) -> dict:
    """``{entry tensor: (components, [stacked value per semiring])}``: per component (in
    ``lay.components``' order, stacked along a new first dim) the ⊕ over the paths that
    pass the component (alpha at its nodes, its columns only) and reach the entry through
    the residual stream alone.

    One forward pass per group of components on the same nodes (the embedding, the heads
    of one block, one MLP), over the nodes of ``between`` (those on a residual path to an
    entry) that the group's nodes reach; the heads of a block at once, each value with a
    leading head dim (the rules under ``torch.vmap``). Their output projection is taken
    per head on its own columns and rows of the weight (:func:`_per_head_projection`):
    the other columns hold no path of that head."""
    ids = res.graph.ids
    comps = lay.components
    groups: dict = {}
    for c, comp in enumerate(comps):
        groups.setdefault(comp.nodes, []).append(c)
    found: dict = {}
    for nodes, cs in groups.items():
        seeds = {n: _group_seed(res, srs, al, [comps[c] for c in cs], n) for n in nodes}
        region = _reached(seeds, between, lay.stops)
        proj = _per_head_projection(res, srs, [comps[c] for c in cs], seeds, region)
        if proj is not None:
            seeds = proj
            region = _reached(seeds, between, lay.stops)
        order = sorted(region - set(seeds), key=ids.__getitem__)
        wanted = [x for x in entries if x in region]
        got = _batched_pass(res, srs, seeds, order, wanted, len(cs))
        for x, rows in got.items():
            found.setdefault(x, []).append((cs, rows))
    out = {}
    for x, parts in found.items():
        idx = [c for cs, _ in parts for c in cs]
        rows = [tuple(torch.cat(f) for f in zip(*(r[s] for _, r in parts)))
                for s in range(len(srs))]  # fmt: skip
        out[x] = (idx, rows)
    return out


def _group_seed(res, srs, al, comps, node) -> list:
    """Per semiring, alpha at ``node`` for each component (its columns only), stacked."""
    like = res.values[node]
    out = []
    for sr in srs:
        a = _alpha(res, al, node, sr)
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


def _batched_pass(res, srs, seeds, order, wanted, batch) -> dict:
    """The forward rules over ``order`` from ``seeds`` (values with a leading dim of
    ``batch``), read at ``wanted``: ``{node: [stacked value per semiring]}``."""
    graph, values, needed, ids = res.graph, res.values, res.needed, res.graph.ids

    def run(start):
        store = dict(start)
        for n in order:
            if not any(i in store for i in n.all_input_nodes):
                continue
            got = apply_rule(graph, values, srs, ids[n], store, needed)
            if any(g is not None for g in got):
                store[n] = got
        return {x: [_or_zero(sr, v, values[x]) for sr, v in zip(srs, store[x])]
                for x in wanted if x in store}  # fmt: skip

    with torch.no_grad():
        if batch == 1:  # no batch to carry: the rules on the values themselves
            got = run({n: [tuple(f[0] for f in v) for v in vs] for n, vs in seeds.items()})
            return {x: [tuple(f[None] for f in v) for v in vs] for x, vs in got.items()}
        per = sum(values[x].numel() for x in order) * 2 * len(srs)
        chunk = max(1, min(batch, _BATCH_BUDGET // max(per, 1)))
        return torch.vmap(run, chunk_size=chunk)(seeds)


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


#: elements a batched pass may hold at once (its chunks are sized by it)
_BATCH_BUDGET = 2**27


def _or_zero(sr, value, like):
    if value is None:
        return tuple(sr.zero(like.shape, like))
    return tuple(value)


def _by_position(res, lay: Layout, x) -> bool:
    """Whether ``x`` is laid out (…, positions, hidden) as the components are (a residual
    path keeps its position: its edge's position can be read at the entry)."""
    shape = res.values[x].shape
    lead = 1
    for d in shape[:-1]:
        lead *= int(d)
    return len(shape) >= 2 and lead == lay.positions and shape[-2] == lay.positions


def _backward_edge_values(res, lay: Layout, srs, acc, al):
    """:func:`_edge_values` by one residual pass back from the entries, read at each
    component's nodes (zero where the pass does not reach them)."""
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


def _meet(res, lay: Layout, srs, fwd, dests) -> dict:
    """``{destination: [value per semiring]}`` for ``dests`` (``[(destination, {entry:
    [D per semiring]})]``), each value of shape (components, positions): as
    :func:`_edge_values`, the destinations that share an entry at once, as one
    contraction of values per semiring (``Semiring.contract``: the components' values
    at the entry against the destinations' D, over the hidden units, per position)."""
    n, positions = len(lay.components), lay.positions
    like = res.values[lay.target]
    by_entry: dict = {}
    for i, acc in dests:
        for x, slot in acc.items():
            by_entry.setdefault(x, []).append((i, slot))
    out = {i: [None] * len(srs) for i, _ in dests}
    for x, group in by_entry.items():
        idx, rows = fwd[x]
        shape = res.values[x].shape
        plain = all(f.dim() == 1 + len(shape) for r in rows for f in r) and all(
            f.dim() == len(shape) for _, slot in group for v in slot for f in v
        )
        if not idx or not plain:  # (fields with dims of their own: one at a time)
            for i, slot in group:
                got = _edge_values(res, lay, srs, fwd, {x: slot})
                out[i] = [v if o is None else sr.plus(o, v) for sr, o, v in zip(srs, out[i], got)]
            continue
        at = torch.as_tensor(idx, device=like.device)
        for s, sr in enumerate(srs):
            a = tuple(f.reshape(len(idx), positions, -1).transpose(0, 1) for f in rows[s])
            b = tuple(torch.stack(fs).reshape(len(group), positions, -1).permute(1, 2, 0)
                      for fs in zip(*(slot[s] for _, slot in group)))  # fmt: skip
            m = sr.contract(a, b)  # (positions, components, destinations)
            for e, (i, _) in enumerate(group):
                per = tuple(f[:, :, e].transpose(0, 1) for f in m)
                part = tuple(
                    z.index_put((at,), f) for z, f in zip(sr.zero((n, positions), like), per)
                )
                out[i][s] = part if out[i][s] is None else sr.plus(out[i][s], part)
    for i in out:
        out[i] = [sr.zero((n, positions), like) if v is None else v for sr, v in zip(srs, out[i])]
    return out


def _edge_values(res, lay: Layout, srs, fwd, acc):
    """Per semiring, (components, positions): ⊕ over the entries ``acc`` and their
    elements at each position of the component's forward value ⊗ the entry's D."""
    out = []
    n = len(lay.components)
    like = res.values[lay.target]
    for s, sr in enumerate(srs):
        total = sr.zero((n, lay.positions), like)
        for x, slot in acc.items():
            idx, rows = fwd[x]
            if not idx:
                continue
            shape = res.values[x].shape
            d = tuple(f.expand(len(idx), *f.shape) for f in slot[s])
            m = sr.mul(rows[s], d)
            flat = tuple(f.reshape(len(idx), lay.positions, -1, *f.shape[1 + len(shape) :])
                         for f in m)  # fmt: skip
            per = sr.sum(flat, (2,))
            at = torch.as_tensor(idx, device=per[0].device)
            part = tuple(
                z.index_put((at,), f) for z, f in zip(sr.zero((n, lay.positions), like), per)
            )
            total = sr.plus(total, part)
        out.append(total)
    return out


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
            m = sr.mul(_alpha(res, al, node, sr), store[node][s])
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


def _alphas(res, srs, seed, baseline, lay: Layout) -> dict:
    """``{semiring: {node: alpha}}``: one forward pass per semiring, up to the last
    nodes the circuit reads (:func:`.circuit.alpha_upto`)."""
    return {sr: alphas(res, sr, seed, baseline, lay.upto) for sr in srs}


def _alpha(res, al, node, sr):
    """alpha at ``node`` (the zero where no path arrives)."""
    found = al[sr].get(node)
    if found is None:
        like = res.values[node]
        return sr.zero(like.shape, like)
    return found


def _has_path(sr, value) -> torch.Tensor:
    zero = sr.zero(value[0].shape, value[0])
    return (value[0] != zero[0]).reshape(value[0].shape[0], -1).any(-1)


def _check_semirings(res, semirings):
    srs = list(semirings) if semirings is not None else list(res.semirings)
    for sr in srs:
        if sr not in res.semirings:
            raise InputError(f"{sr} was not computed in this pass (computed: {res.semirings})")
    return srs


def circuit_edges(res, semirings=None, seed="structural", baseline=None, tokens=None,
                  heads=None, roles=None):  # fmt: skip
    """Tidy DataFrame, one row per edge between two components and position: ``src_layer``,
    ``src_role``, ``src_head_index``, ``dst_layer``, ``dst_role``, ``dst_head_index``,
    ``input``, ``position``, ``token`` and one value column per semiring (named by it).

    Components (``src_role`` / ``dst_role``): ``"embedding"`` (layer -1, a source only),
    ``"head"``, ``"mlp"`` and ``"target"`` (layer = the number of layers, a destination
    only), as in :func:`.circuit.circuit_nodes`. The value of ``u -> v`` at position ``p``
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
    import pandas as pd

    srs = _check_semirings(res, semirings)
    res = pinned(res)
    lay = layout(res, heads, roles)
    al = _alphas(res, srs, seed, baseline, lay)
    labels = site_labels(tokens, lay.positions)
    rows: list = []
    dests = list(_destinations(res, lay, srs))
    # (each region refuses a residual stream that enters a component)
    regions = [_residual_region(res, lay, acc) for _, _, acc in dests]
    forward = [all(_by_position(res, lay, x) for x in acc) for _, _, acc in dests]
    reached = {x for (_, _, acc), f in zip(dests, forward) if f for x in acc}
    between = set().union(*(r for r, f in zip(regions, forward) if f))
    fwd = _source_passes(res, lay, srs, al, reached, between)
    met = _meet(res, lay, srs, fwd, [(i, d[2]) for i, (d, f) in enumerate(zip(dests, forward))
                                     if f])  # fmt: skip
    comps = lay.components
    for i, ((dst, inp, acc), f) in enumerate(zip(dests, forward)):
        if f:
            values = met[i]
        else:  # an entry without positions (the output): a pass back from it
            values = _backward_edge_values(res, lay, srs, acc, al)
        has = torch.stack([_has_path_rows(sr, v) for sr, v in zip(srs, values)]).any(0)
        c, p = (t.cpu().numpy() for t in has.nonzero(as_tuple=True))
        if not len(c):
            continue
        ints = {
            "src_layer": [comps[i].layer for i in c], "src_head_index": [comps[i].head for i in c],
            "dst_layer": [dst.layer] * len(c), "dst_head_index": [dst.head] * len(c),
            "position": p.tolist(),
        }  # fmt: skip
        cols = {k: pd.array(v, dtype="Int64") for k, v in ints.items()}
        cols.update({"src_role": [comps[i].role for i in c], "dst_role": dst.role, "input": inp,
                     "token": [labels[i] for i in p]})  # fmt: skip
        for sr, v in zip(srs, values):
            cols[sr.name] = readout(sr, v).detach().cpu().double().numpy()[c, p]
        rows.append(pd.DataFrame(cols))
    columns = [*EDGE_COLUMNS, *(sr.name for sr in srs)]
    if not rows:
        frame = pd.DataFrame({c: pd.Series(dtype="object") for c in columns})
        for col in ("src_layer", "src_head_index", "dst_layer", "dst_head_index", "position"):
            frame[col] = frame[col].astype("Int64")
        return frame
    return pd.concat(rows, ignore_index=True)[columns]


def _destinations(res, lay: Layout, srs):
    """``(component, input, {entry tensor: [D per semiring]})`` for every entry."""
    for layer in range(lay.layers):
        per_head = _layer_entry_d(res, lay, srs, layer)
        for comp, d in zip(lay.heads[layer], per_head):
            for role in QKV:
                acc = {x: v for (r, x), v in d.items() if r == role}
                if acc:
                    yield comp, _SHORT[role], _filled(res, srs, acc)
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


def attention_edges(res, semirings=None, seed="structural", baseline=None, tokens=None,
                    heads=None, roles=None):  # fmt: skip
    """Tidy DataFrame, one row per head and pair of positions: ``layer``, ``head_index``,
    ``src_position``, ``dst_position``, ``src_token``, ``dst_token`` and one value column
    per semiring: the ⊕ over the whole paths that enter the head's value input (its
    columns of the value projection) at ``src_position`` and leave the head (its slice
    of the output projection's input) at ``dst_position``; readouts and the other
    arguments as in :func:`circuit_edges`. Every pair is a row (attention reads every
    position it is not masked from; a masked pair holds the semiring's zero).
    Under Real, the rows of one head summed over both positions equal the sum of
    ``circuit_edges``' edges into that head's ``"v"`` input.
    """
    import pandas as pd

    srs = _check_semirings(res, semirings)
    res = pinned(res)
    lay = layout(res, heads, roles)
    al = _alphas(res, srs, seed, baseline, lay)
    labels = site_labels(tokens, lay.positions)
    n = lay.positions
    parts = []
    for layer in range(lay.layers):
        for comp in lay.heads[layer]:
            plan = _head_plan(res, lay, srs, layer, comp.head, roles=("value",))
            got = _attention_by_contraction(res, lay, srs, plan, al)
            if got is None:  # the value path is not one A @ V between moves of data
                got = _attention_by_positions(res, lay, srs, plan, al)
            cols = {
                "layer": [layer] * n * n, "head_index": [comp.head] * n * n,
                "src_position": list(range(n)) * n,
                "dst_position": [p for p in range(n) for _ in range(n)],
            }  # fmt: skip
            for sr, v in zip(srs, got):
                cols[sr.name] = readout(sr, v).detach().cpu().double().reshape(-1).numpy()
            parts.append(pd.DataFrame(cols))
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    frame = frame.reindex(columns=[*ATTENTION_COLUMNS, *(sr.name for sr in srs)])
    if len(frame):
        frame["src_token"] = [labels[q] for q in frame.src_position]
        frame["dst_token"] = [labels[p] for p in frame.dst_position]
    for col in ("layer", "head_index", "src_position", "dst_position"):
        frame[col] = frame[col].astype("Int64")
    return frame


def _attention_by_contraction(res, lay, srs, plan: _HeadPlan, al):
    """Per semiring, the head's value (dst positions, src positions), where its value
    path is one batched matmul ``A @ V`` between ops that only move data (as attention
    is written): the paths from ``V[q, j]`` to the head's slice at ``p`` are the one
    edge of weight ``A[p, q]``, so the edge is ``⊕_j alpha(V)[q, j] ⊗ A[p, q] ⊗
    D(A @ V)[p, j]``, the matmul's edge marginals ⊕-ed over ``j`` (and over its batch,
    where only this head's slice holds D). None where the path is not laid out so."""
    graph, values, ids = res.graph, res.values, res.graph.ids
    mm = _last_contraction(res, plan)
    if mm is None or mm.target is not aten.bmm.default or not _only_as_values(res, plan, mm):
        return None
    a, v = mm.args[:2]
    n = lay.positions
    att, like = values[a], values[mm]
    if tuple(att.shape[1:]) != (n, n):
        return None
    within = {m for m in plan.region if ids[m] > ids[mm]} | {mm}
    with torch.no_grad():
        store = propagate(graph, values, srs, {plan.site: list(plan.d)}, res.needed,
                          within=within, start=ids[plan.site] + 1, stop=ids[mm])  # fmt: skip
        out = []
        for s, sr in enumerate(srs):
            if mm not in store:
                out.append(sr.zero((n, n), like))
                continue
            d = store[mm][s]
            live = _has_path(sr, d).nonzero().reshape(-1)  # this head's slice of the batch
            if not len(live):
                out.append(sr.zero((n, n), like))
                continue
            av = tuple(f[live] for f in _alpha(res, al, v, sr))
            d = tuple(f[live] for f in d)
            w = att[live]
            b, width = len(live), like.shape[-1]
            step = max(1, min(n, _CHUNK_ELEMENTS // max(b * n * width, 1)))
            rows = []
            for p in range(0, n, step):
                k = min(step, n - p)
                full = (b, k, n, width)
                x = sr.times(tuple(f[:, None].expand(full) for f in av),
                             w[:, p : p + k, :, None].expand(full))  # fmt: skip
                x = sr.mul(x, tuple(f[:, p : p + k, None].expand(full) for f in d))
                rows.append(sr.sum(x, (0, 3)))
            out.append(tuple(torch.cat(f) for f in zip(*rows)))
    return out


def _last_contraction(res, plan: _HeadPlan):
    """The contraction whose output reaches the head's slice through ops that only move
    data (the attention's ``A @ V``), or None."""
    n = plan.site
    for _ in range(64):
        ins = [i for i in n.all_input_nodes if i in plan.region]
        kind = getattr(rules.lookup(n.target), "kind", None)
        if kind == "contraction":
            return n
        if kind != "routing" or len(ins) != 1:
            return None
        n = ins[0]
    return None


def _only_as_values(res, plan: _HeadPlan, mm) -> bool:
    """Whether the value columns reach ``mm`` only as its second operand ``V``: back from
    ``V`` through ops of one input that only move data, the value projection comes
    before any tensor that ``A`` (the first operand) reads; or where they share one (a
    fused q/k/v projection), ``V``'s side leaves it through a slice of columns that no
    slice on ``A``'s side overlaps."""
    a, v = mm.args[:2]
    if not isinstance(a, torch.fx.Node) or v not in plan.region:
        return False
    feeds_a = ancestors(a, plan.region)
    projs = {p.proj for p in plan.projs}
    n, prev = v, None
    for _ in range(64):
        if n in feeds_a:
            return prev is not None and _disjoint_slice(res, n, prev, feeds_a)
        if n in projs:
            return True
        ins = [i for i in n.all_input_nodes if i in res.needed]
        if getattr(rules.lookup(n.target), "kind", None) != "routing" or len(ins) != 1:
            return False
        prev, n = n, ins[0]
    return False


def _disjoint_slice(res, fork, mine, feeds_a) -> bool:
    def cols(s):
        if s.target is not aten.slice.Tensor:
            return None
        x = res.values[fork]
        args = [*s.args[1:5], *[None] * 4][:4]
        dim = (0 if args[0] is None else args[0]) % x.dim()
        return dim, range(*slice(*args[1:4]).indices(x.shape[dim]))

    got = cols(mine)
    if got is None:
        return False
    for u in fork.users:
        if u is mine or u not in feeds_a:
            continue
        other = cols(u)
        if other is None or other[0] != got[0] or set(other[1]) & set(got[1]):
            return False
    return True


def _attention_by_positions(res, lay, srs, plan: _HeadPlan, al):
    """Per semiring, the head's value (dst positions, src positions), by a pass from the
    head's slice at each position (all positions at once: a leading position dim under
    ``torch.vmap``), met at the value projection by alpha there (:func:`_value_entry`)."""
    n = lay.positions
    like = res.values[plan.site]
    for p in plan.projs:
        _projected_alpha(res, srs, p, al)  # (computed once, outside the batch)
    seeds = torch.eye(n, dtype=torch.bool, device=like.device)

    def run(keep):
        return [tuple(v) for v in _value_entry(res, lay, srs, plan, keep, al)]

    per = sum(res.values[m].numel() for m in plan.region) * 2 * len(srs)
    chunk = max(1, min(n, _BATCH_BUDGET // max(per, 1)))
    with torch.no_grad():
        return torch.vmap(run, chunk_size=chunk)(seeds)


#: elements of one chunk of :func:`_attention_by_contraction`'s broadcast
_CHUNK_ELEMENTS = 2**23


def _value_entry(res, lay, srs, plan: _HeadPlan, keep, al):
    """Per semiring, per position ``q``: the ⊕ over the paths that enter the head's value
    columns at ``q`` and leave its slice at the positions ``keep`` (a bool mask). The
    pass from the slice stops at the value projection's output ``v`` (only the nodes
    between them are followed); the paths into ``v``'s columns ``j`` through the
    projection, ⊕_i alpha(x_i) ⊗ w_ij, are the projection's forward rule on alpha at its
    input, once per projection (the same ⊕ as ⊕_i alpha(x_i) ⊗ (⊕_j w_ij ⊗ D(v_j)),
    grouped the other way)."""
    site, d = plan.site, plan.d
    like = res.values[site]
    d = [_at_positions(sr, v, like, lay.positions, keep) for sr, v in zip(srs, d)]
    graph, values = res.graph, res.values
    store = propagate(graph, values, srs, {site: d}, plan.region, within=plan.region,
                      start=graph.ids[site] + 1, stop=plan.stop)  # fmt: skip
    out = [None] * len(srs)
    for p in plan.projs:
        if p.proj not in store:
            continue
        pl = values[p.proj]
        a = _projected_alpha(res, srs, p, al)
        for s, sr in enumerate(srs):
            if a[s] is None:
                continue
            dp = only_columns(sr, store[p.proj][s], plan.cols[p], pl)
            flat = tuple(f.reshape(lay.positions, -1, *f.shape[pl.dim() :])
                         for f in sr.mul(a[s], dp))  # fmt: skip
            per = sr.sum(flat, (1,))
            out[s] = per if out[s] is None else sr.plus(out[s], per)
    for s, sr in enumerate(srs):
        if out[s] is None:
            out[s] = sr.zero((lay.positions,), res.values[lay.target])
    return out


def _projected_alpha(res, srs, p: Projection, al) -> list:
    """Per semiring: ⊕ over the paths into the projection's output through its input
    ``p.x`` (None where no path reaches ``p.x``), kept on ``al``."""
    cache = al.setdefault(("projected", tuple(srs)), {})
    if p.proj not in cache:
        got = [al[sr].get(p.x) for sr in srs]
        out = [None] * len(srs)
        if any(g is not None for g in got):
            graph = res.graph
            with torch.no_grad():
                out = apply_rule(graph, res.values, srs, graph.ids[p.proj], {p.x: got},
                                    res.needed)  # fmt: skip
        cache[p.proj] = out
    return cache[p.proj]
