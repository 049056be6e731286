"""Fast paths give the same answers as the plain implementation.

- compiled max-times / max-plus kernels == the eager formulas (values and argmax);
- contractions that skip rows carrying no path == the full semiring matmul;
- a reused :class:`Backprop` == a fresh ``backprop`` call, and it re-traces when the
  model's parameters are replaced.
"""

from __future__ import annotations

import math

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop import kernels
from semiring_backprop.rules import contraction

F64 = torch.float64
INF = math.inf


def _fields(n, m, batch=(), dtype=F64, holes=True):
    g = torch.Generator().manual_seed(n * 100 + m)
    hi = torch.randn(*batch, n, m, generator=g, dtype=dtype)
    lo = hi - torch.rand(*batch, n, m, generator=g, dtype=dtype)
    if holes:  # no path: the semiring zero (-inf, +inf) in some entries and a whole row
        hole = torch.rand(*batch, n, m, generator=g) < 0.2
        hole[..., 0, :] = True
        hi = hi.masked_fill(hole, -INF)
        lo = lo.masked_fill(hole, INF)
    return hi, lo


def _weights(m, p, batch=(), dtype=F64):
    g = torch.Generator().manual_seed(m * 7 + p)
    w = torch.randn(*batch, m, p, generator=g, dtype=dtype)
    w[..., 0, :] = 0.0  # structurally present edges of weight 0
    return w


@pytest.fixture
def compiled(monkeypatch):
    """Force the compiled kernels even on small problems."""
    monkeypatch.setattr(kernels, "MIN_WORK", 0)
    kernels.set_compile(True)
    yield
    kernels.set_compile(True)
    # the compiled kernels really ran (a failure would have fallen back to eager)
    assert not kernels._state["failed"], kernels._state["failed"]


@pytest.mark.parametrize("batch", [(), (3,)], ids=["2d", "batched"])
def test_compiled_maxtimes_equals_eager(compiled, batch):
    hi, lo = _fields(5, 7, batch)
    w = _weights(7, 4, batch)
    fast = kernels.maxtimes(hi, lo, w.transpose(-2, -1))
    kernels.set_compile(False)
    slow = kernels.maxtimes(hi, lo, w.transpose(-2, -1))
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the eager formulas are the definition: max over j of the sign-aware products
    h = torch.where(w[..., None, :, :] >= 0, hi[..., :, :, None], lo[..., :, :, None])
    prod = h * w[..., None, :, :]
    prod = torch.where(torch.isnan(prod), -INF, prod)  # 0 · inf: no path
    torch.testing.assert_close(slow[0], prod.amax(-2))
    # the arg-max is the first index where the maximum is attained
    hit = prod == prod.amax(-2, keepdim=True)
    first = hit.to(torch.int64).argmax(-2)
    assert torch.equal(slow[1], first)
    lo_h = torch.where(w[..., None, :, :] >= 0, lo[..., :, :, None], hi[..., :, :, None])
    lprod = lo_h * w[..., None, :, :]
    lprod = torch.where(torch.isnan(lprod), INF, lprod)
    torch.testing.assert_close(slow[2], lprod.amin(-2))
    assert torch.equal(slow[3], (lprod == lprod.amin(-2, keepdim=True)).to(torch.int64).argmax(-2))


def test_compiled_maxplus_equals_eager(compiled):
    m, _ = _fields(6, 5)
    lw = torch.log(_weights(5, 3).abs())
    fast = kernels.maxplus(m, lw.mT)
    kernels.set_compile(False)
    slow = kernels.maxplus(m, lw.mT)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


SEMIRINGS = [
    sbp.Real(),
    sbp.MaxProduct(),
    sbp.MaxProduct("tensor"),
    sbp.MaxAbs(),
    sbp.LogAbs(),
    sbp.Entropy(),
    sbp.PathCount(),
    sbp.TopK(3),
]


@pytest.mark.parametrize("sr", SEMIRINGS, ids=lambda s: s.name)
def test_zero_rows_are_skipped_without_changing_values(sr):
    """Rows of D(out) equal to the zero (positions the output never reads) give zero
    rows; the live rows are computed exactly as by the full semiring matmul."""
    torch.manual_seed(0)
    w = _weights(6, 4)
    live = sr.times(sr.one((5, 6), w), torch.randn(5, 6, dtype=F64))
    zero = sr.zero((5, 6), w)
    rows = torch.tensor([True, False, True, False, False])
    g = tuple(
        torch.where(rows.view(-1, *([1] * (a.dim() - 1))), a, z)
        for a, z in zip(live, zero, strict=True)
    )
    want = sr.matmul(g, w)
    got = contraction._live_matmul(sr, g, w)
    for a, b in zip(got, want, strict=True):  # live rows: every field, pointers included
        assert torch.equal(a[rows], b[rows])
    # dead rows: the same readout (no path); their unused fields (a sign) may differ
    for a, b in zip(_readouts(sr, got), _readouts(sr, want), strict=True):
        torch.testing.assert_close(a, b)


def _readouts(sr, value):
    ro = sr.finalize(value)
    if isinstance(ro, torch.Tensor):
        return [ro]
    return [getattr(ro, f) for f in ro.__dataclass_fields__]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _grad(model, x, output):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(output(model(x)), x)
    return g


def test_backprop_object_reuses_its_trace_and_stays_exact():
    torch.manual_seed(0)
    model = _Net().to(F64).eval()
    output = lambda y: y[0, 1]  # noqa: E731
    bp = sbp.Backprop(model, output, [sbp.Real(), sbp.MaxProduct()])
    x1, x2 = torch.randn(2, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    r1, r2 = bp((x1,)), bp((x2,))
    assert r1.graph is r2.graph  # one trace for one input shape
    torch.testing.assert_close(r2.at(0, sbp.Real()), _grad(model, x2, output))
    fresh = sbp.backprop(model, (x2,), output=output, semirings=[sbp.MaxProduct()])
    torch.testing.assert_close(r2.at(0, sbp.MaxProduct()).hi, fresh.at(0, sbp.MaxProduct()).hi)
    # another shape: another trace, still exact
    x3 = torch.randn(5, 4, dtype=F64)
    r3 = bp((x3,))
    assert r3.graph is not r1.graph
    torch.testing.assert_close(r3.at(0, sbp.Real()), _grad(model, x3, output))


def test_backprop_object_follows_parameter_changes():
    torch.manual_seed(1)
    model = _Net().to(F64).eval()
    output = lambda y: y[0, 0]  # noqa: E731
    bp = sbp.Backprop(model, output, [sbp.Real()])
    x = torch.randn(1, 4, dtype=F64)
    bp((x,))
    with torch.no_grad():  # in place
        model.a.weight.mul_(-2.0)
    torch.testing.assert_close(bp((x,)).at(0, sbp.Real()), _grad(model, x, output))
    model.b = torch.nn.Linear(8, 3).to(F64).eval()  # a new module object
    torch.testing.assert_close(bp((x,)).at(0, sbp.Real()), _grad(model, x, output))
