"""On a GPU, a pass replayed as one CUDA graph.

A pass issues every rule of the traced graph from Python, each semiring field its own
kernel: on a GPU, at the lengths researchers explain, launching them costs more than
running them (BERT base at 512 tokens: 13 ms of autograd against 80 ms of ``Real``).
Once a ``Backprop`` has run the same graph on inputs of the same shapes, strides,
dtypes and devices, with the same ``keep=``, the next call captures the pass (forward
values and reverse pass) into a :class:`torch.cuda.CUDAGraph`, and every later such
call copies its inputs into the graph's own and replays it: the same kernels on the same
addresses in the same order, so the same bits as the pass run from Python.

What may not differ between calls is fixed by the key: the graph (its weights are read
where they live, so writes to them are seen; prepared weights are part of the key), the
semirings, the kept nodes and the inputs' layout. Inputs that are not tensors must equal
the captured call's. A pass that cannot be captured (it reads a value on the host, its
inputs are not all on one CUDA device) runs from Python as before, and is not tried
again. What a replay returns is copied out of the graph's memory, so a result stays
what it was when a later call replays the graph.

Checks stay: the forward's non-finite check and the reverse pass's overflow statistics
are computed inside the graph and read after each replay; when one fails, the call runs
again from Python, which names the node as an uncaptured pass does.

Passes with ``keep=None`` are captured too: their checkpoints (the values and partial
sums from which paths and tables compute segments again) are copied out of the graph's
memory after each replay.

Each captured pass holds a private memory pool about the size of the pass's peak, for as
long as it is kept: at most :data:`PER_MODEL` per model and output function, the least
recently used let go first.

Capture is on by default: ``Backprop(cuda_graphs=False)`` or the environment variable
``SEMIRING_BACKPROP_CUDA_GRAPHS=0`` turns it off (a pass then always runs from Python).
``tests/test_cuda.py`` compares replays with the pass run from Python for every semiring
on BERT, GPT-2 and Llama (``keep=`` and ``keep=None``), across lengths, weight writes and
non-finite inputs.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import threading

import torch
from torch.utils import _pytree as pytree

from .. import kernels
from ..errors import SemiringBackpropError, is_out_of_memory
from ..semirings.base import retype
from . import checkpoints, forward
from .hooks import check_flags
from .reverse import reverse

log = logging.getLogger(__name__)

#: captured passes kept per model and output function (each holds its memory pool)
PER_MODEL = 4
#: calls with the same key before one is captured (the first one runs from Python:
#: kernels compile, prepared weights are made, lazy state is set up)
CAPTURE_AT = 2


def enabled_by_default() -> bool:
    """On unless ``SEMIRING_BACKPROP_CUDA_GRAPHS`` is ``0`` (``false``, ``no``, ``off``)."""
    return os.environ.get("SEMIRING_BACKPROP_CUDA_GRAPHS", "1").strip().lower() not in (
        "0", "false", "no", "off",
    )  # fmt: skip


def available() -> bool:
    """Whether passes can be captured here at all (a CUDA device is present)."""
    return torch.cuda.is_available()


class Passes:
    """The captured passes of one model and output function, and how often each key was
    seen (``Backprop`` keeps one per traced model)."""

    def __init__(self):
        self.captured: collections.OrderedDict = collections.OrderedDict()
        self.seen: collections.Counter = collections.Counter()
        self.failed: set = set()
        self.why_not = ""  # why the last capture that failed did
        self.lock = threading.Lock()

    def saw(self, graph, semirings, kept, args, kwargs) -> None:
        """Count a call that runs from Python before ``run`` is asked (the one that
        checks a new trace against the model): the next call with its key is captured."""
        key = _key(graph, semirings, kept, args, kwargs)
        if key is not None:
            with self.lock:
                self.seen[key] += 1

    def run(self, graph, semirings, kept, step, copy_out, args, kwargs):
        """What ``step`` returned, computed by a replay and copied out of the graph's
        memory, or None: run the pass from Python.

        ``step(args, kwargs)`` runs the pass and returns ``(out, flags, confirm)``: what
        the pass holds, its overflow statistics and its forward's ``confirm`` (see
        ``forward.run_deferred``); ``copy_out(out)`` copies what a replay computed out of
        the graph's memory. ``kept`` is part of the key (None: checkpoints)."""
        key = _key(graph, semirings, kept, args, kwargs)
        if key is None:
            return None
        with self.lock:
            if key in self.failed:
                return None
            entry = self.captured.get(key)
            if entry is None:
                if len(self.seen) > 4096:  # keys of graphs long gone
                    self.seen.clear()
                self.seen[key] += 1  # (the first call may have been counted by `saw`)
                if self.seen[key] < CAPTURE_AT:
                    return None
                entry = self._capture(key, graph, semirings, kept, step, args, kwargs)
                if entry is None:
                    return None
            self.captured.move_to_end(key)
        return entry.replay(args, kwargs, copy_out)

    def _capture(self, key, graph, semirings, kept, step, args, kwargs):
        try:
            entry = CapturedPass(graph, semirings, kept, step, args, kwargs)
        except Exception as e:
            if isinstance(e, SemiringBackpropError):  # the pass itself refuses: say so
                raise
            self.failed.add(key)
            self.why_not = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log.info("the pass is not captured as a CUDA graph (%s); it runs from Python",
                     self.why_not)  # fmt: skip
            if is_out_of_memory(e):
                torch.cuda.empty_cache()
            return None
        self.captured[key] = entry
        while len(self.captured) > PER_MODEL:
            self.captured.popitem(last=False)
        return entry

    def describe(self) -> list[dict]:
        """One row per captured pass: input shapes, semirings, pool size."""
        return [e.describe() for e in self.captured.values()]

    def clear(self) -> None:
        with self.lock:
            self.captured.clear()
            self.seen.clear()
            self.failed.clear()


def _key(graph, semirings, kept, args, kwargs):
    """What must equal the captured call's for a replay to compute this call; None where
    the call cannot be captured (inputs not all on one CUDA device, unhashable leaves)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    layout, devices = [], set()
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.layout is not torch.strided or leaf.is_nested:
                return None
            devices.add(leaf.device)
            layout.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device))
        else:
            layout.append(("value", type(leaf), leaf))
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    key = (id(graph), id(graph.prepared), tuple(semirings), kept, str(spec), tuple(layout))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class CapturedPass:
    """One pass of ``graph`` for inputs of one layout, captured as a CUDA graph."""

    def __init__(self, graph, semirings, kept, step, args, kwargs):
        # held so that what the captured kernels read stays where it is
        self.graph, self.prepared, self.kept = graph, graph.prepared, kept
        self.semirings = list(semirings)
        self.lock = threading.Lock()
        leaves, self.spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self.static = [
            torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
            if isinstance(x, torch.Tensor) else x
            for x in leaves
        ]  # fmt: skip
        s_args, s_kwargs = pytree.tree_unflatten(self.static, self.spec)
        device = next(x.device for x in self.static if isinstance(x, torch.Tensor))
        with torch.cuda.device(device), torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # lazy set-up and recompiles happen here
                step(s_args, s_kwargs)
            torch.cuda.current_stream().wait_stream(side)
            # torch.cuda.graph empties the cache before capturing: do it first, so that
            # what the capture reserves is measured apart from what the warm-up freed
            torch.cuda.synchronize(device)
            gc.collect()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(device)
            self.cuda_graph = torch.cuda.CUDAGraph()
            with (
                kernels.no_new_compiles(),
                torch.cuda.graph(self.cuda_graph, capture_error_mode="thread_local"),
            ):
                self.out = step(s_args, s_kwargs)
            self.pool_bytes = torch.cuda.memory_reserved(device) - before
        self.shapes = [tuple(x.shape) for x in self.static if isinstance(x, torch.Tensor)]

    def replay(self, args, kwargs, copy_out):
        """``copy_out(out)`` of the pass replayed on these inputs; None where a check
        failed (the caller runs the pass from Python, which names the node)."""
        leaves, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
        with self.lock:
            for mine, x in zip(self.static, leaves, strict=True):
                if isinstance(mine, torch.Tensor):
                    mine.copy_(x)
            self.cuda_graph.replay()
            out, flags, confirm = self.out
            if not _fine(self.graph, flags, confirm):
                return None
            return copy_out(out)

    def describe(self) -> dict:
        return {
            "input shapes": self.shapes,
            "semirings": [s.name for s in self.semirings],
            "kept": None if self.kept is None else sorted(n.name for n in self.kept),
            "pool MB": round(self.pool_bytes / 2**20, 1),
        }


def kept_pass(graph, semirings, kept, drop):
    """The ``step`` of a ``keep=`` pass: the kept values (and the output) and D."""

    def step(args, kwargs):
        flags: list = []
        values, confirm = forward.run_deferred(graph, args, kwargs, drop)
        store = reverse(graph, values, semirings, graph.output_node, kept, flags=flags)
        held = {n: values[n] for n in (*kept, graph.output_node) if n in values}
        return (held, store), flags, confirm

    def copy_out(out):
        held, store = out
        return {n: copy(v) for n, v in held.items()}, {
            n: [copy(v) for v in d] for n, d in store.items()
        }

    return step, copy_out


def checkpointed_pass(graph, semirings, needed):
    """The ``step`` of a ``keep=None`` pass: its checkpoints (``checkpoints.run``)."""

    def step(args, kwargs):
        flags, confirms = [], []

        def forward_run(drop):
            values, confirm = forward.run_deferred(graph, args, kwargs, drop)
            confirms.append(confirm)
            return values

        inputs = frozenset(graph.user_inputs.values())
        ckpt = checkpoints.run(graph, forward_run, semirings, needed, inputs, flags=flags,
                               check_budget=False)  # fmt: skip
        return ckpt, flags, confirms[0]

    return step, lambda ckpt: checkpoints.copied(ckpt, copy)


def _fine(graph, flags, confirm) -> bool:
    """Whether the replay's forward values were finite and its D did not overflow (reads
    the flags the graph computed: one wait for the device)."""
    if confirm.finite is not None and not bool(confirm.finite):
        return False
    try:
        check_flags(graph, flags, "pass")
    except SemiringBackpropError:
        return False
    return True


def copy(value):
    """A semiring value (or a tensor) copied out of a graph's memory."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return retype(value, tuple(copy(f) for f in value))
    return value
