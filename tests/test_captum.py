"""The semirings as Captum attribution methods (``semiring_backprop.captum``).

Oracles: Captum's own ``Saliency(abs=False)`` and ``InputXGradient`` (Real through this
API must equal them, on Captum-tutorial-style models: the Titanic MLP, a small CNN, a
model of two inputs with an additional forward argument); path products written out by
hand on a one-hidden-layer MLP (MaxProduct's hi and lo, MaxAbs, TopK); Captum's metrics
run on the attributions and give what they give for Saliency's.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop.errors import InputError

captum_attr = pytest.importorskip("captum.attr")
captum_metrics = pytest.importorskip("captum.metrics")
from semiring_backprop.captum import SemiringAttribution  # noqa: E402

F64 = torch.float64


class TitanicSimpleNNModel(nn.Module):  # Captum's Titanic tutorial
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(12, 12)
        self.sigmoid1 = nn.Sigmoid()
        self.linear2 = nn.Linear(12, 8)
        self.sigmoid2 = nn.Sigmoid()
        self.linear3 = nn.Linear(8, 2)
        self.softmax = nn.Softmax(dim=1)

    def forward(self, x):
        x = self.sigmoid1(self.linear1(x))
        x = self.sigmoid2(self.linear2(x))
        return self.softmax(self.linear3(x))


class SmallCNN(nn.Module):  # Captum's CIFAR tutorial network, smaller
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2, 2)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        return self.fc(x.flatten(1))


class TwoInputs(nn.Module):  # Captum's BasicModel_MultiLayer_MultiInput, in spirit
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(2, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x1, x2, scale):
        return self.out(torch.tanh(self.a(x1) * scale + self.b(x2)))


def _model(cls, seed=0):
    torch.manual_seed(seed)
    return cls().to(F64).eval()


def _leaf(*xs):
    """Inputs as Captum's gradient methods want them (requiring grad, so no warning)."""
    out = tuple(x.detach().clone().requires_grad_() for x in xs)
    return out if len(out) > 1 else out[0]


def _close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


# -- 1. Real = Saliency(abs=False); times the input = InputXGradient ----------------------


def test_real_equals_saliency_and_input_x_gradient_titanic():
    model = _model(TitanicSimpleNNModel)
    x = torch.rand(6, 12, dtype=F64)
    for target in (1, [0, 1, 1, 0, 1, 0], torch.tensor([1, 0, 0, 1, 1, 1])):
        got = SemiringAttribution(model, sbp.Real()).attribute(x, target=target)
        want = captum_attr.Saliency(model).attribute(_leaf(x), target=target, abs=False)
        assert got.shape == x.shape
        _close(got, want, f"saliency target={target}")
        got = SemiringAttribution(model, multiply_by_inputs=True).attribute(x, target=target)
        _close(got, captum_attr.InputXGradient(model).attribute(_leaf(x), target=target), "ixg")


def test_real_equals_saliency_cnn_per_example_targets():
    model = _model(SmallCNN)
    x = torch.randn(4, 3, 8, 8, dtype=F64)
    target = torch.tensor([0, 3, 4, 1])
    got = SemiringAttribution(model).attribute(x, target=target)
    _close(got, captum_attr.Saliency(model).attribute(_leaf(x), target=target, abs=False), "cnn")


def test_tuple_inputs_and_additional_forward_args():
    model = _model(TwoInputs)
    x1, x2 = torch.randn(3, 3, dtype=F64), torch.randn(3, 2, dtype=F64)
    scale = torch.tensor(0.7, dtype=F64)
    sa = SemiringAttribution(model, sbp.Real())
    got = sa.attribute((x1, x2), target=2, additional_forward_args=(scale,))
    want = captum_attr.Saliency(model).attribute(
        _leaf(x1, x2), target=2, abs=False, additional_forward_args=(scale,)
    )
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        _close(g, w, "two inputs")
    got = sa.attribute((x1, x2), target=2, additional_forward_args=scale)  # not a tuple
    _close(got[1], want[1], "additional arg not in a tuple")
    ixg = SemiringAttribution(model, multiply_by_inputs=True)
    assert ixg.multiplies_by_inputs and not sa.multiplies_by_inputs
    got = ixg.attribute((x1, x2), target=2, additional_forward_args=(scale,))
    want = captum_attr.InputXGradient(model).attribute(
        _leaf(x1, x2), target=2, additional_forward_args=(scale,)
    )
    for g, w in zip(got, want):
        _close(g, w, "input x gradient, two inputs")


class PerPosition(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):  # (batch, positions, 4) -> (batch, positions, 3)
        return torch.tanh(self.lin(x))


def test_targets_as_tuples_and_float32_inputs_that_require_grad():
    model = _model(PerPosition)
    x = torch.randn(2, 5, 4, dtype=F64)
    sal = captum_attr.Saliency(model)
    for target in ((3, 1), [(1, 2), (4, 0)]):  # one for all; one per example
        got = SemiringAttribution(model).attribute(x, target=target)
        _close(got, sal.attribute(_leaf(x), target=target, abs=False), f"target={target}")
    model32 = _model(TitanicSimpleNNModel).float()
    x32 = torch.rand(5, 12, requires_grad=True)
    got = SemiringAttribution(model32).attribute(x32, target=1)
    want = captum_attr.Saliency(model32).attribute(x32, target=1, abs=False)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


# -- 2. the selective semirings, against path products written out by hand ----------------


class OneHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def test_selective_semirings_are_the_best_path_per_input_element():
    model = _model(OneHidden, seed=1)
    x = torch.randn(2, 3, dtype=F64)
    target = [1, 0]
    # every path from x[b, i] to out[b, t]: W1[j, i] * tanh'(h[b, j]) * W2[t, j], over j
    h = model.l1(x).detach()
    w1, w2 = model.l1.weight.detach(), model.l2.weight.detach()
    paths = torch.stack(
        [w1.T * (1 - torch.tanh(h[b]) ** 2) * w2[t] for b, t in enumerate(target)]
    )  # (batch, input i, hidden j)
    hi = SemiringAttribution(model, sbp.MaxProduct()).attribute(x, target=target)
    lo = SemiringAttribution(model, sbp.MaxProduct(), field="lo").attribute(x, target=target)
    _close(hi, paths.max(-1).values, "MaxProduct hi")
    _close(lo, paths.min(-1).values, "MaxProduct lo")
    mx = SemiringAttribution(model, sbp.MaxAbs()).attribute(x, target=target)
    _close(mx, paths.abs().max(-1).values, "MaxAbs")
    top = SemiringAttribution(model, sbp.TopK(2)).attribute(x, target=target)
    best = paths.gather(-1, paths.abs().argmax(-1, keepdim=True)).squeeze(-1)
    _close(top, best, "TopK: the heaviest path's signed product")
    log_abs = SemiringAttribution(model, sbp.LogAbs()).attribute(x, target=target)
    _close(log_abs, paths.abs().sum(-1).log(), "LogAbs")
    ent = SemiringAttribution(model, sbp.Entropy()).attribute(x, target=target)
    p = paths.abs() / paths.abs().sum(-1, keepdim=True)
    _close(ent, -(p * p.log()).sum(-1), "Entropy")
    times = SemiringAttribution(model, sbp.MaxProduct(), multiply_by_inputs=True)
    _close(times.attribute(x, target=target), hi * x, "MaxProduct times the input")
    count = SemiringAttribution(model, sbp.PathCount()).attribute(x, target=target)
    _close(count, torch.full_like(x, math.log(4)), "PathCount: 4 paths per element")


# -- 3. Captum's metrics and visualization take them -----------------------------------------


def _perturb(inputs):
    noise = torch.randn_like(inputs) * 0.01
    return noise, inputs - noise


def test_infidelity_and_sensitivity_run_and_agree_with_saliency():
    model = _model(TitanicSimpleNNModel)
    x = torch.rand(4, 12, dtype=F64)
    sa = SemiringAttribution(model, sbp.Real())
    sal = captum_attr.Saliency(model)
    ours = sa.attribute(x, target=1)
    theirs = sal.attribute(_leaf(x), target=1, abs=False)
    torch.manual_seed(7)
    inf_ours = captum_metrics.infidelity(model, _perturb, x, ours, target=1, n_perturb_samples=4)
    torch.manual_seed(7)
    inf_theirs = captum_metrics.infidelity(
        model, _perturb, x, theirs, target=1, n_perturb_samples=4
    )
    assert inf_ours.shape == (4,) and torch.isfinite(inf_ours).all()
    _close(inf_ours, inf_theirs, "infidelity")
    torch.manual_seed(8)
    sens_ours = captum_metrics.sensitivity_max(sa.attribute, x, target=1, n_perturb_samples=3)
    torch.manual_seed(8)
    with warnings.catch_warnings():  # Saliency on the perturbed copies it makes itself
        warnings.filterwarnings("ignore", "Input Tensor 0 did not already require gradients")
        sens_theirs = captum_metrics.sensitivity_max(
            sal.attribute, x, target=1, abs=False, n_perturb_samples=3
        )
    assert sens_ours.shape == (4,) and torch.isfinite(sens_ours).all()
    _close(sens_ours, sens_theirs, "sensitivity_max")
    # a selective semiring through the metric too
    best = SemiringAttribution(model, sbp.MaxAbs())
    torch.manual_seed(8)
    sens = captum_metrics.sensitivity_max(best.attribute, x, target=1, n_perturb_samples=3)
    assert torch.isfinite(sens).all()


def test_visualize_image_attr_takes_them():
    pytest.importorskip("matplotlib")
    from captum.attr import visualization as viz

    model = _model(SmallCNN)
    x = torch.rand(1, 3, 8, 8, dtype=F64)
    attr = SemiringAttribution(model, sbp.MaxAbs()).attribute(x, target=2)
    # max pooling passes on only the pixels it selects: the others have no path, which
    # MaxAbs reads as 0 and MaxProduct's hi as -inf (not a number a heat map can show;
    # a path through a ReLU at a negative input has product 0: 0 under both)
    hi = SemiringAttribution(model, sbp.MaxProduct()).attribute(x, target=2)
    assert torch.isfinite(attr).all() and (attr > 0).any() and (hi == -math.inf).any()
    assert (attr[hi == -math.inf] == 0).all() and torch.isfinite(hi[attr > 0]).all()
    fig, _ = viz.visualize_image_attr(
        attr[0].permute(1, 2, 0).numpy(), x[0].permute(1, 2, 0).numpy(),
        method="blended_heat_map", sign="all", use_pyplot=False,
    )  # fmt: skip
    assert fig is not None


# -- 4. errors -----------------------------------------------------------------------------


def test_errors_say_what_to_do():
    model = _model(TitanicSimpleNNModel)
    x = torch.rand(2, 12, dtype=F64)
    sa = SemiringAttribution(model)
    with pytest.raises(InputError, match="floating-point tensor"):
        sa.attribute(torch.ones(2, 12, dtype=torch.long), target=1)
    with pytest.raises(InputError, match="does not select"):
        sa.attribute(x, target=5)
    with pytest.raises(InputError, match="one number per example"):
        sa.attribute(x)  # two numbers per example and no target
    with pytest.raises(InputError, match="does not select"):
        sa.attribute(x, target=[0, 1, 1])  # three targets for two examples
    with pytest.raises(InputError, match="not one"):
        SemiringAttribution(model, sbp.Entropy(), multiply_by_inputs=True)
    with pytest.raises(InputError, match="Semiring"):
        SemiringAttribution(model, "max")
    with pytest.raises(InputError, match="no field 'hi'"):
        SemiringAttribution(model, sbp.Entropy(), field="hi").attribute(x, target=1)


def test_missing_captum_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "captum.attr", None)  # import captum.attr fails
    monkeypatch.delitem(sys.modules, "semiring_backprop.captum")
    with pytest.raises(InputError, match=r'pip install "semiring-backprop\[captum\]"'):
        importlib.import_module("semiring_backprop.captum")
