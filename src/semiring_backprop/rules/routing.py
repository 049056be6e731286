"""Routing ops move data only: weight-1 edges, backward is a ⊕-scatter.

Shape-only ops have direct inverses. Every other routing op is handled by one generic
rule: the op is run once on integer tensors holding the flat index of each input
element, which yields, for every output element, the input element it was copied from
(-1 for none); the backward pass ⊕-scatters along that map, so an element read at
several places ⊕-accumulates (never overwrites).

Forward rules (the transpose) move the value the way the op moves data: every output
element has at most one source, so they gather (the zero where there is none).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

from ..semirings.base import fmap, fmap2, has_storage
from ..tracing import ops as _ops  # noqa: F401  (defines the mark op)
from .registry import reads_nothing, register, register_forward, rows
from .shapes import broadcast, unbroadcast

aten = torch.ops.aten


def reshape_back(sr, g, op, x, *args, **kwargs):
    return [fmap(lambda f: f.reshape(x.shape), g)]


RESHAPES = [
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.alias.default,
    aten.clone.default,
    aten.lift_fresh_copy.default,
    aten.contiguous.default,
    aten.flatten.using_ints,
    torch.ops.semiring_backprop.mark.default,
]
register(RESHAPES, "routing", reads=reads_nothing)(reshape_back)


#: ops whose every output element is one input element (or none): a D moves back as it
#: is, no arithmetic (``engine.hooks.only_moved``)
MOVES = frozenset([*RESHAPES, aten.permute.default, aten.transpose.int, aten.t.default,
                   aten.slice.Tensor, aten.select.int])  # fmt: skip
#: and those that do so where the input has the output's shape (no broadcast to sum)
MOVES_SAME_SHAPE = frozenset([aten.where.self, aten.expand.default])


def only_moves(reader, node) -> bool:
    """Whether graph node ``reader`` only moves ``node``'s elements (reads it once, sums
    over no broadcast)."""
    if reader.op != "call_function":
        return False
    if sum(a is node for a in pytree.tree_leaves((reader.args, reader.kwargs))) != 1:
        return False
    if reader.target in MOVES:
        return True
    return reader.target in MOVES_SAME_SHAPE and _same_shape(
        node.meta.get("val"), reader.meta.get("val")
    )


def _same_shape(a, b) -> bool:
    """Whether two traced values are tensors of one shape (symbolic sizes: where that is
    known without a guard)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != b.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape, strict=True))


@register_forward(RESHAPES)
@rows
def reshape_forward(sr, a, op, x, *args, **kwargs):
    return _moved(a[0], lambda f: f.reshape(*f.shape[: 1 if op.rows else 0], *op.out.shape))


def _moved(value, fn):
    """``fmap(fn, value)``; None stays None (no path)."""
    return None if value is None else fmap(fn, value)


@register([aten._to_copy.default, aten.to.dtype], "routing", reads=reads_nothing)
def _to_copy(sr, g, op, x, *args, **kwargs):
    if not x.is_floating_point():
        return [None]  # int -> float (ids, masks): no edges
    return [fmap(lambda f: f.to(x.dtype) if f.is_floating_point() else f, g)]


@register_forward([aten._to_copy.default, aten.to.dtype])
def _to_copy_forward(sr, a, op, x, *args, **kwargs):
    dtype = op.out.dtype
    return _moved(a[0], lambda f: f.to(dtype) if f.is_floating_point() else f)


@register(aten.copy.default, "routing", reads=reads_nothing)
def _copy(sr, g, op, dst, src, non_blocking=False):
    """``dst.copy_(src)`` made functional (``y[:, :2] = x`` on a view): every output
    element is ``src``'s, broadcast and cast to ``dst``; ``dst``'s old values are gone."""
    if not (op.needs(1) and isinstance(src, torch.Tensor) and src.is_floating_point()):
        return [None, None]
    d = unbroadcast(sr, g, src.shape)
    return [None, fmap(lambda f: f.to(src.dtype) if f.is_floating_point() else f, d)]


@register_forward(aten.copy.default)
def _copy_forward(sr, a, op, dst, src, non_blocking=False):
    if a[1] is None:
        return None
    dtype = op.out.dtype
    moved = fmap(lambda f: f.to(dtype) if f.is_floating_point() else f, a[1])
    return broadcast(moved, op.out.shape)


@register(aten.permute.default, "routing", reads=reads_nothing)
def _permute(sr, g, op, x, dims):
    inv = [0] * len(dims)
    for i, d in enumerate(dims):
        inv[d % len(dims)] = i
    return [fmap(lambda f: f.permute(inv), g)]


@register_forward(aten.permute.default)
def _permute_forward(sr, a, op, x, dims):
    return _moved(a[0], lambda f: f.permute(dims))


@register([aten.transpose.int, aten.t.default], "routing", reads=reads_nothing)
def _transpose(sr, g, op, x, d0=0, d1=1):
    return [fmap(lambda f: f.transpose(d0, d1), g)]


@register_forward(aten.transpose.int)
def _transpose_forward(sr, a, op, x, d0, d1):
    return _moved(a[0], lambda f: f.transpose(d0, d1))


@register_forward(aten.t.default)
def _t_forward(sr, a, op, x):
    return _moved(a[0], lambda f: f.t())


@register(aten.expand.default, "routing", reads=reads_nothing)
def _expand(sr, g, op, x, size, **kwargs):
    return [unbroadcast(sr, g, x.shape)]


@register_forward(aten.expand.default)
def _expand_forward(sr, a, op, x, size, **kwargs):
    return None if a[0] is None else broadcast(a[0], op.out.shape)


def _put(z, part, scatter):
    """``(zero field, value field) -> the zero with the value written into part(zero)``.

    In place into the fresh zero (one tensor of the input's size, not the zero and a
    copy: at an LM head's logits that is 16 MB per field for BERT-base) where every
    field of the zero is its own tensor; out of place where fields share memory (TopK's
    pointer fields are one tensor) or are broadcasts.
    """
    storages = [f.untyped_storage().data_ptr() for f in z]
    if len(set(storages)) < len(storages) or any(0 in f.stride() for f in z):
        return scatter

    def put(zf, gf):
        if not has_storage(gf):  # batched (``torch.vmap``): no writing into an unbatched zero
            return scatter(zf, gf)
        part(zf).copy_(gf)
        return zf

    return put


@register(aten.slice.Tensor, "routing", reads=reads_nothing)
def _slice(sr, g, op, x, dim=0, start=None, end=None, step=1):
    dim = dim % x.dim()  # fields may have trailing dims of their own (TopK's k)
    if op.out.shape[dim] == x.shape[dim]:  # every element, in order: D is g itself
        return [g]
    z = sr.zero(x.shape, op.out)
    # concrete bounds (an ``end`` of 2**63 - 1, as traced, is no SymInt under torch.vmap)
    start, end, step = slice(start, end, step).indices(x.shape[dim])
    put = _put(
        z,
        lambda zf: aten.slice(zf, dim, start, end, step),
        lambda zf, gf: torch.slice_scatter(zf, gf, dim, start, end, step),
    )
    return [fmap2(put, z, g)]


@register_forward(aten.slice.Tensor)
def _slice_forward(sr, a, op, x, dim=0, start=None, end=None, step=1):
    return _moved(a[0], lambda f: aten.slice(f, dim, start, end, step))


@register(aten.select.int, "routing", reads=reads_nothing)
def _select(sr, g, op, x, dim, index):
    dim = dim % x.dim()  # fields may have trailing dims of their own (TopK's k)
    if x.shape[dim] == 1:  # the whole input: a reshape (no zero to fill)
        return [fmap(lambda f: f.unsqueeze(dim), g)]
    z = sr.zero(x.shape, op.out)
    put = _put(
        z,
        lambda zf: zf.select(dim, index),
        lambda zf, gf: torch.select_scatter(zf, gf, dim, index),
    )
    return [fmap2(put, z, g)]


@register_forward(aten.select.int)
def _select_forward(sr, a, op, x, dim, index):
    return _moved(a[0], lambda f: f.select(dim, index))


@register(aten.cat.default, "routing", reads=reads_nothing)
def _cat(sr, g, op, tensors, dim=0):
    dim = dim % op.out.dim()
    legacy = [t.dim() == 1 and t.numel() == 0 for t in tensors]  # skipped by cat
    sizes = [0 if skip else t.shape[dim] for t, skip in zip(tensors, legacy)]
    parts = [f.split(sizes, dim) for f in g]
    out = []
    for i, skip in enumerate(legacy):
        if skip:
            out.append(None)
        else:
            out.append(tuple(p[i] for p in parts))
    return [out]


@register_forward(aten.cat.default)
def _cat_forward(sr, a, op, tensors, dim=0):
    if all(v is None for v in a[0]):
        return None
    dim = dim % op.out.dim()
    parts = [
        v if v is not None else sr.zero(t.shape, op.out)
        for t, v in zip(tensors, a[0])
        if not (t.dim() == 1 and t.numel() == 0)  # skipped by cat
    ]
    return tuple(torch.cat(fs, dim) for fs in zip(*parts))


# -- generic routing through a source map ---------------------------------------------


def _scatter_plus(sr, value, dest, n, like):
    """⊕ of flat ``value`` elements into ``n`` slots given by ``dest`` (a flat index)."""
    out = sr.zero((n,), like)
    if dest.numel() == 0:
        return out
    order = torch.argsort(dest, stable=True)
    d = dest[order]
    uniq, counts = torch.unique_consecutive(d, return_counts=True)
    width = int(counts.max())
    if width == 1:
        grouped = fmap(lambda f: f[order], value)
    else:
        starts = torch.cumsum(counts, 0) - counts
        group = torch.repeat_interleave(torch.arange(len(uniq), device=d.device), counts)
        pos = torch.arange(len(d), device=d.device) - starts[group]
        table = torch.full((len(uniq), width), len(d), dtype=torch.long, device=d.device)
        table[group, pos] = order
        pad = sr.zero((1,), like)
        padded = fmap2(lambda f, p: torch.cat([f, p]), value, pad)
        grouped = sr.sum(fmap(lambda f: f[table], padded), 1)
    return fmap2(lambda o, v: o.index_put((uniq,), v), out, grouped)


def _source_map(op, data_slots, index_fn):
    """Run ``index_fn`` on index tensors: the flat source (offset per slot) of each output."""
    args = list(op.args)
    offsets, off = {}, 0
    for i in data_slots:
        a = args[i]
        if isinstance(a, torch.Tensor):
            args[i] = torch.arange(off, off + a.numel(), device=a.device).view(a.shape)
            offsets[i] = (off, a.numel(), a.shape)
            off += a.numel()
    src = index_fn(*args, **op.kwargs)
    return src, offsets


def routing(ops, data_slots=(0,), index_fn=None):
    """Register a routing op by the function that runs it on integer index tensors."""
    register(ops, "routing", reads=reads_nothing)(_source_rule(data_slots, index_fn))
    register_forward(ops)(_source_forward(data_slots, index_fn))


def _source_forward(data_slots=(0,), index_fn=None):
    """The transpose of :func:`_source_rule`: each output element reads the value at
    its source (the zero where it has none)."""

    def forward(sr, a, op, *args, **kwargs):
        fn = index_fn or op.node.target
        src, offsets = op.cached("src", lambda: _source_map(op, data_slots, fn))
        if all(a[i] is None for i in offsets):
            return None
        parts, total = [], 0
        for i, (off, n, _) in sorted(offsets.items(), key=lambda kv: kv[1][0]):
            v = a[i] if a[i] is not None else sr.zero((n,), op.out)
            parts.append(fmap(lambda f: f.reshape(-1), v))
            total = off + n
        parts.append(sr.zero((1,), op.out))  # at index ``total``: "no source"
        s = src.reshape(-1)
        s = torch.where(s < 0, total, s)
        return tuple(torch.cat(fs)[s].reshape(op.out.shape) for fs in zip(*parts))

    return forward


def _source_rule(data_slots=(0,), index_fn=None):
    def rule(sr, g, op, *args, **kwargs):
        fn = index_fn or op.node.target
        src, offsets = op.cached("src", lambda: _source_map(op, data_slots, fn))
        flat = tuple(f.reshape(-1) for f in g)
        s = src.reshape(-1)
        out = [None] * len(args)
        for i, (off, n, shape) in offsets.items():
            if not (op.needs(i) and args[i].is_floating_point()):
                continue
            sel = (s >= off) & (s < off + n)
            v = _scatter_plus(sr, fmap(lambda f, sel=sel: f[sel], flat), s[sel] - off, n, op.out)
            out[i] = tuple(f.reshape(shape) for f in v)
        return out

    return rule


def _embedding_sources(w, ids, padding_idx=-1, *args, **kwargs):
    # autograd treats the padding row as a constant: no edges from it (as for masks)
    src = aten.embedding(w, ids)
    return src.masked_fill((ids == padding_idx)[..., None], -1) if padding_idx >= 0 else src


_index_put_copy = _source_rule(data_slots=(0, 2))
_index_put_copy_forward = _source_forward(data_slots=(0, 2))


def uniform(cond) -> bool | None:
    """True where a mask holds everywhere, False where nowhere, None where it is mixed
    or not on the CPU (reading it on a GPU would make the pass wait for the device).

    A mask that depends only on the input's length (the attention mask of an unpadded
    input, ``_safe_softmax``'s fully masked rows) is usually uniform: the rules then
    pass D on, or give the zero, without a ``where`` over every element. The values are
    the same bits either way."""
    if not isinstance(cond, torch.Tensor) or cond.device.type != "cpu":
        return None
    if bool(cond.all()):
        return True
    return False if not bool(cond.any()) else None


def where_value(cond, x, y):
    """``torch.where(cond, x, y)``; where the condition is uniform (:func:`uniform`: on
    the CPU) and the input it picks already is the output (its shape, dtype and a
    contiguous layout), that input itself: no copy of what the mask of an unpadded input
    leaves as it is."""
    same = uniform(cond)
    if same is not None and isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        v = x if same else y
        if (
            v.is_contiguous()
            and v.shape == torch.broadcast_shapes(cond.shape, x.shape, y.shape)
            and v.dtype == torch.result_type(x, y)
        ):  # fmt: skip
            return v
    return aten.where.self(cond, x, y)


def _read_where(sr, g, keep, shape):
    """D of an input read where ``keep`` holds (the zero elsewhere), ⊕-reduced over the
    dims the op broadcast it along."""
    same = uniform(keep)
    if same is not None:  # read everywhere or nowhere
        return unbroadcast(sr, g, shape) if same else sr.zero(shape, g[0])
    zero = sr.zero((1,), g[0])
    picked = tuple(torch.where(keep, f, z) for f, z in zip(g, zero))
    return unbroadcast(sr, picked, shape)


@register(aten.where.self, "routing", reads=reads_nothing)
def _where(sr, g, op, cond, a, b):
    out = [None, None, None]
    for i, x, keep in ((1, a, cond), (2, b, ~cond)):
        if op.needs(i) and isinstance(x, torch.Tensor) and x.is_floating_point():
            out[i] = _read_where(sr, g, keep, x.shape)
    return out


def _pick(sr, op, keep, a, b):
    """``a`` where ``keep`` holds, ``b`` elsewhere (None: the zero), at the output's shape."""
    if a is None and b is None:
        return None
    shape = op.out.shape
    same = uniform(keep)
    if same is not None:  # one of them everywhere
        v = a if same else b
        return sr.zero(shape, op.out) if v is None else broadcast(v, shape)
    a, b = (sr.zero(shape, op.out) if v is None else broadcast(v, shape) for v in (a, b))
    return tuple(torch.where(keep, x, y) for x, y in zip(a, b))


@register_forward(aten.where.self)
def _where_forward(sr, a, op, cond, x, y):
    return _pick(sr, op, cond, a[1], a[2])


@register(aten.masked_fill.Scalar, "routing", reads=reads_nothing)
def _masked_fill(sr, g, op, x, mask, value):
    return [_read_where(sr, g, ~mask, x.shape) if op.needs(0) else None, None, None]


@register_forward(aten.masked_fill.Scalar)
def _masked_fill_forward(sr, a, op, x, mask, value):
    return _pick(sr, op, ~mask, a[0], None)


@register(aten.index_put.default, "routing", reads=reads_nothing)
def _index_put(sr, g, op, x, indices, values, accumulate=False):
    """``accumulate=True`` adds: each output element reads itself and every value put there."""
    if not accumulate:
        return _index_put_copy(sr, g, op, x, indices, values, accumulate)
    dv = None
    if op.needs(2):
        dv = unbroadcast(sr, fmap(lambda f: aten.index(f, indices), g), values.shape)
    return [g, None, dv]


@register_forward(aten.index_put.default)
def _index_put_forward(sr, a, op, x, indices, values, accumulate=False):
    if not accumulate:
        return _index_put_copy_forward(sr, a, op, x, indices, values, accumulate)
    own = a[0] if a[0] is not None else sr.zero(op.out.shape, op.out)
    if a[2] is None:
        return a[0]
    # each value put at position p is ⊕-ed into the output there (with x's own value)
    places = aten.index(torch.arange(x.numel(), device=x.device).view(x.shape), indices)
    put = fmap(lambda f: f.reshape(-1), broadcast(a[2], places.shape))
    added = _scatter_plus(sr, put, places.reshape(-1), x.numel(), op.out)
    return sr.plus(own, tuple(f.reshape(op.out.shape) for f in added))


routing(aten.index.Tensor)
routing(aten.gather.default)
routing(aten.index_select.default)
routing(aten.flip.default)
routing(aten.roll.default)
routing(aten.diagonal.default)
routing(aten.embedding.default, index_fn=_embedding_sources)
routing(aten.masked_fill.Tensor, data_slots=(0, 2))
routing(
    aten.constant_pad_nd.default,
    index_fn=lambda x, pad, value=0: aten.constant_pad_nd(x, pad, -1),
)
routing(aten.slice_scatter.default, data_slots=(0, 1))
routing(aten.select_scatter.default, data_slots=(0, 1))
routing(aten.scatter.src, data_slots=(0, 3))
routing(aten.scatter.value, index_fn=lambda x, dim, index, value: aten.scatter(x, dim, index, -1))
routing(aten.repeat.default)
routing(aten.unfold.default)
