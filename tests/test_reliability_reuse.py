"""Reused traces after the changes people make to ablate and patch a model, backward
hooks, and the raw errors around tracing (issue 29).

Oracles: ``torch.autograd`` on the changed model (float64), ``reuse=False`` (a fresh
trace), and the model's own forward. Whether a trace was reused is read off
``Result.graph``.
"""

from __future__ import annotations

import copy
import pickle
import threading
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import semiring_backprop as sbp

F64 = torch.float64
SCALE = 1.0  # read by Scaled.forward as a module-level global
settings = types.ModuleType("settings")  # an output function reads settings.IDX
settings.IDX = 0


class Knobs:
    IDX = 0


def _x(rows=2):
    return torch.randn(rows, 4, dtype=F64, generator=torch.Generator().manual_seed(3))


def _grad(model, x, output):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(output(model(x)), x)
    return g


def _real(model, x, output, **kw):
    return sbp.backprop(model, (x,), output=output, **kw)


def _agrees(res, model, x, output):
    torch.testing.assert_close(res.at(0, sbp.Real()), _grad(model, x, output))


def out01(y):
    return y[0, 1]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64).eval()


class Scaled(nn.Module):
    """Reads a dict, a list, a plain tensor attribute and a global."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.opts = {"scale": 2.0}
        self.taps = [1.0, 0.5]
        self.gain = torch.tensor([1.0, -1.0, 2.0], dtype=F64)

    def forward(self, x):
        return self.lin(x) * self.opts["scale"] * self.taps[1] * self.gain * SCALE


def _scaled():
    torch.manual_seed(0)
    return Scaled().to(F64).eval()


# -- 1. reused traces after common changes -----------------------------------------------


def _instance_forward(m):
    m[1].forward = lambda z: 5 * z


def _dict_item(m):
    m.opts["scale"] = -5.0


def _list_item(m):
    m.taps[1] = -4.0


def _tensor_attr(m):
    m.gain = torch.tensor([3.0, 1.0, -2.0], dtype=F64)


def _tensor_attr_in_place(m):
    m.gain.mul_(-3)


CHANGES = {
    "instance-forward": (_mlp, _instance_forward),
    "dict-item": (_scaled, _dict_item),
    "list-item": (_scaled, _list_item),
    "tensor-attribute": (_scaled, _tensor_attr),
    "tensor-attribute-in-place": (_scaled, _tensor_attr_in_place),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_model_is_traced_again(change):
    make, edit = CHANGES[change]
    model, x = make(), _x()
    first = _real(model, x, out01)
    _agrees(first, model, x, out01)
    edit(model)
    again = _real(model, x, out01)
    assert again.graph is not first.graph
    _agrees(again, model, x, out01)
    assert _real(model, x, out01).graph is again.graph  # and reused after that


def test_a_patched_class_forward_is_traced_again(monkeypatch):
    model, x = _mlp(), _x()
    first = _real(model, x, out01)
    monkeypatch.setattr(nn.Tanh, "forward", lambda self, z: torch.sigmoid(z))
    again = _real(model, x, out01)
    assert again.graph is not first.graph
    _agrees(again, model, x, out01)


def test_a_changed_global_of_forward_is_traced_again(monkeypatch):
    model, x = _scaled(), _x()
    first = _real(model, x, out01)
    monkeypatch.setattr(__import__(__name__), "SCALE", -3.0)
    again = _real(model, x, out01)
    assert again.graph is not first.graph
    _agrees(again, model, x, out01)


def _by_settings(y):
    return y[0, settings.IDX]


def _by_knobs(y):
    return y[0, Knobs.IDX]


@pytest.mark.parametrize("holder", [settings, Knobs], ids=["module", "class"])
def test_an_output_function_reading_a_changed_attribute_is_traced_again(holder, monkeypatch):
    output = _by_settings if holder is settings else _by_knobs
    model, x = _mlp(), _x()
    first = _real(model, x, output)
    assert _real(model, x, output).graph is first.graph  # unchanged: reused
    monkeypatch.setattr(holder, "IDX", 2)
    again = _real(model, x, output)
    assert again.graph is not first.graph
    _agrees(again, model, x, output)


def test_a_helper_function_called_by_forward_is_read_into(monkeypatch):
    """A global function the forward calls, and the global that function reads."""
    model, x = _Helped().to(F64).eval(), _x()
    first = _real(model, x, out01)
    monkeypatch.setattr(__import__(__name__), "HELPER_GAIN", 4.0)
    again = _real(model, x, out01)
    assert again.graph is not first.graph
    _agrees(again, model, x, out01)


HELPER_GAIN = 1.0


def _helper(z):
    return z * HELPER_GAIN


class _Helped(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return _helper(self.lin(x))


def test_reuse_still_happens_on_an_unchanged_model():
    model, x = _scaled(), _x()
    first = _real(model, x, out01)
    assert _real(model, _x() + 1, out01).graph is first.graph


def test_stamps_hold_no_model_alive_and_see_a_recycled_object():
    """Identity is compared by (weak) reference, not by id: a new tensor at a freed
    tensor's address is a change."""
    from semiring_backprop.tracing import reuse

    model = _scaled()
    before = reuse.stamp(model)
    model.gain = model.gain.clone()
    assert reuse.stamp(model) != before


# -- 2. backward hooks ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "old", "pre"])
def test_backward_hooks_on_modules_are_refused(kind):
    model, x = _mlp(), _x()
    if kind == "full":
        model[1].register_full_backward_hook(lambda m, gi, go: (gi[0] * 5,))
    elif kind == "old":
        model[1].register_backward_hook(lambda m, gi, go: (-gi[0],))
    else:
        model[1].register_full_backward_pre_hook(lambda m, go: (go[0] * 10,))
    assert not torch.allclose(_grad(model, x, out01), _grad(_mlp(), x, out01))  # it matters
    with pytest.raises(sbp.TracingError, match=r"module '1' \(Tanh\) has a backward hook.*remove"):
        _real(model, x, out01)


def test_a_backward_hook_added_after_a_trace_is_refused_on_reuse():
    model, x = _mlp(), _x()
    _real(model, x, out01)
    handle = model[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * -1,))
    with pytest.raises(sbp.TracingError, match="module '2'"):
        _real(model, x, out01)
    handle.remove()
    _agrees(_real(model, x, out01), model, x, out01)


class _TensorHook(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(4, 3))
        self.inner[0].register_forward_hook(self._hook)

    def _hook(self, m, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: g * 10)

    def forward(self, x):
        return self.inner(x)


def test_tensor_register_hook_in_forward_is_refused():
    model, x = _TensorHook().to(F64).eval(), _x()
    plain = torch.zeros_like(x)
    plain[0] = model.inner[0].weight[1].detach()  # d y[0, 1] / d x without the hook
    assert torch.allclose(_grad(model, x, out01), 10 * plain)
    with pytest.raises(sbp.TracingError, match="register_hook.*'inner.0'|register_hook"):
        _real(model, x, out01)


def test_value_changing_forward_hooks_still_work():
    model, x = _mlp(), _x()
    model[1].register_forward_hook(lambda m, a, out: out * 3)
    model[0].register_forward_pre_hook(lambda m, a: (a[0] * -2,))
    _agrees(_real(model, x, out01), model, x, out01)


# -- 3. raw errors that become right answers or clear errors -------------------------------


class _Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
        self.head = nn.Linear(5, 3)
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_blocks_are_traced_as_their_function(reentrant):
    model, x = _Checkpointed(reentrant).to(F64).eval(), _x()
    res = _real(model, x, out01)
    xg = x.clone().requires_grad_()
    out01(model(xg)).backward()  # autograd.grad refuses reentrant checkpoints
    torch.testing.assert_close(res.at(0, sbp.Real()), xg.grad)
    assert "block" in res.graph.module_types


class _Data(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x)
        return h * h.data  # no gradient through the second factor, as in autograd


def test_tensor_data_in_forward_is_read_as_detach():
    model, x = _Data().to(F64).eval(), _x()
    res = _real(model, x, out01)
    _agrees(res, model, x, out01)
    torch.testing.assert_close(res.values[res.graph.output_node], model(x)[0, 1])


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_is_refused_by_name():
    model = torch.jit.script(_mlp())
    with pytest.raises(sbp.TracingError, match="TorchScript.*original nn.Module"):
        _real(model, _x(), out01)
    outer = nn.Sequential(torch.jit.script(nn.Linear(4, 3).to(F64)), nn.Tanh()).eval()
    with pytest.raises(sbp.TracingError, match="submodule '0' is TorchScript"):
        _real(outer, _x(), out01)


def _race(calls):
    """Run every call at once, each in its thread; what each returned or raised."""
    results = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i):
        start.wait()
        try:
            results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001  (reported below)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_first_calls_of_one_backprop_from_several_threads():
    model, x = _mlp(), _x()
    bp = sbp.Backprop(model, out01)
    results = _race([lambda: bp((x,))] * 4)
    for r in results:
        assert isinstance(r, sbp.Result), r
        _agrees(r, model, x, out01)
    assert bp.traces == 1


def test_first_calls_of_several_models_from_several_threads():
    models = [_mlp() for _ in range(3)] + [_scaled()]
    for i, m in enumerate(models):
        with torch.no_grad():
            m[0].weight.mul_(i + 1) if isinstance(m, nn.Sequential) else m.lin.weight.neg_()
    x = _x()
    results = _race([lambda m=m: _real(m, x, out01) for m in models])
    for m, r in zip(models, results):
        assert isinstance(r, sbp.Result), r
        _agrees(r, m, x, out01)


def test_a_result_deep_copies_and_refuses_pickle_saying_what_to_save():
    model, x = _mlp(), _x()
    res = _real(model, x, out01, semirings=[sbp.Real(), sbp.MaxProduct()])
    dup = copy.deepcopy(res)
    assert dup.at(0, sbp.Real()) is not res.at(0, sbp.Real())
    torch.testing.assert_close(dup.at(0, sbp.Real()), _grad(model, x, out01))
    assert dup.top_path(0).value == res.top_path(0).value
    with pytest.raises(sbp.InputError, match="cannot be pickled.*to_json"):
        pickle.dumps(res)


def _chain(depth=30, weight=0.01, dtype=torch.float32):
    model = nn.Sequential(*[nn.Linear(1, 1, bias=False) for _ in range(depth)]).eval()
    for layer in model:
        nn.init.constant_(layer.weight, weight)
    return model.to(dtype)


def test_float32_underflow_in_a_deep_chain_is_named():
    model = _chain()
    res = _real(model, torch.ones(1, 1), lambda y: y[0, 0], semirings=[sbp.MaxProduct()])
    with pytest.raises(sbp.PathMismatchError, match="underflow.*float64.*MaxAbs") as e:
        res.top_path(0)
    assert "changed after the pass" not in str(e.value)
    # what it suggests works: the log-space semiring and float64 both read the path
    want = 0.01**30
    alt = _real(model, torch.ones(1, 1), lambda y: y[0, 0], semirings=[sbp.MaxAbs()])
    assert alt.top_path(0, sbp.MaxAbs()).value == pytest.approx(want, rel=1e-4)
    m64 = _chain(dtype=F64)
    ones = torch.ones(1, 1, dtype=F64)
    r64 = _real(m64, ones, lambda y: y[0, 0], semirings=[sbp.MaxProduct()])
    assert r64.top_path(0).value == pytest.approx(want, rel=1e-9)


# -- 4. training mode ----------------------------------------------------------------------


def test_training_mode_without_mode_dependent_ops_is_explained():
    model, x = _mlp().train(), _x()
    _agrees(_real(model, x, out01), model, x, out01)


@pytest.mark.parametrize("layer", ["dropout", "batchnorm"])
def test_training_mode_with_mode_dependent_ops_is_refused(layer):
    extra = nn.Dropout(0.5) if layer == "dropout" else nn.BatchNorm1d(5)
    model = nn.Sequential(nn.Linear(4, 5), extra, nn.Linear(5, 3)).to(F64).train()
    cls = type(extra).__name__
    with pytest.raises(sbp.TrainingModeError, match=rf"'1' \({cls}\).*model.eval\(\)"):
        _real(model, _x(3), out01)
    _agrees(_real(model.eval(), _x(3), out01), model, _x(3), out01)


def test_dropout_with_p_zero_is_the_identity_in_training_mode():
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.0), nn.Linear(5, 3)).to(F64).train()
    _agrees(_real(model, _x(), out01), model, _x(), out01)
