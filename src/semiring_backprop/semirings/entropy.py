"""Eisner's expectation semiring in normalized log form: the entropy of gradient paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import (
    INF,
    Dense,
    Semiring,
    Value,
    dense_if,
    has_storage,
    log_abs,
    move_to_end,
    normal_dims,
    reduced_shape,
    retype,
)


@dataclass(frozen=True)
class EntropyReadout:
    entropy: torch.Tensor  #: H of p(π) ∝ |w(π)| over paths to the output (0 where none)
    log_z: torch.Tensor  #: log Σ_π |w(π)| (-inf where no path of nonzero weight)


def _finite(m: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``m`` where it is finite, 0 elsewhere.

    The only non-finite ``m`` arise where there is no path (``lz == -inf``: a zero
    weight gives ``-log 0``, an empty total ``0 / 0``), where ``m`` means nothing; kept
    finite, it never turns a real term into NaN (``exp(-inf) · m == 0``). One fast
    arithmetic op instead of a comparison and a select.
    """
    if out is m:  # in place (an ``out=`` op has no batching rule under ``torch.vmap``)
        return m.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0, out=out)


@dataclass(frozen=True)
class Entropy(Semiring):
    """Fields ``(log Z, m)`` with ``Z = Σ_π |w(π)|`` and ``m = E_p[-log |w(π)|]``
    (finite, and meaningless where there is no path: read ``finalize``).

    The path entropy is ``H = m + log Z``. Zero-weight edges carry no probability.
    The readout has ``entropy`` and ``log_z``.

    Examples:
        The entropy of the distribution ``p = |w(π)| / Z`` over each input's paths:

        >>> p = paths.abs() / paths.abs().sum(0)
        >>> torch.allclose(mlp_res.at(0, sbp.Entropy()).entropy[0], -(p * p.log()).sum(0))
        True
    """

    fields = ("log_z", "m")
    zero_weight_is_no_edge = True  # (an edge of weight 0 carries no probability)

    def zero(self, shape, like):
        lz = torch.full(tuple(shape), -INF, dtype=like.dtype, device=like.device)
        return (lz, torch.zeros_like(lz))

    def one(self, shape, like):
        lz = torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)
        return Dense((lz, torch.zeros_like(lz)))

    # Invariant: m is finite; where there is no path (lz == -inf) its value is unused.

    def accumulate(self, prev, c):
        return c if prev is None else self.plus(prev, c)

    def plus(self, a: Value, b: Value) -> Value:
        lz = torch.logaddexp(a[0], b[0])
        # exp(-inf - lz) is 0 for an empty term; only an empty total gives NaN
        m = (a[0] - lz).exp_().mul_(a[1]).add_((b[0] - lz).exp_().mul_(b[1]))
        m = _finite(m, out=m)
        return dense_if(isinstance(a, Dense) or isinstance(b, Dense), (lz, m))

    def times(self, a: Value, w: torch.Tensor) -> Value:
        lw = log_abs(w)
        lz = a[0] + lw
        fresh = lw.shape == lz.shape and has_storage(a[1])  # lw is ours
        m = lw.neg_().add_(a[1]) if fresh else a[1] - lw
        return retype(a, (lz, _finite(m, out=m)))

    def mul(self, a: Value, b: Value) -> Value:
        return (a[0] + b[0], a[1] + b[1])

    def sum(self, a: Value, dims, keepdim=False) -> Value:
        dims = normal_dims(dims, a[0].dim())
        if not dims:
            return a
        shape = reduced_shape(a[0].shape, dims, keepdim)
        lz, m = move_to_end(a[0], dims), move_to_end(a[1], dims)
        total = torch.logsumexp(lz, -1, keepdim=True)
        m = (lz - total).exp_().mul_(m).sum(-1)
        m = _finite(m, out=m)  # NaN only for an empty total
        return retype(a, (total[..., 0].reshape(shape), m.reshape(shape)))

    def prepare(self, w: torch.Tensor):
        wa = torch.abs(w)
        c = wa.amax(-2, keepdim=True)  # columns scaled by their max: no overflow
        c = torch.where(c > 0, c, torch.ones_like(c))
        wn = wa / c
        return wn, torch.xlogy(wn, wa), torch.log(c)  # |w|/c · log|w|: 0 where w == 0

    def matmul(self, a: Value, w: torch.Tensor, prep=None) -> Value:
        wn, w_log_w, log_c = self.prepare(w) if prep is None else prep
        lz, m = a
        s = lz.amax(-1, keepdim=True)
        s = torch.where(torch.isfinite(s), s, 0.0)
        e = (lz - s).exp_()  # s is finite: 0 for empty terms
        n = e.shape[-2]
        zm = torch.matmul(torch.cat([e, e * m], -2), wn)  # one pass over the weights
        z, num = zm[..., :n, :], zm[..., n:, :] - torch.matmul(e, w_log_w)
        lz = torch.log(z).add_(s + log_c)  # -inf where z == 0: no path of nonzero weight
        m = num.div_(z)
        return retype(a, (lz, _finite(m, out=m)))

    def scalar(self, a: Value) -> torch.Tensor:
        return self.finalize(a).entropy

    def finalize(self, a: Value) -> EntropyReadout:
        live = a[0] > -INF
        return EntropyReadout(entropy=torch.where(live, a[1] + a[0], 0.0), log_z=a[0])
