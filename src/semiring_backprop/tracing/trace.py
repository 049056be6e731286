"""Model + example inputs + output function -> :class:`Graph` (an ATen-level FX graph).

Tracing uses ``torch.export`` (non-strict), then our decomposition table (applied by
:func:`.decompose.decompose`: ``run_decompositions``'s graph, each distinct op traced
once). Before exporting, every submodule gets hooks that wrap its first float input and
its output in the identity op ``semiring_backprop::mark``, so that
``Result.at("encoder.layer.0")`` finds exactly that module's output in the graph.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import warnings
from collections.abc import Callable

import torch
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from ..errors import InputError, TracingError, TrainingModeError
from ..graph import Graph
from . import blocks, decompositions, rewrites
from . import ops as _ops  # noqa: F401  (defines the mark op)
from .checks import (
    check_functions,
    data_dependent_hint,
    eager_failure,
    experts_hint,
    refuse_backward_hooks,
    refuse_script,
    too_long,
    watch_functions,
    watch_tensor_code,
)
from .decompose import decompose
from .stitch import stitch

mark_op = torch.ops.semiring_backprop.mark.default
aten = torch.ops.aten

log = logging.getLogger(__name__)


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
    owner = threading.get_ident()  # another thread running the model is not traced

    def tag_for(name):
        n = calls.get(name, 0)
        return name if n == 0 else f"{name}@{n}"

    def pre(name):
        def hook(mod, args, kwargs):
            if threading.get_ident() != owner:
                return None
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
            if threading.get_ident() != owner:
                return None
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


def _check_mode(model, program, allow_training: bool):
    """A model in training mode is explained as it is unless its trace holds an op
    whose result depends on the mode: a random one (dropout) or batch statistics."""
    if not isinstance(model, torch.nn.Module) or allow_training:
        return
    training = [n or type(model).__name__ for n, m in model.named_modules() if m.training]
    if not training:
        return
    node = next(
        (n for gm in program.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
         for n in gm.graph.nodes if _mode_dependent(n)),
        None,
    )  # fmt: skip
    if node is None:  # the training-mode function is the eval-mode one
        return
    stack = node.meta.get("nn_module_stack") or {}
    path, cls = next(reversed(stack.values()), ("", None))
    path = path.removeprefix("model").removeprefix(".")  # the tracing wrapper's name
    cls = getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1])
    where = f"{path!r} ({cls})" if path else "the model"
    what = (
        "with the batch's statistics (the examples would interact)"
        if "batch_norm" in str(node.target)
        else "which draws random numbers (dropout: the gradient graph would be random)"
    )
    raise TrainingModeError(
        f"{type(model).__name__} is in training mode ({training[0]!r} and "
        f"{len(training) - 1} more modules), and in that mode {where} applies "
        f"{node.target} {what}. Call model.eval() first, or pass allow_training=True to "
        "explain the training-mode function as it is."
    )


_DROPOUT_P = 1  # the probability argument of aten.dropout and its kin


def _mode_dependent(node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    name = node.target.name()
    if "batch_norm" in name:  # (input, weight, bias, running_mean, running_var, training, ...)
        return len(node.args) > 5 and node.args[5] is True
    if torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    p = node.args[_DROPOUT_P] if "dropout" in name and len(node.args) > 1 else None
    return not (isinstance(p, int | float) and p == 0)  # dropout(p=0) is the identity


#: held while tracing: torch.export and the checks around it patch torch's global state
_LOCK = threading.RLock()


def trace(
    model,
    args: tuple = (),
    kwargs: dict | None = None,
    output: Callable | None = None,
    *,
    whole: tuple[str, ...] = (),
    allow_training: bool = False,
    dynamic: bool = True,
    paper: bool = False,
) -> Graph:
    """Trace ``output(model(*args, **kwargs))`` to a [Graph][semiring_backprop.Graph].

    With ``paper``, composite ops are decomposed as the paper's library (brunoflow)
    built them (DESIGN §1, paper mode; ``decompositions``): tensor-granularity
    semirings then compute what it computed.

    With ``dynamic`` (default), every dimension of every tensor input may vary:
    torch.export keeps those it can symbolic (a sequence length, usually) and fixes the
    others (hidden sizes; any size-1 dimension), so one graph serves inputs of many
    lengths (``Graph.accepts``). If the model cannot be traced that way, it is
    traced for these exact shapes.

    Blocks repeated in an ``nn.ModuleList`` (a transformer's layers) are traced once for
    exact shapes: the others' traces are copies, made where their code was checked to
    call the same functions (``tracing.blocks``). The graph is the one a full trace
    gives; with symbolic sizes every block is traced.

    Examples:
        The sequence length of the BERT's inputs stays symbolic; the batch of one is
        fixed:

        >>> g = sbp.trace(model, kwargs=dict(enc), output=are_is)
        >>> longer = tok("the keys to the cabinet on the table [MASK] on the table",
        ...              return_tensors="pt")
        >>> g.accepts(dict(longer)), g.accepts({k: v.repeat(2, 1) for k, v in enc.items()})
        (True, False)
    """
    with _LOCK:
        return _trace(model, args, kwargs, output, whole, allow_training, dynamic, paper)


def _trace(model, args, kwargs, output, whole, allow_training, dynamic, paper=False) -> Graph:
    kwargs = dict(kwargs or {})
    args = tuple(args) if isinstance(args, tuple | list) else (args,)
    if output is None:
        output = _identity
    if not callable(model):
        raise InputError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    refuse_script(model)
    refuse_backward_hooks(model)
    long = too_long(model, args, kwargs, learned_only=True)
    if long:  # before torch.export, which would fail deep inside with fake tensors
        raise InputError(long)
    table = decompositions.table(tuple(whole), paper=paper)
    functions: list = []
    refusals: list = []  # what the model's code did that the pass cannot follow
    groups = [] if dynamic else blocks.find_groups(model)
    try:
        with warnings.catch_warnings(), _no_stack_traces(), _code_when_read():
            # torch.export's own pytree internals warn about their deprecated API
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            for tries in itertools.count(1):
                functions.clear()
                refusals.clear()
                attempt = blocks.Attempt(groups, lambda: (len(functions), len(refusals)))
                try:
                    program, changed = _export_once(model, output, args, kwargs, dynamic,
                                                    attempt, functions, refusals)  # fmt: skip
                    break
                except Exception as e:
                    if attempt.retry is None and not attempt.stubs:
                        raise
                    log.debug("exporting again: %s", attempt.retry or e)
                    if attempt.retry is None or tries >= blocks.MAX_ATTEMPTS:
                        for g in groups:  # (a failure with stand-ins: again without)
                            g.off = True
                finally:
                    attempt.forget()
            if refusals:
                raise refusals[0]
            _check_mode(model, program, allow_training)
            if functions:
                check_functions(_Explained(model, output), args, kwargs, functions)
            # (the passes change graphs in place; each graph's code is made once after)
            changed |= rewrites.detach_no_grad_blocks(program)
            changed |= rewrites.views_as_reshapes(program)
            changed |= rewrites.unwrap_bool_checks(program)
            if changed:
                program.graph_module.recompile()
            program = decompose(program, table)
            if rewrites.select_by_indices(program) | rewrites.drop_identity_restrides(program):
                program.graph_module.recompile()
    except (TracingError, InputError, TrainingModeError):
        raise
    except Exception as e:  # torch raises many types; say what failed and what to try
        if refusals:  # the cause, said plainly
            raise refusals[0] from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        long = too_long(model, args, kwargs)
        if long:
            raise InputError(long) from None
        for key, x in {**dict(enumerate(args)), **kwargs}.items():  # (a function of an
            if isinstance(x, torch.Tensor) and x.numel() == 0 and x.dim() > 0:  # empty batch
                raise InputError(  # may trace; a model's reshapes usually cannot)
                    f"input {key!r} is empty (shape {tuple(x.shape)}), and "
                    f"{type(model).__name__} cannot be traced with it: {first[:200]}. Give at "
                    "least one example of at least one position"
                ) from None
        eager = eager_failure(model, output, args, kwargs)
        raise TracingError(
            f"could not trace {getattr(model, '__class__', type(model)).__name__} with "
            f"torch.export: {type(e).__name__}: {first[:500]}\n"
            + (
                eager
                or data_dependent_hint(e)
                + "Things to try: load a Hugging Face model with attn_implementation='eager'; "
                "remove data-dependent Python control flow; or pass a plain function of "
                f"tensors as the model.{experts_hint(model)}"
            )
        ) from e
    graph = _build_graph(program, args, kwargs, tuple(whole))
    if isinstance(model, torch.nn.Module):
        graph.module_types = {n: type(m).__name__ for n, m in model.named_modules()}
        graph.head_attrs = head_attrs(model)
    graph.paper = paper
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


def _identity(out):
    return out


@contextlib.contextmanager
def _no_stack_traces():
    """torch.export records the Python stack that made each node (``stack_trace``, for
    debugging): a fifth of a transformer's export, and nothing here reads it. Off for
    ``run_decompositions`` too, which records a stack for each node that has none."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", None)
    if before is None:  # (torch without the switch)
        yield
        return
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _code_when_read():
    """The programs made meanwhile (the export's, the decomposed one) make their graph
    module's Python code when it is first run or read, not each time the graph changes
    (``torch.fx``'s lazy graph module): nothing here runs it, and for a 30-layer model
    each made it again took 0.15-0.2 s, three times over."""
    try:
        from torch.export import exported_program as ep
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # (another torch: code made as it is)
        yield
        return
    made = getattr(ep, "_create_graph_module_for_export", None)
    if made is None:
        yield
        return
    ep._create_graph_module_for_export = _LazyGraphModule
    try:
        yield
    finally:
        ep._create_graph_module_for_export = made


def _export_once(model, output, args, kwargs, dynamic, attempt, functions, refusals):
    """One export (``attempt``: its blocks' records and stand-ins, replaced by copies of
    their templates after it) and whether its graph changed since its code was made;
    raises where ``attempt`` aborted it (``attempt.retry``)."""
    handles = _install_marks(model) if isinstance(model, torch.nn.Module) else []
    try:
        with watch_functions(functions), watch_tensor_code(model, refusals), attempt.patched():
            program = _export(_Explained(model, output), args, kwargs, dynamic)
    finally:
        for h in handles:
            h.remove()
    return (stitch(program, attempt), True) if attempt.stubs else (program, False)


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
