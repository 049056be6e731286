"""Paths and branch tables without holding every node: a pass keeps checkpoints, and
the values path reading asks for are computed again, one segment of the graph at a time.

The graph's nodes, in order, are cut into segments where few values cross the cut. A
pass with ``keep=None`` holds, besides what its rules read while it runs (as with
``keep=``, :mod:`liveness`):

- the forward values each segment reads from before it (its *frontier*), and
- the reverse pass's partial sums at each cut (copied as the pass crosses it).

Asking for a value or a ``D`` in segment ``s`` runs ``s``'s ops again from its frontier
and the pass over ``s`` again from the partial sums at its end: the same ops on the same
inputs in the same order, so the same values, bit for bit, as a pass that held every
node; D is computed again for the semiring asked for only. The last few segments asked
for are kept, so that reading a path (segment after segment, each looked at several
times) computes each segment about once.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.fx.node import map_arg

from ..errors import OutOfMemoryError
from ..graph import is_random
from ..tracing.trace import mark_op
from . import budget, liveness
from .reverse import propagate, reverse

#: False: a pass with ``keep=None`` holds every node instead (the same values)
ENABLED = True


#: whether passes started here are tapped (per thread and task: a pass elsewhere is not)
_TAPPING = contextvars.ContextVar("semiring_backprop_tapping", default=False)


@contextlib.contextmanager
def tapped():
    """Within the block, a checkpointed pass also hands over every node's forward value
    and D (``Checkpoints.taps``: the same values, held until :func:`untap`), for work
    that reads every segment once and would otherwise compute each again (a circuit).
    D only where such work on the same graph read it before (:func:`tap_reads`), once
    there is a record. Afterwards the pass holds only its checkpoints again. Only the
    passes of this thread (and asyncio task) are tapped."""
    token = _TAPPING.set(True)
    try:
        yield
    finally:
        _TAPPING.reset(token)


def tapping() -> bool:
    return _TAPPING.get()


def taps(values):
    """``(values, D)`` as dicts, where ``values`` (a result's) are a tapped pass's; else
    None. Every node's value is there; D only at the nodes :func:`tap_reads` named when
    the pass ran (every node's where it named none): the others are the checkpoints'."""
    return values.ckpt.taps if isinstance(values, _Values) else None


def tap_reads(graph, needed):
    """The nodes whose D a tapped pass over ``graph`` and ``needed`` hands over: those
    that work on an earlier tapped pass read (:func:`read_taps`); None (every node's)
    before any was read."""
    return graph.__dict__.get("_tap_reads", {}).get(needed)


def read_taps(graph, needed, nodes) -> None:
    """Record that ``nodes``' D was read from a tapped pass: later tapped passes over
    ``graph`` and ``needed`` hand it over (the set only grows)."""
    graph.__dict__.setdefault("_tap_reads", {}).setdefault(needed, set()).update(nodes)


def untap(values) -> None:
    """Let go of what a tapped pass handed over (its checkpoints stay)."""
    if isinstance(values, _Values):
        values.ckpt.taps = None


#: segments kept computed (a path reads a node's consumers: the next segment too; a
#: third saved no time on BERT-20's paths and layer table and held 4 MB more)
CACHED_SEGMENTS = 2
#: a symbolic size counts as this many elements when cuts are placed
_NOMINAL_SIZE = 64


@dataclass(frozen=True)
class Layout:
    bounds: tuple  #: segment s holds the node ids ``bounds[s]`` to ``bounds[s + 1] - 1``
    segment: dict  #: ops' node -> its segment
    frontier: frozenset  #: values some segment reads from before it


def usable(graph) -> bool:
    """Whether values can be computed again (no op draws random numbers)."""
    return not any(is_random(n) for n in graph.nodes if n.op == "call_function")


def layout(graph, needed) -> Layout:
    """Where the graph is cut (cached per graph and needed set)."""
    cache = graph.__dict__.setdefault("_checkpoint_layout", {})
    if needed not in cache:
        cache[needed] = _layout(graph, needed)
    return cache[needed]


def _layout(graph, needed) -> Layout:
    nodes, ids = graph.nodes, graph.ids
    n = len(nodes)
    ops = [i for i, node in enumerate(nodes) if node.op == "call_function"]
    if not ops:
        return Layout((0, n), {}, frozenset())
    first, last = ops[0], ops[-1] + 1
    # live[b]: bytes of op values made before id b and read at b or later
    live = [0.0] * (n + 1)
    for i in ops:
        node = nodes[i]
        end = max((ids[u] for u in node.users), default=i)
        if end > i:
            w = _bytes(node, graph)
            live[i + 1] += w
            live[end + 1] -= w
    for b in range(1, n + 1):
        live[b] += live[b - 1]
    k = max(1, min(64, round(math.sqrt(max(len(needed), 1)))))
    span = (last - first) / k
    cuts = []
    for j in range(1, k):
        lo = max(first + 1, round(first + (j - 0.25) * span), (cuts[-1] + 1) if cuts else 0)
        hi = min(last - 1, round(first + (j + 0.25) * span))
        if lo <= hi:
            cuts.append(min(range(lo, hi + 1), key=lambda b: (live[b], abs(b - first - j * span))))
    bounds = (0, *cuts, n)
    segment, frontier = {}, set()
    for s in range(len(bounds) - 1):
        a, b = bounds[s], bounds[s + 1]
        for node in nodes[a:b]:
            if node.op != "call_function":
                continue
            segment[node] = s
            frontier.update(
                x for x in node.all_input_nodes if x.op == "call_function" and ids[x] < a
            )
    return Layout(bounds, segment, frozenset(frontier))


def _bytes(node, graph) -> float:
    """Size of a node's value, from the trace (a symbolic size counts as nominal)."""
    if node in graph.static:
        return 0.0  # the weights' views: the same on every call, usually no memory
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    numel = 1
    for d in val.shape:
        numel *= int(d) if isinstance(d, int) else _NOMINAL_SIZE
    return float(numel * val.element_size())


class Checkpoints:
    """What a checkpointed pass holds, and each segment computed again on demand: its
    forward values once, and its D for one semiring at a time (what a path or a table
    of one semiring reads)."""

    def __init__(self, graph, needed, semirings, lay: Layout, held: dict, store: dict,
                 snaps: dict, reached: set):  # fmt: skip
        self.graph, self.needed, self.semirings, self.layout = graph, needed, semirings, lay
        self.held, self.held_store, self.snaps, self.reached = held, store, snaps, reached
        self.taps = None  #: (values, D) of every node, from a tapped pass (see tapped)
        self._values: OrderedDict = OrderedDict()  # segment -> its forward values
        self._d: OrderedDict = OrderedDict()  # (segment, semiring index) -> its D

    # Views made on demand and not kept: a view kept here would point back at this
    # object, a cycle that only the cyclic garbage collector frees, so a loop of passes
    # held every finished pass's values (GBs) until a full collection came.
    @property
    def values(self) -> _Values:
        """The forward values, as a mapping (segments computed again when read)."""
        return _Values(self)

    @property
    def store(self) -> _Store:
        """D per node, as a mapping (segments' D computed again when read)."""
        return _Store(self)

    def segment_values(self, s: int) -> dict:
        """Forward values of segment ``s``'s ops."""
        if s not in self._values:
            a, b = self.layout.bounds[s], self.layout.bounds[s + 1]
            with torch.no_grad():
                self._values[s] = self._forward(a, b)
            while len(self._values) > CACHED_SEGMENTS:
                self._values.popitem(last=False)
        self._values.move_to_end(s)
        return self._values[s]

    def segment_d(self, s: int, k: int) -> dict:
        """``{node: D}`` of semiring ``k`` for segment ``s``'s nodes."""
        key = (s, k)
        if key not in self._d:
            a, b = self.layout.bounds[s], self.layout.bounds[s + 1]
            # (a rule may read a value of another segment: the structural zeros of
            # engine.structure, found again there, read a mask's condition)
            both = _Chain(self.segment_values(s), self.values)
            snap = self.snaps.get(b - 1) or {}
            acc = {n: [slot[k]] for n, slot in snap.items() if slot[k] is not None}
            sr = [self.semirings[k]]
            with torch.no_grad():
                store = propagate(self.graph, both, sr, acc, self.needed, start=b, stop=a)
            self._d[key] = {n: d[0] for n, d in store.items()}
            while len(self._d) > CACHED_SEGMENTS * len(self.semirings):
                self._d.popitem(last=False)
        self._d.move_to_end(key)
        return self._d[key]

    def _forward(self, a: int, b: int) -> dict:
        vals: dict = {}
        get = lambda n: vals[n] if n in vals else self.held[n]  # noqa: E731
        for node in self.graph.nodes[a:b]:
            if node.op != "call_function":
                continue
            args, kwargs = map_arg(node.args, get), map_arg(node.kwargs, get)
            vals[node] = args[0] if node.target is mark_op else node.target(*args, **kwargs)
        return vals


class _Chain(Mapping):
    """A segment's values, then the held ones (what the segment's rules read)."""

    def __init__(self, first: dict, second: dict):
        self.first, self.second = first, second

    def __getitem__(self, node):
        return self.first[node] if node in self.first else self.second[node]

    def __contains__(self, node):
        return node in self.first or node in self.second

    def __iter__(self):
        yield from self.first
        yield from (n for n in self.second if n not in self.first)

    def __len__(self):
        return sum(1 for _ in self)


class _Values(Mapping):
    """Node -> forward value: a held one, else its segment's (computed on demand)."""

    def __init__(self, ckpt: Checkpoints):
        self.ckpt = ckpt

    def __getitem__(self, node):
        c = self.ckpt
        if node in c.held:
            return c.held[node]
        s = c.layout.segment.get(node)
        if s is None:
            raise KeyError(node)
        return c.segment_values(s)[node]

    def __contains__(self, node):
        return node in self.ckpt.held or node in self.ckpt.layout.segment

    def __iter__(self):  # graph order: each segment computed once
        return (n for n in self.ckpt.graph.nodes if n in self)

    def __len__(self):
        return sum(1 for _ in self)


class _Store(Mapping):
    """Node -> its D per semiring (a :class:`_Row`, computed on demand per semiring)."""

    def __init__(self, ckpt: Checkpoints):
        self.ckpt = ckpt

    def __getitem__(self, node):
        if node not in self:
            raise KeyError(node)
        return _Row(self.ckpt, node)

    def __contains__(self, node):
        return node in self.ckpt.reached

    def __iter__(self):
        return (n for n in self.ckpt.graph.nodes if n in self.ckpt.reached)

    def __len__(self):
        return len(self.ckpt.reached)


class _Row(Sequence):
    """One node's D, one entry per semiring, each computed when first read."""

    def __init__(self, ckpt: Checkpoints, node):
        self.ckpt, self.node = ckpt, node

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(len(self))[k]]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        c = self.ckpt
        if self.node in c.held_store:
            return c.held_store[self.node][k]
        return c.segment_d(c.layout.segment[self.node], k % len(self))[self.node]

    def __len__(self):
        return len(self.ckpt.semirings)


def run(graph, forward_run, semirings, needed, inputs: frozenset, *, flags=None,
        check_budget=True):  # fmt: skip
    """A checkpointed pass: ``forward_run(drop)`` computes the forward values (dropping
    ``drop``); returns the :class:`Checkpoints` (its ``values`` and ``store``: every
    node's, on demand). ``flags``: see :func:`reverse`; ``check_budget=False``: no
    refusal of a pass too large (a pass captured as a CUDA graph was checked before)."""
    lay = layout(graph, needed)
    kept = lay.frontier | inputs
    tap = tapping()
    values = forward_run(None if tap else liveness.unread_values(graph, needed, kept))
    held = {n: values[n] for n in (*lay.frontier, *graph.constants, *graph.user_inputs.values())}
    held[graph.output_node] = values[graph.output_node]
    snaps, reached = dict.fromkeys(b - 1 for b in lay.bounds[1:]), set()
    at = None
    if tap:  # D where work on an earlier tapped pass read it (the rest: from checkpoints)
        at = tap_reads(graph, needed)
        at = None if at is None else frozenset(at) | inputs
    if check_budget:
        try:
            budget.check(graph, values, semirings, needed, at if tap else kept)
        except OutOfMemoryError as e:
            if not tap or not getattr(e, "budget", None):
                raise
            raise _tapped_refusal(*e.budget) from None
    store = reverse(graph, values, semirings, graph.output_node, None if tap else kept, snaps,
                    reached, flags=flags, store_at=at)  # fmt: skip
    ckpt = Checkpoints(graph, needed, semirings, lay, held,
                       {n: d for n, d in store.items() if n in inputs}, snaps, reached)  # fmt: skip
    if tap:
        ckpt.taps = (values, store)
    return ckpt


def _tapped_refusal(need, free, device, names) -> OutOfMemoryError:
    gib = 2**30
    return OutOfMemoryError(
        f"a circuit reads every node's value of its pass and D where it reads it (at "
        f"every node on a trace's first circuit), which needs at least {need / gib:.2f} "
        f"GiB for the D values alone ({names}), and {free / gib:.2f} GiB "
        f"is free on {device}. What uses less: one semiring (semirings=[sbp.Real()] or "
        "[sbp.MaxProduct()]); float32 instead of float64; a shorter input. "
        "SEMIRING_BACKPROP_MEMORY=BYTES sets the budget."
    )


def copied(ckpt: Checkpoints, copy) -> Checkpoints:
    """``ckpt`` with every tensor it holds replaced by ``copy(value)`` (a pass replayed
    as a CUDA graph hands out copies of what its graph's memory holds)."""
    held = {n: copy(v) for n, v in ckpt.held.items()}
    store = {n: [copy(v) for v in d] for n, d in ckpt.held_store.items()}
    snaps = {
        i: None if snap is None else {n: [copy(v) for v in slot] for n, slot in snap.items()}
        for i, snap in ckpt.snaps.items()
    }  # fmt: skip
    return Checkpoints(ckpt.graph, ckpt.needed, ckpt.semirings, ckpt.layout, held, store,
                       snaps, set(ckpt.reached))  # fmt: skip
