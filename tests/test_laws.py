"""Semiring laws, checked by property tests on every semiring (DESIGN §4).

Values are built as expressions of lifted random edge weights (``lift``, ``zero``,
``one`` combined by ``plus`` and ``mul``), so every value is one the reverse pass could
produce. Readouts (``finalize``) are compared with a float64 tolerance; raw back-pointer
fields are not (ties may be broken differently on the two sides of a law).

``MaxProduct("tensor")`` is left out on purpose: inside one op it aggregates by the real
sum (the paper's code), which is not a semiring (DESIGN §1, granularity).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import semiring_backprop as sbp
from semiring_backprop.semirings import fmap

SEMIRINGS = [
    sbp.Real(),
    sbp.MaxProduct(),
    sbp.MaxAbs(),
    sbp.LogAbs(),
    sbp.Entropy(),
    sbp.PathCount(),
    sbp.TopK(1),
    sbp.TopK(3),
]
IDS = [sr.name for sr in SEMIRINGS]
SHAPE = (2, 3)
LIKE = torch.zeros((), dtype=torch.float64)

laws = settings(max_examples=50, deadline=None)
semirings = pytest.mark.parametrize("sr", SEMIRINGS, ids=IDS)

# -- values --------------------------------------------------------------------------
# An expression is ("zero",), ("one",), ("lift", seed, zeros, scale) or (op, left, right).

_leaf = st.one_of(
    st.tuples(
        st.just("lift"),
        st.integers(0, 2**31 - 1),
        st.sampled_from(["none", "some", "all"]),
        st.sampled_from([1e-3, 1.0, 30.0]),
    ),
    st.just(("zero",)),
    st.just(("one",)),
)
expressions = st.recursive(
    _leaf, lambda kids: st.tuples(st.sampled_from(["plus", "mul"]), kids, kids), max_leaves=5
)


@functools.lru_cache(maxsize=4096)
def _weights(seed: int, zeros: str, scale: float, shape: tuple) -> torch.Tensor:
    """Random weights: seeded, so no two distinct leaves tie in magnitude (no sign ties in
    top-k); ``zeros`` makes some or all of them structurally-present zero-weight edges."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    if zeros == "some":
        w = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.4, 0.0, w)
    elif zeros == "all":
        w = torch.zeros(shape, dtype=torch.float64)
    return w


def weights(seed: int, shape=SHAPE, zeros: str = "none", scale: float = 1.0) -> torch.Tensor:
    return _weights(seed, zeros, scale, tuple(shape))


def build(sr, expr, shape=SHAPE):
    kind = expr[0]
    if kind == "zero":
        return sr.zero(shape, LIKE)
    if kind == "one":
        return sr.one(shape, LIKE)
    if kind == "lift":
        _, seed, zeros, scale = expr
        return sr.lift(weights(seed, shape, zeros, scale))
    a, b = build(sr, expr[1], shape), build(sr, expr[2], shape)
    return sr.plus(a, b) if kind == "plus" else sr.mul(a, b)


def readout(sr, value) -> dict:
    out = sr.finalize(value)
    if isinstance(out, torch.Tensor):
        return {"g": out}
    return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}


def assert_same(sr, x, y):
    rx, ry = readout(sr, x), readout(sr, y)
    assert rx.keys() == ry.keys()
    for name in rx:
        a, b = rx[name], ry[name]
        assert not torch.isnan(a).any() and not torch.isnan(b).any(), f"NaN in {name}"
        finite = a[torch.isfinite(a)]
        scale = float(finite.abs().max()) if finite.numel() else 1.0
        torch.testing.assert_close(
            a, b, rtol=1e-9, atol=1e-9 * max(1.0, scale), msg=lambda m, n=name: f"{n}: {m}"
        )


# -- ⊕ ------------------------------------------------------------------------------


@semirings
@laws
@given(a=expressions, b=expressions, c=expressions)
def test_plus_associative(sr, a, b, c):
    a, b, c = build(sr, a), build(sr, b), build(sr, c)
    assert_same(sr, sr.plus(sr.plus(a, b), c), sr.plus(a, sr.plus(b, c)))


_PLUS_IS_SUM = [sr for sr in [*SEMIRINGS, sbp.MaxProduct("tensor")] if sr.plus_is_sum]


@pytest.mark.parametrize("sr", _PLUS_IS_SUM, ids=[sr.name for sr in _PLUS_IS_SUM])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@laws
@given(a=expressions, b=expressions)
def test_plus_is_the_sum_of_the_two_stacked_where_said(sr, dtype, a, b):
    """Where a semiring says so (``plus_is_sum``: an op's two parts are then ⊕-ed by
    ``plus``, not stacked and summed), the two are the same, bit for bit."""
    a, b = (fmap(lambda f: f.to(dtype), build(sr, e)) for e in (a, b))
    summed = sr.sum(tuple(torch.stack(fs) for fs in zip(a, b)), 0)
    for x, y in zip(sr.plus(a, b), summed, strict=True):
        assert (
            torch.equal(x, y)
            or (x.isnan() == y.isnan()).all()
            and torch.equal(x.nan_to_num(), y.nan_to_num())
        )


def test_the_semirings_that_say_plus_is_the_sum_of_the_two():
    """Not MaxProduct at tensor granularity (it sums an op's parts as reals, hi and lo
    apart), nor those whose ⊕ rounds otherwise (log space)."""
    assert [sr.name for sr in _PLUS_IS_SUM] == ["Real", "MaxProduct(neuron)"]


@semirings
@laws
@given(a=expressions, b=expressions)
def test_plus_commutative(sr, a, b):
    a, b = build(sr, a), build(sr, b)
    assert_same(sr, sr.plus(a, b), sr.plus(b, a))


@semirings
@laws
@given(a=expressions)
def test_zero_is_plus_identity(sr, a):
    a = build(sr, a)
    zero = sr.zero(SHAPE, LIKE)
    assert_same(sr, sr.plus(zero, a), a)
    assert_same(sr, sr.plus(a, zero), a)


# -- ⊗ ------------------------------------------------------------------------------


@semirings
@laws
@given(a=expressions, b=expressions, c=expressions)
def test_mul_associative(sr, a, b, c):
    a, b, c = build(sr, a), build(sr, b), build(sr, c)
    assert_same(sr, sr.mul(sr.mul(a, b), c), sr.mul(a, sr.mul(b, c)))


@semirings
@laws
@given(a=expressions, b=expressions)
def test_mul_commutative(sr, a, b):
    a, b = build(sr, a), build(sr, b)
    assert_same(sr, sr.mul(a, b), sr.mul(b, a))


@semirings
@laws
@given(a=expressions)
def test_one_is_mul_identity(sr, a):
    a = build(sr, a)
    one = sr.one(SHAPE, LIKE)
    assert_same(sr, sr.mul(one, a), a)
    assert_same(sr, sr.mul(a, one), a)


@semirings
@laws
@given(a=expressions)
def test_zero_annihilates(sr, a):
    a = build(sr, a)
    zero = sr.zero(SHAPE, LIKE)
    assert_same(sr, sr.mul(zero, a), zero)
    assert_same(sr, sr.mul(a, zero), zero)


@semirings
@laws
@given(a=expressions, b=expressions, c=expressions)
def test_distributive(sr, a, b, c):
    a, b, c = build(sr, a), build(sr, b), build(sr, c)
    assert_same(sr, sr.mul(a, sr.plus(b, c)), sr.plus(sr.mul(a, b), sr.mul(a, c)))
    assert_same(sr, sr.mul(sr.plus(b, c), a), sr.plus(sr.mul(b, a), sr.mul(c, a)))


# -- the operations rules use, against the laws -----------------------------------------


@semirings
@laws
@given(a=expressions, seed=st.integers(0, 2**31 - 1), zeros=st.sampled_from(["none", "some"]))
def test_times_is_mul_by_lift(sr, a, seed, zeros):
    a = build(sr, a)
    w = weights(seed, SHAPE, zeros)
    assert_same(sr, sr.times(a, w), sr.mul(a, sr.lift(w)))


@semirings
@laws
@given(a=expressions, seed=st.integers(0, 2**31 - 1))
def test_times_broadcasts_the_weight(sr, a, seed):
    a = build(sr, a)
    w = weights(seed, SHAPE[-1:])
    assert_same(sr, sr.times(a, w), sr.times(a, w.expand(SHAPE)))


SCALED = [*SEMIRINGS, sbp.MaxProduct("tensor"), sbp.MaxProduct().pointed]


@pytest.mark.parametrize("sr", SCALED, ids=[sr.name for sr in SCALED])
@laws
@given(a=expressions, c=st.sampled_from([1, 1.0, -1.0, 0.5, -2.5, 0.0, 3.0]))
def test_scale_is_times_by_a_constant(sr, a, c):
    """``scale`` (constant edge weights: add, sub, mean) agrees with ``times``; its
    shortcut for 1 is the law lift(1) == one."""
    a = build(sr, a)
    assert_same(sr, sr.scale(a, c), sr.times(a, torch.tensor(float(c), dtype=LIKE.dtype)))
    assert_same(sr, sr.lift(torch.ones(SHAPE, dtype=LIKE.dtype)), sr.one(SHAPE, LIKE))


def _fold_plus(sr, parts):
    acc = parts[0]
    for p in parts[1:]:
        acc = sr.plus(acc, p)
    return acc


@semirings
@laws
@given(a=expressions, dim=st.sampled_from([0, 1, 2, -1]), keepdim=st.booleans())
def test_sum_is_folded_plus(sr, a, dim, keepdim):
    shape = (2, 3, 4)
    a = build(sr, a, shape)
    d = dim % len(shape)
    parts = [fmap(lambda f, i=i: f.select(d, i), a) for i in range(shape[d])]
    want = _fold_plus(sr, parts)
    if keepdim:
        want = fmap(lambda f: f.unsqueeze(d), want)
    assert_same(sr, sr.sum(a, dim, keepdim=keepdim), want)


@semirings
@laws
@given(a=expressions)
def test_sum_over_several_dims(sr, a):
    shape = (2, 3, 4)
    a = build(sr, a, shape)
    assert_same(sr, sr.sum(a, (0, 2)), sr.sum(sr.sum(a, 2), 0))
    assert_same(sr, sr.sum(a, (0, 2), keepdim=True), sr.sum(sr.sum(a, 2, True), 0, True))
    assert_same(sr, sr.sum(a, ()), a)


def _explicit_matmul(sr, a, w):
    """``out[..., i, k] = ⊕_j a[..., i, j] ⊗ lift(w[..., j, k])``, term by term."""
    n, m, p = a[0].shape[-2], a[0].shape[-1], w.shape[-1]
    shape = torch.broadcast_shapes(a[0].shape[:-2], w.shape[:-2]) + (n, p)
    terms = []
    for j in range(m):
        aj = fmap(lambda f, j=j: f[..., :, j : j + 1].expand(shape), a)
        terms.append(sr.mul(aj, sr.lift(w[..., j : j + 1, :].expand(shape))))
    return _fold_plus(sr, terms)


@semirings
@laws
@given(
    a=expressions,
    seed=st.integers(0, 2**31 - 1),
    zeros=st.sampled_from(["none", "some", "all"]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    batch=st.sampled_from(["none", "a", "w", "both"]),
)
def test_matmul_is_explicit_sum_of_products(sr, a, seed, zeros, scale, batch):
    n, m, p = 3, 4, 2
    a_shape = (2, n, m) if batch in ("a", "both") else (n, m)
    w_shape = (2, m, p) if batch in ("w", "both") else (m, p)
    a = build(sr, a, a_shape)
    w = weights(seed, w_shape, zeros, scale)
    assert_same(sr, sr.matmul(a, w), _explicit_matmul(sr, a, w))


# -- cross-semiring identities (cheap and strong) ---------------------------------------


@laws
@given(a=expressions, b=expressions)
def test_topk1_is_maxabs(a, b):
    top, mx = sbp.TopK(1), sbp.MaxAbs()
    for expr in (a, ("plus", a, b), ("mul", a, b)):
        t, m = top.finalize(build(top, expr)), mx.finalize(build(mx, expr))
        torch.testing.assert_close(t.log_abs[..., 0], m.log, rtol=1e-12, atol=1e-12)


@laws
@given(a=expressions)
def test_maxproduct_bounds_real_and_maxabs(a):
    """hi/lo are a path product each, so |hi|, |lo| <= MaxAbs and lo <= hi."""
    mp, mx = sbp.MaxProduct(), sbp.MaxAbs()
    r, m = mp.finalize(build(mp, a)), mx.finalize(build(mx, a))
    live = torch.isfinite(r.hi)
    assert bool((r.lo[live] <= r.hi[live]).all())
    big = torch.maximum(r.hi[live].abs(), r.lo[live].abs())
    torch.testing.assert_close(big, m.value[live], rtol=1e-12, atol=0.0)
