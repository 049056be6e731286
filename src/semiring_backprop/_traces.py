"""The traces that :func:`~semiring_backprop.backprop` and a
:class:`~semiring_backprop.Backprop` keep: per model and output function, the graphs
traced for each input signature, made again when the model or what its code reads
changes (:mod:`.tracing.reuse` says what is compared), and the lock every trace is made
under."""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils import _pytree as pytree

from . import rules
from .engine import graphed
from .errors import InputError
from .tracing import reuse
from .tracing.trace import input_tensors, trace


class _Traces:
    """The graphs traced for one model and output function, by input signature, and the
    weights they were traced with. ``weak``: the model is held by a weak reference (the
    traces :func:`backprop` keeps must not keep a model alive)."""

    def __init__(self, model, output, options, weight_cache=0, dynamic=None, *, weak=False,
                 limit=None):  # fmt: skip
        self._model = weakref.ref(model) if weak else (lambda: model)
        self.output, self.options = output, options
        self.weight_cache, self.dynamic = weight_cache, dynamic
        self.limit = limit  # most graphs kept per input signature (None: all)
        self.graphs: dict = {}  # signature -> graphs traced for it
        self.stamp = self.prepared = self.samples = None
        self.passes = graphed.Passes()  # passes captured as CUDA graphs

    @property
    def model(self):
        return self._model()

    @property
    def count(self) -> int:
        return sum(len(graphs) for graphs in self.graphs.values())

    def set_prepared(self, samples=None) -> None:
        """A fresh store of prepared weights, for every graph (``samples``: the model's
        ``reuse.samples`` now, if known)."""
        self.prepared = rules.Prepared(self.weight_cache) if self.weight_cache else None
        self.passes.clear()  # captured with the graphs and prepared weights of before
        if self.prepared is not None:
            self.samples = reuse.samples(self.model) if samples is None else samples
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.prepared = self.prepared

    def graph(self, args: tuple, kwargs: dict):
        with _LOCK:  # two threads' first calls: one traces, the other finds its graph
            return self._graph(args, kwargs)

    def _graph(self, args: tuple, kwargs: dict):
        model = self.model
        key = reuse.signature(args, kwargs)
        stamp = reuse.stamp(model)
        if stamp != self.stamp:  # the model or what its code reads changed: all are stale
            self.graphs, self.stamp = {}, stamp
            self.set_prepared()
        elif self.prepared is not None:  # writes the version counter does not see
            samples = reuse.samples(model)
            if not torch.equal(samples, self.samples):
                self.set_prepared(samples)
        given = input_tensors(args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        for graph in self.graphs.get(key, ()):
            if graph.accepts(given, leaves):
                return graph
        opts = self.options
        dynamic = self.dynamic
        if dynamic is None:  # exact shapes first (faster to trace); symbolic once they vary
            dynamic = bool(self.graphs.get(key))
        graph = trace(
            model, args, kwargs, self.output, whole=opts["whole"],
            allow_training=opts["allow_training"], dynamic=dynamic,
            paper=opts.get("paper", False),
        )  # fmt: skip
        _check_output(graph, opts["per_example"])
        graph.prepared = self.prepared
        graph.weights = opts.get("weights", "gradient")  # (engine.relevance reads it)
        if self.limit is not None and any(part[0] == "I" for part in key[1]):
            return graph  # an argument known by identity only: not kept (ids are reused)
        kept = self.graphs.setdefault(key, [])
        kept.append(graph)
        if self.limit is not None and len(kept) > self.limit:
            del kept[0]
        return graph


#: held while a kept trace is looked up or made (by every thread, for every model: tracing
#: patches torch's global state, so two traces at once would break each other)
_LOCK = threading.RLock()
#: model -> {(output key, options): _Traces}, most recently used last
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KEPT_PER_MODEL = 8  # output functions per model
_GRAPHS_PER_SIGNATURE = 8  # input shapes per output function


def _kept_traces(model, output, options) -> _Traces | None:
    """The traces :func:`backprop` keeps for this model and output function (made on
    first use), or None where they cannot be keyed safely."""
    with _LOCK:  # the dict of kept traces is shared by every thread
        try:
            key = (reuse.function_key(output), tuple(sorted(options.items())))
            hash(key)
            per_model = _KEPT.setdefault(model, {})
        except (reuse.Unkeyed, TypeError):  # not comparable by value, or no weak reference
            return None
        try:
            traces = per_model.pop(key)
        except KeyError:
            limit = _GRAPHS_PER_SIGNATURE
            traces = _Traces(model, output, options, 0, False, weak=True, limit=limit)
        traces.output = output  # the same code and constants; this call's object
        per_model[key] = traces  # most recently used last
        while len(per_model) > _KEPT_PER_MODEL:
            del per_model[next(iter(per_model))]
    return traces


def _check_output(graph, per_example: bool):
    outputs = graph.user_outputs
    if len(outputs) != 1:
        raise InputError(
            f"output(model(...)) returned {len(outputs)} tensors (a tuple or a model output "
            "object); pick one scalar, e.g. output=lambda out: out.logits[0, -1, token_id]"
        )
    node = graph.output_node
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
    if not isinstance(val, torch.Tensor):
        raise InputError(
            f"output(model(...)) must return a tensor, got {type(val).__name__}; "
            "e.g. output=lambda out: out.logits[0, -1, token_id]"
        )
    if not val.is_floating_point():
        raise InputError(f"output(model(...)) is a {val.dtype} tensor; it must be float")
    ok = val.dim() == 0 or (per_example and val.dim() == 1)
    if not ok:
        raise InputError(
            f"output(model(...)) has shape {tuple(val.shape)}; it must be a scalar "
            "(e.g. output=lambda out: out[0, 1] or out.sum()), or a 1-D tensor of "
            "per-example scalars with per_example=True"
        )
