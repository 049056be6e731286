"""Identical blocks traced once.

A transformer repeats one block (a layer) many times, and torch.export traces each one
anew: most of a first call's time. While a model is exported, the first call of each
*group* (the members of an ``nn.ModuleList`` or ``nn.Sequential`` of one class and one
structure) is traced as usual, and every torch function its ``forward`` calls is recorded
(:class:`_Recorder`): the function, each argument (a tensor by where it comes from: an
input, a parameter or buffer of the block by name, an earlier call's result; and by its
layout; other values as they are) and what the call returned. Every later member runs its
``forward`` on meta tensors instead, outside the trace, recorded the same way. Where the
two records are equal, the member's Python code called the same functions on tensors of
the same layouts and origins, so its trace is the first member's with its own parameters
and inputs: the export holds a stand-in (``ops.block``) with the member's inputs and
outputs, and :func:`.stitch.stitch` puts that copy in its place. The program is the one a
full trace gives (``tests/test_blocks.py`` compares them on every model family the tests
build).

A member whose record differs (T5's first block has the relative position bias, the
others do not) aborts the export, which starts again with that member traced in full
too, a template of its own (:class:`Retry`). A group whose members cannot be compared
(a value the record cannot hold, a call that fails on meta tensors) is traced in full.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

from .ops import BLOCK_OUTPUTS

_MAX_TEMPLATES = 3  # members of one group traced in full before the group is given up
MAX_ATTEMPTS = 3  # exports of one trace aborted to trace a member in full, at most
#: node meta: the template a node belongs to; ``(template, i)`` of its inputs, outputs
REGION, INPUTS, OUTPUTS = "sbp_region", "sbp_inputs", "sbp_outputs"
_COUNTER = itertools.count()  # stand-in keys unique within the process


class Retry(Exception):
    """The export is to start again: a member of a group is not a copy of a template."""


class _Bad(Exception):
    """A value the record cannot hold: the members cannot be compared."""


@dataclass(eq=False)
class Group:
    """Members of one ``ModuleList``: their paths in the user's model, and which of them
    earlier attempts found must be traced in full."""

    path: str
    members: list
    paths: list
    templates: set = field(default_factory=set)
    off: bool = False


def find_groups(model) -> list[Group]:
    """The members of an ``nn.ModuleList`` or ``nn.Sequential`` alike in class and
    structure (submodules, parameters and buffers by name, shape, dtype), at least two of
    them, sharing no module or tensor (T5's blocks but the first, which holds the
    position bias, form one); outermost lists only."""
    if not isinstance(model, torch.nn.Module):
        return []
    groups, lists = [], []
    for path, m in model.named_modules():
        if not isinstance(m, torch.nn.ModuleList | torch.nn.Sequential) or len(m) < 2:
            continue
        if any(path.startswith(f"{p}.") if p else path for p in lists):
            continue  # inside a member of a list found before (named_modules: pre-order)
        prefix = f"{path}." if path else ""
        alike: dict = {}
        for name, member in m.named_children():
            alike.setdefault(_structure(member), []).append((prefix + name, member))
        found = [g for g in alike.values() if len(g) > 1 and _apart([x for _, x in g])]
        if found:
            lists.append(path)
        for g in found:
            groups.append(Group(path, [x for _, x in g], [n for n, _ in g]))
    return groups


def _structure(block) -> tuple:
    mods = tuple((n, type(x)) for n, x in block.named_modules(remove_duplicate=False))
    tensors = tuple(
        (n, tuple(t.shape), t.dtype, t.requires_grad, isinstance(t, torch.nn.Parameter))
        for n, t in itertools.chain(
            block.named_parameters(remove_duplicate=False),
            block.named_buffers(remove_duplicate=False),
        )
    )
    return mods, tensors


def _owned(block) -> set:
    return {id(x) for x in itertools.chain(block.modules(), block.parameters(), block.buffers())}


def _apart(members) -> bool:
    """No two members share a module, parameter or buffer."""
    seen: set = set()
    for m in members:
        own = _owned(m)
        if own & seen:
            return False
        seen |= own
    return True


# -- the record ------------------------------------------------------------------------


def rename(text: str, old: str, new: str) -> str:
    """``text`` with the module path ``old`` at its start replaced by ``new``."""
    if text == old or (text.startswith(old) and text[len(old)] in ".:@"):
        return new + text[len(old) :]
    return text


_PLAIN = (int, bool, type(None), torch.dtype, torch.layout, torch.memory_format)


class _Mismatch(Exception):
    """A member calls what no template called there."""


class _Unlike(_Mismatch):
    """A member's inputs are unlike every template's (found before it runs)."""


class _Recorder(TorchFunctionMode):
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
            if not _leaves(out, []):  # a tensor's metadata: no op, and the traced
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
        except _Bad as e:
            if self.templates is not None:
                raise _Mismatch(str(e)) from None
            self.bad = f"{getattr(func, '__name__', func)}: {e}"
            return run()
        if self.templates is None:
            out = run()
            self.runs.append((_leaves((args, kwargs), []), out))
        else:
            self.templates = [t for t in self.templates
                              if i < len(t.record[1]) and t.record[1][i][:3] == call]  # fmt: skip
            if not self.templates:
                raise _Mismatch(f"call {i} ({getattr(func, '__name__', func)})")
            given, out = self.templates[0].runs[i]
            with unset_fake_temporarily():  # (made directly: five times as fast)
                out = _fresh(out, given, _leaves((args, kwargs), []), self.fake)
        try:
            self.calls.append((*call, self.describe(out, result=i)))
        except _Bad as e:
            if self.templates is not None:
                raise _Mismatch(str(e)) from None
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
        raise _Bad(f"an argument of type {t.__name__}")

    def _tensor(self, x, result, at):
        if x.layout != torch.strided or not all(isinstance(d, int) for d in x.shape):
            raise _Bad("a tensor of symbolic size or not strided")
        device = "<device>" if x.device == self.device else str(x.device)
        layout = (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, device,
                  x.requires_grad)  # fmt: skip
        if result is None:
            origin = self.origin.get(id(x))
            if origin is None:
                raise _Bad("a tensor from outside the block (a global, another module's)")
            return ("tensor", origin, layout)
        if at is None:
            at = []
        at.append(0)
        self.origin[id(x)] = ("result", result, len(at) - 1)  # (a call may return its input)
        self.alive.append(x)
        return ("tensor", layout)


def _fresh(out, given: list, now: list, fake):
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
        return type(out)(_fresh(v, given, now, fake) for v in out)
    if isinstance(out, tuple) and hasattr(type(out), "n_fields"):  # torch.return_types
        return type(out)([_fresh(v, given, now, fake) for v in out])
    if type(out) is dict:
        return {k: _fresh(v, given, now, fake) for k, v in out.items()}
    if _leaves(out, []) or isinstance(out, tuple):
        raise _Mismatch(f"a result of type {type(out).__name__}")
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


def _leaves(x, out: list) -> list:
    """The tensors in ``x`` (tuples, lists and dicts of them, looked into)."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif type(x) in (list, tuple):
        for v in x:
            _leaves(v, out)
    elif type(x) is dict:
        for v in x.values():
            _leaves(v, out)
    return out


def _rebuild(x, swap):
    """``x`` with each tensor ``t`` replaced by ``swap(t)``."""
    if isinstance(x, torch.Tensor):
        return swap(x)
    if type(x) in (list, tuple):
        return type(x)(_rebuild(v, swap) for v in x)
    if type(x) is dict:
        return {k: _rebuild(v, swap) for k, v in x.items()}
    return x


def _state(block) -> dict:
    return dict(itertools.chain(block.named_parameters(), block.named_buffers()))


# -- one export ------------------------------------------------------------------------


@dataclass(eq=False)
class Template:
    """A member traced in full: its record, and the tag of its nodes in the graph."""

    group: Group
    index: int
    tag: str
    record: tuple
    outputs: list  # the layouts of the distinct tensors of its result made inside it
    runs: list  # (the tensors each call was given, what it returned)


@dataclass(eq=False)
class Stub:
    """A member whose trace is a copy of ``template``'s: its stand-in's key."""

    key: str
    group: Group
    index: int
    template: Template


class Attempt:
    """One export of the model with its groups' members patched (:meth:`patched`).
    ``probe()`` changes when the traced code applies a custom autograd Function or does
    something a trace refuses (their checks need the member's own trace)."""

    def __init__(self, groups: list[Group], probe):
        self.groups, self.probe = groups, probe
        self.prefix = f"b{next(_COUNTER)}"
        self.templates: dict = {}  # group -> [Template]
        self.called: dict = {}  # group -> indices of the members called so far
        self.stubs: dict = {}  # key -> Stub
        self.retry: str | None = None  # why the export was aborted

    @contextlib.contextmanager
    def patched(self):
        """Each member's ``forward`` replaced for the export (put back after)."""
        saved = []
        try:
            for g in self.groups:
                for j, m in enumerate(g.members if not g.off else ()):
                    saved.append((m, m.__dict__.get("forward", _NONE)))
                    m.forward = self._forward(g, j, m.forward)
            yield self
        finally:
            for m, old in reversed(saved):
                if old is _NONE:
                    del m.forward
                else:
                    m.forward = old

    def forget(self) -> None:
        """Drop the stand-ins' layouts (once the program holds no stand-in)."""
        for key in self.stubs:
            BLOCK_OUTPUTS.pop(key, None)

    def _forward(self, g, j, orig):
        def forward(*args, **kwargs):
            called = self.called.setdefault(g, set())
            if g.off or j in called:  # (a member called twice: traced as it is)
                return orig(*args, **kwargs)
            called.add(j)
            if j in g.templates or not self.templates.get(g):
                return self._template(g, j, orig, args, kwargs)
            return self._stub(g, j, orig, args, kwargs)

        return forward

    def _template(self, g, j, orig, args, kwargs):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

        mode = get_proxy_mode()
        inputs = _leaves((args, kwargs), [])
        device = _device(inputs, g.members[j])
        if mode is None or device is None:
            g.off = True  # (not under torch.export, or tensors on several devices)
            return orig(*args, **kwargs)
        tracer = mode.tracer
        nodes = [get_proxy_slot(t, tracer, None) for t in inputs]
        rec = _Recorder(g.paths[j], device, inputs, _state(g.members[j]))
        entry = _try(rec, (args, kwargs))
        last, before = next(reversed(tracer.graph.nodes)), self.probe()
        with rec:
            out = orig(*args, **kwargs)
        result = _try(rec, out)
        region = []
        node = last.next
        while node.op != "root":
            region.append(node)
            node = node.next
        if rec.bad is None and self.probe() != before:
            rec.bad = "a custom autograd Function or refused code"
        if rec.bad is None and any(n is None for n in nodes):
            rec.bad = "an input the trace does not follow"
        if rec.bad is None and not all(_copyable(n, tracer) for n in region):
            rec.bad = "a node other than an op (a grad-mode or autocast region)"
        made = _made(rec, out) if rec.bad is None else None
        if rec.bad is not None or made is None:
            g.off = True  # (for the next attempts; this one goes on without it)
            return out
        tag = f"{self.prefix}.{sum(len(t) for t in self.templates.values())}"
        for n in region:
            n.meta[REGION] = tag
        for i, slot in enumerate(nodes):
            slot.proxy.node.meta.setdefault(INPUTS, []).append((tag, i))
        for m, t in enumerate(made):
            get_proxy_slot(t, tracer).proxy.node.meta.setdefault(OUTPUTS, []).append((tag, m))
        layouts = [(tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in made]
        record = (entry, tuple(rec.calls), result)
        self.templates.setdefault(g, []).append(Template(g, j, tag, record, layouts, rec.runs))
        return out

    def _stub(self, g, j, orig, args, kwargs):
        inputs = _leaves((args, kwargs), [])
        device = _device(inputs, g.members[j])
        templates = self.templates[g]
        try:
            if device is None:
                raise _Bad("tensors on several devices")
            match, out, rec = _replayed(g, j, orig, args, kwargs, device, self.probe, templates)
        except _Unlike:  # (nothing ran yet: it is traced in full now, a template itself)
            if len(templates) < _MAX_TEMPLATES:
                return self._template(g, j, orig, args, kwargs)
            return orig(*args, **kwargs)
        except _Mismatch as e:  # traced in full next time, as are the templates of now
            g.templates = {j, *(t.index for t in templates)}
            g.off = len(g.templates) > _MAX_TEMPLATES
            raise self._abort(f"{g.paths[j]} differs from the members traced before it "
                              f"({e})") from None  # fmt: skip
        except Exception as e:  # noqa: BLE001  (whatever fails untraced: trace it in full)
            g.off = True
            raise self._abort(f"{g.paths[j]} could not be compared: {e}") from None
        key = f"{self.prefix}.{g.paths[j]}.{next(_COUNTER)}"
        BLOCK_OUTPUTS[key] = [(shape, stride, dtype, dev) for shape, stride, dtype, dev, _ in
                              match.outputs]  # fmt: skip
        made = torch.ops.semiring_backprop.block(inputs, key)
        if [t.requires_grad for t in made] != [lay[-1] for lay in match.outputs]:
            g.off = True
            raise self._abort(f"{g.paths[j]}: its outputs' requires_grad")
        self.stubs[key] = Stub(key, g, j, match)
        results = [o for o in dict.fromkeys(rec.origin[id(t)] for t in _leaves(out, []))
                   if o[0] == "result"]  # fmt: skip
        state = _state(g.members[j])

        def swap(t):
            origin = rec.origin[id(t)]
            if origin[0] == "input":
                return inputs[origin[1]]
            if origin[0] == "state":
                return state[origin[1]]
            return made[results.index(origin)]

        return _rebuild(out, swap)

    def _abort(self, why: str) -> Retry:
        self.retry = why
        return Retry(why)


_NONE = object()


def _try(rec, value):
    try:
        return rec.describe(value, objects=True)
    except _Bad as e:
        rec.bad = rec.bad or str(e)
        return None


def _made(rec, out) -> list | None:
    """The distinct tensors of ``out`` made inside the member, in order (None: a tensor
    of it comes from nowhere the record knows)."""
    made = []
    for t in _leaves(out, []):
        origin = rec.origin.get(id(t))
        if origin is None:
            return None
        if origin[0] == "result" and not any(t is m for m in made):
            made.append(t)
    return made


def _copyable(node, tracer) -> bool:
    """An op, a getitem, or a constant tensor read (lifted later as an input)."""
    if node.op == "call_function":
        return isinstance(node.target, torch._ops.OpOverload) or node.target.__name__ == "getitem"
    if node.op == "get_attr":
        return isinstance(getattr(tracer.root, node.target, None), torch.Tensor)
    return False


def _device(inputs, block):
    devices = {t.device for t in itertools.chain(inputs, _state(block).values())}
    return devices.pop() if len(devices) == 1 else None


def _replayed(g, j, orig, args, kwargs, device, probe, templates):
    """``(template, result, recorder)``: member ``j``'s forward replayed against the
    records of ``templates`` (:class:`_Recorder`), with no mode of the trace on but its
    fake tensors' (nothing enters the graph); the template whose record it matches
    whole. Raises :class:`_Mismatch` where it matches none."""
    from torch._guards import detect_fake_mode
    from torch.utils._python_dispatch import _disable_current_modes

    inputs = _leaves((args, kwargs), [])
    fake = detect_fake_mode(inputs)
    if fake is None:
        raise _Bad("no fake tensors")
    rec = _Recorder(g.paths[j], device, inputs, _state(g.members[j]), templates)
    rec.fake = fake
    entry = rec.describe((args, kwargs), objects=True)
    rec.templates = [t for t in templates if t.record[0] == entry]
    if not rec.templates:
        raise _Unlike("its inputs")
    modes = []
    while torch._C._len_torch_function_stack():
        modes.append(torch._C._pop_torch_function_stack())
    try:
        with _disable_current_modes(), fake:
            before = probe()
            with rec:
                out = orig(*args, **kwargs)
            if probe() != before:
                raise _Bad("a custom autograd Function or refused code")
    finally:
        for m in reversed(modes):
            torch._C._push_on_torch_function_stack(m)
    result = rec.describe(out, objects=True)
    n = len(rec.calls)
    match = [t for t in rec.templates if len(t.record[1]) == n and t.record[2] == result]
    if not match:
        raise _Mismatch("its result" if n else "its calls")
    return match[0], out, rec
