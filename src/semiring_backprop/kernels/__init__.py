"""Fused semiring matmuls: max-times (sign-aware, with argmax) and max-plus (with argmax).

``torch.compile`` turns each into one loop nest that never materializes the (n, m, p)
broadcast (CPU and CUDA alike); shapes are dynamic, so one compilation serves every
size. Small problems, or any problem when compiling is unavailable or disabled
(``SEMIRING_BACKPROP_COMPILE=0`` or :func:`set_compile`), run the same formulas eagerly
in row chunks under a memory budget. Both paths compute the same values; tests compare
them.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

log = logging.getLogger(__name__)

INF = float("inf")

#: below this many (row, inner, column) triples a kernel runs eagerly (compiling would
#: cost more than it saves)
MIN_WORK = 2**18

_state = {"compile": os.environ.get("SEMIRING_BACKPROP_COMPILE", "1") != "0", "failed": set()}


def chunk_rows(n: int, per_row: int, budget: int = 2**24) -> int:
    """How many rows of a contraction to expand at once under an element budget."""
    return max(1, min(n, budget // max(per_row, 1)))


def set_compile(enabled: bool) -> None:
    """Use compiled kernels (default) or the chunked eager ones."""
    _state["compile"] = bool(enabled)


def _nan_to(t, fill):
    return torch.where(torch.isnan(t), fill, t)


def _maxtimes(hi, lo, w):
    """(B, n, m) x (B, m, p) -> max / min over m of the sign-aware products + argmax."""
    w4 = w[:, None, :, :]
    pos = w4 >= 0
    h4, l4 = hi[:, :, :, None], lo[:, :, :, None]
    out_hi, jh = _nan_to(torch.where(pos, h4 * w4, l4 * w4), -INF).max(2)
    out_lo, jl = _nan_to(torch.where(pos, l4 * w4, h4 * w4), INF).min(2)
    return out_hi, jh, out_lo, jl


def _maxplus(m, lw):
    """(B, n, m) x (B, m, p) -> max over m of m + lw, and its argmax."""
    return (m[:, :, :, None] + lw[:, None, :, :]).max(2)


_EAGER = {"maxtimes": _maxtimes, "maxplus": _maxplus}
_COMPILED: dict = {}


def _compiled(name):
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(_EAGER[name], dynamic=True, fullgraph=True)
    return _COMPILED[name]


def _run(name, a, b):
    """Run kernel ``name`` on batched (B, n, m) fields and (B, m, p) weights."""
    n, m, p = a[0].shape[-2], a[0].shape[-1], b.shape[-1]
    work = a[0].shape[0] * n * m * p
    key = (name, a[0].dtype, a[0].device.type)
    if _state["compile"] and work >= MIN_WORK and key not in _state["failed"]:
        try:  # contiguous inputs: one compiled graph for every shape (no stride guards)
            with warnings.catch_warnings():  # torch's own deprecations, raised while compiling
                warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch")
                return _compiled(name)(*(f.contiguous() for f in a), b.contiguous())
        except Exception as e:  # no compiler, unsupported device: same formulas, eagerly
            _state["failed"].add(key)
            log.warning("compiled %s kernel unavailable (%s); using the eager one", name, e)
    step = chunk_rows(n, m * p * a[0].shape[0])
    outs = [_EAGER[name](*(f[:, r : r + step] for f in a), b) for r in range(0, n, step)]
    return tuple(torch.cat(parts, 1) for parts in zip(*outs))


def _flat(fields, w):
    batch = torch.broadcast_shapes(fields[0].shape[:-2], w.shape[:-2])
    fields = [f.expand(*batch, *f.shape[-2:]).reshape(-1, *f.shape[-2:]) for f in fields]
    w = w.expand(*batch, *w.shape[-2:]).reshape(-1, *w.shape[-2:])
    return batch, fields, w


def maxtimes(hi, lo, w):
    """``out_hi[..., i, k] = max_j hi|lo[..., i, j] * w[..., j, k]`` (hi where w >= 0, lo
    where w < 0), ``out_lo`` likewise with min; with the argmax / argmin ``j``."""
    batch, (hi, lo), w = _flat((hi, lo), w)
    outs = _run("maxtimes", (hi, lo), w)
    return tuple(o.reshape(*batch, *o.shape[-2:]) for o in outs)


def maxplus(m, lw):
    """``out[..., i, k] = max_j m[..., i, j] + lw[..., j, k]`` and its argmax ``j``."""
    batch, (m,), lw = _flat((m,), lw)
    outs = _run("maxplus", (m,), lw)
    return tuple(o.reshape(*batch, *o.shape[-2:]) for o in outs)
