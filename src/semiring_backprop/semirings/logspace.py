"""Log-space semirings over |path product|: MaxAbs, LogAbs and PathCount."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .base import (
    INF,
    Semiring,
    full_int,
    log_abs,
    move_to_end,
    node_index,
    normal_dims,
    reduced_shape,
)
from .maxproduct import batch_broadcast


def scaled_abs(w: torch.Tensor):
    """``(|w| / c, log c)`` with ``c`` the column max of ``|w|`` (1 for a zero column)."""
    w_abs = torch.abs(w)
    c = w_abs.amax(-2, keepdim=True)
    c = torch.where(c > 0, c, torch.ones_like(c))
    return w_abs / c, torch.log(c)


def shifted_logmatmul(la: torch.Tensor, scaled) -> torch.Tensor:
    """``log Σ_j exp(la[i, j]) · |w[j, k]|`` with ordinary (BLAS) matmuls, for
    ``scaled = scaled_abs(w)``.

    Rows of ``la`` are shifted by their max and columns of ``|w|`` scaled by theirs,
    so neither overflows nor underflows; an all ``-inf`` row gives ``-inf``.
    """
    wn, log_c = scaled
    s = la.amax(-1, keepdim=True)
    s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
    out = torch.matmul(torch.exp(la - s), wn)
    return torch.log(out) + s + log_c


@dataclass(frozen=True)
class MaxAbsReadout:
    value: torch.Tensor  #: max over paths of |path product| (0 where no path)
    log: torch.Tensor  #: its logarithm (-inf where no path)


@dataclass(frozen=True)
class MaxAbs(Semiring):
    """Largest |path product|, kept as a logarithm: safe from underflow in deep nets.

    The readout has ``value`` (the product's magnitude) and ``log``.

    Examples:
        >>> r = sbp.backprop(mlp, (x,), output=lambda y: y[0, 1], semirings=[sbp.MaxAbs()])
        >>> torch.allclose(r.at(0, sbp.MaxAbs()).value[0], paths.abs().amax(0))
        True
    """

    fields = ("m", "node", "idx")
    selective = True
    zero_weight_is_no_edge = True  # (log |0| = -inf)

    def zero(self, shape, like):
        m = torch.full(tuple(shape), -INF, dtype=like.dtype, device=like.device)
        return (m, full_int(shape, -1, m), full_int(shape, -1, m))

    def one(self, shape, like):
        m = torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)
        return (m, full_int(shape, -1, m), full_int(shape, -1, m))

    def tag(self, a, node_id):
        return (a[0], full_int(a[0].shape, node_id, a[0]), node_index(a[0].shape, a[0]))

    def accumulate(self, prev, c):
        return c if prev is None else self.plus(prev, c)

    def plus(self, a, b):
        t = a[0] >= b[0]
        return tuple(torch.where(t, x, y) for x, y in zip(a, b))

    def times(self, a, w):
        m = a[0] + log_abs(w)
        return (m, a[1].expand(m.shape), a[2].expand(m.shape))

    def mul(self, a, b):
        return (a[0] + b[0], a[1], a[2])

    def sum(self, a, dims, keepdim=False):
        dims = normal_dims(dims, a[0].dim())
        if not dims:
            return a
        shape = reduced_shape(a[0].shape, dims, keepdim)
        m, j = move_to_end(a[0], dims).max(-1)
        ptrs = (move_to_end(p, dims).gather(-1, j[..., None])[..., 0] for p in a[1:])
        return tuple(f.reshape(shape) for f in (m, *ptrs))

    def prepare(self, w):
        return log_abs(w).transpose(-2, -1).contiguous()  # the kernel reads it transposed

    def matmul(self, a, w, prep=None):
        lwt = self.prepare(w) if prep is None else prep
        best, j = kernels.maxplus(a[0], lwt)
        a, w = batch_broadcast(a, w)
        return (best, *(ptr.gather(-1, j) for ptr in a[1:]))

    def scalar(self, a) -> torch.Tensor:
        return torch.exp(a[0])

    def rank(self, a) -> torch.Tensor:
        return a[0]

    def finalize(self, a) -> MaxAbsReadout:
        return MaxAbsReadout(value=torch.exp(a[0]), log=a[0])


@dataclass(frozen=True)
class LogAbsReadout:
    log: torch.Tensor  #: log Σ over paths of |path product|


@dataclass(frozen=True)
class LogAbs(Semiring):
    """``log Σ_π |w(π)|``: the total absolute gradient flow, in log space.

    Examples:
        >>> r = sbp.backprop(mlp, (x,), output=lambda y: y[0, 1], semirings=[sbp.LogAbs()])
        >>> torch.allclose(r.at(0, sbp.LogAbs()).log[0], paths.abs().sum(0).log())
        True
    """

    fields = ("l",)
    zero_weight_is_no_edge = True  # (log |0| = -inf)

    def zero(self, shape, like):
        return (torch.full(tuple(shape), -INF, dtype=like.dtype, device=like.device),)

    def one(self, shape, like):
        return (torch.zeros(tuple(shape), dtype=like.dtype, device=like.device),)

    def plus(self, a, b):
        return (torch.logaddexp(a[0], b[0]),)

    def _edge(self, w):
        return log_abs(w)

    def times(self, a, w):
        return (a[0] + self._edge(w),)

    def mul(self, a, b):
        return (a[0] + b[0],)

    def sum(self, a, dims, keepdim=False):
        dims = normal_dims(dims, a[0].dim())
        return (torch.logsumexp(a[0], dims, keepdim=keepdim) if dims else a[0],)

    def prepare(self, w):
        return scaled_abs(w)

    def matmul(self, a, w, prep=None):
        return (shifted_logmatmul(a[0], self.prepare(w) if prep is None else prep),)

    def scalar(self, a) -> torch.Tensor:
        return a[0]  # log Σ |w(π)| (log #paths for PathCount)

    def finalize(self, a) -> LogAbsReadout:
        return LogAbsReadout(log=a[0])


@dataclass(frozen=True)
class PathCountReadout:
    log_count: torch.Tensor  #: log of the number of paths to the output


@dataclass(frozen=True)
class PathCount(LogAbs):
    """``log`` of the number of paths: every structurally present edge counts 1.

    Examples:
        Each input of the MLP reaches the output through its three hidden units:

        >>> r = sbp.backprop(mlp, (x,), output=lambda y: y[0, 1], semirings=[sbp.PathCount()])
        >>> r.at(0, sbp.PathCount()).log_count.exp().round()
        tensor([[3., 3., 3., 3.]], dtype=torch.float64)
    """

    zero_weight_is_no_edge = False  # (every edge there counts, whatever its weight)

    def _edge(self, w):
        return torch.zeros_like(w)

    def prepare(self, w):
        return None

    def matmul_without(self, a, w, absent):
        """The number of paths over the edges that are there: ``log Σ_j exp(a[i, j])`` over
        the ``j`` whose edge to ``k`` is not ``absent``."""
        present = (~absent).to(a[0].dtype)
        return (shifted_logmatmul(a[0], scaled_abs(present)),)

    def matmul(self, a, w, prep=None):
        a0, w = batch_broadcast(a, w)
        lse = torch.logsumexp(a0[0], -1, keepdim=True)
        return (lse.expand(*lse.shape[:-1], w.shape[-1]),)

    def finalize(self, a) -> PathCountReadout:
        return PathCountReadout(log_count=a[0])
