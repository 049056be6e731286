"""Model + example inputs + output function -> :class:`Graph` (an ATen-level FX graph).

Tracing uses ``torch.export`` (non-strict), then our decomposition table. Before
exporting, every submodule gets hooks that wrap its first float input and its output in
the identity op ``semiring_backprop::mark``, so that ``Result.at("encoder.layer.0")``
finds exactly that module's output in the graph.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
from torch.utils import _pytree as pytree

from . import (
    _ops,  # noqa: F401
    decompositions,
)
from .errors import InputError, TracingError, TrainingModeError

mark_op = torch.ops.semiring_backprop.mark.default
aten = torch.ops.aten

log = logging.getLogger(__name__)


@dataclass
class Graph:
    """A traced function: the FX graph, its inputs and where each module lives in it.

    Examples:
        >>> g = sbp.trace(mlp, (x,), output=lambda y: y[0, 1])
        >>> sorted(g.user_inputs), sorted(g.tags)[:4]   # inputs; places of modules
        ([0], ['0', '0:input', '1', '1:input'])
        >>> [str(n.target) for n in g.nodes if n.op == "call_function"][:3]
        ['semiring_backprop.mark.default', 'aten.permute.default', 'aten.addmm.default']
        >>> g.module_of(g.nodes[5])
        '0'
    """

    program: torch.export.ExportedProgram
    user_inputs: dict  # key (position or keyword) -> placeholder node, in flatten order
    constants: dict  # placeholder node -> parameter / buffer / constant tensor
    tags: dict  # "module.path" / "module.path:input" -> mark node
    whole: tuple = ()  #: composite ops kept whole
    #: placeholder -> every placeholder fed the same tensor object (``mha(x, x, x)``):
    #: torch.export may read only one of them, so an input's value is their ⊕
    aliases: dict = field(default_factory=dict)
    #: module path -> class name, for every submodule of the traced model
    module_types: dict = field(default_factory=dict)
    #: module path -> the attention head counts and sizes its attributes (or its
    #: ``config`` / ``cfg``) give, for per-head branch tables (``head_attrs``)
    head_attrs: dict = field(default_factory=dict)
    #: prepared contraction weights kept across calls (``rules.Prepared``), if any
    prepared: object = None
    nodes: list = field(init=False)

    def __post_init__(self):
        self.nodes = list(self.graph.nodes)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph_module.graph

    @functools.cached_property
    def ids(self) -> dict:
        """``{node: its position in nodes}`` (the node ids of rules and pointers)."""
        return {n: i for i, n in enumerate(self.nodes)}

    @functools.cached_property
    def static(self) -> frozenset:
        """Nodes whose value is the same on every call: computed from the model's
        parameters, buffers and constants alone, by ops that draw no random numbers."""
        out = set(self.constants)
        for node in self.nodes:
            if (
                node.op == "call_function"
                and node.all_input_nodes
                and all(a in out for a in node.all_input_nodes)
                and not _random(node)
            ):
                out.add(node)
        return frozenset(out)

    @functools.cached_property
    def input_shapes(self) -> dict:
        """Input key -> its traced shape: an int per fixed dim, a symbol name per dim that
        may vary; and the symbols' ranges ``{name: (low, high or None)}``."""
        ranges = {}
        for sym, vr in self.program.range_constraints.items():
            high = int(vr.upper) if getattr(vr.upper, "is_Integer", False) else None
            low = int(vr.lower) if getattr(vr.lower, "is_Integer", False) else 0
            ranges[str(sym)] = (low, high)  # high None: unbounded
        shapes = {}
        for key, node in self.user_inputs.items():
            dims = []
            for d in node.meta["val"].shape:
                expr = d.node.expr if isinstance(d, torch.SymInt) else d
                dims.append(int(expr) if getattr(expr, "is_number", True) else str(expr))
            shapes[key] = tuple(dims)
        return {"shapes": shapes, "ranges": ranges}

    @functools.cached_property
    def _guards(self):
        """torch.export's checks on the inputs beyond size ranges (``size()[1] != 5``
        where the model branched on a size), as a function of the flat inputs."""
        if not getattr(self.program, "_guards_code", None):
            return None
        return getattr(self.program.module(), "_guards_fn", None)

    def accepts(self, given: dict, leaves: list | None = None) -> bool:
        """Whether input tensors ``{key: tensor}`` fit this graph: fixed dims equal, and
        each varying size consistent across inputs and within its traced range; with
        ``leaves`` (every input, flattened), also the other checks torch.export
        recorded, such as a size the model branched on."""
        if not self._fits(given):
            return False
        if leaves is not None and self._guards is not None:
            try:
                self._guards(*leaves)
            except Exception:  # noqa: BLE001  (a failed guard: another trace is needed)
                return False
        return True

    def _fits(self, given: dict) -> bool:
        spec, bound = self.input_shapes, {}
        for key, dims in spec["shapes"].items():
            x = given.get(key)
            if not isinstance(x, torch.Tensor) or x.dim() != len(dims):
                return False
            for want, got in zip(dims, x.shape):
                if isinstance(want, int):
                    if want != got:
                        return False
                    continue
                if bound.setdefault(want, got) != got:
                    return False
                low, high = spec["ranges"].get(want, (0, None))
                if got < low or (high is not None and got > high):
                    return False
        return True

    @property
    def user_outputs(self) -> list:
        """What ``output(model(...))`` returned, without the inputs and buffers the model
        wrote into in place (torch.export returns their new values too)."""
        specs = self.program.graph_signature.output_specs
        outs = self.nodes[-1].args[0]
        return [o for o, s in zip(outs, specs) if s.kind == OutputKind.USER_OUTPUT]

    @property
    def output_node(self) -> torch.fx.Node:
        (out,) = self.user_outputs
        return out

    def module_of(self, node: torch.fx.Node) -> str | None:
        """The owning module path of a node, as the user names it."""
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return None
        path = list(stack.values())[-1][0]
        path = path.removeprefix("L['self']").removeprefix(".")
        # the traced wrapper holds the user's model as ``model``
        path = "" if path == "model" else path.removeprefix("model.")
        return path or None


def _random(node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def mark_module(node: torch.fx.Node) -> str | None:
    """The module path a ``mark`` node stands for (its input or output), else None."""
    if node.op == "call_function" and node.target is mark_op:
        return node.args[1].split("@")[0].removesuffix(":input")
    return None


class _Explained(torch.nn.Module):
    def __init__(self, model, output: Callable):
        super().__init__()
        if isinstance(model, torch.nn.Module):
            self.model = model
        else:
            self._fn = model
        self._output = output

    def forward(self, args, kwargs):  # two explicit inputs: dynamic shapes match them
        fn = self.model if hasattr(self, "model") else self._fn
        return self._output(fn(*args, **kwargs))


def _first_float(items):
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return i, x
    return None, None


def _install_marks(model: torch.nn.Module):
    """Hooks that mark each module's first float input and first float output."""
    calls: dict[str, int] = {}
    handles = []

    def tag_for(name):
        n = calls.get(name, 0)
        return name if n == 0 else f"{name}@{n}"

    def pre(name):
        def hook(mod, args, kwargs):
            tag = tag_for(name) + ":input"
            i, x = _first_float(args)
            if x is None:
                j, x = _first_float(kwargs.values())
                if x is None:
                    return None
            m = torch.ops.semiring_backprop.mark(x, tag)
            args = tuple(m if a is x else a for a in args)
            kwargs = {k: (m if v is x else v) for k, v in kwargs.items()}
            return args, kwargs

        return hook

    def post(name):
        def hook(mod, args, kwargs, out):
            tag = tag_for(name)
            calls[name] = calls.get(name, 0) + 1
            if isinstance(out, torch.Tensor):
                return (
                    torch.ops.semiring_backprop.mark(out, tag) if out.is_floating_point() else out
                )
            if isinstance(out, tuple | list):
                i, x = _first_float(out)
                if x is None:
                    return out
                items = list(out)
                items[i] = torch.ops.semiring_backprop.mark(x, tag)
                return type(out)(items) if isinstance(out, list) else tuple(items)
            if isinstance(out, dict):
                for k, v in out.items():
                    if isinstance(v, torch.Tensor) and v.is_floating_point():
                        out[k] = torch.ops.semiring_backprop.mark(v, tag)
                        break
            return out

        return hook

    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(mod.register_forward_hook(post(name), with_kwargs=True))
    return handles


def _check_mode(model, allow_training: bool):
    if not isinstance(model, torch.nn.Module) or allow_training:
        return
    training = [n or type(model).__name__ for n, m in model.named_modules() if m.training]
    if training:
        raise TrainingModeError(
            f"{type(model).__name__} is in training mode ({training[0]!r} and "
            f"{len(training) - 1} more modules): dropout would make the gradient graph "
            "random. Call model.eval() first, or pass allow_training=True to explain "
            "the training-mode function as it is."
        )


def trace(
    model,
    args: tuple = (),
    kwargs: dict | None = None,
    output: Callable | None = None,
    *,
    whole: tuple[str, ...] = (),
    allow_training: bool = False,
    dynamic: bool = True,
) -> Graph:
    """Trace ``output(model(*args, **kwargs))`` to a [Graph][semiring_backprop.Graph].

    With ``dynamic`` (default), every dimension of every tensor input may vary:
    torch.export keeps those it can symbolic (a sequence length, usually) and fixes the
    others (hidden sizes; any size-1 dimension), so one graph serves inputs of many
    lengths (``Graph.accepts``). If the model cannot be traced that way, it is
    traced for these exact shapes.

    Examples:
        The sequence length of the BERT's inputs stays symbolic; the batch of one is
        fixed:

        >>> g = sbp.trace(model, kwargs=dict(enc), output=are_is)
        >>> longer = tok("the keys to the cabinet on the table [MASK] on the table",
        ...              return_tensors="pt")
        >>> g.accepts(dict(longer)), g.accepts({k: v.repeat(2, 1) for k, v in enc.items()})
        (True, False)
    """
    kwargs = dict(kwargs or {})
    args = tuple(args) if isinstance(args, tuple | list) else (args,)
    if output is None:
        output = _identity
    if not callable(model):
        raise InputError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    _check_mode(model, allow_training)
    too_long = _too_long(model, args, kwargs, learned_only=True)
    if too_long:  # before torch.export, which would fail deep inside with fake tensors
        raise InputError(too_long)
    table = decompositions.table(tuple(whole))
    handles = _install_marks(model) if isinstance(model, torch.nn.Module) else []
    functions: list = []
    try:
        with warnings.catch_warnings():
            # torch.export's own pytree internals warn about their deprecated API
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            with _watch_functions(functions):
                program = _export(_Explained(model, output), args, kwargs, dynamic)
            if functions:
                _check_functions(_Explained(model, output), args, kwargs, functions)
            _detach_no_grad_blocks(program)
            program = program.run_decompositions(table)
            _select_by_indices(program)
    except (TracingError, InputError):
        raise
    except Exception as e:  # torch raises many types; say what failed and what to try
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        too_long = _too_long(model, args, kwargs)
        if too_long:
            raise InputError(too_long) from None
        for key, x in {**dict(enumerate(args)), **kwargs}.items():  # (a function of an
            if isinstance(x, torch.Tensor) and x.numel() == 0 and x.dim() > 0:  # empty batch
                raise InputError(  # may trace; a model's reshapes usually cannot)
                    f"input {key!r} is empty (shape {tuple(x.shape)}), and "
                    f"{type(model).__name__} cannot be traced with it: {first[:200]}. Give at "
                    "least one example of at least one position"
                ) from None
        eager = _eager_failure(model, output, args, kwargs)
        raise TracingError(
            f"could not trace {getattr(model, '__class__', type(model)).__name__} with "
            f"torch.export: {type(e).__name__}: {first[:500]}\n"
            + (
                eager
                or "Things to try: load a Hugging Face model with attn_implementation='eager'; "
                "remove data-dependent Python control flow; or pass a plain function of "
                f"tensors as the model.{_experts_hint(model)}"
            )
        ) from e
    finally:
        for h in handles:
            h.remove()
    graph = _build_graph(program, args, kwargs, tuple(whole))
    if isinstance(model, torch.nn.Module):
        graph.module_types = {n: type(m).__name__ for n, m in model.named_modules()}
        graph.head_attrs = head_attrs(model)
    return graph


#: attribute names under which modules and configs give head counts and sizes
HEAD_ATTRS = (
    "num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads",
    "num_kv_heads", "n_kv_heads", "n_key_value_heads", "num_key_value_groups", "head_dim",
    "attention_head_size", "head_size", "key_value_proj_dim", "d_head",
)  # fmt: skip


def head_attrs(model: torch.nn.Module) -> dict:
    """``{module path: {attribute: int}}`` for the :data:`HEAD_ATTRS` each module has,
    itself or through its ``config`` (Hugging Face) or ``cfg`` (TransformerLens)."""
    out = {}
    for path, m in model.named_modules():
        found: dict = {}
        for src in (m, getattr(m, "config", None), getattr(m, "cfg", None)):
            for name in HEAD_ATTRS if src is not None else ():
                val = getattr(src, name, None)
                if isinstance(val, int) and not isinstance(val, bool) and val > 0:
                    found.setdefault(name, val)
        if found:
            out[path] = found
    return out


@contextlib.contextmanager
def _watch_functions(seen: list, check=None):
    """Record every custom ``torch.autograd.Function`` the traced code applies (torch's
    own are what their forward says); with ``check``, call ``check(cls, apply, args)``
    in its place."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls.__module__.startswith("torch."):
            return original.__func__(cls, *args, **kwargs)
        seen.append(cls)
        if check is not None:
            return check(cls, lambda *a: original.__func__(cls, *a, **kwargs), args)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _check_functions(wrapper, args, kwargs, seen: list) -> None:
    """The trace holds a custom Function's forward ops, and the gradient graph their
    derivatives; autograd uses the Function's own backward. Where that is their
    derivative (an op fused by hand, Bloom's GELU) the answer is autograd's; where it is
    not (a gradient-reversal layer's -g, a straight-through estimator) it would differ
    without a word. So the model runs once on these inputs, and at every application
    the Function's backward is compared with the derivative of its forward's ops
    (vector-Jacobian products for a random cotangent); a mismatch is refused."""
    bad: dict = {}

    def check(cls, apply, fargs):
        out = apply(*fargs)
        if cls not in bad:
            why = _compare_backward(cls, apply, fargs)
            if why:
                bad[cls] = why
        return out

    with torch.enable_grad(), _watch_functions([], check):
        wrapper(args, kwargs)
    if bad:
        cls, why = next(iter(bad.items()))
        names = ", ".join(f"{f.__module__}.{f.__qualname__}" for f in dict.fromkeys(seen))
        raise TracingError(
            f"the model applies the custom torch.autograd.Function "
            f"{cls.__module__}.{cls.__qualname__}, whose backward is not the derivative of "
            f"its forward ({why}; a gradient-reversal layer returns -g): the gradient graph "
            "is built from the derivatives of its forward's ops, so the answer would differ "
            "from autograd's. Explain a version of the model that calls plain torch ops in "
            f"its place. (Custom Functions applied: {names}.)"
        )


def _compare_backward(cls, apply, fargs) -> str | None:
    """Why ``cls``'s backward differs from its forward ops' derivative at ``fargs``
    (None where they agree, or where nothing differentiable goes in or out)."""
    from torch.autograd.function import FunctionCtx, _SingleLevelFunction

    leaves = [
        a.detach().requires_grad_()
        if isinstance(a, torch.Tensor) and a.is_floating_point()
        and not isinstance(a, torch.nn.Parameter) else a
        for a in fargs
    ]  # fmt: skip
    wrt = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
    if not wrt:
        return None

    def vjp(outs):
        outs = [o for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor)
                and o.requires_grad]  # fmt: skip
        if not outs:
            return None
        gen = torch.Generator(device=outs[0].device).manual_seed(0)
        cot = [torch.randn(o.shape, generator=gen, dtype=o.dtype, device=o.device) for o in outs]
        return torch.autograd.grad(outs, wrt, cot, allow_unused=True)

    own = vjp(apply(*leaves))
    if cls.setup_context is _SingleLevelFunction.setup_context:  # forward(ctx, *args)
        plain = vjp(cls.forward(FunctionCtx(), *leaves))
    else:  # forward(*args) with a separate setup_context
        plain = vjp(cls.forward(*leaves))
    if own is None or plain is None:
        return None if own is plain else "one of them has no gradient"
    for i, (a, b) in enumerate(zip(own, plain)):
        a = torch.zeros_like(wrt[i]) if a is None else a
        b = torch.zeros_like(wrt[i]) if b is None else b
        scale = float(b.abs().max()) if b.numel() else 0.0
        if not torch.allclose(a, b, rtol=1e-3, atol=1e-5 * max(scale, 1e-30)):
            err = float((a - b).abs().max())
            return f"input {i}: largest difference {err:.3g} against {scale:.3g}"
    return None


def max_positions(model) -> int | None:
    """The most positions a Hugging Face model's config allows (None: not said)."""
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        n = getattr(cfg, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def _too_long(model, args, kwargs, learned_only: bool = False) -> str | None:
    """Why tracing fails, where the cause is an input longer than the model's positions
    (the error torch gives is about fake tensors and indices). ``learned_only``: only
    where the model has a learned position table (an ``nn.Embedding`` named
    ``*position*``) that the input outgrows; rotary positions run longer."""
    limit = max_positions(model)
    if learned_only:
        tables = [m.num_embeddings for n, m in getattr(model, "named_modules", list)()
                  if isinstance(m, torch.nn.Embedding) and "position" in n.lower()]  # fmt: skip
        limit = min(tables) if tables and limit is not None else None
    if limit is None:
        return None
    given = {**dict(enumerate(args)), **kwargs}
    for key in ("input_ids", "inputs_embeds", 0):
        x = given.get(key)
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] > limit:
            return (
                f"the input is {x.shape[1]} positions long ({key!r}, shape "
                f"{tuple(x.shape)}); {type(model).__name__} has {limit} positions: shorten "
                "it, or explain it in windows of at most that length"
            )
    return None


def _eager_failure(model, output, args, kwargs) -> str | None:
    """Where the call fails when run without tracing (on copies of the inputs): the
    model's forward or the output function; None where both run (the failure is
    torch.export's own)."""
    args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
    try:
        with torch.no_grad():
            y = model(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (whatever the model raises, it is the model)
        return (
            f"The model fails without tracing too ({_first_line(e)}): check the inputs (their "
            "shapes, dtypes, devices and names) against what its forward takes."
        )
    try:
        with torch.no_grad():
            output(y)
    except Exception as e:  # noqa: BLE001
        return (
            f"The model runs, but output(model(...)) fails on its output without tracing too "
            f"({_first_line(e)}): check the output function against what the model returns "
            "(its type, fields and sizes)."
        )
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _experts_hint(model) -> str:
    """A mixture-of-experts model whose experts loop over the tokens each one got (data-
    dependent shapes, which torch.export cannot trace) has traceable alternatives."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "eager":
        return ""
    return (
        " This model's experts run as a Python loop (experts_implementation='eager'): "
        "load it with experts_implementation='grouped_mm' (the default) or 'batched_mm'."
    )


def _identity(out):
    return out


def _export(wrapper, args, kwargs, dynamic):
    inputs = (args, kwargs)  # the two positional inputs of _Explained.forward
    if dynamic:
        auto = torch.export.Dim.AUTO
        shapes = pytree.tree_map(
            lambda x: {i: auto for i in range(x.dim())} if isinstance(x, torch.Tensor) else None,
            (args, kwargs),
        )
        quiet = logging.getLogger("torch._export.non_strict_utils")  # "0/1 specialized"
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            return torch.export.export(wrapper, inputs, dynamic_shapes=shapes, strict=False)
        except (TracingError, InputError):
            raise
        except Exception as e:  # noqa: BLE001  (symbolic sizes failed: trace these shapes)
            log.info("dynamic-shape export failed (%s: %s); tracing static shapes",
                     type(e).__name__, str(e).splitlines()[0] if str(e) else "")  # fmt: skip
        finally:
            quiet.setLevel(level)
    return torch.export.export(wrapper, inputs, strict=False)


def _detach_no_grad_blocks(program) -> None:
    """Values computed under ``torch.no_grad()`` carry no edges, as in autograd.

    ``torch.export`` keeps such a block as ``wrap_with_set_grad_enabled(False, ...)`` until
    ``run_decompositions`` inlines it and the grad mode is lost; detach its outputs first.
    """
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    graph = program.graph_module.graph
    outs = [
        user
        for node in graph.nodes
        if hop is not None and node.target is hop and node.args[0] is False
        for user in node.users
        if user.target is operator.getitem
    ]
    for out in outs:
        with graph.inserting_after(out):
            detached = graph.call_function(torch.ops.aten.detach.default, (out,))
        detached.meta = dict(out.meta)
        out.replace_all_uses_with(detached, delete_user_cb=lambda n, d=detached: n is not d)
    if outs:
        program.graph_module.recompile()


# ops returning (values, indices) where the values are the input's elements at the
# indices: op -> (keyword, position, default) of the dim they select along, and of keepdim
_ALONG_DIM = {
    aten.topk.default: (("dim", 2, -1), None),
    aten.sort.default: (("dim", 1, -1), None),
    aten.sort.stable: (("dim", None, -1), None),
    aten.cummax.default: (("dim", 1, None), None),
    aten.cummin.default: (("dim", 1, None), None),
    aten.kthvalue.default: (("dim", 2, -1), ("keepdim", 3, False)),
    aten.median.dim: (("dim", 1, None), ("keepdim", 2, False)),
    aten.nanmedian.dim: (("dim", 1, None), ("keepdim", 2, False)),
    aten.mode.default: (("dim", 1, -1), ("keepdim", 2, False)),
}
# pooling ops whose indices are flat positions in each input plane (volume) of n dims
_IN_PLANE = {
    aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
    aten.adaptive_max_pool2d.default: 2,
    aten.adaptive_max_pool3d.default: 3,
}


def _arg(node, spec):
    name, pos, default = spec
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[pos] if pos is not None and pos < len(node.args) else default


def _select_by_indices(program) -> None:
    """Selections (topk, sort, max pooling, ...) read their values back from the input
    at their indices: ``gather(x, dim, indices)``. The values then have edges to the
    selected elements only, as in autograd, and the indices (integers) none; the op
    itself, a node with two outputs, is left with its indices alone.
    """
    graph = program.graph_module.graph
    changed = False
    order = {n: i for i, n in enumerate(graph.nodes)}  # of the traced nodes (inserts come after)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (_ALONG_DIM.keys() | _IN_PLANE.keys()):
            continue
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        values = outs.get(0)
        if values is None or not values.users:
            continue
        idx = outs.get(1)
        at = values if idx is None or order[values] > order[idx] else idx
        emit = _Emitter(graph, node, at)
        if idx is None:
            idx = emit(operator.getitem, node, 1)
        x = node.args[0]
        if node.target in _IN_PLANE:  # flat positions in each plane of the last n dims
            n = _IN_PLANE[node.target]
            val = idx.meta["val"]
            shape = [
                emit(aten.sym_size.int, idx, d) if isinstance(s, torch.SymInt) else int(s)
                for d, s in enumerate(val.shape)
            ]
            flat_x = emit(aten.flatten.using_ints, x, -n, -1)
            flat_i = emit(aten.flatten.using_ints, idx, -n, -1)
            out = emit(aten.view.default, emit(aten.gather.default, flat_x, -1, flat_i), shape)
        else:
            dim_spec, keep_spec = _ALONG_DIM[node.target]
            dim = _arg(node, dim_spec)
            if keep_spec is None or _arg(node, keep_spec):
                out = emit(aten.gather.default, x, dim, idx)
            else:
                wide = emit(aten.unsqueeze.default, idx, dim)
                out = emit(aten.squeeze.dims, emit(aten.gather.default, x, dim, wide), [dim])
        values.replace_all_uses_with(out)
        graph.erase_node(values)
        changed = True
    if changed:
        graph.lint()
        program.graph_module.recompile()


class _Emitter:
    """Inserts ops one after another after ``at``, each with its traced value (computed
    on the trace's fake tensors) and the module of ``like``."""

    def __init__(self, graph, like, at):
        self.graph, self.like, self.prev = graph, like, at
        self.fake = next(
            v.fake_mode for v in pytree.tree_leaves(like.meta["val"]) if hasattr(v, "fake_mode")
        )

    def __call__(self, target, *args):
        with self.graph.inserting_after(self.prev):
            node = self.graph.call_function(target, args)
        vals = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        with self.fake:
            node.meta["val"] = target(*vals)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in self.like.meta:
                node.meta[key] = self.like.meta[key]
        self.prev = node
        return node


def _build_graph(program, args, kwargs, whole) -> Graph:
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    constants, user_specs = {}, []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            user_specs.append(spec)
            continue
        if not isinstance(spec.arg, TensorArgument):
            continue
        node = placeholders[spec.arg.name]
        if spec.target in program.state_dict:
            constants[node] = program.state_dict[spec.target]
        else:
            constants[node] = program.constants[spec.target]
    leaves = [
        (path, leaf)
        for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]
        if isinstance(leaf, torch.Tensor)
    ]
    tensor_specs = [s for s in user_specs if isinstance(s.arg, TensorArgument)]
    if len(leaves) != len(tensor_specs):
        raise TracingError(
            f"traced graph has {len(tensor_specs)} tensor inputs but the call has "
            f"{len(leaves)}; pass inputs as flat tensors in args/kwargs"
        )
    user_inputs, same = {}, {}
    for (path, leaf), spec in zip(leaves, tensor_specs):
        user_inputs[_key(path)] = placeholders[spec.arg.name]
        same.setdefault(id(leaf), []).append(placeholders[spec.arg.name])
    aliases = {n: tuple(group) for group in same.values() if len(group) > 1 for n in group}
    tags = {}
    for n in program.graph.nodes:
        if n.op == "call_function" and n.target is mark_op:
            tags.setdefault(n.args[1], n)
    return Graph(program, user_inputs, constants, tags, whole, aliases)


def input_tensors(args, kwargs) -> dict:
    """``{key: tensor}`` for the tensors among the inputs (keys as in ``Graph.user_inputs``)."""
    return {
        _key(path): leaf
        for path, leaf in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
        if isinstance(leaf, torch.Tensor)
    }


def _key(path):
    """``((SequenceKey(0), SequenceKey(2))`` -> 2; ``(SequenceKey(1), MappingKey('x'))`` -> 'x'."""
    top, *rest = path
    if top.idx == 0:
        key = rest[0].idx
    else:
        key = rest[0].key
    return (
        key
        if len(rest) == 1
        else (key, *(getattr(p, "idx", getattr(p, "key", None)) for p in rest[1:]))
    )
