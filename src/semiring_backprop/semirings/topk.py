"""Top-k: the k path products of largest magnitude, with signs and back-pointers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import kernels
from ..errors import InputError
from .base import (
    INF,
    Semiring,
    Value,
    full_int,
    has_storage,
    log_abs,
    move_to_end,
    node_index,
    normal_dims,
    reduced_shape,
)

_GROUPS = ("v", "s", "ptr")

# a back-pointer (consumer node, flat element there, rank there) as one int64:
# node << 44 | element << 8 | rank; -1 (every bit set) is "no pointer", and its node
# reads back as -1 (an arithmetic shift)
_RANK_BITS, _ELEMENT_BITS, _NODE_BITS = 8, 36, 19
_ELEMENT_SHIFT = _RANK_BITS
_NODE_SHIFT = _RANK_BITS + _ELEMENT_BITS


def _pointers(node_id: int, shape, k: int, like: torch.Tensor) -> torch.Tensor:
    """The back-pointers of a node's entries: ``(..., k)``, entry ``r`` of element ``i``
    pointing at (``node_id``, ``i``, ``r``)."""
    if node_id >= 1 << _NODE_BITS:
        raise InputError(
            f"TopK's back-pointers name graph nodes below {1 << _NODE_BITS}; this graph has "
            f"node {node_id}: use MaxProduct for its top path, or explain a smaller model"
        )
    if math.prod(shape) >= 1 << _ELEMENT_BITS:
        raise InputError(
            f"TopK's back-pointers name elements below 2^{_ELEMENT_BITS}; node {node_id} has "
            f"{math.prod(shape)} (shape {tuple(shape)}): explain fewer examples at once"
        )
    base = node_index(shape, like).mul_(1 << _ELEMENT_SHIFT).add_(node_id << _NODE_SHIFT)
    return base[..., None] + torch.arange(k, device=like.device)


def unpack_pointers(ptr: torch.Tensor):
    """``(node, element, rank)`` of packed back-pointers; node -1 where there is none."""
    node = ptr >> _NODE_SHIFT
    element = (ptr >> _ELEMENT_SHIFT) & ((1 << _ELEMENT_BITS) - 1)
    return node, element, ptr & ((1 << _RANK_BITS) - 1)


@dataclass(frozen=True)
class TopKReadout:
    values: torch.Tensor  #: (..., k) signed path products, descending |value|; 0 = no path
    log_abs: torch.Tensor  #: (..., k) log |value|, -inf where fewer than k paths exist


def _stack(fields) -> torch.Tensor:
    """``torch.stack(fields, -1)``; a view, not a copy, where the fields are equally
    spaced views of one tensor (as ``_unpack`` makes them, and as moves keep them), or
    one view k times (a group broadcast along the k entries, as ``tag``'s element
    indices are: stride 0)."""
    f0 = fields[0]
    if len(fields) > 1 and has_storage(f0):
        step = fields[1].storage_offset() - f0.storage_offset()
        shape, stride, storage = f0.shape, f0.stride(), f0.untyped_storage().data_ptr()
        if all(
            f.shape == shape
            and f.stride() == stride
            and f.dtype == f0.dtype
            and f.storage_offset() == f0.storage_offset() + r * step
            and f.untyped_storage().data_ptr() == storage
            for r, f in enumerate(fields)
        ):
            return f0.as_strided((*shape, len(fields)), (*stride, step))
    return torch.stack(fields, -1)


def _sign(w: torch.Tensor) -> torch.Tensor:
    return torch.where(w < 0, -1.0, 1.0).to(w.dtype)


@dataclass(frozen=True)
class TopK(Semiring):
    """The ``k`` heaviest paths by |product|. Fields: k log-magnitudes ``v``, k signs
    ``s`` and, per entry, the back-pointer (consumer node, element, rank there) packed
    into one int64 (:func:`unpack_pointers`; :meth:`pointers` reads them).

    The readout has ``values`` (signed products, heaviest first, in a last dimension of
    size ``k``) and ``log_abs``.

    Examples:
        >>> heaviest = paths.gather(0, paths.abs().argsort(0, descending=True))[:2]
        >>> torch.allclose(mlp_res.at(0, sbp.TopK(2)).values[0], heaviest.T)
        True
    """

    k: int = 5
    selective = True
    zero_weight_is_no_edge = True  # (log |0| = -inf)

    def __post_init__(self):
        if not isinstance(self.k, int) or not 1 <= self.k < 1 << _RANK_BITS:
            raise InputError(
                f"TopK(k={self.k!r}): k must be a positive integer, at most {(1 << _RANK_BITS) - 1}"
            )

    @property
    def fields(self):
        return tuple(f"{g}{r}" for g in _GROUPS for r in range(self.k))

    @property
    def name(self) -> str:
        return f"TopK({self.k})"

    # values are tuples of 3k fields; inside the operations we stack them to (..., k)
    def _pack(self, a: Value) -> list[torch.Tensor]:
        k = self.k
        return [_stack(a[i * k : (i + 1) * k]) for i in range(len(_GROUPS))]

    def _unpack(self, groups) -> Value:
        return tuple(t for g in groups for t in g.unbind(-1))

    def pointers(self, a: Value):
        """``(log |value|, sign, node, element, rank)`` of a value, each ``(..., k)``:
        entry ``r``'s path goes on to entry ``rank`` of ``element`` (flat) of graph node
        ``node`` (-1: none)."""
        v, s, ptr = self._pack(a)
        return (v, s, *unpack_pointers(ptr))

    def _make(self, v):
        s = torch.ones_like(v)
        ptr = full_int(v.shape, -1, v)
        return self._unpack([v, s, ptr])

    def zero(self, shape, like):
        v = torch.full((*shape, self.k), -INF, dtype=like.dtype, device=like.device)
        return self._make(v)

    def one(self, shape, like):
        v = torch.full((*shape, self.k), -INF, dtype=like.dtype, device=like.device)
        v[..., 0].fill_(0)  # (an assignment of 0 would copy a host scalar: a device waits)
        return self._make(v)

    def tag(self, a, node_id):
        v, s, _ = self._pack(a)
        return self._unpack([v, s, _pointers(node_id, v.shape[:-1], self.k, v)])

    def _select(self, groups, cand_v, order_src=None):
        """Keep the k best of the trailing candidate dim; gather every group along."""
        v, j = cand_v.topk(self.k, -1)
        return [v] + [g.gather(-1, j) for g in groups]

    def accumulate(self, prev, c):
        # zero ⊕ c is c: every value lists its k entries in descending order
        return c if prev is None else self.plus(prev, c)

    def plus(self, a, b):
        ga, gb = self._pack(a), self._pack(b)
        shape = torch.broadcast_shapes(ga[0].shape, gb[0].shape)
        cat = [torch.cat([x.expand(shape), y.expand(shape)], -1) for x, y in zip(ga, gb)]
        return self._unpack(self._select(cat[1:], cat[0]))

    def times(self, a, w):
        v, s, *ptrs = self._pack(a)
        v = v + log_abs(w)[..., None]
        s = s * _sign(w)[..., None]
        return self._unpack([v, s, *(p.expand(v.shape) for p in ptrs)])

    def mul(self, a, b):
        k = self.k
        va, sa, *pa = self._pack(a)
        vb, sb, *_ = self._pack(b)
        v = (va[..., :, None] + vb[..., None, :]).flatten(-2)
        s = (sa[..., :, None] * sb[..., None, :]).flatten(-2)
        p = [x[..., :, None].expand(*x.shape, k).flatten(-2) for x in pa]
        return self._unpack(self._select([s, *p], v))

    def sum(self, a, dims, keepdim=False):
        groups = self._pack(a)
        dims = normal_dims(dims, groups[0].dim() - 1)
        if not dims:
            return a
        shape = reduced_shape(groups[0].shape[:-1], dims, keepdim)
        flat = [move_to_end(g, (*dims, g.dim() - 1)) for g in groups]
        out = self._select(flat[1:], flat[0])
        return self._unpack([g.reshape(*shape, self.k) for g in out])

    def prepare(self, w):
        # log |w| transposed (the kernel reads the reduced dim contiguous), padded with
        # log 0 to a multiple of kernels.PAD (its blocks)
        lwt = log_abs(w).transpose(-2, -1)
        pad = -lwt.shape[-1] % kernels.PAD
        return torch.nn.functional.pad(lwt, (0, pad), value=-INF).contiguous()

    def matmul(self, a, w, prep=None):
        """The k best of the (m, k) candidates ``v[i, t] + log |w[i, j]|`` of each output
        element come from the k inputs ``i`` whose best (``t = 0``) candidates are the k
        best: those k "heads" are found first (a max-plus top-k kernel over (n, m, p),
        never the (n, m, p, k) broadcast), then the k best of their k x k candidates."""
        k = self.k
        groups = self._pack(a)  # (..., n, m, k) each
        lwt = self.prepare(w) if prep is None else prep  # (..., p, m)
        m = groups[0].shape[-2]
        if m == 0:  # an empty sum: no path
            return self.zero((*torch.broadcast_shapes(groups[0].shape[:-3], w.shape[:-2]),
                              groups[0].shape[-3], w.shape[-1]), groups[0])  # fmt: skip
        heads, rows = kernels.maxplus_topk(groups[0][..., 0], lwt, min(k, m))  # (..., n, p, h)
        rows = rows.clamp(max=m - 1)  # where no path is left (heads -inf): any row
        lwt = lwt[..., :m]
        *groups, lwt, wt = _batch_broadcast_groups(groups, lwt, w.transpose(-2, -1))
        n, p, h = rows.shape[-3:]

        def at_rows(t):  # (..., p, m) weights at each head's row -> (..., n, p, h)
            return t[..., None, :, :].expand(*t.shape[:-2], n, p, m).gather(-1, rows)

        def cands(g):  # (..., n, m, k) -> (..., n, p, h, k): the heads' k entries
            ix = rows.flatten(-2)[..., None].expand(*rows.shape[:-2], p * h, k)
            return g.gather(-2, ix).view(*rows.shape, k)

        v = cands(groups[0]) + at_rows(lwt)[..., None]
        v = v.masked_fill((heads == -INF)[..., None], -INF)  # no path: no head
        best, j = v.flatten(-2).topk(k, -1)
        # the kept entries alone, not the heads' k x k: entry j // k of the heads' rows,
        # rank j % k there, read from each group flat as (..., n, m * k)
        row = rows.gather(-1, j // k)
        at = (row * k + j % k).flatten(-2)

        def kept(g):
            return g.flatten(-2).gather(-1, at).view(row.shape)

        w_at = wt[..., None, :, :].expand(*wt.shape[:-2], n, p, m).gather(-1, row)
        return self._unpack([best, kept(groups[1]) * _sign(w_at), *map(kept, groups[2:])])

    def scalar(self, a) -> torch.Tensor:
        return self.finalize(a).values[..., 0]

    def rank(self, a) -> torch.Tensor:
        return self._pack(a)[0][..., 0]

    def finalize(self, a) -> TopKReadout:
        v, s, _ = self._pack(a)
        return TopKReadout(
            values=torch.where(v > -INF, s * torch.exp(v), 0.0).to(v.dtype), log_abs=v
        )


def _batch_broadcast_groups(groups, *ws):
    batch = torch.broadcast_shapes(groups[0].shape[:-3], *(w.shape[:-2] for w in ws))
    groups = [g.expand(*batch, *g.shape[-3:]) for g in groups]
    return (*groups, *(w.expand(*batch, *w.shape[-2:]) for w in ws))
