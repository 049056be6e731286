"""``backprop``: trace, run forward, run the reverse pass, return a :class:`Result`."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch

from . import independence
from ._traces import (
    _KEPT,
    _KEPT_PER_MODEL,  # noqa: F401 (read from here too: the kept traces' bound)
    _LOCK,
    _kept_traces,
    _Traces,
)
from .engine import allocator, budget, checkpoints, forward, graphed, liveness, relevance
from .engine.hooks import Overflow
from .engine.reverse import needed_nodes, reverse
from .errors import InputError, OutOfMemoryError, SemiringBackpropError, is_out_of_memory
from .places import resolve_keep
from .result import Result
from .semirings import Real, Semiring
from .tracing.checks import check_against_eager, compared


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
    paper: bool = False,
    weights: str = "gradient",
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
        paper: trace the graph as the paper's library (brunoflow) built it (DESIGN §1,
            paper mode): with ``MaxProduct("tensor")`` the values are brunoflow's.
        weights: what each edge weighs (DESIGN §3c): ``"gradient"`` (default), the local
            derivative (``Real`` is torch.autograd's gradient); ``"relevance"``, the local
            rules of relevance propagation as RelP applies them (a norm's scale held
            constant, activations as f(x)/x, the half rule for products, the attention
            pattern held constant: ``semiring_backprop.engine.relevance``). Every
            semiring reads the graph of those weights; not with ``paper=True``.

    A call traces the model for these inputs' shapes; a later call with the same model
    object, an output function of the same code and equal constants, the same
    ``whole``, ``allow_training`` and ``per_example``, and inputs of the same structure,
    shapes, dtypes, devices and non-tensor values reuses that trace (the model is held
    weakly: deleting it frees its traces). Equal constants: the values the output
    function's closure, defaults and globals hold (numbers, strings, small tensors and
    containers of them, compared by value; modules and functions by identity); an
    output function that reads anything else (a large tensor, a model) is traced on
    every call; of a module or class it reads a global of (``settings.IDX``,
    ``Knobs.IDX``), the attributes its code names are compared too (torch's and other
    libraries' modules by identity). The model is traced again when anything its code
    reads changes, as [Backprop][semiring_backprop.Backprop] says
    (``semiring_backprop.tracing.reuse`` lists it).
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
    options = {"whole": tuple(whole), "allow_training": allow_training,
               "per_example": per_example, "paper": bool(paper)}  # fmt: skip
    options.update(_weights_option(weights, options))
    traces = _kept_traces(model, output, options) if reuse else None
    return Backprop(
        model, output, semirings, keep=keep, weight_cache=0, dynamic=False, **options,
        _traces=traces,
    )(args, kwargs)  # fmt: skip


def _weights_option(weights, options) -> dict:
    """The trace option of the edge weights (a graph per weighting: its relevance plan is
    kept on it); none under ``"gradient"``, so that its traces are keyed as before."""
    weights = relevance.check(weights, options["paper"], options["whole"])
    return {} if weights == "gradient" else {"weights": weights}


def clear_traces() -> None:
    """Forget every trace [backprop][semiring_backprop.backprop] keeps for reuse.

    Examples:
        >>> sbp.clear_traces()   # the next backprop call traces the model again
    """
    _KEPT.clear()


class Backprop:
    """A reusable explainer: traces once, then only runs the pass.

    The first trace is for the input's exact shapes (about three times faster to make
    than a trace with symbolic sizes: 3.5 s against 9.8 s for a 6-layer BERT). An input
    of other sizes is traced once more with symbolic sizes, and that graph serves inputs
    of any sequence length (and batch size, when traced with a batch of 2 or more) with
    the same structure, dtypes and devices. ``dynamic=True`` traces with symbolic sizes
    from the first call (for a data set of many lengths), ``dynamic=False`` always for
    exact shapes; the values are the same either way. ``output`` is traced into the
    graph, so it must be a fixed function of the model's output (its indices become
    constants; a negative index such as ``logits[0, -1]`` follows the length): make one
    ``Backprop`` per output function, or pass a varying position as a tensor input of a
    wrapper.
    What the trace depends on is checked on every call: it is traced again when the
    model's parameters or buffers are replaced or modified in place (torch's version
    counter: optimizer steps, ``load_state_dict``, ``with torch.no_grad(): p.mul_(2)``),
    its modules are replaced, its hooks or train/eval mode change, or an attribute of
    a module changes: a number or flag (a norm's ``eps``), a tensor that is not a
    parameter (replaced or written in place), a list, tuple, dict or set (by content,
    up to 1024 items, 4 levels deep: ``m.opts['scale'] = -5``), an object's attributes
    (a config, two levels deep), or a function (``m.forward = ...``). Code changes are
    seen too: a method of a module's class replaced (``nn.Tanh.forward = ...``), and,
    in the model's own code (not torch's, transformers' or the standard library's), a
    global its functions read (``SCALE = 3``, and ``settings.SCALE`` of a module or
    class it names), their closures and defaults, and the functions they call. Not
    seen: deeper state of objects (compared by identity), and the installed libraries'
    module state (``torch.nn.functional.gelu = ...``). Writes that bypass the
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

    ``weights`` (``"gradient"``, the default, or ``"relevance"``): what each edge of the
    graph weighs, as for [backprop][semiring_backprop.backprop].

    ``weight_cache`` (bytes, default 1 GiB; 0 turns it off): what contractions derive
    from a weight alone (``log |w|`` for ``Entropy`` and ``MaxAbs``, a transposed copy for
    ``MaxProduct``) is kept across calls, up to this size. It trades memory for time;
    the values are the same either way.

    ``cuda_graphs`` (on by default; ``False`` or ``SEMIRING_BACKPROP_CUDA_GRAPHS=0`` turns
    it off): on a GPU, a pass that ran once for inputs of the same shapes is captured as
    a CUDA graph on its second call and replayed on later ones (no Python per rule; the
    same kernels, so the same values). Each captured pass holds a memory pool about the
    size of its peak; ``captured`` lists them. See ``semiring_backprop.engine.graphed``.

    On its first call, on glibc, malloc is set to reuse freed host memory instead of
    returning it to the system (``semiring_backprop.allocator``: faster by a third
    on a CPU, no value changes); ``SEMIRING_BACKPROP_TUNE_MALLOC=0`` leaves it alone.

    Examples:
        The first sentence is traced for its shapes; the second, of another length,
        once more with symbolic sizes, which then serves every length:

        >>> bp = sbp.Backprop(model, output=are_is, semirings=[sbp.Real()])
        >>> for text in ["the keys to the cabinet [MASK] on the table",
        ...              "the dog is on the [MASK]", "the dog is on the [MASK] table"]:
        ...     r = bp(kwargs=dict(tok(text, return_tensors="pt")))
        ...     print(r.at("bert.embeddings.word_embeddings", sbp.Real()).shape, bp.traces)
        torch.Size([1, 11, 16]) 1
        torch.Size([1, 8, 16]) 2
        torch.Size([1, 9, 16]) 2
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
        dynamic: bool | None = None,
        paper: bool = False,
        cuda_graphs: bool | None = None,
        weights: str = "gradient",
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
                   "per_example": per_example, "paper": bool(paper)}  # fmt: skip
        options.update(_weights_option(weights, options))
        self._traces = _traces or _Traces(model, output, options, int(weight_cache), dynamic)
        self.cuda_graphs = graphed.enabled_by_default() if cuda_graphs is None else cuda_graphs

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

        By default the first graph is traced for these exact shapes, and the first input
        it does not fit is traced with symbolic sizes: that graph serves every input of
        the same structure, dtypes and devices whose sizes fit it (sentences of any
        length, usually); inputs that fit neither are traced again.

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
    def captured(self) -> list[dict]:
        """The passes kept as CUDA graphs for this model and output function: input
        shapes, semirings, kept places and the memory pool each holds (MB)."""
        return self._traces.passes.describe()

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
        except Overflow:  # seen where paths end: find the node where it began
            with torch.no_grad():
                values = forward.run(graph, args, kwargs)
                needed = needed_nodes(graph, graph.output_node)
                budget.check(graph, values, self.semirings, needed, set())
                reverse(graph, values, self.semirings, graph.output_node, set(), check="every")
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
            needed = needed_nodes(graph, graph.output_node)
            step = lambda: graphed.checkpointed_pass(graph, self.semirings, needed)  # noqa: E731
            # (a tapped pass hands over every node: not what a captured graph holds)
            ckpt = None if checkpoints.tapping() else self._replay(graph, None, step, args, kwargs)
            if ckpt is not None:
                self._check_examples(args, kwargs, ckpt.held[graph.output_node])
                return Result(graph, ckpt.values, ckpt.store, self.semirings)
            # the value the trace's check compares, kept from the forward (the pass holds
            # checkpoints only: reading it after would compute its segment again)
            node = None if getattr(graph, "eager_checked", False) else compared(graph)
            seen: dict = {}

            def run_forward(drop):
                if node is not None and drop:
                    drop = {n: [x for x in xs if x is not node] for n, xs in drop.items()}
                values = forward.run(graph, args, kwargs, drop)
                if node is not None and node in values:
                    seen[node] = values[node]
                return values

            with torch.no_grad():
                ckpt = checkpoints.run(graph, run_forward, self.semirings, needed,
                                       frozenset(graph.user_inputs.values()))  # fmt: skip
            self._check_examples(args, kwargs, ckpt.values.get(graph.output_node))
            self._check_trace(graph, args, kwargs, collections.ChainMap(seen, ckpt.values))
            return Result(graph, ckpt.values, ckpt.store, self.semirings)
        kept = None if self.keep is None else resolve_keep(graph, self.keep)
        drop = None  # with keep=, values no rule reads are not kept through the forward
        if kept is not None:
            held = set(kept)
            if not getattr(graph, "eager_checked", False):  # what the trace check reads
                held |= {n for n in (compared(graph),) if n is not None}
            drop = liveness.unread_values(graph, needed_nodes(graph, graph.output_node), held)
            step = lambda: graphed.kept_pass(graph, self.semirings, kept, drop)  # noqa: E731
            replayed = self._replay(graph, kept, step, args, kwargs)
            if replayed is not None:
                values, store = replayed
                self._check_examples(args, kwargs, values.get(graph.output_node))
                values = {n: v for n, v in values.items() if n in kept}
                return Result(graph, values, store, self.semirings, kept=kept)
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
                needed = needed_nodes(graph, graph.output_node)
                budget.check(graph, values, self.semirings, needed, kept)  # before a pass too large
                store = reverse(graph, values, self.semirings, graph.output_node, kept)
            except SemiringBackpropError:
                if confirm is not None:
                    confirm()
                raise
            if confirm is not None:  # (kept values are never dropped: they stand)
                confirm()
        if kept is not None:
            values = {n: v for n, v in values.items() if n in kept}
        return Result(graph, values, store, self.semirings, kept=kept)

    def _replay(self, graph, kept, step, args: tuple, kwargs: dict):
        """The pass replayed as a CUDA graph (``engine.graphed``; ``step``: the pass and
        how its results are copied out, made by ``step()``), or None: run it from Python."""
        if not (self.cuda_graphs and graphed.available()):
            return None
        if not getattr(graph, "eager_checked", False):
            # the call that checks the trace runs from Python; it is the key's first call
            self._traces.passes.saw(graph, self.semirings, kept, args, kwargs)
            return None
        return self._traces.passes.run(graph, self.semirings, kept, *step(), args, kwargs)

    def _check_trace(self, graph, args: tuple, kwargs: dict, values) -> None:
        if getattr(graph, "eager_checked", False):  # once per traced graph
            return
        with _LOCK:  # not while another thread traces (its hooks are on the modules)
            if not getattr(graph, "eager_checked", False):
                check_against_eager(graph, self.model, args, kwargs, values)
                graph.eager_checked = True

    def _check_examples(self, args: tuple, kwargs: dict, out) -> None:
        per_example = self._traces.options["per_example"]
        if per_example and isinstance(out, torch.Tensor):  # they must not interact
            independence.check(self.model, self.output, args, kwargs, out)
