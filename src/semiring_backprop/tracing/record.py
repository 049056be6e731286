"""The record of a block's forward: the torch functions it calls, as :mod:`.blocks`
compares two members' (:class:`Recorder`), and a member's forward replayed against the
records of others (:func:`replayed`).

A call is recorded as the function, each argument (a tensor by where it comes from: an
input of the block, a parameter or buffer of it by name, an earlier call's result; and by
its layout: shape, strides, offset, dtype, device, whether it requires grad; a string
with the block's path in it as relative to it; other plain values as they are) and its
result (tensors by layout). Reads of a tensor's metadata (``x.shape``, ``x.size(1)``,
``x.device``) are not calls: a fake tensor answers some of them without one, and what
they return shows where it is read (in the arguments of a later call). Two records are
equal where the Python code of the two members made the same calls on tensors of the same
layouts and origins: their traces then differ only in the parameters and inputs read.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode


class Bad(Exception):
    """A value the record cannot hold: the members cannot be compared."""


def rename(text: str, old: str, new: str) -> str:
    """``text`` with the module path ``old`` at its start replaced by ``new``."""
    if text == old or (text.startswith(old) and text[len(old)] in ".:@"):
        return new + text[len(old) :]
    return text


_PLAIN = (int, bool, type(None), torch.dtype, torch.layout, torch.memory_format)


class Mismatch(Exception):
    """A member calls what no template called there."""


class Unlike(Mismatch):
    """A member's inputs are unlike every template's (found before it runs)."""


class Recorder(TorchFunctionMode):
    """Records the torch functions called while it is on: the function, what
    :meth:`describe` makes of its arguments and of its result. With ``templates`` (the
    records of members traced before), each call is compared with theirs at the same
    place instead of run, and returns new tensors of the layouts theirs returned (or,
    where theirs returned one of its arguments, the same argument): the member's code
    runs on, tracing nothing, as long as it calls what a template called."""

    def __init__(self, path: str, device, inputs: list, state: dict, templates=None):
        super().__init__()
        self.path, self.device = path, device
        self.origin: dict = {}  # id of a tensor -> where it comes from
        self.alive: list = []  # (the tensors whose ids are keys: not freed meanwhile)
        for i, t in enumerate(inputs):
            self._name(t, ("input", i))
        for name, t in state.items():
            self._name(t, ("state", name))
        self.calls: list = []  # (function, arguments, keywords, result), described
        self.runs: list = []  # (the tensors a call was given, what it returned)
        self.templates = templates
        self.fake = None  # the trace's fake mode (replaying)
        self.bad: str | None = None

    def _name(self, t, origin) -> None:
        self.origin.setdefault(id(t), origin)
        self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA or _is_getter(func):
            out = func(*args, **kwargs)
            if not leaves(out, []):  # a tensor's metadata: no op, and the traced
                return out  # tensors' own ``device`` is no torch function call
            func = ("getter", getattr(func, "__self__", func))
            return self._record(func, args, kwargs, lambda: out)
        return self._record(func, args, kwargs, lambda: func(*args, **kwargs))

    def _record(self, func, args, kwargs, run):
        if self.bad is not None:
            return run()
        i = len(self.calls)
        try:
            call = (func, self.describe(args), self.describe(kwargs))
        except Bad as e:
            if self.templates is not None:
                raise Mismatch(str(e)) from None
            self.bad = f"{getattr(func, '__name__', func)}: {e}"
            return run()
        if self.templates is None:
            out = run()
            self.runs.append((leaves((args, kwargs), []), out))
        else:
            self.templates = [t for t in self.templates
                              if i < len(t.record[1]) and t.record[1][i][:3] == call]  # fmt: skip
            if not self.templates:
                raise Mismatch(f"call {i} ({getattr(func, '__name__', func)})")
            given, out = self.templates[0].runs[i]
            with unset_fake_temporarily():  # (made directly: five times as fast)
                out = fresh(out, given, leaves((args, kwargs), []), self.fake)
        try:
            self.calls.append((*call, self.describe(out, result=i)))
        except Bad as e:
            if self.templates is not None:
                raise Mismatch(str(e)) from None
            self.bad = f"the result of {getattr(func, '__name__', func)}: {e}"
        return out

    def describe(self, x, result: int | None = None, at: list | None = None, objects=False):
        """``x`` as the record holds it; ``result``: the call ``x`` is the result of (its
        tensors are named as such, after they are described); ``objects``: other objects
        by identity (the block's own inputs: a cache, a config), else refused."""
        t = type(x)
        if t in _PLAIN or isinstance(x, _PLAIN):
            return (t.__name__, x)
        if t is str:
            return ("str", rename(x, self.path, "<block>"))
        if t is float or t is complex:
            return (t.__name__, repr(x))
        if isinstance(x, torch.Tensor):
            return self._tensor(x, result, at)
        if t is torch.Size:
            return ("size", tuple(x))
        if t is torch.device:
            return ("device", "<device>" if x == self.device else str(x))
        if isinstance(x, list | tuple) and (t in (list, tuple) or result is not None):
            at = [] if at is None else at
            return (t.__name__, tuple(self.describe(v, result, at, objects) for v in x))
        if t is dict:
            at = [] if at is None else at
            items = tuple((k, self.describe(v, result, at, objects)) for k, v in x.items())
            return ("dict", items)
        if t is slice:
            return ("slice", self.describe((x.start, x.stop, x.step)))
        if x is Ellipsis:
            return ("...",)
        if result is not None and not isinstance(x, torch.nn.Module):
            return ("object", t.__qualname__)  # what a call returned (a grad_fn)
        if objects:
            self.alive.append(x)
            return ("object", id(x))
        raise Bad(f"an argument of type {t.__name__}")

    def _tensor(self, x, result, at):
        if x.layout != torch.strided or not all(isinstance(d, int) for d in x.shape):
            raise Bad("a tensor of symbolic size or not strided")
        device = "<device>" if x.device == self.device else str(x.device)
        layout = (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, device,
                  x.requires_grad)  # fmt: skip
        if result is None:
            origin = self.origin.get(id(x))
            if origin is None:
                raise Bad("a tensor from outside the block (a global, another module's)")
            return ("tensor", origin, layout)
        if at is None:
            at = []
        at.append(0)
        self.origin[id(x)] = ("result", result, len(at) - 1)  # (a call may return its input)
        self.alive.append(x)
        return ("tensor", layout)


def fresh(out, given: list, now: list, fake):
    """What a template's call returned, for another member's call of the same record:
    each tensor it was given (``given``) as the one given now (``now``), other tensors
    new fake ones of their layouts (of ``fake``, the trace's mode: they enter no graph)."""
    if isinstance(out, torch.Tensor):
        for g, n in zip(given, now):
            if out is g:
                return n
        shape, stride, offset = out.shape, out.stride(), out.storage_offset()
        meta = torch.empty_strided(shape, stride, dtype=out.dtype, device="meta")
        if offset:
            size = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
            meta = torch.empty(size, dtype=out.dtype, device="meta")
            meta = meta.as_strided(shape, stride, offset)
        return FakeTensor(fake, meta.requires_grad_(out.requires_grad), out.device)
    if type(out) in (list, tuple):
        return type(out)(fresh(v, given, now, fake) for v in out)
    if isinstance(out, tuple) and hasattr(type(out), "n_fields"):  # torch.return_types
        return type(out)([fresh(v, given, now, fake) for v in out])
    if type(out) is dict:
        return {k: fresh(v, given, now, fake) for k, v in out.items()}
    if leaves(out, []) or isinstance(out, tuple):
        raise Mismatch(f"a result of type {type(out).__name__}")
    return out


_TENSOR = torch._C.TensorBase
#: methods of tensors that read their metadata (shape, layout), which fixed sizes hold
_METADATA = frozenset({
    _TENSOR.size, _TENSOR.dim, _TENSOR.stride, _TENSOR.storage_offset, _TENSOR.numel,
    _TENSOR.nelement, _TENSOR.ndimension, _TENSOR.is_contiguous, _TENSOR.element_size,
    _TENSOR.is_floating_point, _TENSOR.is_complex, _TENSOR.get_device,
})  # fmt: skip


def _is_getter(func) -> bool:
    """A tensor attribute read (``x.shape``, ``x.T``): the ``__get__`` of a descriptor."""
    return getattr(func, "__name__", None) == "__get__"


def leaves(x, out: list) -> list:
    """The tensors in ``x`` (tuples, lists and dicts of them, looked into)."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif type(x) in (list, tuple):
        for v in x:
            leaves(v, out)
    elif type(x) is dict:
        for v in x.values():
            leaves(v, out)
    return out


def rebuild(x, swap):
    """``x`` with each tensor ``t`` replaced by ``swap(t)``."""
    if isinstance(x, torch.Tensor):
        return swap(x)
    if type(x) in (list, tuple):
        return type(x)(rebuild(v, swap) for v in x)
    if type(x) is dict:
        return {k: rebuild(v, swap) for k, v in x.items()}
    return x


def replayed(path, state, forward, args, kwargs, device, probe, templates):
    """``(template, result, recorder)``: the ``forward`` of the member at ``path`` (its
    parameters and buffers ``state``) replayed against the records of ``templates``
    (:class:`Recorder`), with no mode of the trace on but its fake tensors' (nothing
    enters the graph); the template whose record it matches whole. Raises
    :class:`Mismatch` where it matches none, :class:`Unlike` before anything ran."""
    from torch._guards import detect_fake_mode
    from torch.utils._python_dispatch import _disable_current_modes

    inputs = leaves((args, kwargs), [])
    fake = detect_fake_mode(inputs)
    if fake is None:
        raise Bad("no fake tensors")
    rec = Recorder(path, device, inputs, state, templates)
    rec.fake = fake
    entry = rec.describe((args, kwargs), objects=True)
    rec.templates = [t for t in templates if t.record[0] == entry]
    if not rec.templates:
        raise Unlike("its inputs")
    modes = []
    while torch._C._len_torch_function_stack():
        modes.append(torch._C._pop_torch_function_stack())
    try:
        with _disable_current_modes(), fake:
            before = probe()
            with rec:
                out = forward(*args, **kwargs)
            if probe() != before:
                raise Bad("a custom autograd Function or refused code")
    finally:
        for m in reversed(modes):
            torch._C._push_on_torch_function_stack(m)
    result = rec.describe(out, objects=True)
    n = len(rec.calls)
    match = [t for t in rec.templates if len(t.record[1]) == n and t.record[2] == result]
    if not match:
        raise Mismatch("its result" if n else "its calls")
    return match[0], out, rec
