"""``backprop``: trace, run forward, run the reverse pass, return a :class:`Result`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from . import allocator, engine, forward, memory, rules
from .errors import InputError
from .result import Result, resolve_keep
from .semirings import Real, Semiring
from .tracing import input_tensors, trace


def backprop(
    model,
    args=(),
    kwargs: dict | None = None,
    output: Callable | None = None,
    semirings: Sequence[Semiring] = (Real(),),
    *,
    whole: tuple[str, ...] = (),
    keep: Sequence | None = None,
    allow_training: bool = False,
    per_example: bool = False,
) -> Result:
    """Semiring backpropagation of ``output(model(*args, **kwargs))``.

    Args:
        model: an ``nn.Module`` (in eval mode) or a plain callable of tensors.
        args, kwargs: example inputs, exactly as the model takes them.
        output: picks the scalar to explain from the model's output.
        semirings: computed together in one pass.
        whole: composite ops to keep whole (``"softmax"``, ``"log_softmax"``,
            ``"layer_norm"``, ``"gelu"``); by default they are decomposed.
        keep: the places whose values the result keeps (inputs, module paths, with
            ``:input`` and ``*`` wildcards: ``("inputs_embeds", "*.attention:input")``);
            everything else is freed during the pass. ``None`` (default) keeps every
            node, which paths and branch tables need.
        allow_training: explain a model in training mode as it is (random edges).
        per_example: allow a 1-D output of per-example scalars (examples must not
            interact); all are seeded at once.

    >>> res = backprop(mlp, (x,), output=lambda y: y[0, 1], semirings=[Real(), Entropy()])
    >>> res.at(0, Real())  # == torch.autograd.grad(mlp(x)[0, 1], x)
    """
    return Backprop(
        model, output, semirings, whole=whole, keep=keep, allow_training=allow_training,
        per_example=per_example, weight_cache=0, dynamic=False,
    )(args, kwargs)  # fmt: skip


class Backprop:
    """A reusable explainer: traces once, then only runs the pass.

    The trace has symbolic sizes (``dynamic=True``): one graph serves inputs of any
    sequence length (and batch size, when traced with a batch of 2 or more) with the
    same structure, dtypes and devices. ``output`` is traced into the graph, so it must
    be a fixed function of the model's output (its indices become constants; a negative
    index such as ``logits[0, -1]`` follows the length): make one ``Backprop`` per
    output function, or pass a varying position as a tensor input of a wrapper.
    The model's parameters are checked on every call (same tensors, not modified in
    place); if they changed, the model is traced again.

    ``keep`` (places, as for :meth:`Result.at`, with ``*`` wildcards) keeps only those
    values and frees the rest during the pass, for memory; paths and branch tables
    need every value (``keep=None``, the default).

    ``weight_cache`` (bytes, default 1 GiB; 0 turns it off): what contractions derive
    from a weight alone (``log |w|`` for ``Entropy`` and ``MaxAbs``, a transposed copy for
    ``MaxProduct``) is kept across calls, up to this size. It trades memory for time;
    the values are the same either way.

    On its first call, on glibc, malloc is set to reuse freed host memory instead of
    returning it to the system (:mod:`semiring_backprop.allocator`: faster by a third
    on a CPU, no value changes); ``SEMIRING_BACKPROP_TUNE_MALLOC=0`` leaves it alone.

    >>> bp = Backprop(model, output=lambda out: out.logits[0, -1, 5], semirings=[Real()])
    >>> for ids in batches:
    ...     res = bp(kwargs={"input_ids": ids})
    """

    def __init__(
        self,
        model,
        output: Callable | None = None,
        semirings: Sequence[Semiring] = (Real(),),
        *,
        whole: tuple[str, ...] = (),
        keep: Sequence | None = None,
        allow_training: bool = False,
        per_example: bool = False,
        weight_cache: int = 2**30,
        dynamic: bool = True,
    ):
        semirings = list(semirings)
        if not semirings or not all(isinstance(s, Semiring) for s in semirings):
            raise InputError(
                f"semirings must be a non-empty list of Semiring instances, got {semirings!r}"
            )
        if len(set(semirings)) != len(semirings):
            raise InputError(f"semirings contains duplicates: {semirings}")
        self.model, self.output, self.semirings = model, output, semirings
        self.whole, self.allow_training = tuple(whole), allow_training
        self.per_example = per_example
        if isinstance(keep, str | int):
            keep = (keep,)
        self.keep = None if keep is None else tuple(keep)
        self.weight_cache, self.dynamic = int(weight_cache), dynamic
        self._graphs: dict = {}  # signature -> graphs traced for it
        self._stamp = self._prepared = None

    def graph(self, args=(), kwargs: dict | None = None):
        """The traced graph for inputs like these (traced on first use).

        With ``dynamic`` (default), a graph is traced with symbolic sizes and serves
        every input of the same structure, dtypes and devices whose sizes fit it
        (sentences of any length, usually); inputs that do not fit are traced again.
        """
        args = tuple(args) if isinstance(args, tuple | list) else (args,)
        kwargs = dict(kwargs or {})
        key = _signature(args, kwargs)
        stamp = _stamp(self.model)
        if stamp != self._stamp:  # new or modified weights: every trace is stale
            self._graphs, self._stamp = {}, stamp
            self._prepared = rules.Prepared(self.weight_cache) if self.weight_cache else None
        given = input_tensors(args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        for graph in self._graphs.get(key, ()):
            if graph.accepts(given, leaves):
                return graph
        graph = trace(
            self.model, args, kwargs, self.output, whole=self.whole,
            allow_training=self.allow_training, dynamic=self.dynamic,
        )  # fmt: skip
        _check_output(graph, self.per_example)
        graph.prepared = self._prepared
        self._graphs.setdefault(key, []).append(graph)
        return graph

    @property
    def traces(self) -> int:
        """How many graphs are traced now (for the current weights)."""
        return sum(len(graphs) for graphs in self._graphs.values())

    def __call__(self, args=(), kwargs: dict | None = None) -> Result:
        args = tuple(args) if isinstance(args, tuple | list) else (args,)
        kwargs = dict(kwargs or {})
        allocator.auto()  # freed host memory reused, not faulted in again (see allocator)
        graph = self.graph(args, kwargs)
        kept = None if self.keep is None else resolve_keep(graph, self.keep)
        drop = None  # with keep=, values no rule reads are not kept through the forward
        if kept is not None:
            drop = memory.unread_values(graph, engine.needed_nodes(graph, graph.output_node), kept)
        with torch.no_grad():
            values = forward.run(graph, args, kwargs, drop)
            store = engine.reverse(graph, values, self.semirings, graph.output_node, kept)
        if kept is not None:
            values = {n: v for n, v in values.items() if n in kept}
        return Result(graph, values, store, self.semirings, kept=kept)


def _signature(args, kwargs):
    """What every graph traced for these inputs shares: structure, tensor ranks, dtypes
    and devices, and the values of non-tensor arguments (sizes are checked by
    ``Graph.accepts``)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig, first = [], {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):  # and which inputs are one tensor (mha(x, x, x))
            sig.append(("T", leaf.dim(), leaf.dtype, leaf.device, first.setdefault(id(leaf), i)))
        else:
            try:
                hash(leaf)
                sig.append(("V", type(leaf).__name__, leaf))
            except TypeError:
                sig.append(("I", id(leaf)))
    return (str(spec), tuple(sig))


def _stamp(model):
    """Identity and in-place version of every parameter and buffer, and the mode."""
    if not isinstance(model, torch.nn.Module):
        return (id(model),)
    stamp = []  # one walk over the modules (parameters() and buffers() walk it again)
    for m in model.modules():
        stamp.append(m.training)
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                stamp.append((id(t), t.data_ptr(), t._version))
    return tuple(stamp)


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
