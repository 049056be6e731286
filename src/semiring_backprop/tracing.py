"""Model + example inputs + output function -> :class:`Graph` (an ATen-level FX graph).

Tracing uses ``torch.export`` (non-strict), then our decomposition table. Before
exporting, every submodule gets hooks that wrap its first float input and its output in
the identity op ``semiring_backprop::mark``, so that ``Result.at("encoder.layer.0")``
finds exactly that module's output in the graph.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from . import (
    _ops,  # noqa: F401
    decompositions,
)
from .errors import InputError, TracingError, TrainingModeError

mark_op = torch.ops.semiring_backprop.mark.default


@dataclass
class Graph:
    """A traced function: the FX graph, its inputs and where each module lives in it."""

    program: torch.export.ExportedProgram
    user_inputs: dict  # key (position or keyword) -> placeholder node, in flatten order
    constants: dict  # placeholder node -> parameter / buffer / constant tensor
    tags: dict  # "module.path" / "module.path:input" -> mark node
    keep: tuple = ()
    #: placeholder -> every placeholder fed the same tensor object (``mha(x, x, x)``):
    #: torch.export may read only one of them, so an input's value is their ⊕
    aliases: dict = field(default_factory=dict)
    #: module path -> class name, for every submodule of the traced model
    module_types: dict = field(default_factory=dict)
    #: prepared contraction weights kept across calls (``rules.Prepared``), if any
    prepared: object = None
    nodes: list = field(init=False)

    def __post_init__(self):
        self.nodes = list(self.graph.nodes)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph_module.graph

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

    @property
    def output_node(self) -> torch.fx.Node:
        (out,) = self.nodes[-1].args[0]
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

    def forward(self, *args, **kwargs):
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
    keep: tuple[str, ...] = (),
    allow_training: bool = False,
) -> Graph:
    """Trace ``output(model(*args, **kwargs))`` to a :class:`Graph`."""
    kwargs = dict(kwargs or {})
    args = tuple(args) if isinstance(args, tuple | list) else (args,)
    if output is None:
        output = _identity
    if not callable(model):
        raise InputError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    _check_mode(model, allow_training)
    table = decompositions.table(tuple(keep))
    handles = _install_marks(model) if isinstance(model, torch.nn.Module) else []
    try:
        with warnings.catch_warnings():
            # torch.export's own pytree internals warn about their deprecated API
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            program = torch.export.export(_Explained(model, output), args, kwargs, strict=False)
            _detach_no_grad_blocks(program)
            program = program.run_decompositions(table)
    except (TracingError, InputError):
        raise
    except Exception as e:  # torch raises many types; say what failed and what to try
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TracingError(
            f"could not trace {getattr(model, '__class__', type(model)).__name__} with "
            f"torch.export: {type(e).__name__}: {first[:500]}\n"
            "Things to try: load a Hugging Face model with attn_implementation='eager'; "
            "remove data-dependent Python control flow; or pass a plain function of "
            "tensors as the model."
        ) from e
    finally:
        for h in handles:
            h.remove()
    graph = _build_graph(program, args, kwargs, tuple(keep))
    if isinstance(model, torch.nn.Module):
        graph.module_types = {n: type(m).__name__ for n, m in model.named_modules()}
    return graph


def _identity(out):
    return out


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


def _build_graph(program, args, kwargs, keep) -> Graph:
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
    return Graph(program, user_inputs, constants, tags, keep, aliases)


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


def numel(node) -> int:
    val = node.meta.get("val")
    return math.prod(val.shape) if isinstance(val, torch.Tensor) else 0
