"""Identical blocks traced once.

A transformer repeats one block (a layer) many times, and torch.export traces each one
anew: most of a first call's time. While a model is exported, the members of a *group*
(those of an ``nn.ModuleList`` or ``nn.Sequential`` alike in class and structure) are
handled so: the first one called is traced as usual, and the torch functions its
``forward`` calls are recorded (:class:`.record.Recorder`). Each later member's
``forward`` runs outside the trace, on its fake tensors, replayed against that record:
each call is compared with the template's at the same place and, where equal, answered
with new tensors of the layouts the template's call returned, without running it. A
member whose code made the same calls, on tensors of the same layouts and origins, has
the template's trace with its own parameters and inputs: the export holds a stand-in
(``ops.block``) with the member's inputs and outputs, and :func:`.stitch.stitch` puts
that copy in its place. The program is the one a full trace gives (``tests/test_blocks.py``
compares them whole on every model family the tests build).

A member whose inputs differ from every template's (the first block's input may not
require grad, the next one's does) is traced in full where it comes, a template itself.
One whose calls differ once its code ran (a block that scales by another constant)
aborts the export, which starts again with that member a template too (:class:`Retry`).
A group whose members cannot be compared (a value the record cannot hold, a tensor read
from outside the block) is traced in full, and so is the whole model where an export
with stand-ins fails (a later module read what only a full trace of a member makes).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field

import torch

from .ops import BLOCK_OUTPUTS
from .record import Bad, Mismatch, Recorder, Unlike, leaves, rebuild, replayed

_MAX_TEMPLATES = 3  # members of one group traced in full before the group is given up
MAX_ATTEMPTS = 3  # exports of one trace aborted to trace a member in full, at most
#: node meta: the template a node belongs to; ``(template, i)`` of its inputs, outputs
REGION, INPUTS, OUTPUTS = "sbp_region", "sbp_inputs", "sbp_outputs"
_COUNTER = itertools.count()  # stand-in keys unique within the process


class Retry(Exception):
    """The export is to start again: a member of a group is not a copy of a template."""


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
        self.owner = threading.get_ident()  # (another thread running the model meanwhile
        # runs it as it is)

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
            if g.off or j in called or threading.get_ident() != self.owner:
                return orig(*args, **kwargs)  # (a member called twice: traced as it is)
            called.add(j)
            if j in g.templates or not self.templates.get(g):
                return self._template(g, j, orig, args, kwargs)
            return self._stub(g, j, orig, args, kwargs)

        return forward

    def _template(self, g, j, orig, args, kwargs):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

        mode = get_proxy_mode()
        inputs = leaves((args, kwargs), [])
        device = _device(inputs, g.members[j])
        if mode is None or device is None:
            g.off = True  # (not under torch.export, or tensors on several devices)
            return orig(*args, **kwargs)
        tracer = mode.tracer
        nodes = [get_proxy_slot(t, tracer, None) for t in inputs]
        rec = Recorder(g.paths[j], device, inputs, _state(g.members[j]))
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
        inputs = leaves((args, kwargs), [])
        device = _device(inputs, g.members[j])
        templates = self.templates[g]
        try:
            if device is None:
                raise Bad("tensors on several devices")
            match, out, rec = replayed(g.paths[j], _state(g.members[j]), orig, args, kwargs,
                                       device, self.probe, templates)  # fmt: skip
        except Unlike:  # (nothing ran yet: it is traced in full now, a template itself)
            if len(templates) < _MAX_TEMPLATES:
                return self._template(g, j, orig, args, kwargs)
            return orig(*args, **kwargs)
        except Mismatch as e:  # traced in full next time, as are the templates of now
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
        results = [o for o in dict.fromkeys(rec.origin[id(t)] for t in leaves(out, []))
                   if o[0] == "result"]  # fmt: skip
        state = _state(g.members[j])

        def swap(t):
            origin = rec.origin[id(t)]
            if origin[0] == "input":
                return inputs[origin[1]]
            if origin[0] == "state":
                return state[origin[1]]
            return made[results.index(origin)]

        return rebuild(out, swap)

    def _abort(self, why: str) -> Retry:
        self.retry = why
        return Retry(why)


_NONE = object()


def _try(rec, value):
    try:
        return rec.describe(value, objects=True)
    except Bad as e:
        rec.bad = rec.bad or str(e)
        return None


def _made(rec, out) -> list | None:
    """The distinct tensors of ``out`` made inside the member, in order (None: a tensor
    of it comes from nowhere the record knows)."""
    made = []
    for t in leaves(out, []):
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
