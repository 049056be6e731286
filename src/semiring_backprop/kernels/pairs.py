"""Max-times of two signed values: ``out[..., i, k] = max_j`` of the four products of
``a[..., i, j]``'s and ``b[..., j, k]``'s hi and lo (and ``min_j`` likewise), one loop
nest over (i, k, j) that reads each pair once (compiled as the other kernels are, see
:mod:`semiring_backprop.kernels`; eagerly in row chunks otherwise).

This is the contraction of two MaxProduct values (paths that meet at ``j``: a circuit's
edges, a head's token-to-token edges), where the pass's :func:`..kernels.maxtimes`
multiplies a value by edge weights. The zero (no path: ``(-inf, inf)``) of either side
never wins: its products are replaced by 0 and a penalty of -inf is added to them.
"""

from __future__ import annotations

import torch

from . import INF, chunk_rows, has_storage, plain, try_compiled, zero_masked

_COMPILED: dict = {}
#: elements of the eager kernel's products held at once (a chunk of rows and of the
#: batch: four products and two of their max / min, ``6 * m * p`` per row). Chunks of
#: 2^19-2^20 ran fastest on CPU (chunks of 2^21 and more were 2-7x slower: each large
#: temporary is new memory to fault in)
PAIRS_BUDGET = 2**20


def _pairs(ahs, als, apen, bhs, bls, bpen):
    """(B, n, m) and (B, p, m) (``b`` transposed) -> the (B, n, p) max and min over m of
    the four products, each with both sides' penalties (-inf at the zero)."""
    a1, a2, pa = ahs[:, :, None, :], als[:, :, None, :], apen[:, :, None, :]
    b1, b2, pb = bhs[:, None, :, :], bls[:, None, :, :], bpen[:, None, :, :]
    c1, c2, c3, c4 = a1 * b1, a1 * b2, a2 * b1, a2 * b2
    pen = pa + pb
    hi = (torch.maximum(torch.maximum(c1, c2), torch.maximum(c3, c4)) + pen).amax(-1)
    lo = (torch.minimum(torch.minimum(c1, c2), torch.minimum(c3, c4)) - pen).amin(-1)
    return hi, lo


def _whole(a_hi, a_lo, bt_hi, bt_lo):
    """:func:`zero_masked` of both sides, then :func:`_pairs`: compiled as one program, the
    parts are loops of their own over the inputs, not over the (n, p, m) products."""
    return _pairs(*zero_masked(a_hi, a_lo), *zero_masked(bt_hi, bt_lo))


def _compiled():
    if "pairs" not in _COMPILED:
        _COMPILED["pairs"] = torch.compile(_whole, dynamic=True, fullgraph=True)
    return _COMPILED["pairs"]


def maxtimes_pairs(a_hi, a_lo, b_hi, b_lo):
    """``(hi, lo)`` of ``⊕_j a[..., i, j] ⊗ b[..., j, k]`` under signed max-times: ``hi``
    the largest of the products of ``a``'s hi or lo with ``b``'s hi or lo, ``lo`` the
    smallest; ``(-inf, inf)`` (no path) where no ``j`` holds a path on both sides."""
    batch = torch.broadcast_shapes(a_hi.shape[:-2], b_hi.shape[:-2])
    n, m, p = a_hi.shape[-2], a_hi.shape[-1], b_hi.shape[-1]
    if m == 0:  # an empty sum: no path
        hi = a_hi.new_full((*batch, n, p), -INF)
        return hi, torch.full_like(hi, INF)
    b = batch.numel()

    def flat(t, rows, cols):
        return t.expand(*batch, rows, cols).reshape(b, rows, cols)

    a = flat(a_hi, n, m), flat(a_lo, n, m)
    bt = tuple(flat(t.transpose(-2, -1), p, m) for t in (b_hi, b_lo))
    work = b * n * m * p if has_storage(a_hi) and has_storage(b_hi) else 0
    key = ("maxtimes_pairs", a_hi.dtype, a_hi.device.type)
    out = try_compiled(key, work, a_hi.device, lambda: _compiled()(*(plain(t) for t in (*a, *bt))))
    if out is None:
        out = _eager(zero_masked(*a), zero_masked(*bt), b, n, m, p)
    return tuple(o.reshape(*batch, n, p) for o in out)


def _eager(a, bt, b: int, n: int, m: int, p: int):
    """:func:`_pairs` in chunks of rows and of the batch, each holding at most
    :data:`PAIRS_BUDGET` elements of products."""
    per = 6 * m * p
    rows = chunk_rows(n, per, PAIRS_BUDGET)
    span = max(1, PAIRS_BUDGET // (per * rows))  # batch elements at once
    hi = a[0].new_empty(b, n, p)
    lo = torch.empty_like(hi)
    for i in range(0, b, span):
        for r in range(0, n, rows):
            h, low = _pairs(*(t[i : i + span, r : r + rows] for t in a),
                            *(t[i : i + span] for t in bt))  # fmt: skip
            hi[i : i + span, r : r + rows] = h
            lo[i : i + span, r : r + rows] = low
    return hi, lo
