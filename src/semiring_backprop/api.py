"""``backprop``: trace, run forward, run the reverse pass, return a :class:`Result`."""

from __future__ import annotations

import dis
import functools
import types
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from . import (
    allocator,
    budget,
    checkpoints,
    engine,
    forward,
    independence,
    memory,
    rules,
    trace_checks,
)
from .errors import InputError, OutOfMemoryError, SemiringBackpropError, is_out_of_memory
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
    reuse: bool = True,
) -> Result:
    """Semiring backpropagation of ``output(model(*args, **kwargs))``.

    Args:
        model: an ``nn.Module`` (in eval mode) or a plain callable of tensors.
        args: example positional inputs, exactly as the model takes them.
        kwargs: example keyword inputs, exactly as the model takes them.
        output: picks the scalar to explain from the model's output.
        semirings: computed together in one pass.
        whole: composite ops to keep whole (``"softmax"``, ``"log_softmax"``,
            ``"layer_norm"``, ``"gelu"``); by default they are decomposed.
        keep: the places whose values the result keeps (inputs, module paths, with
            ``:input`` and ``*`` wildcards: ``("inputs_embeds", "*.attention:input")``);
            everything else is freed during the pass. ``None`` (default): every
            node's value can be read (paths and branch tables read many): the pass
            holds checkpoints and computes the rest again when asked
            (``semiring_backprop.checkpoints``).
        allow_training: explain a model in training mode as it is (random edges).
        per_example: allow a 1-D output of per-example scalars, all seeded at once. The
            examples must not interact: every call runs each one alone and raises if
            its output differs from its output in the batch (``independence``).
        reuse: reuse the trace of an earlier call (see below); ``False`` traces anew.

    A call traces the model for these inputs' shapes; a later call with the same model
    object, an output function of the same code and equal constants, the same
    ``whole``, ``allow_training`` and ``per_example``, and inputs of the same structure,
    shapes, dtypes, devices and non-tensor values reuses that trace (the model is held
    weakly: deleting it frees its traces). Equal constants: the values the output
    function's closure, defaults and globals hold (numbers, strings, small tensors and
    containers of them, compared by value; modules and functions by identity); an
    output function that reads anything else (a large tensor, a model) is traced on
    every call. The model is traced again when its parameters or buffers are replaced
    or modified in place, its modules are replaced, its hooks or train/eval mode change,
    or a plain attribute of a module (a norm's ``eps``, a scale) changes.
    [clear_traces][semiring_backprop.clear_traces] drops every kept trace.

    Examples:
        The gradient (``Real``) is torch.autograd's:

        >>> r = sbp.backprop(mlp, (x,), output=lambda y: y[0, 1],
        ...                  semirings=[sbp.Real(), sbp.Entropy()])
        >>> xg = x.clone().requires_grad_()
        >>> grad, = torch.autograd.grad(mlp(xg)[0, 1], xg)
        >>> torch.allclose(r.at(0, sbp.Real()), grad)
        True
        >>> r.at(0, sbp.Entropy()).entropy   # how spread the gradient flow is, per input
        tensor([[0.5284, 1.0928, 0.7564, 0.9620]], dtype=torch.float64)

        A Hugging Face model takes its inputs as keywords; ``output`` picks the scalar
        (here a [WordChoice][semiring_backprop.WordChoice], ``log p(are) - log p(is)``):

        >>> r = sbp.backprop(model, kwargs=dict(enc), output=are_is,
        ...                  semirings=[sbp.MaxProduct()])
        >>> r.aggregate("bert.embeddings.word_embeddings", sbp.MaxProduct()).hi.shape
        torch.Size([1, 11])
    """
    options = {"whole": tuple(whole), "allow_training": allow_training, "per_example": per_example}
    traces = _kept_traces(model, output, options) if reuse else None
    return Backprop(
        model, output, semirings, keep=keep, weight_cache=0, dynamic=False, **options,
        _traces=traces,
    )(args, kwargs)  # fmt: skip


def clear_traces() -> None:
    """Forget every trace [backprop][semiring_backprop.backprop] keeps for reuse.

    Examples:
        >>> sbp.clear_traces()   # the next backprop call traces the model again
    """
    _KEPT.clear()


class Backprop:
    """A reusable explainer: traces once, then only runs the pass.

    The trace has symbolic sizes (``dynamic=True``): one graph serves inputs of any
    sequence length (and batch size, when traced with a batch of 2 or more) with the
    same structure, dtypes and devices. ``output`` is traced into the graph, so it must
    be a fixed function of the model's output (its indices become constants; a negative
    index such as ``logits[0, -1]`` follows the length): make one ``Backprop`` per
    output function, or pass a varying position as a tensor input of a wrapper.
    What the trace depends on is checked on every call: it is traced again when the
    model's parameters or buffers are replaced or modified in place (torch's version
    counter: optimizer steps, ``load_state_dict``, ``with torch.no_grad(): p.mul_(2)``),
    its modules are replaced, its hooks or train/eval mode change, or a plain
    attribute of a module (a norm's ``eps``, a scale) changes. Writes that bypass the
    version counter (through ``p.data`` or a NumPy view of ``p``) are read by the pass
    itself, which computes with the parameters' memory; the weights prepared from them
    (``weight_cache``) are checked by 64 evenly spaced elements of every parameter and
    buffer and made again if one differs: a write to a whole tensor or a large part of
    it is seen, a write to a few elements may not be. Call ``refresh`` after such
    a write.

    ``keep`` (places, as for [Result.at][semiring_backprop.Result.at], with ``*``
    wildcards) keeps only those values and frees the rest during the pass, for memory;
    paths and branch tables need every value (``keep=None``, the default: checkpoints,
    from which what they read is computed again, one segment of the graph at a time).

    ``weight_cache`` (bytes, default 1 GiB; 0 turns it off): what contractions derive
    from a weight alone (``log |w|`` for ``Entropy`` and ``MaxAbs``, a transposed copy for
    ``MaxProduct``) is kept across calls, up to this size. It trades memory for time;
    the values are the same either way.

    On its first call, on glibc, malloc is set to reuse freed host memory instead of
    returning it to the system (``semiring_backprop.allocator``: faster by a third
    on a CPU, no value changes); ``SEMIRING_BACKPROP_TUNE_MALLOC=0`` leaves it alone.

    Examples:
        One trace serves sentences of other lengths:

        >>> bp = sbp.Backprop(model, output=are_is, semirings=[sbp.Real()])
        >>> for text in ["the keys to the cabinet [MASK] on the table",
        ...              "the dog is on the [MASK]"]:
        ...     r = bp(kwargs=dict(tok(text, return_tensors="pt")))
        ...     print(r.at("bert.embeddings.word_embeddings", sbp.Real()).shape)
        torch.Size([1, 11, 16])
        torch.Size([1, 8, 16])
        >>> bp.traces
        1
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
        _traces: _Traces | None = None,
    ):
        if isinstance(semirings, Semiring):
            raise InputError(
                f"semirings must be a list of Semiring instances, got the single semiring "
                f"{semirings!r}: pass semirings=[{semirings!r}]"
            )
        try:
            semirings = list(semirings)
        except TypeError:  # None, a number: not a collection of semirings
            semirings = [semirings]
        if not semirings or not all(isinstance(s, Semiring) for s in semirings):
            raise InputError(
                f"semirings must be a non-empty list of Semiring instances, got {semirings!r}"
            )
        if len(set(semirings)) != len(semirings):
            raise InputError(f"semirings contains duplicates: {semirings}")
        self.semirings = semirings
        if isinstance(keep, str | int):
            keep = (keep,)
        self.keep = None if keep is None else tuple(keep)
        options = {"whole": tuple(whole), "allow_training": allow_training,
                   "per_example": per_example}  # fmt: skip
        self._traces = _traces or _Traces(model, output, options, int(weight_cache), dynamic)

    @property
    def model(self):
        """The explained model."""
        return self._traces.model

    @property
    def output(self):
        """The output function (``None``: the model's output is the scalar)."""
        return self._traces.output

    def graph(self, args=(), kwargs: dict | None = None):
        """The traced graph for inputs like these (traced on first use).

        With ``dynamic`` (default), a graph is traced with symbolic sizes and serves
        every input of the same structure, dtypes and devices whose sizes fit it
        (sentences of any length, usually); inputs that do not fit are traced again.

        Examples:
            >>> bp = sbp.Backprop(model, output=are_is)
            >>> g = bp.graph(kwargs=dict(enc))
            >>> sorted(g.user_inputs)
            ['attention_mask', 'input_ids', 'token_type_ids']
        """
        args = tuple(args) if isinstance(args, tuple | list) else (args,)
        return self._traces.graph(args, dict(kwargs or {}))

    def refresh(self) -> None:
        """Forget the prepared weights (made again on the next call): after a write to
        the parameters that torch's version counter does not see (``p.data``, NumPy).

        Examples:
            Doubling the last layer's weights doubles every path product:

            >>> import copy
            >>> net = copy.deepcopy(mlp)
            >>> bp = sbp.Backprop(net, output=lambda y: y[0, 1], semirings=[sbp.MaxAbs()])
            >>> before = bp((x,)).at(0, sbp.MaxAbs()).value
            >>> _ = net[2].weight.data.mul_(2)      # a write torch's version counter misses
            >>> bp.refresh()
            >>> torch.allclose(bp((x,)).at(0, sbp.MaxAbs()).value, 2 * before)
            True
        """
        self._traces.set_prepared()

    @property
    def traces(self) -> int:
        """How many graphs are traced now (for the current weights)."""
        return self._traces.count

    @property
    def _prepared(self):
        return self._traces.prepared

    def __call__(self, args=(), kwargs: dict | None = None) -> Result:
        args = tuple(args) if isinstance(args, tuple | list) else (args,)
        kwargs = dict(kwargs or {})
        allocator.auto()  # freed host memory reused, not faulted in again (see allocator)
        graph = self.graph(args, kwargs)
        try:
            return self._run(graph, args, kwargs)
        except engine.Overflow:  # seen where paths end: find the node where it began
            with torch.no_grad():
                values = forward.run(graph, args, kwargs)
                engine.reverse(graph, values, self.semirings, graph.output_node, set(),
                               check="every")  # fmt: skip
            raise
        except OutOfMemoryError as e:  # the budget's own refusal, already saying what uses less
            if self.keep is None and getattr(e, "budget", None) and "keep=" not in str(e):
                raise budget.refusal(*e.budget, suggest_keep=True) from None
            raise
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            raise self._out_of_memory(e) from None

    def _out_of_memory(self, e) -> OutOfMemoryError:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return OutOfMemoryError(
            f"the pass ran out of memory ({first}) with {len(self.semirings)} semiring(s) "
            f"{', '.join(s.name for s in self.semirings)}. "
            + budget.what_uses_less(self.keep is None)
        )

    def _run(self, graph, args: tuple, kwargs: dict) -> Result:
        if self.keep is None and checkpoints.ENABLED and checkpoints.usable(graph):
            needed = engine.needed_nodes(graph, graph.output_node)
            with torch.no_grad():
                ckpt = checkpoints.run(
                    graph, lambda drop: forward.run(graph, args, kwargs, drop),
                    self.semirings, needed, frozenset(graph.user_inputs.values()),
                )  # fmt: skip
            self._check_examples(args, kwargs, ckpt.values.get(graph.output_node))
            self._check_trace(graph, args, kwargs, ckpt.values)
            return Result(graph, ckpt.values, ckpt.store, self.semirings)
        kept = None if self.keep is None else resolve_keep(graph, self.keep)
        drop = None  # with keep=, values no rule reads are not kept through the forward
        if kept is not None:
            held = set(kept)
            if not getattr(graph, "eager_checked", False):  # what the trace check reads
                held |= {n for n in (trace_checks.compared(graph),) if n is not None}
            drop = memory.unread_values(graph, engine.needed_nodes(graph, graph.output_node), held)
        with torch.no_grad():
            values, confirm = forward.run_deferred(graph, args, kwargs, drop)
            out = values.get(graph.output_node)
            checks = self._traces.options["per_example"] or not getattr(
                graph, "eager_checked", False
            )
            if checks or not (isinstance(out, torch.Tensor) and out.is_cuda):
                values = confirm() or values  # the checks read values: they must be finite
                confirm = None
            self._check_examples(args, kwargs, out)
            self._check_trace(graph, args, kwargs, values)
            # on a GPU, the forward's check is read once the pass is queued (no wait for
            # the device in between); a bad forward value is still what is reported
            try:
                store = engine.reverse(graph, values, self.semirings, graph.output_node, kept)
            except SemiringBackpropError:
                if confirm is not None:
                    confirm()
                raise
            if confirm is not None:  # (kept values are never dropped: they stand)
                confirm()
        if kept is not None:
            values = {n: v for n, v in values.items() if n in kept}
        return Result(graph, values, store, self.semirings, kept=kept)

    def _check_trace(self, graph, args: tuple, kwargs: dict, values) -> None:
        if not getattr(graph, "eager_checked", False):  # once per traced graph
            trace_checks.check_against_eager(graph, self.model, args, kwargs, values)
            graph.eager_checked = True

    def _check_examples(self, args: tuple, kwargs: dict, out) -> None:
        per_example = self._traces.options["per_example"]
        if per_example and isinstance(out, torch.Tensor):  # they must not interact
            independence.check(self.model, self.output, args, kwargs, out)


class _Traces:
    """The graphs traced for one model and output function, by input signature, and the
    weights they were traced with. ``weak``: the model is held by a weak reference (the
    traces :func:`backprop` keeps must not keep a model alive)."""

    def __init__(self, model, output, options, weight_cache=0, dynamic=True, *, weak=False,
                 limit=None):  # fmt: skip
        self._model = weakref.ref(model) if weak else (lambda: model)
        self.output, self.options = output, options
        self.weight_cache, self.dynamic = weight_cache, dynamic
        self.limit = limit  # most graphs kept per input signature (None: all)
        self.graphs: dict = {}  # signature -> graphs traced for it
        self.stamp = self.prepared = self.samples = None

    @property
    def model(self):
        return self._model()

    @property
    def count(self) -> int:
        return sum(len(graphs) for graphs in self.graphs.values())

    def set_prepared(self, samples=None) -> None:
        """A fresh store of prepared weights, for every graph (``samples``: the model's
        :func:`_samples` now, if known)."""
        self.prepared = rules.Prepared(self.weight_cache) if self.weight_cache else None
        if self.prepared is not None:
            self.samples = _samples(self.model) if samples is None else samples
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.prepared = self.prepared

    def graph(self, args: tuple, kwargs: dict):
        model = self.model
        key = _signature(args, kwargs)
        stamp = _stamp(model)
        if stamp != self.stamp:  # new or modified weights or modules: every trace is stale
            self.graphs, self.stamp = {}, stamp
            self.set_prepared()
        elif self.prepared is not None:  # writes the version counter does not see
            samples = _samples(model)
            if not torch.equal(samples, self.samples):
                self.set_prepared(samples)
        given = input_tensors(args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        for graph in self.graphs.get(key, ()):
            if graph.accepts(given, leaves):
                return graph
        opts = self.options
        graph = trace(
            model, args, kwargs, self.output, whole=opts["whole"],
            allow_training=opts["allow_training"], dynamic=self.dynamic,
        )  # fmt: skip
        _check_output(graph, opts["per_example"])
        graph.prepared = self.prepared
        if self.limit is not None and any(part[0] == "I" for part in key[1]):
            return graph  # an argument known by identity only: not kept (ids are reused)
        kept = self.graphs.setdefault(key, [])
        kept.append(graph)
        if self.limit is not None and len(kept) > self.limit:
            del kept[0]
        return graph


#: model -> {(output key, options): _Traces}, most recently used last
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KEPT_PER_MODEL = 8  # output functions per model
_GRAPHS_PER_SIGNATURE = 8  # input shapes per output function


def _kept_traces(model, output, options) -> _Traces | None:
    """The traces :func:`backprop` keeps for this model and output function (made on
    first use), or None where they cannot be keyed safely."""
    try:
        key = (_function_key(output), tuple(sorted(options.items())))
        hash(key)
        per_model = _KEPT.setdefault(model, {})
    except (_Unkeyed, TypeError):  # not comparable by value, or no weak reference
        return None
    try:
        traces = per_model.pop(key)
    except KeyError:
        traces = _Traces(model, output, options, 0, False, weak=True, limit=_GRAPHS_PER_SIGNATURE)
    traces.output = output  # the same code and constants; this call's object
    per_model[key] = traces  # most recently used last
    while len(per_model) > _KEPT_PER_MODEL:
        del per_model[next(iter(per_model))]
    return traces


class _Unkeyed(Exception):
    """A value an output function reads cannot be compared by value."""


_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _function_key(fn, depth=0):
    """What decides what ``fn`` computes: its code and the values it reads (closure,
    defaults, the globals its code names), by value; raises ``_Unkeyed`` where one of
    them cannot be compared by value."""
    if fn is None:
        return None
    if depth > 3:
        raise _Unkeyed
    if isinstance(fn, functools.partial):
        return ("partial", _function_key(fn.func, depth + 1), _value_key(fn.args, depth),
                _value_key(fn.keywords, depth))  # fmt: skip
    if isinstance(fn, types.BuiltinFunctionType | torch._ops.OpOverloadPacket):
        return ("builtin", fn)
    if callable(getattr(type(fn), "_trace_key", None)):  # a target object, by its value
        return ("object", type(fn), fn._trace_key())
    if not isinstance(fn, types.FunctionType):
        raise _Unkeyed  # a callable object or a bound method: its state is not known
    code = fn.__code__
    glob = tuple(
        (name, _value_key(fn.__globals__[name], depth))
        for name in sorted(_globals_read(code)) if name in fn.__globals__
    )  # fmt: skip
    cells = tuple(_value_key(c.cell_contents, depth) for c in fn.__closure__ or ())
    defaults = (_value_key(fn.__defaults__, depth), _value_key(fn.__kwdefaults__, depth))
    return ("function", code, glob, cells, defaults)


@functools.lru_cache(maxsize=256)
def _globals_read(code: types.CodeType) -> frozenset:
    """The global names ``code`` reads, nested functions and comprehensions included
    (``co_names`` alone also lists attribute names)."""
    names = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.add(ins.argval)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _globals_read(c)
    return frozenset(names)


def _value_key(v, depth):
    if isinstance(v, _SCALARS):
        return (type(v).__name__, v)
    if isinstance(v, tuple | list):
        return (type(v).__name__, tuple(_value_key(x, depth) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((_value_key(k, depth), _value_key(x, depth)) for k, x in v.items()))
    if isinstance(v, torch.Tensor):
        if v.numel() > 64 or v.requires_grad or v.is_meta or v.layout != torch.strided:
            raise _Unkeyed
        return ("tensor", v.dtype, v.device, tuple(v.shape), tuple(v.flatten().tolist()))
    if isinstance(v, types.ModuleType | type):
        return ("object", v)  # held by the key: modules and classes live long anyway
    if isinstance(v, types.FunctionType | functools.partial | types.BuiltinFunctionType):
        return _function_key(v, depth + 1)
    raise _Unkeyed


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
    """What the trace of ``model`` depends on besides the inputs: every module (identity
    and class), its mode, its hooks and its plain attributes (numbers, strings, flags,
    also those of an attribute object such as a config), and every parameter and buffer
    (identity, storage, in-place version)."""
    if not isinstance(model, torch.nn.Module):
        return (id(model),)
    stamp, seen = [], {}
    for m in model.modules():  # one walk (parameters() and buffers() walk it again)
        stamp.append((id(m), type(m), m.training, *map(tuple, _hooks(m))))
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                # inference tensors (made under torch.inference_mode) have no version
                # counter; the sampled elements (_samples) still see writes to them
                version = None if t.is_inference() else t._version
                stamp.append((id(t), t.data_ptr(), version))
        stamp.append(_plain(m.__dict__, seen))
    return tuple(stamp)


#: elements of every parameter and buffer compared for writes torch's version counter
#: does not see (what prepared weights are checked by)
SAMPLES = 64


def _samples(model) -> torch.Tensor:
    """64 evenly spaced elements of every float parameter and buffer, as their bits."""
    if not isinstance(model, torch.nn.Module):
        return torch.zeros(0, dtype=torch.int64)
    groups: dict = {}  # (dtype, device) -> the sampled views (one copy per group)
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point() and t.numel() and t.layout == torch.strided and not t.is_meta:
            flat = t.detach().reshape(-1) if t.is_contiguous() else t.detach().flatten()
            step = max(1, flat.numel() // SAMPLES)
            groups.setdefault((t.dtype, t.device), []).append(flat[::step][:SAMPLES])
    parts = [torch.cat(views).to(torch.float64).cpu() for views in groups.values()]
    return torch.cat(parts).view(torch.int64) if parts else torch.zeros(0, dtype=torch.int64)


def _hooks(m):
    return (m._forward_hooks, m._forward_pre_hooks, m._forward_hooks_with_kwargs,
            m._forward_pre_hooks_with_kwargs)  # fmt: skip


def _plain(attrs: dict, seen: dict, depth: int = 0) -> tuple:
    """The plain values in ``attrs`` (one level into other objects, each once)."""
    out = []
    for name, v in attrs.items():
        if isinstance(v, _SCALARS):
            out.append((name, v))
        elif isinstance(v, tuple) and all(isinstance(x, _SCALARS) for x in v):
            out.append((name, v))
        elif (
            depth == 0
            and hasattr(v, "__dict__")
            and not isinstance(
                v, torch.nn.Module | torch.Tensor | types.FunctionType | types.MethodType | type
            )
        ):
            if id(v) not in seen:  # a config shared by every layer: once
                seen[id(v)] = _plain(vars(v), seen, 1)
            out.append((name, id(v), seen[id(v)]))
    return tuple(out)


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
