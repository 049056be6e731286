"""Battery cases: reused traces after the changes people make to ablate and patch a
model, backward hooks, and the raw errors around tracing (issue 29).

A module's forward replaced on the instance or on its class; a dict, list or tensor
attribute changed; a global read by forward or by the output function changed; backward
hooks; reentrant checkpoints; ``x.data``; TorchScript; two threads' first calls;
pickling a result; float32 underflow of a path; training mode without dropout.

Oracles: ``torch.autograd`` on the model as it is when the case runs (computed in the
case, before anything is restored), and the model's own forward.
"""

from __future__ import annotations

import copy
import pickle
import threading
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import battery
import semiring_backprop as sbp
from battery import autograd, clear, close, graceful, out01

F64 = torch.float64
SCALE = 1.0  # a global Scaled.forward reads
settings = types.ModuleType("settings")  # a module an output function reads
settings.IDX = 0


class Knobs:
    IDX = 0


class Scaled(nn.Module):
    """Reads a dict, a list, a plain tensor attribute and a global."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.opts = {"scale": 2.0}
        self.taps = [1.0, 0.5]
        self.gain = torch.tensor([1.0, -1.0])

    def forward(self, x):
        return self.lin(x) * self.opts["scale"] * self.taps[1] * self.gain * SCALE


def _agrees(pair, env):
    """The result's Real value is the gradient autograd gave for the model as it was."""
    res, want = pair
    return close(res.at(0, sbp.Real()), want)


def _after(env, make, change, output=out01, restore=None):
    """``backprop`` once, ``change(model)``, again (reusing what it may); the second
    result and autograd's gradient on the changed model."""
    model = make(env)
    try:
        sbp.backprop(model, (env.x,), output=output)
        change(model)
        res = sbp.backprop(model, (env.x,), output=output)
        return res, autograd(model, (env.x,), output)
    finally:
        if restore:
            restore()


def _net(env):
    return env.net()


def _scaled(env):
    return Scaled().eval()


def _set_scale(v):
    global SCALE
    SCALE = v


def _patch_tanh():
    original = nn.Tanh.forward
    nn.Tanh.forward = lambda self, z: torch.sigmoid(z)
    return lambda: setattr(nn.Tanh, "forward", original)


# -- reused traces after common changes ----------------------------------------------------


@graceful("reuse.instance-forward", _agrees)
def _(env):
    """a submodule's forward replaced on the instance (m.act.forward = ...)"""
    return _after(env, _net, lambda m: setattr(m.act, "forward", lambda z: 5 * z))


@graceful("reuse.class-forward", _agrees)
def _(env):
    """a class's forward patched (nn.Tanh.forward = ...)"""
    undo = []
    return _after(env, _net, lambda m: undo.append(_patch_tanh()), restore=lambda: undo[0]())


@graceful("reuse.dict-item", _agrees)
def _(env):
    """a dict attribute forward reads changed in place (m.opts['scale'] = -5)"""
    return _after(env, _scaled, lambda m: m.opts.__setitem__("scale", -5.0))


@graceful("reuse.list-item", _agrees)
def _(env):
    """a list attribute forward reads changed in place (m.taps[1] = -4)"""
    return _after(env, _scaled, lambda m: m.taps.__setitem__(1, -4.0))


@graceful("reuse.tensor-attribute", _agrees)
def _(env):
    """a plain tensor attribute (not a buffer) replaced"""
    return _after(env, _scaled, lambda m: setattr(m, "gain", torch.tensor([3.0, -2.0])))


@graceful("reuse.tensor-attribute-in-place", _agrees)
def _(env):
    """a plain tensor attribute (not a buffer) written in place"""
    return _after(env, _scaled, lambda m: m.gain.mul_(-3))


@graceful("reuse.global-of-forward", _agrees)
def _(env):
    """a module-level global read by forward changed"""
    return _after(env, _scaled, lambda m: _set_scale(-3.0), restore=lambda: _set_scale(1.0))


def _by_settings(y):
    return y[0, settings.IDX]


def _by_knobs(y):
    return y[0, Knobs.IDX]


@graceful("reuse.output-reads-module-attribute", _agrees)
def _(env):
    """an output function reading settings.IDX, which changed"""
    return _after(
        env, _net, lambda m: setattr(settings, "IDX", 1), _by_settings,
        restore=lambda: setattr(settings, "IDX", 0),
    )  # fmt: skip


@graceful("reuse.output-reads-class-attribute", _agrees)
def _(env):
    """an output function reading Knobs.IDX, which changed"""
    return _after(
        env, _net, lambda m: setattr(Knobs, "IDX", 1), _by_knobs,
        restore=lambda: setattr(Knobs, "IDX", 0),
    )  # fmt: skip


# -- hooks ---------------------------------------------------------------------------------


@clear("reuse.full-backward-hook", r"module 'act' \(Tanh\) has a backward hook.*[Rr]emove")
def _(env):
    """register_full_backward_hook that scales the gradient"""
    net = env.net()
    net.act.register_full_backward_hook(lambda m, gi, go: (gi[0] * 5,))
    return battery._bp(env, model=net)


@clear("reuse.old-backward-hook", r"module 'fc2'.*register_backward_hook")
def _(env):
    """register_backward_hook (the old kind) that reverses the gradient"""
    net = env.net()
    net.fc2.register_backward_hook(lambda m, gi, go: tuple(-g for g in gi))
    return battery._bp(env, model=net)


@clear("reuse.backward-hook-after-reuse", r"module 'fc1'.*backward hook")
def _(env):
    """a backward hook added after a first call (the kept trace must not serve)"""
    net = env.net()
    battery._bp(env, model=net)
    net.fc1.register_full_backward_hook(lambda m, gi, go: (gi[0] * 10,))
    return battery._bp(env, model=net)


class _TensorHook(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 10)
        return h


@clear("reuse.tensor-hook-in-forward", r"register_hook.*does not run")
def _(env):
    """tensor.register_hook inside forward"""
    return battery._bp(env, model=_TensorHook().eval())


@graceful("reuse.forward-hook-changes-value", _agrees)
def _(env):
    """forward hooks and pre-hooks that change values are traced"""
    net = env.net()
    net.act.register_forward_hook(lambda m, a, out: out * 3)
    net.fc1.register_forward_pre_hook(lambda m, a: (a[0] * -2,))
    return battery._bp(env, model=net), autograd(net, (env.x,), out01)


# -- raw errors that become right answers or clear errors -----------------------------------


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=True))


@graceful("reuse.checkpoint-reentrant", _agrees)
def _(env):
    """torch.utils.checkpoint(use_reentrant=True) inside forward"""
    model = _Checkpointed().eval()
    x = env.x.clone().requires_grad_()
    out01(model(x)).backward()  # autograd.grad refuses reentrant checkpoints
    return battery._bp(env, model=model), x.grad


class _Data(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        h = self.lin(x)
        return h * h.data


@graceful("reuse.tensor-data-in-forward", _agrees)
def _(env):
    """x.data inside forward: no gradient through it, as in autograd"""
    model = _Data().eval()
    return battery._bp(env, model=model), autograd(model, (env.x,), out01)


@clear("reuse.jit-script", r"TorchScript.*original nn\.Module")
def _(env):
    """a torch.jit.script module"""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.script(env.net())
    return battery._bp(env, model=model)


def _race(calls):
    results = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i):
        start.wait()
        try:
            results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001  (the check reports it)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _all_agree(pairs, env):
    for res, want in pairs:
        if not isinstance(res, sbp.Result):
            return f"a thread raised {type(res).__name__}: {res}"
        ok = close(res.at(0, sbp.Real()), want)
        if ok is not True:
            return ok
    return True


@graceful("reuse.threads-one-backprop", _all_agree)
def _(env):
    """four threads make the first call of one Backprop at once"""
    net = env.net()
    bp = sbp.Backprop(net, out01)
    want = autograd(net, (env.x,), out01)
    return [(r, want) for r in _race([lambda: bp((env.x,))] * 4)]


@graceful("reuse.threads-several-models", _all_agree)
def _(env):
    """three threads make the first backprop call of three models at once"""
    nets = [env.net() for _ in range(3)]
    for i, net in enumerate(nets):
        with torch.no_grad():
            net.fc1.weight.mul_(i + 1)
    results = _race([lambda n=n: battery._bp(env, model=n) for n in nets])
    return [(r, autograd(n, (env.x,), out01)) for r, n in zip(results, nets)]


@clear("reuse.result-pickle", r"cannot be pickled.*to_json")
def _(env):
    """pickle.dumps of a Result"""
    return pickle.dumps(battery._bp(env))


@graceful("reuse.result-deepcopy", _agrees)
def _(env):
    """copy.deepcopy of a Result"""
    res = battery._bp(env, semirings=[sbp.Real(), sbp.MaxProduct()])
    return copy.deepcopy(res), autograd(env.net(), (env.x,), out01)


@clear("reuse.float32-underflow-path", r"underflow.*float64.*MaxAbs")
def _(env):
    """the top path of a 30-layer float32 chain whose product is 1e-60"""
    chain = battery.Chain(depth=30, scale=0.01)
    res = sbp.backprop(chain, (torch.ones(1, 1),), output=lambda y: y[0, 0],
                       semirings=[sbp.MaxProduct()])  # fmt: skip
    return res.top_path(0)


# -- training mode -------------------------------------------------------------------------


@graceful("reuse.training-plain", _agrees)
def _(env):
    """a plain Linear/Tanh model in training mode (nothing depends on the mode)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).train()
    return battery._bp(env, model=model), autograd(model, (env.x,), out01)


@clear("reuse.training-batchnorm", r"training mode.*'1' \(BatchNorm1d\).*batch's statistics")
def _(env):
    """batch norm in training mode: the examples' statistics"""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).train()
    return battery._bp(env, model=model, args=(env.x.repeat(3, 1),))


@clear("reuse.training-dropout-named", r"training mode.*'1' \(Dropout\)")
def _(env):
    model = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5), nn.Linear(3, 2)).train()
    return battery._bp(env, model=model)
