"""Contractions: the semiring matmul of the output value with the other operand.

For ``c = a @ b``: ``D(a) = D(c) ⊗ bᵀ`` and ``D(b) = (D(c)ᵀ ⊗ a)ᵀ``, where
``sr.matmul(x, w)[i, k] = ⊕_j x[i, j] ⊗ lift(w[j, k])``. Every (i, k, j) is an edge,
whatever the weight's value (dense), but where the weight is a structural zero (an
attention probability a mask made 0: ``Op.absent``). The forward rules multiply on the
other side:
``alpha(c) = alpha(a) ⊗ b ⊕ (alpha(b)ᵀ ⊗ aᵀ)ᵀ``.
"""

from __future__ import annotations

import math

import torch

from ..errors import UnsupportedOpError
from ..semirings.base import Dense, fmap, fmap2
from .registry import reads_each_for_the_other, register, register_forward
from .shapes import broadcast, oplus, unbroadcast

aten = torch.ops.aten


def _mT(value):
    return fmap(lambda f: f.transpose(-2, -1), value)


def _live_matmul(sr, g, w, prep=None):
    """``sr.matmul(g, w)`` computing only the rows of ``g`` that carry a path.

    Rows equal to the semiring's zero (positions the output never reads, such as every
    position but one in a language model's head) give zero rows; skipping them changes
    no value and saves most of the work there.
    """
    x = g[0]
    if isinstance(g, Dense) or x.dim() != 2 or w.dim() != 2:
        return sr.matmul(g, w, prep)
    if x.device.type != "cpu" and x.shape[0] * x.shape[1] * w.shape[-1] < LIVE_ROWS_ON_DEVICE:
        return sr.matmul(g, w, prep)  # counting live rows waits for the device: not worth it
    live = _live_rows(x, _zero_of(sr, x))
    n_live = int(live.sum())
    if n_live == x.shape[0]:  # a path in every row, so at every element of the result
        out = sr.matmul(g, w, prep)
        return Dense(out) if type(out) is tuple else out
    rows = live.nonzero().flatten()
    out = sr.zero((x.shape[0], w.shape[-1]), x)
    if n_live == 0:
        return out
    part = sr.matmul(tuple(f.index_select(0, rows) for f in g), w, prep)
    return fmap2(lambda o, p: o.index_copy(0, rows, p), out, part)


#: on an accelerator, counting the live rows is a host synchronization (the device's
#: queue drains while the host waits): only contractions of at least this many
#: (row, inner, column) triples look for them first, where the rows skipped save more
#: than the wait costs (a vocabulary-sized head read at one position of a long input:
#: 1,024 x 1,024 x 50,257 for GPT-2 medium); smaller ones run on every row
LIVE_ROWS_ON_DEVICE = 2**34

_ZEROS: dict = {}


def _zero_of(sr, x) -> float:
    """The first field of ``sr``'s zero, as a number (once per semiring and dtype)."""
    key = (sr, x.dtype)
    if key not in _ZEROS:
        _ZEROS[key] = float(sr.zero((), x.new_zeros((), device="cpu"))[0])
    return _ZEROS[key]


def _live_rows(x, zero: float):
    """Rows of ``x`` with an entry other than ``zero`` (NaN counts as live), by a fast
    reduction where the zero allows one (comparisons are the slow ops on CPU)."""
    if x.shape[-1] == 0:
        return (x != zero).any(-1)
    if zero == -math.inf:
        return ~(x.amax(-1) == zero)
    if zero == 0:  # two reductions, no |x| copy (16 MB at BERT-base's logits)
        return ~((x.amax(-1) == 0) & (x.amin(-1) == 0))
    return (x != zero).any(-1)


def _matmul(sr, x, w, absent=None):
    """``sr.matmul(x, w)``, without the edges where ``absent`` (over ``w``) holds."""
    return sr.matmul(x, w) if absent is None else sr.matmul_without(x, w, absent)


def _matmul_grads(sr, g, op, a, b, i_a, i_b, scale=1):
    da = db = None
    # edges that are not there (Op.absent): a's where b is a structural zero, and b's
    # where a is
    not_a, not_b = op.absent.get(i_a), op.absent.get(i_b)
    if op.needs(i_a) and not_a is not None:
        w = (b if scale == 1 else b * scale).transpose(-2, -1)
        da = sr.matmul_without(g, w, not_a.transpose(-2, -1))
    elif op.needs(i_a):  # b is usually a weight: its prepared form is kept across calls
        w, prep = op.weight(sr, i_b, lambda: (b if scale == 1 else b * scale).transpose(-2, -1))
        da = _live_matmul(sr, g, w, prep)
    if op.needs(i_b):
        db = _mT(_matmul(sr, _mT(g), a if scale == 1 else a * scale, not_b))
    return da, db


def _matmul_forward(sr, alpha_a, alpha_b, a, b, scale=1, absent=(None, None)):
    """The two slots' parts of ``alpha(a @ b)`` (None where no path reaches a slot);
    ``absent``: the two slots' edges that are not there (``Op.absent``)."""
    da = db = None
    if alpha_a is not None:
        da = _matmul(sr, alpha_a, b if scale == 1 else b * scale, absent[0])
    if alpha_b is not None:
        at = (a if scale == 1 else a * scale).transpose(-2, -1)
        not_b = None if absent[1] is None else absent[1].transpose(-2, -1)
        db = _mT(_matmul(sr, _mT(alpha_b), at, not_b))
    return [da, db]


@register([aten.mm.default, aten.bmm.default], "contraction", reads=reads_each_for_the_other(0, 1))
def _mm(sr, g, op, a, b):
    return list(_matmul_grads(sr, g, op, a, b, 0, 1))


@register_forward([aten.mm.default, aten.bmm.default])
def _mm_forward(sr, alphas, op, a, b):
    absent = (op.absent.get(0), op.absent.get(1))
    return oplus(sr, _matmul_forward(sr, alphas[0], alphas[1], a, b, absent=absent))


@register(
    [aten.addmm.default, aten.baddbmm.default], "contraction", reads=reads_each_for_the_other(1, 2)
)
def _addmm(sr, g, op, bias, a, b, *, beta=1, alpha=1):
    da, db = _matmul_grads(sr, g, op, a, b, 1, 2, alpha)
    dbias = None
    if isinstance(bias, torch.Tensor) and op.needs(0):
        scaled = g if beta == 1 else sr.times(g, torch.full_like(op.out, beta))
        dbias = unbroadcast(sr, scaled, bias.shape)
    return [dbias, da, db]


@register_forward([aten.addmm.default, aten.baddbmm.default])
def _addmm_forward(sr, alphas, op, bias, a, b, *, beta=1, alpha=1):
    absent = (op.absent.get(1), op.absent.get(2))
    parts = _matmul_forward(sr, alphas[1], alphas[2], a, b, alpha, absent)
    if isinstance(bias, torch.Tensor) and alphas[0] is not None:
        spread = broadcast(alphas[0], op.out.shape)
        parts.append(spread if beta == 1 else sr.times(spread, torch.full_like(op.out, beta)))
    return oplus(sr, parts)


@register(
    [aten._grouped_mm.default, "transformers.grouped_mm_fallback.default"],
    "contraction",
    reads=reads_each_for_the_other(0, 1),
)
def _grouped_mm(sr, g, op, x, w, offs=None, bias=None, out_dtype=None):
    """Mixture-of-experts matmul: rows ``offs[i-1]:offs[i]`` of ``x`` (sorted by expert)
    times ``w[i]``; rows past the last offset are not read."""
    if offs is None or x.dim() != 2 or w.dim() != 3 or bias is not None:
        raise UnsupportedOpError(
            f"{op.node.target} at node `{op.node.name}`: only the mixture-of-experts form "
            "(2-D input, 3-D weights, offsets, no bias) has a rule"
        )
    bounds = [0, *offs.tolist()]
    dx, dw = [], [None] * w.shape[0]
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end == start:
            continue
        rows = fmap(lambda f, s=start, e=end: f[s:e], g)
        if op.needs(0):
            dx.append(sr.matmul(rows, w[i].transpose(0, 1)))
        if op.needs(1):
            dw[i] = _mT(sr.matmul(_mT(rows), x[start:end]))
    out = [None, None, None, None, None]
    if op.needs(0):
        tail = x.shape[0] - bounds[-1]
        if tail:
            dx.append(sr.zero((tail, x.shape[1]), x))
        out[0] = tuple(torch.cat(fs) for fs in zip(*dx)) if dx else sr.zero(x.shape, x)
    if op.needs(1):
        zero = sr.zero(w.shape[1:], w)
        out[1] = tuple(torch.stack(fs) for fs in zip(*(d or zero for d in dw)))
    return out
