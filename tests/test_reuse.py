"""``sbp.backprop`` reuses the trace of an earlier call only where nothing that decides
the function changed: the model object and its weights, modules, hooks and plain
attributes; the output function's code and the values it reads; the inputs' kind.

Oracle: ``torch.autograd`` (float64) for every result, whether reused or traced anew;
whether a trace was reused is read off ``Result.graph`` (the same object or not).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop._backprop import _KEPT, _KEPT_PER_MODEL

F64 = torch.float64
TARGET = 1  # read by an output function as a global


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.act = nn.Tanh()
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.act(self.norm(self.lin(x))))


def _net():
    return Net().to(F64).eval()


def _x():
    return torch.randn(2, 4, dtype=F64)


def _grad(model, x, output):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(output(model(x)), x)
    return g


def _check(model, x, output, **kw):
    res = sbp.backprop(model, (x,), output=output, **kw)
    torch.testing.assert_close(res.at(0, sbp.Real()), _grad(model, x, output))
    return res


def _pick(i):
    return lambda y: y[0, i]  # one code object, the index in its closure


def test_same_code_and_constants_reuse_the_trace():
    model, x = _net(), _x()
    first = _check(model, x, _pick(2))
    again = _check(model, torch.randn(2, 4, dtype=F64), _pick(2))  # new values, same kind
    assert again.graph is first.graph
    # the other semirings on the reused trace agree with a trace made for them
    sr = [sbp.MaxProduct(), sbp.Entropy()]
    reused = sbp.backprop(model, (x,), output=_pick(2), semirings=sr)
    fresh = sbp.backprop(model, (x,), output=_pick(2), semirings=sr, reuse=False)
    assert reused.graph is first.graph and fresh.graph is not first.graph
    for s in sr:
        for a, b in zip(reused.at(0, s).__dict__.values(), fresh.at(0, s).__dict__.values()):
            torch.testing.assert_close(a, b)


def test_other_constants_or_inputs_trace_again():
    model, x = _net(), _x()
    first = _check(model, x, _pick(2))
    assert _check(model, x, _pick(0)).graph is not first.graph  # closure value
    assert _check(model, x, lambda y: y[0, 2]).graph is not first.graph  # other code
    assert _check(model, torch.randn(3, 4, dtype=F64), _pick(2)).graph is not first.graph

    def by_global(y):
        return y[1, TARGET]

    g1 = _check(model, x, by_global).graph
    assert _check(model, x, by_global).graph is g1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(__import__(__name__), "TARGET", 2)
        assert _check(model, x, by_global).graph is not g1

    def scaled(y, c=2.0):
        return c * y[0, 1]

    g2 = _check(model, x, scaled).graph
    scaled.__defaults__ = (3.0,)
    assert _check(model, x, scaled).graph is not g2


def test_a_reused_trace_computes_with_weights_written_through_data():
    """``p.data`` writes bypass the version counter (no new trace), but the trace reads
    the parameters' memory: every semiring sees the new weights."""
    model, x = _net(), _x()
    sr = [sbp.Real(), sbp.MaxProduct()]
    first = sbp.backprop(model, (x,), output=_pick(1), semirings=sr)
    model.lin.weight.data.mul_(2)
    reused = _check(model, x, _pick(1), semirings=sr)
    fresh = sbp.backprop(model, (x,), output=_pick(1), semirings=sr, reuse=False)
    assert reused.graph is first.graph
    assert torch.equal(reused.at(0, sbp.MaxProduct()).hi, fresh.at(0, sbp.MaxProduct()).hi)


@pytest.mark.parametrize(
    "change",
    ["eps", "swap_module", "hook", "weights_replaced", "weights_in_place", "train_mode"],
)
def test_a_changed_model_is_traced_again(change):
    model, x = _net(), _x()
    output = _pick(1)
    first = _check(model, x, output)
    if change == "eps":
        model.norm.eps = 0.5
    elif change == "swap_module":
        model.act = nn.Sigmoid().eval()
    elif change == "hook":
        model.act.register_forward_hook(lambda m, a, out: out * 3)
    elif change == "weights_replaced":
        model.lin.weight = nn.Parameter(torch.randn(6, 4, dtype=F64))
    elif change == "weights_in_place":
        with torch.no_grad():
            model.lin.weight.mul_(2)
    else:
        model.train()
    kw = {"allow_training": True} if change == "train_mode" else {}
    assert _check(model, x, output, **kw).graph is not first.graph


def test_unkeyed_output_functions_are_traced_every_call():
    model, x = _net(), _x()
    big = torch.randn(3, dtype=F64).repeat(100)[:3]  # small: keyed by value
    weights = torch.randn(500, dtype=F64)  # large: not compared, so never reused

    def small(y):
        return (y[0] * big).sum()

    def large(y):
        return (y[0] * weights[:3]).sum()

    assert _check(model, x, small).graph is _check(model, x, small).graph
    assert _check(model, x, large).graph is not _check(model, x, large).graph

    class Pick:  # a callable object: its state is not known
        def __call__(self, y):
            return y[0, 0]

    pick = Pick()
    assert _check(model, x, pick).graph is not _check(model, x, pick).graph


def test_traces_do_not_keep_the_model_alive():
    model, x = _net(), _x()
    _check(model, x, _pick(0))
    assert model in _KEPT
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_clear_traces():
    model, x = _net(), _x()
    first = _check(model, x, _pick(0))
    sbp.clear_traces()
    assert _check(model, x, _pick(0)).graph is not first.graph


def test_output_functions_per_model_are_bounded():
    model, x = _net(), _x()
    for i in range(_KEPT_PER_MODEL + 2):
        _check(model, x, lambda y, i=i: y[0, i % 3] * (i + 1))
    assert len(_KEPT[model]) == _KEPT_PER_MODEL
