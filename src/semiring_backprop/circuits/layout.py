"""What the circuit's edges are read from (:mod:`.edges`, :mod:`.attention_edges`):
the components of a model and the entries of each block (:func:`layout`), one call's
values and D held for the call (:func:`pinned`), each head's plan (the region between
its slice and the projections), and the forward pass's alpha where the circuit reads
it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..analysis.branches import blocks, on_result
from ..analysis.fanout import Roles, ancestors, descendants, entries, first_contraction
from ..analysis.heads import QKV, only_columns
from ..engine import checkpoints
from ..engine.marginals import alphas
from ..errors import InputError, NotFoundError
from .nodes import alpha_upto, find_sites

#: the ``input`` column: how a path enters its destination
INPUTS = ("q", "k", "v", "mlp", "target")
#: the ``input`` of each projection's role
SHORT_ROLES = {"query": "q", "key": "k", "value": "v"}
#: the columns of :func:`circuit_edges` before the value columns (one per semiring)
EDGE_COLUMNS = ("src_layer", "src_role", "src_head_index", "dst_layer", "dst_role",
                "dst_head_index", "input", "position", "token")  # fmt: skip
#: the columns of :func:`attention_edges` before the value columns
ATTENTION_COLUMNS = ("layer", "head_index", "src_position", "dst_position", "src_token",
                     "dst_token")  # fmt: skip


def text_column(values, at):
    """A text column of the edge tables: ``values`` (a few strings: roles, inputs,
    tokens) as ``astype(str)`` makes them, taken at the indices ``at`` (one per row)
    rather than made as a string per row."""
    import pandas as pd

    return pd.Series(list(values), dtype=object).astype(str).array.take(at)


@dataclass(frozen=True)
class Component:
    """A site of :func:`.nodes.find_sites` that a path passes between two residual
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
    return on_result(res, ("layout", repr(heads), repr(roles)),
                     lambda: _layout(res, heads, roles))  # fmt: skip


def _layout(res, heads, roles) -> Layout:
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
        # (a block with no MLP, which find_sites has told apart from a parallel one)
        mlp_entries[i] = _mlp_entries(res, b, roles) if "mlp" in b.points else []
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
    # (under relevance weights no path enters a query or key: CP-LRP, engine.relevance)
    need = {"value"} if getattr(res.graph, "weights", "gradient") == "relevance" else set(QKV)
    if not need <= {p.role for p in out.values()}:
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


def residual_region(res, lay: Layout, entries) -> frozenset:
    """The nodes the residual stream passes on its way to ``entries`` (tensors a
    destination reads), back to the components' nodes (``lay.stops``), which it
    includes. InputError where the stream reads inside a component (its first op, or an
    input of its node): the paths there cannot be given to one component.

    Found once per graph, needed nodes, components and entries (a circuit asks for
    every destination's: a walk over the graph each, on every call)."""
    key = (tuple(entries), lay.stops, lay.blocked, res.needed)
    found = res.graph.__dict__.setdefault("_residual_regions", {})
    if key not in found:
        found[key] = frozenset(_residual_region(res, lay, key[0]))
    return found[key]


def _residual_region(res, lay: Layout, entries) -> set:
    needed = res.needed
    entries = list(entries)
    region, todo = set(), list(entries)
    while todo:
        n = todo.pop()
        if n in region:
            continue
        if n in lay.blocked:
            raise InputError(
                f"circuit: the residual stream before `{entries[0].name}` reads "
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
                f"circuit: `{inner[0].name}`, an input of the component `{s.name}`, "
                "is also read by the residual stream: paths through it pass no component"
            )
    return region


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
    tapped = checkpoints.taps(res.values)
    if tapped is not None:  # a tapped pass handed every value over, and D where read
        new.values = tapped[0]
        new._store = _TappedStore(ckpt, tapped[1])
    else:
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


class _TappedStore(_PinnedStore):
    """A tapped pass's D: where it handed D over, that; elsewhere computed again from the
    checkpoints, once per segment. Each node read is recorded
    (:func:`checkpoints.read_taps`): the next tapped pass hands its D over, and holds no
    other node's D (every node's the first time)."""

    def __init__(self, ckpt, tapped: dict):
        super().__init__(ckpt)
        self.tapped = tapped

    def __getitem__(self, node):
        if node not in self:
            raise KeyError(node)
        c = self.ckpt
        checkpoints.read_taps(c.graph, c.needed, (node,))
        got = self.tapped.get(node)
        return got if got is not None else _PinnedRow(self, node)


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


# -- one head, and alpha -------------------------------------------------------------


@dataclass(frozen=True)
class HeadPlan:
    """What every pass from one head's slice reads: its site, the D there masked to the
    head's columns, the projections followed and the nodes between them and the site."""

    site: torch.fx.Node
    d: list
    projs: list
    region: frozenset
    stop: int
    cols: dict  #: projection -> its columns, as a mask of the projection's output


def head_plan(res, lay: Layout, srs, layer: int, head: int, roles=QKV) -> HeadPlan:
    """The :class:`HeadPlan` of a head, following the projections of ``roles`` only (the
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
    # (the heads of a block share the site and projections: their region, once per graph)
    cache = res.graph.__dict__.setdefault("_head_regions", {})
    key = (site, tuple(p.proj for p in projs))
    if key not in cache:
        down = set().union(*(descendants(p.proj) for p in projs))
        cache[key] = frozenset(ancestors(site, down))
    region = cache[key]
    ids = res.graph.ids
    cols = {}
    for p in projs:
        pl = res.values[p.proj]
        c = torch.zeros(pl.shape[-1], dtype=torch.bool, device=pl.device)
        c[list(p.cols)] = True
        cols[p] = c
    stop = min(ids[n] for n in region) if region else ids[site]
    return HeadPlan(site, d, projs, region, stop, cols)


def at_positions(sr, value, like, positions, keep):
    """``value`` at the positions ``keep`` (a bool mask) of a (…, positions, hidden)
    tensor, the zero elsewhere."""
    zero = sr.zero(like.shape, like)
    out = []
    for f, z in zip(value, zero):
        flat = f.reshape(positions, -1, *f.shape[like.dim() :])
        m = keep.reshape(positions, *(1,) * (flat.dim() - 1))
        out.append(torch.where(m, flat, z.reshape(flat.shape)).reshape(f.shape))
    return tuple(out)


def circuit_alphas(res, srs, seed, baseline, lay: Layout) -> dict:
    """``{semiring: {node: alpha}}``: one forward pass per semiring, up to the last
    nodes the circuit reads (:func:`.nodes.alpha_upto`)."""
    return {sr: alphas(res, sr, seed, baseline, lay.upto) for sr in srs}


def alpha_or_zero(res, al, node, sr):
    """alpha at ``node`` (the zero where no path arrives)."""
    found = al[sr].get(node)
    if found is None:
        like = res.values[node]
        return sr.zero(like.shape, like)
    return found


def has_path(sr, value) -> torch.Tensor:
    zero = sr.zero(value[0].shape, value[0])
    return (value[0] != zero[0]).reshape(value[0].shape[0], -1).any(-1)


def check_semirings(res, semirings):
    srs = list(semirings) if semirings is not None else list(res.semirings)
    for sr in srs:
        if sr not in res.semirings:
            raise InputError(f"{sr} was not computed in this pass (computed: {res.semirings})")
    return srs


#: elements a batched pass may hold at once (its chunks are sized by it)
BATCH_BUDGET = 2**27
