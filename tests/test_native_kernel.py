"""The native max-times kernel (``kernels/native.py``, ``kernels/native.cpp``) against
the torch kernels it replaces (``kernels._maxtimes``, ``_maxtimes_values``: the formulas
as broadcasts): the same values and the same first arg-max / arg-min, bit for bit, on
ties, tails of the register tile, dead entries and whole dead rows, shared and batched
weights, float32 and float64, one thread and several; and where it must not run (a NaN
or an infinity, no compiler, a failed build, turned off) the torch kernels' answer.
"""

from __future__ import annotations

import logging

import pytest
import torch

from semiring_backprop import kernels
from semiring_backprop.kernels import native

INF = float("inf")


@pytest.fixture(autouse=True)
def turned_on(monkeypatch):
    """The kernel is on unless ``SEMIRING_BACKPROP_NATIVE=0``; these tests make sure."""
    monkeypatch.setenv("SEMIRING_BACKPROP_NATIVE", "1")
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@pytest.fixture
def lib():
    got = native.library()
    if got is None:
        pytest.skip("no C++ compiler here: the native kernel is not built (torch's runs)")
    return got


def test_it_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("SEMIRING_BACKPROP_NATIVE")
    assert native.enabled()
    for off in ("0", "false", " False "):
        monkeypatch.setenv("SEMIRING_BACKPROP_NATIVE", off)
        native.library.cache_clear()
        assert not native.enabled() and native.library() is None


def _fields(b, n, m, dtype, seed, ties=False, dead=0.2):
    g = torch.Generator().manual_seed(seed)
    if ties:  # small integers: many equal products, so the first index must be kept
        hi = torch.randint(-2, 3, (b, n, m), generator=g).to(dtype)
        lo = hi - torch.randint(0, 2, (b, n, m), generator=g).to(dtype)
    else:
        hi = torch.randn(b, n, m, generator=g, dtype=dtype)
        lo = hi - torch.rand(b, n, m, generator=g, dtype=dtype)
    gone = torch.rand(b, n, m, generator=g) < dead
    if n > 2:
        gone[:, 1] = True  # a row with no path at all
    hi[gone], lo[gone] = -INF, INF
    return hi, lo


def _weights(b, p, m, dtype, seed, ties=False):
    g = torch.Generator().manual_seed(seed + 1)
    if ties:
        return torch.randint(-1, 2, (b, p, m), generator=g).to(dtype)
    wt = torch.randn(b, p, m, generator=g, dtype=dtype)
    wt[wt.abs() < 0.3] = 0
    return wt


def _torch(hi, lo, wt, argmax):
    f = kernels._maxtimes if argmax else kernels._maxtimes_values
    return f(*kernels.zero_masked(hi, lo), wt.expand(hi.shape[0], -1, -1))


SHAPES = [(1, 1, 1, 1), (1, 5, 7, 3), (2, 33, 70, 45), (3, 17, 64, 200), (1, 9, 130, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ties", [False, True])
def test_the_native_kernel_is_the_torch_kernel_bit_for_bit(lib, dtype, shape, ties):
    b, n, m, p = shape
    hi, lo = _fields(b, n, m, dtype, seed=sum(shape), ties=ties)
    wt = _weights(b, p, m, dtype, seed=sum(shape), ties=ties)
    for argmax in (False, True):
        got = native.maxtimes(hi, lo, wt, argmax)
        want = _torch(hi, lo, wt, argmax)
        assert got is not None and len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w), (argmax, (g != w).sum())
    if n > 2:  # the dead row: no path, the semiring's zero, index 0
        out_hi, j_hi, out_lo, _ = native.maxtimes(hi, lo, wt, True)
        assert bool((out_hi[:, 1] == -INF).all() and (out_lo[:, 1] == INF).all())
        assert bool((j_hi[:, 1] == 0).all())


def test_shared_weights_and_threads(lib):
    hi, lo = _fields(4, 40, 96, torch.float32, seed=3)
    wt = _weights(1, 50, 96, torch.float32, seed=3)  # one weight matrix for every batch
    want = _torch(hi, lo, wt, True)
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = native.maxtimes(hi, lo, wt, True)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), n
    finally:
        torch.set_num_threads(before)


def test_the_public_kernel_runs_it_with_the_same_answer(lib, monkeypatch):
    hi, lo = _fields(2, 12, 40, torch.float64, seed=5)
    wt = _weights(2, 30, 40, torch.float64, seed=5)
    calls = []
    real = native.maxtimes
    monkeypatch.setattr(native, "maxtimes", lambda *a: calls.append(1) or real(*a))
    got = kernels.maxtimes(hi.view(2, 1, 12, 40), lo.view(2, 1, 12, 40), wt.view(2, 1, 30, 40))
    assert calls and got[0].shape == (2, 1, 12, 30)
    want = _torch(hi, lo, wt, True)
    assert all(torch.equal(g.reshape(w.shape), w) for g, w in zip(got, want))


@pytest.mark.parametrize("where", ["weight nan", "weight inf", "field nan", "field inf"])
def test_a_nan_or_an_infinity_goes_to_the_torch_kernels(lib, where):
    hi, lo = _fields(1, 6, 20, torch.float32, seed=7)
    wt = _weights(1, 9, 20, torch.float32, seed=7)
    bad = float("nan") if "nan" in where else INF
    if where.startswith("weight"):
        wt[0, 2, 3] = bad
    else:
        hi[0, 0, 0], lo[0, 0, 0] = bad, (bad if "nan" in where else 1.0)
    assert native.maxtimes(hi, lo, wt, True) is None
    got = kernels.maxtimes(hi, lo, wt)
    want = _torch(hi, lo, wt, True)
    for g, w in zip(got, want):
        assert torch.equal(g, w) or torch.allclose(g, w, equal_nan=True)
    if "nan" in where:
        assert bool(got[0].isnan().any())  # the NaN is not hidden


def test_no_compiler_or_turned_off_runs_torch(monkeypatch, tmp_path):
    hi, lo = _fields(1, 6, 20, torch.float32, seed=9)
    wt = _weights(1, 9, 20, torch.float32, seed=9)
    want = _torch(hi, lo, wt, True)
    monkeypatch.setenv("SEMIRING_BACKPROP_CACHE", str(tmp_path))
    for setup in ("off", "no compiler"):
        native.library.cache_clear()
        with monkeypatch.context() as m:
            if setup == "off":
                m.setenv("SEMIRING_BACKPROP_NATIVE", "0")
            else:
                m.setattr(native, "compiler", lambda: None)
            assert native.library() is None
            assert native.maxtimes(hi, lo, wt, True) is None
            got = kernels.maxtimes(hi, lo, wt)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), setup
    native.library.cache_clear()
    assert not list(tmp_path.iterdir())  # nothing was built


def test_a_failed_build_says_so_and_runs_torch(monkeypatch, tmp_path, caplog):
    if native.compiler() is None:
        pytest.skip("no C++ compiler here")
    broken = tmp_path / "native.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setenv("SEMIRING_BACKPROP_CACHE", str(tmp_path / "cache"))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert native.library() is None
        assert "did not build" in caplog.text
        hi, lo = _fields(1, 4, 8, torch.float32, seed=11)
        wt = _weights(1, 5, 8, torch.float32, seed=11)
        got = kernels.maxtimes(hi, lo, wt)
        assert all(torch.equal(g, w) for g, w in zip(got, _torch(hi, lo, wt, True)))
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batched", [False, True])
def test_weights_packed_once_give_the_same_answer(lib, dtype, batched):
    """``MaxProduct.prepare``'s packed weights (made once, kept across calls): the
    answer of the weights packed on the call, and of the torch kernels, bit for bit;
    one matrix for every batch of fields, or one per batch."""
    hi, lo = _fields(3, 21, 70, dtype, seed=11, ties=True)
    wt = _weights(3 if batched else 1, 50, 70, dtype, seed=11, ties=True)
    packed = native.pack(wt if batched else wt[0])
    assert packed is not None and packed.panels.shape[0] == (3 if batched else 1)
    for argmax in (False, True):
        want = _torch(hi, lo, wt, argmax)
        got = kernels.maxtimes(hi, lo, packed, argmax)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), argmax


def test_packed_weights_unpack_for_values_the_kernel_does_not_take(lib):
    """The panels alone are kept: they give back the transposed weights exactly, and
    values the native kernel does not take (a NaN; fields broadcast against a batch the
    panels do not hold) get the torch kernels' answer on those weights."""
    wt = _weights(2, 13, 20, torch.float64, seed=5, ties=True).reshape(2, 1, 13, 20)
    packed = native.pack(wt)
    assert torch.equal(packed.unpack(), wt)
    hi, lo = _fields(1, 4, 20, torch.float64, seed=5)
    hi[0, 1, 2] = float("nan")
    got = kernels.maxtimes(hi, lo, packed)
    want = _torch(hi.expand(2, 4, 20), lo.expand(2, 4, 20), wt.reshape(2, 13, 20), True)
    for g, w in zip(got, want, strict=True):  # (NaN where the NaN reaches)
        torch.testing.assert_close(g.reshape(w.shape), w, rtol=0, atol=0, equal_nan=True)
    hi, lo = _fields(3, 4, 20, torch.float64, seed=6)  # batch (2, 3): not the panels' (2, 1)
    got = kernels.maxtimes(hi, lo, packed)
    want = kernels.maxtimes(hi, lo, wt)
    assert got[0].shape == (2, 3, 4, 13)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_weights_that_do_not_fit_are_not_packed(lib):
    wt = _weights(1, 9, 20, torch.float32, seed=7)
    wt[0, 2, 3] = float("nan")
    assert native.pack(wt) is None  # (the torch kernels read it, NaN and all)
    assert native.pack(wt.to(torch.float16)) is None
    assert native.pack(torch.ones(3)) is None


def test_a_pass_with_packed_weights_kept_across_calls_is_the_torch_kernels_pass(lib):
    """A neuron MaxProduct pass of a ``Backprop`` (weights prepared on the first call
    and kept: the second call reads them packed) equals, bit for bit, the same pass with
    the kernel off (the torch kernels on the transposed weights)."""
    import semiring_backprop as sbp
    from semiring_backprop.semirings.maxproduct import MaxProduct

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 50), torch.nn.Tanh(),
                                torch.nn.Linear(50, 7)).eval()  # fmt: skip
    x = torch.randn(5, 30)
    output = lambda y: y[1, 2] - y[3, 4]  # noqa: E731
    sr = MaxProduct()
    bp = sbp.Backprop(model, output, [sr], keep=None)
    first, second = bp((x,)), bp((x,))
    kept = [v for _, v in bp._prepared.items.values() if isinstance(v, native.Packed)]
    assert len(kept) == 3  # the three Linear weights, packed once
    native.library.cache_clear()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SEMIRING_BACKPROP_NATIVE", "0")
        native.library.cache_clear()
        assert isinstance(sr.prepare(torch.ones(2, 3)), torch.Tensor)  # (not packed)
        off = sbp.Backprop(model, output, [sr], keep=None, weight_cache=0)((x,))
    native.library.cache_clear()
    for got in (first, second):
        for node in (0, "1", "3"):
            a, b = got.value(node, sr), off.value(node, sr)
            assert len(a) == len(b) == 2
            for fa, fb in zip(a, b, strict=True):
                assert torch.equal(fa, fb), node


def _eager_topk(m, lwt, k):
    """The eager kernel's answer: ``topk`` over the broadcast sums (padded as the
    kernels pad them)."""
    pad = lwt.shape[-1] - m.shape[-1]
    if pad:
        m = torch.nn.functional.pad(m, (0, pad), value=-INF)
    return (m[:, :, None, :] + lwt[:, None, :, :]).topk(k, -1)


def _log_fields(b, n, L, p, dtype, seed, ties):
    g = torch.Generator().manual_seed(seed)
    if ties:  # small integers: ties everywhere, so most (row, column)s are undecided
        m = torch.randint(-3, 2, (b, n, L), generator=g).to(dtype)
        lwt = torch.randint(-3, 2, (b, p, L), generator=g).to(dtype)
    else:
        m = torch.randn(b, n, L, generator=g, dtype=dtype)
        lwt = torch.randn(b, p, L, generator=g, dtype=dtype)
    m[torch.rand(b, n, L, generator=g) < 0.3] = -INF  # no path
    lwt[torch.rand(b, p, L, generator=g) < 0.1] = -INF  # a zero weight
    if n > 1:
        m[:, 1] = -INF  # a row with no path at all
    return m, lwt


KBEST = [(1, 5, 64, 7, 3), (2, 33, 128, 45, 3), (1, 9, 256, 33, 1), (3, 4, 64, 17, 8),
         (1, 20, 512, 70, 2)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", KBEST)
@pytest.mark.parametrize("ties", [False, True])
def test_the_k_best_kernel_is_the_eager_topk_bit_for_bit(lib, dtype, shape, ties):
    """Where the kernel says its k best are decided they are eager ``topk``'s, values
    and indices; ``kernels.maxplus_topk`` (the kernel, the undecided ranked again) is
    eager ``topk`` everywhere, ties and rows without a path included."""
    b, n, L, p, k = shape
    m, lwt = _log_fields(b, n, L, p, dtype, seed=sum(shape), ties=ties)
    want = _eager_topk(m, lwt, k)
    best, idx, ok = native.maxplus_kbest(m, lwt, k)
    assert best.shape == idx.shape == (b, n, p, k) and ok.shape == (b, n, p)
    assert not bool(ok[:, 1].any())  # no path in row 1: fewer than k finite sums
    if not ties:
        assert float(ok.float().mean()) > 0.5  # (most are decided: the test means something)
    assert torch.equal(best[ok], want[0][ok]) and torch.equal(idx[ok], want[1][ok])
    got = kernels.maxplus_topk(m, lwt, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_k_best_kernel_with_weights_shared_by_every_batch(lib):
    m, lwt = _log_fields(3, 6, 64, 20, torch.float32, seed=3, ties=False)
    shared = lwt[:1].expand(3, -1, -1)
    want = _eager_topk(m, shared, 3)
    got = kernels.maxplus_topk(m, shared, 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_k_best_kernel_leaves_nan_and_infinity_to_torch(lib):
    m, lwt = _log_fields(1, 4, 64, 9, torch.float64, seed=8, ties=False)
    for bad in (float("nan"), INF):
        m2 = m.clone()
        m2[0, 2, 5] = bad
        assert native.maxplus_kbest(m2, lwt, 3) is None
        assert native.maxplus_kbest(m, lwt, 9) is None  # k past 8: torch's kernels
        want = _eager_topk(m2, lwt, 3)
        got = kernels.maxplus_topk(m2, lwt, 3)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_a_topk_pass_is_the_torch_kernels_pass(lib):
    """A TopK(3) pass through a small attention block with the kernel on equals, bit for
    bit (values, signs and back-pointers), the same pass with it off."""
    import semiring_backprop as sbp

    torch.manual_seed(5)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(1, 6, 16)
    output = lambda y: y[0, 2, 3] - y[0, 4, 1]  # noqa: E731
    sr = sbp.TopK(3)
    ran, kbest = [], native.maxplus_kbest

    def counted(*args):
        out = kbest(*args)
        ran.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "maxplus_kbest", counted)
        on = sbp.Backprop(layer, output, [sr], keep=None)((x,))
    assert sum(ran) >= 2  # (the kernel ran: the linear layers' contractions at least)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SEMIRING_BACKPROP_NATIVE", "0")
        native.library.cache_clear()
        off = sbp.Backprop(layer, output, [sr], keep=None)((x,))
    native.library.cache_clear()
    a, b = on.value(0, sr), off.value(0, sr)
    assert len(a) == len(b) > 3
    for fa, fb in zip(a, b, strict=True):
        assert torch.equal(fa, fb)
