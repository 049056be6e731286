"""Eisner's expectation semiring in normalized log form: the entropy of gradient paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import INF, Semiring, Value, _dims, log_abs, move_to_end, reduced_shape


@dataclass(frozen=True)
class EntropyReadout:
    entropy: torch.Tensor  #: H of p(π) ∝ |w(π)| over paths to the output (0 where none)
    log_z: torch.Tensor  #: log Σ_π |w(π)| (-inf where no path of nonzero weight)


def _weights(lz: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """p_i = exp(lz_i - total), 0 where the term or the total is empty."""
    return torch.where(lz == -INF, torch.zeros_like(lz), torch.exp(lz - total))


@dataclass(frozen=True)
class Entropy(Semiring):
    """Fields ``(log Z, m)`` with ``Z = Σ_π |w(π)|`` and ``m = E_p[-log |w(π)|]``.

    The path entropy is ``H = m + log Z``. Zero-weight edges carry no probability.
    """

    fields = ("log_z", "m")

    def zero(self, shape, like):
        lz = torch.full(tuple(shape), -INF, dtype=like.dtype, device=like.device)
        return (lz, torch.zeros_like(lz))

    def one(self, shape, like):
        lz = torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)
        return (lz, torch.zeros_like(lz))

    def accumulate(self, prev, c):
        if prev is None:  # zero ⊕ c: c, with no expectation where no path
            return (c[0], torch.where(c[0] == -INF, 0.0, c[1]).to(c[1].dtype))
        return self.plus(prev, c)

    def plus(self, a: Value, b: Value) -> Value:
        lz = torch.logaddexp(a[0], b[0])
        return (lz, _weights(a[0], lz) * a[1] + _weights(b[0], lz) * b[1])

    def times(self, a: Value, w: torch.Tensor) -> Value:
        lw = log_abs(w)
        lz = a[0] + lw
        return (lz, torch.where(lz == -INF, 0.0, a[1] - lw).to(lz.dtype))

    def mul(self, a: Value, b: Value) -> Value:
        lz = a[0] + b[0]
        return (lz, torch.where(lz == -INF, 0.0, a[1] + b[1]).to(lz.dtype))

    def sum(self, a: Value, dims, keepdim=False) -> Value:
        dims = _dims(dims, a[0].dim())
        if not dims:
            return a
        shape = reduced_shape(a[0].shape, dims, keepdim)
        lz, m = move_to_end(a[0], dims), move_to_end(a[1], dims)
        total = torch.logsumexp(lz, -1, keepdim=True)
        m = (_weights(lz, total) * m).sum(-1)
        return (total[..., 0].reshape(shape), m.reshape(shape))

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
        s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
        e = _weights(lz, s)  # exp(lz - s), 0 for empty terms
        n = e.shape[-2]
        zm = torch.matmul(torch.cat([e, e * m], -2), wn)  # one pass over the weights
        z, num = zm[..., :n, :], zm[..., n:, :] - torch.matmul(e, w_log_w)
        live = z > 0
        safe_z = torch.where(live, z, torch.ones_like(z))
        return (
            torch.where(live, torch.log(safe_z) + s + log_c, -INF),
            torch.where(live, num / safe_z, torch.zeros_like(z)),
        )

    def scalar(self, a: Value) -> torch.Tensor:
        return self.finalize(a).entropy

    def finalize(self, a: Value) -> EntropyReadout:
        live = a[0] > -INF
        return EntropyReadout(
            entropy=torch.where(live, a[1] + a[0], 0.0).to(a[0].dtype), log_z=a[0]
        )
