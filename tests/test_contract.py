"""``Semiring.contract`` (the matmul of two values) against the paths it combines: each
value is the ⊕ of two lifted weights (two paths per element); the contraction must be
the ⊕ over ``j`` and over the four pairs of paths of their products."""

from __future__ import annotations

import itertools

import pytest
import torch

import semiring_backprop as sbp

F64 = torch.float64


def _paths(shape, gen, zero_share=0.0):
    ws = [torch.randn(shape, dtype=F64, generator=gen) for _ in range(2)]
    gone = torch.rand(shape, generator=gen, dtype=F64) < zero_share
    return ws, gone


def _value(sr, ws, gone):
    v = sr.plus(*(sr.times(sr.one(w.shape, w), w) for w in ws))
    z = sr.zero(ws[0].shape, ws[0])
    return tuple(torch.where(gone, zf, f) for zf, f in zip(z, v))


@pytest.mark.parametrize("zero_share", [0.0, 0.3])
@pytest.mark.parametrize("budget", [None, 120, 240, 720])
def test_max_product_contraction_is_the_best_of_every_pair_of_paths(
    zero_share, budget, monkeypatch
):
    """``budget``: the eager kernel in chunks (120 elements of products: one row of one
    batch element at a time; 240: two rows, then one; 720: all rows of two elements)."""
    from semiring_backprop.kernels import pairs

    if budget is not None:
        monkeypatch.setattr(pairs, "PAIRS_BUDGET", budget)
    gen = torch.Generator().manual_seed(0)
    (wa, ga), (wb, gb) = _paths((2, 3, 4), gen, zero_share), _paths((2, 4, 5), gen, zero_share)
    sr = sbp.MaxProduct()
    got = sr.finalize(sr.contract(_value(sr, wa, ga), _value(sr, wb, gb)))
    hi = torch.full((2, 3, 5), -torch.inf, dtype=F64)
    lo = torch.full((2, 3, 5), torch.inf, dtype=F64)
    for b, i, k, j in itertools.product(range(2), range(3), range(5), range(4)):
        if ga[b, i, j] or gb[b, j, k]:
            continue
        for x, y in itertools.product(wa, wb):
            prod = x[b, i, j] * y[b, j, k]
            hi[b, i, k], lo[b, i, k] = max(hi[b, i, k], prod), min(lo[b, i, k], prod)
    assert torch.equal(got.hi, hi) and torch.equal(got.lo, lo)


def test_max_product_contraction_with_columns_of_no_path():
    """Whole columns of ``b`` with no path (the kernel's way) and mixed ones (the
    broadcast) give the best pair of paths, or the zero where there is none."""
    gen = torch.Generator().manual_seed(3)
    (wa, ga), (wb, _) = _paths((2, 3, 4), gen), _paths((2, 4, 5), gen)
    sr = sbp.MaxProduct()
    for gone_cols in ([1, 3], [0, 1, 2, 3, 4]):
        gb = torch.zeros(2, 4, 5, dtype=torch.bool)
        gb[:, :, gone_cols] = True
        got = sr.finalize(sr.contract(_value(sr, wa, ga), _value(sr, wb, gb)))
        for k in range(5):
            if k in gone_cols:
                assert (got.hi[..., k] == -torch.inf).all() and (got.lo[..., k] == torch.inf).all()
            else:
                prods = torch.stack([x[..., :, :, None] * y[..., None, :, k : k + 1]
                                     for x in wa for y in wb])  # fmt: skip
                assert torch.equal(got.hi[..., k], prods.amax((0, 3)).squeeze(-1))
                assert torch.equal(got.lo[..., k], prods.amin((0, 3)).squeeze(-1))


def test_real_contraction_is_the_sum_over_every_pair_of_paths():
    gen = torch.Generator().manual_seed(1)
    (wa, ga), (wb, gb) = _paths((3, 4), gen), _paths((4, 2), gen)
    sr = sbp.Real()
    got = sr.finalize(sr.contract(_value(sr, wa, ga), _value(sr, wb, gb)))
    want = sum(x @ y for x, y in itertools.product(wa, wb))
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("sr", [sbp.Entropy(), sbp.TopK(2), sbp.PathCount()],
                         ids=lambda s: type(s).__name__)  # fmt: skip
def test_other_semirings_contract_as_mul_then_sum(sr):
    """The default (the broadcast ``mul``, then ``sum`` over ``j``), checked by its
    readout against one element computed by hand with ``plus`` and ``mul``."""
    gen = torch.Generator().manual_seed(2)
    a, b = _value(sr, *_paths((3, 4), gen)), _value(sr, *_paths((4, 2), gen))
    got = sr.contract(a, b)
    i, k = 2, 1
    acc = None
    for j in range(4):
        term = sr.mul(tuple(f[i, j].reshape(1) for f in a), tuple(f[j, k].reshape(1) for f in b))
        acc = term if acc is None else sr.plus(acc, term)
    want = sr.finalize(acc)
    mine = sr.finalize(tuple(f[i, k].reshape(1) for f in got))
    for name in vars(want):
        x, y = getattr(mine, name), getattr(want, name)
        assert torch.allclose(x, y, rtol=1e-12, atol=1e-15, equal_nan=True), name


def test_max_product_contraction_compiled_equals_eager_and_leaves_the_pass_kernel():
    """Compiled (its own kernel, whatever shapes it meets: a row, a column, batches;
    with and without entries of no path on either side), the contraction gives the
    eager values, and the pass's kernels are not lost to its recompilations."""
    from semiring_backprop import kernels

    sr = sbp.MaxProduct()
    gen = torch.Generator().manual_seed(4)
    shapes = [(4, 16, 64, 40), (4, 1, 64, 200), (4, 200, 64, 1), (1, 16, 64, 40),
              (2, 300, 64, 1), (3, 9, 65, 70), (5, 12, 64, 60), (1, 1, 64, 600),
              (6, 20, 31, 30), (2, 40, 64, 16)]  # fmt: skip
    try:
        for (b, n, m, p), share in itertools.product(shapes, (0.0, 0.3)):
            a = _value(sr, *_paths((b, n, m), gen, share))
            w = _value(sr, *_paths((b, m, p), gen, share))
            kernels.set_compile(False)
            want = sr.contract(a, w)
            kernels.set_compile(True)
            got = sr.contract(a, w)
            assert all(torch.equal(x, y) for x, y in zip(got, want)), (b, n, m, p, share)
    finally:
        kernels.set_compile("auto")
    assert any(key[0] == "maxtimes_pairs" for key in kernels._COMPILED_KEYS)
    assert not any(key[0].startswith("maxtimes") for key in kernels._state["failed"])
