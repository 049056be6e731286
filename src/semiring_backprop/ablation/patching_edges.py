"""What edge patching (:mod:`.patching`) reads: every destination of an edge, the ops that
read its input, and the residual-only region each input is recomputed through.

Destinations come in :func:`..circuits.edges.circuit_edges`' order: per layer each head's
query, key and value (that head's columns of the projection), the MLP (its entry ops),
then the target (the output itself). An input is recomputed from the components' nodes
(``Layout.stops``) through the nodes between them and the input, never crossing a
component's first op (``Layout.blocked``): adds, norms, output projections.

Where each head of a block has projection columns of its own (checked by autograd:
no other column reaches its slice), a head's query, key or value is read at the
projection, on its columns. Where heads share columns (grouped-query attention: the
heads of a group read one K/V head, repeated for each of them), a head's own copy of
what it reads is the projections applied to its own recomputed inputs and carried
through the attention to its slice (:class:`OwnPass`): only that head's slice takes
the result, so the other heads of its group read the K/V they read before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.node import map_arg

from ..analysis.fanout import ancestors, descendants
from ..analysis.heads import QKV
from ..circuits.layout import SHORT_ROLES, Component, Layout
from ..circuits.layout import residual_region as layout_region
from ..tracing.trace import mark_op

__all__ = ["Destinations", "OwnPass", "destinations", "own_pass", "residual_region",
           "assignment", "call", "call_order", "args_of"]  # fmt: skip

#: the max that softmax subtracts: no gradient flows through it (its paths cancel)
_SHIFT = torch.ops.semiring_backprop.softmax_shift.default
#: ``dst.copy_(src)`` as a traced value: ``src`` in ``dst``'s shape and dtype
_COPY = torch.ops.aten.copy.default
_SLICE_SCATTER = torch.ops.aten.slice_scatter.default


@dataclass
class Destinations:
    dests: list  #: [(Component, input)], in circuit_edges' order
    #: op -> [(destination, the tensor it reads, a bool mask of the op's output columns
    #: that are the destination's, or None: all of them)]; the output reads itself
    entries: dict
    regions: dict  #: tensor read -> (component nodes it reads, nodes between, in order)
    index: dict  #: (layer, role, head, input) -> destination
    #: a head's slice node -> [OwnPass per head] where a block's heads share columns
    own: dict


@dataclass(frozen=True)
class OwnPass:
    """One head's own pass where heads share projection columns: ``reads`` = [(destination,
    projection op, the tensor it reads, a bool mask of the projection's output columns of
    that destination's role)]; ``order``: the nodes from the projections to the heads'
    slice ``site`` (itself included), in graph order; ``mask``: the head's columns of the
    slice (viewed as (positions, columns))."""

    site: torch.fx.Node
    mask: torch.Tensor
    reads: tuple
    order: tuple


def destinations(res, lay: Layout, values) -> Destinations:
    """The :class:`Destinations` of ``res`` (``values``: every node's clean value)."""
    dests, entries, own = [], {}, {}
    for layer in range(lay.layers):
        comps = lay.heads[layer]
        cols = head_columns(res, lay, values, layer)
        order = None if cols is not None else _attention_region(res, lay, layer)
        for comp in comps:
            reads = []
            for role in QKV:
                d = len(dests)
                dests.append((comp, SHORT_ROLES[role]))
                for p in lay.projections[layer]:
                    if p.role != role:
                        continue
                    if cols is None:
                        reads.append((d, p.proj, p.x, _mask(values[p.proj], p.cols)))
                    else:
                        mask = cols[(p.proj, comp.head, role)]
                        entries.setdefault(p.proj, []).append((d, p.x, mask))
            if cols is None:
                (site,) = comp.nodes
                width = values[site].numel() // lay.positions
                mine = _mask(values[site].reshape(lay.positions, width),
                             range(width)[comp.cols or slice(None)])  # fmt: skip
                own.setdefault(site, []).append(OwnPass(site, mine, tuple(reads), order))
        mlp = lay.mlp_entries.get(layer) or []  # (none in an attention-only model)
        if mlp:
            dests.append((Component("mlp", layer, ()), "mlp"))
        for op, via in mlp:
            entries.setdefault(op, []).append((len(dests) - 1, via, None))
    out = res.graph.output_node
    dests.append((Component("target", lay.layers, ()), "target"))
    entries.setdefault(out, []).append((len(dests) - 1, out, None))
    regions = {}
    read = [x for reads in entries.values() for _, x, _ in reads]
    read += [x for passes in own.values() for o in passes for _, _, x, _ in o.reads]
    for x in read:
        if x not in regions:
            regions[x] = residual_region(res, lay, x)
    index = {(c.layer, c.role, c.head, inp): i for i, (c, inp) in enumerate(dests)}
    return Destinations(dests, entries, regions, index, own)


def own_pass(own: OwnPass, reads, inputs, out, vals, positions):
    """The heads' slice ``out`` with one head's columns computed again from the
    projections applied to that head's own recomputed ``inputs`` (one per row of
    ``reads``, a part of ``own.reads``); the other heads' columns are kept."""
    local = {}
    for (_, proj, x, cols), xd in zip(reads, inputs):
        alt = call(proj, *args_of(proj, {x: xd}, vals))
        local[proj] = torch.where(cols, alt, local.get(proj, vals[proj]))
    for n in own.order:
        local[n] = call(n, *args_of(n, local, vals))
    flat = torch.where(own.mask, local[own.site].reshape(positions, -1),
                       out.reshape(positions, -1))  # fmt: skip
    return flat.reshape(out.shape)


def _mask(like, cols):
    """A bool mask of ``like``'s last dim, True at ``cols``."""
    mask = torch.zeros(like.shape[-1], dtype=torch.bool, device=like.device)
    mask[list(cols)] = True
    return mask


def _attention_region(res, lay: Layout, layer) -> tuple:
    """The nodes from block ``layer``'s projections to its heads' slice (the slice
    included, the projections not), in graph order."""
    projs = {p.proj for p in lay.projections[layer]}
    (site,) = lay.heads[layer][0].nodes
    down = set().union(*(descendants(p) for p in projs))
    return tuple(sorted(ancestors(site, down) - projs, key=res.graph.ids.__getitem__))


def residual_region(res, lay: Layout, x):
    """``(stops, order)``: the components' nodes the residual stream before ``x`` reads,
    and the nodes between them and ``x`` in graph order (the region of
    :func:`..circuits.layout.residual_region`)."""
    region = layout_region(res, lay, [x])
    ids = res.graph.ids
    stops = sorted(region & lay.stops, key=ids.__getitem__)
    return stops, sorted(region - lay.stops, key=ids.__getitem__)


def head_columns(res, lay: Layout, values, layer) -> dict | None:
    """``{(projection, head, role): bool mask of the projection's output columns}``: each
    role's columns split evenly among the heads, in order; None where that does not
    hold (:func:`_apart`: some other column of a projection's output reaches a head's
    slice, as where heads share K/V columns; or a role's columns do not split evenly)."""
    comps = lay.heads[layer]
    n = len(comps)
    out: dict = {}
    for p in lay.projections[layer]:
        like = values[p.proj]
        cols = list(p.cols)
        if len(cols) % n:
            return None
        size = len(cols) // n
        for h, comp in enumerate(comps):
            mask = torch.zeros(like.shape[-1], dtype=torch.bool, device=like.device)
            mask[cols[h * size : (h + 1) * size]] = True
            out[(p.proj, comp.head, p.role)] = mask
    return out if _apart(res, lay, values, layer, out) else None


def _apart(res, lay, values, layer, cols) -> bool:
    """Whether no head's slice depends on a projection column not its own: the gradient
    of a random weighting of the slice (positive weights) at the projections' outputs,
    by autograd through the nodes between them, is 0 off its own columns."""
    ids = res.graph.ids
    comps = lay.heads[layer]
    projs = sorted({p.proj for p in lay.projections[layer]}, key=ids.__getitem__)
    (site,) = comps[0].nodes
    down = set().union(*(descendants(p) for p in projs))
    region = sorted(ancestors(site, down) - set(projs), key=ids.__getitem__)
    gen = torch.Generator().manual_seed(0)
    with torch.enable_grad():
        local = {p: values[p].detach().clone().requires_grad_() for p in projs}
        for node in region:
            local[node] = call(node, *args_of(node, local, values))
        flat = local[site].reshape(lay.positions, -1)
        for comp in comps:
            w = torch.zeros_like(flat)
            part = w[:, comp.cols]
            w[:, comp.cols] = torch.rand(part.shape, generator=gen, dtype=w.dtype).to(w) + 0.5
            grads = torch.autograd.grad((flat * w).sum(), [local[p] for p in projs],
                                        retain_graph=True, allow_unused=True)  # fmt: skip
            for p, g in zip(projs, grads):
                if g is None:
                    continue
                own = torch.zeros(g.shape[-1], dtype=torch.bool, device=g.device)
                for (proj, head, _), m in cols.items():
                    if proj is p and head == comp.head:
                        own = own | m
                if bool((g.reshape(-1, g.shape[-1])[:, ~own] != 0).any()):
                    return False
    return True


def assignment(lay: Layout, like, node):
    """``(A, free)``: ``A[c, j]`` = 1 where column ``j`` of ``node`` (value ``like``, viewed
    as (positions, columns)) is component ``c``'s; ``free``: 1 at the columns of none."""
    width = like.numel() // lay.positions
    a = torch.zeros(len(lay.components), width, dtype=like.dtype, device=like.device)
    for c, comp in enumerate(lay.components):
        if node in comp.nodes:
            a[c, comp.cols or slice(None)] = 1
    return a, 1 - a.sum(0).clamp(max=1)


def args_of(node, first, rest):
    """``node``'s args and kwargs, each input read from ``first`` where it is there, else
    from ``rest``."""

    def get(a):
        return first[a] if a in first else rest[a]

    return map_arg(node.args, get), map_arg(node.kwargs, get)


def call(node, args, kwargs):
    """Run one op of the graph (marks are identities; the softmax shift as the op computes
    it, here also under vmap and autograd, where the custom op has no rules; the
    functional copy as the broadcast it is, which autograd differentiates)."""
    if node.target is mark_op:
        return args[0]
    if node.target is _SHIFT:
        m = args[0].detach().amax(args[1], keepdim=True)
        return torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    if node.target is _COPY:  # (autograd has no derivative for the functional copy)
        dst, src = args[:2]
        return torch.broadcast_to(src.to(dst.dtype), dst.shape).clone()
    if node.target is _SLICE_SCATTER and len(args) > 4 and args[4] is not None:
        # an open end (sys.maxsize) clamped to the size: vmap cannot batch it
        dim = args[2] % args[0].dim()
        args = (*args[:4], min(args[4], args[0].shape[dim]), *args[5:])
    return node.target(*args, **kwargs)


def call_order(graph, out) -> list:
    """The ops the output depends on, in graph order."""
    seen, todo = set(), [out]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return [n for n in graph.nodes if n.op == "call_function" and n in seen]
