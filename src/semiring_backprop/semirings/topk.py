"""Top-k: the k path products of largest magnitude, with signs and back-pointers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .base import (
    INF,
    Semiring,
    Value,
    _dims,
    chunk_rows,
    full_int,
    log_abs,
    move_to_end,
    node_index,
    reduced_shape,
)

_GROUPS = ("v", "s", "node", "idx", "rank")


@dataclass(frozen=True)
class TopKReadout:
    values: torch.Tensor  #: (..., k) signed path products, descending |value|; 0 = no path
    log_abs: torch.Tensor  #: (..., k) log |value|, -inf where fewer than k paths exist


def _sign(w: torch.Tensor) -> torch.Tensor:
    return torch.where(w < 0, -1.0, 1.0).to(w.dtype)


@dataclass(frozen=True)
class TopK(Semiring):
    """The ``k`` heaviest paths by |product|. Fields: k log-magnitudes ``v``, k signs
    ``s`` and, per entry, the back-pointer (consumer node, element, rank there)."""

    k: int = 5
    selective = True

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise InputError(f"TopK(k={self.k!r}): k must be a positive integer")

    @property
    def fields(self):
        return tuple(f"{g}{r}" for g in _GROUPS for r in range(self.k))

    @property
    def name(self) -> str:
        return f"TopK({self.k})"

    # values are tuples of 5k fields; inside the operations we stack them to (..., k)
    def _pack(self, a: Value) -> list[torch.Tensor]:
        k = self.k
        return [torch.stack(a[i * k : (i + 1) * k], -1) for i in range(len(_GROUPS))]

    def _unpack(self, groups) -> Value:
        return tuple(t for g in groups for t in g.unbind(-1))

    def _make(self, v):
        s = torch.ones_like(v)
        ptr = full_int(v.shape, -1, v)
        return self._unpack([v, s, ptr, ptr, ptr])

    def zero(self, shape, like):
        v = torch.full((*shape, self.k), -INF, dtype=like.dtype, device=like.device)
        return self._make(v)

    def one(self, shape, like):
        v = torch.full((*shape, self.k), -INF, dtype=like.dtype, device=like.device)
        v[..., 0] = 0
        return self._make(v)

    def tag(self, a, node_id):
        v, s, _, _, _ = self._pack(a)
        shape = v.shape[:-1]
        node = full_int(v.shape, node_id, v)
        idx = node_index(shape, v)[..., None].expand(v.shape)
        rank = torch.arange(self.k, device=v.device).expand(v.shape)
        return self._unpack([v, s, node, idx, rank])

    def _select(self, groups, cand_v, order_src=None):
        """Keep the k best of the trailing candidate dim; gather every group along."""
        v, j = cand_v.topk(self.k, -1)
        return [v] + [g.gather(-1, j) for g in groups]

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
        dims = _dims(dims, groups[0].dim() - 1)
        if not dims:
            return a
        shape = reduced_shape(groups[0].shape[:-1], dims, keepdim)
        flat = [move_to_end(g, (*dims, g.dim() - 1)) for g in groups]
        out = self._select(flat[1:], flat[0])
        return self._unpack([g.reshape(*shape, self.k) for g in out])

    def matmul(self, a, w, prep=None):
        k = self.k
        groups = self._pack(a)  # (..., n, m, k)
        *batch_groups, w = _batch_broadcast_groups(groups, w)
        lw = log_abs(w)[..., None, :, :, None]  # (..., 1, m, p, 1)
        sw = _sign(w)[..., None, :, :, None]
        n, m, p = batch_groups[0].shape[-3], batch_groups[0].shape[-2], w.shape[-1]
        step = chunk_rows(n, m * p * k * max(1, w[..., 0, 0].numel()))
        outs = []
        for r in range(0, n, step):
            v, s, *ptrs = (g[..., r : r + step, :, :] for g in batch_groups)
            cand = (v[..., :, :, None, :] + lw).transpose(-3, -2).flatten(-2)  # (.., r, p, m*k)
            best, j = cand.topk(k, -1)
            jm, jr = j // k, j % k
            flat = jm * k + jr  # index into the (m, k) grid of each row

            def take(g, flat=flat):
                g = g.flatten(-2)[..., None, :].expand(*g.shape[:-2], p, m * k)
                return g.gather(-1, flat)

            sign = take(s) * torch.gather(
                sw[..., 0].expand(*v.shape[:-2], m, p).transpose(-1, -2), -1, jm
            )
            outs.append([best, sign, *(take(g) for g in ptrs)])
        return self._unpack([torch.cat(gs, -3) for gs in zip(*outs)])

    def scalar(self, a) -> torch.Tensor:
        return self.finalize(a).values[..., 0]

    def rank(self, a) -> torch.Tensor:
        return self._pack(a)[0][..., 0]

    def finalize(self, a) -> TopKReadout:
        v, s, *_ = self._pack(a)
        return TopKReadout(
            values=torch.where(v > -INF, s * torch.exp(v), 0.0).to(v.dtype), log_abs=v
        )


def _batch_broadcast_groups(groups, w):
    batch = torch.broadcast_shapes(groups[0].shape[:-3], w.shape[:-2])
    groups = [g.expand(*batch, *g.shape[-3:]) for g in groups]
    return (*groups, w.expand(*batch, *w.shape[-2:]))
