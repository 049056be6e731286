"""What is checked around a trace, so that a model traces exactly or fails clearly.

- custom ``torch.autograd.Function``s: the trace holds their forward's ops, so their
  backward must be the derivative of those (:func:`check_functions`); a reentrant
  ``torch.utils.checkpoint`` is traced as the function it checkpoints;
- what changes gradients outside the ops, which the pass never runs: backward hooks
  on modules (:func:`refuse_backward_hooks`) and ``tensor.register_hook`` in forward;
  ``tensor.data`` in forward is read as ``tensor.detach()`` (:func:`watch_tensor_code`);
- TorchScript, which torch.export cannot trace (:func:`refuse_script`);
- inputs longer than the model's positions (:func:`too_long`);
- a model or output function that fails without tracing too (:func:`eager_failure`):
  the user's error, said as such instead of as a tracing failure.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import traceback

import torch
from torch.utils import _pytree as pytree

from ..errors import TracingError
from ..independence import computed_in, in_training


@contextlib.contextmanager
def watch_functions(seen: list, check=None):
    """Record every custom ``torch.autograd.Function`` the traced code applies (torch's
    own are what their forward says); with ``check``, call ``check(cls, apply, args)``
    in its place."""
    original = torch.autograd.Function.__dict__["apply"]
    from torch.utils.checkpoint import CheckpointFunction

    def apply(cls, *args, **kwargs):
        if cls is CheckpointFunction:  # reentrant checkpoint(fn, *args): its forward runs
            fn, _, *inputs = args  # fn under no_grad; traced, it is fn (the same values)
            return fn(*inputs)
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


def check_functions(wrapper, args, kwargs, seen: list) -> None:
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

    with torch.enable_grad(), watch_functions([], check):
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


def refuse_script(model) -> None:
    """TorchScript (``torch.jit.script`` / ``torch.jit.trace``) is compiled code that
    torch.export cannot trace: say so, and what to pass instead."""
    if isinstance(model, torch.nn.Module):
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    else:
        found = [("", model)] if isinstance(model, torch.jit.ScriptFunction) else []
    if found:
        name, m = found[0]
        where = f"its submodule {name!r}" if name else "the model"
        raise TracingError(
            f"{where} is TorchScript ({type(m).__name__}, made by torch.jit.script or "
            "torch.jit.trace), which torch.export cannot trace. Explain the original "
            "nn.Module or function, the one passed to torch.jit.script / torch.jit.trace."
        )


def refuse_backward_hooks(model) -> None:
    """Backward hooks change or record the gradient where autograd runs them; the pass
    runs no autograd, so a hook that scales the gradient would be ignored (the answer
    differs from autograd's) and one that records it would record nothing."""
    mod = torch.nn.modules.module
    if getattr(mod, "_global_backward_hooks", None) or getattr(
        mod, "_global_backward_pre_hooks", None
    ):
        raise TracingError(
            "a global module backward hook is registered (torch.nn.modules.module."
            "register_module_full_backward_hook / _pre_hook): the pass does not run backward "
            "hooks, so what it does to the gradient would be missing. Remove it (its "
            "handle's .remove()) before explaining, and apply its change to the result."
        )
    if not isinstance(model, torch.nn.Module):
        return
    for name, m in model.named_modules():
        hooks = [*m._backward_hooks.values(), *m._backward_pre_hooks.values()]
        if hooks:
            kind = ("register_full_backward_pre_hook" if m._backward_pre_hooks
                    else "register_full_backward_hook" if m._is_full_backward_hook
                    else "register_backward_hook")  # fmt: skip
            raise TracingError(
                f"module {name or '(the model)'!r} ({type(m).__name__}) has a backward hook "
                f"({kind}: {_name_of(hooks[0])}): the pass does not run backward hooks, so "
                "what the hook does to the gradient would be missing (a hook that records "
                "gradients would record none). Remove it (the handle's .remove()) before "
                "explaining, and apply its change to the result yourself."
            )


def _name_of(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@contextlib.contextmanager
def watch_tensor_code(model, refusals: list):
    """While the model is traced: ``tensor.register_hook`` (a gradient hook the pass
    never runs) is recorded in ``refusals`` as an error naming the module that called
    it; ``tensor.data`` read by the model's code is ``tensor.detach()`` (the same values
    and, as in autograd, no gradient through it; torch.export cannot trace ``.data``)."""
    owner = threading.get_ident()
    original_hook = torch.Tensor.__dict__["register_hook"]
    data = torch._C.TensorBase.data

    def register_hook(self, hook):
        if threading.get_ident() == owner:
            where = _calling_module(model)
            refusals.append(TracingError(
                f"the model's forward calls tensor.register_hook ({_name_of(hook)}"
                f"{' in module ' + repr(where) if where is not None else ''}): a gradient hook "
                "runs in autograd's backward, which the pass does not run, so what it does "
                "to the gradient would be missing. Remove the hook from forward (or make it "
                "conditional on a flag you turn off) before explaining."
            ))  # fmt: skip
        return original_hook(self, hook)

    def get_data(self):
        if threading.get_ident() == owner and not _called_by_torch():
            return self.detach()
        return data.__get__(self)

    def set_data(self, value):
        data.__set__(self, value)

    torch.Tensor.register_hook = register_hook
    torch.Tensor.data = property(get_data, set_data)
    try:
        yield refusals
    finally:
        torch.Tensor.register_hook = original_hook
        del torch.Tensor.data  # torch.Tensor inherits it from TensorBase again


def _called_by_torch() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == "torch" or caller.startswith("torch.")


def _calling_module(model) -> str | None:
    """The path of the innermost module of ``model`` whose code is on the stack."""
    names = {id(m): n for n, m in model.named_modules()} if isinstance(
        model, torch.nn.Module) else {}  # fmt: skip
    frame = sys._getframe(2)
    while frame is not None:
        me = frame.f_locals.get("self")
        if me is not None and id(me) in names:
            return names[id(me)] or "(the model)"
        frame = frame.f_back
    return None


def max_positions(model) -> int | None:
    """The most positions a Hugging Face model's config allows (None: not said)."""
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        n = getattr(cfg, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def too_long(model, args, kwargs, learned_only: bool = False) -> str | None:
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


def eager_failure(model, output, args, kwargs) -> str | None:
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


def experts_hint(model) -> str:
    """A mixture-of-experts model whose experts loop over the tokens each one got (data-
    dependent shapes, which torch.export cannot trace) has traceable alternatives."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "eager" or not _has_experts(model):
        return ""  # (transformers sets "eager" on every model's config, experts or none)
    return (
        " This model's experts run as a Python loop (experts_implementation='eager'): "
        "load it with experts_implementation='grouped_mm' (the default) or 'batched_mm'."
    )


#: torch's errors for a tensor's value read where tracing needs a number: a Python branch
#: on it, or a size computed from it that the traced graph cannot hold
_DATA_DEPENDENT = ("PendingUnbackedSymbolNotFound", "GuardOnDataDependentSymNode")
_NOT_THE_MODELS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__.split(".")[0]])
)


def data_dependent_hint(e: BaseException) -> str:
    """Where torch.export failed on a tensor's value (a branch on it, a size computed
    from it): that, and the line of the model's code it failed at, as the start of a
    sentence; ``""`` for any other failure."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:  # the error and what it was raised from
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    if not any(type(x).__name__ in _DATA_DEPENDENT for x in chain):
        return ""
    where = ""
    for frame in reversed(traceback.extract_tb(chain[-1].__traceback__)):
        if not frame.filename.startswith(_NOT_THE_MODELS + ("<",)):
            code = f" ({frame.line.strip()})" if frame.line else ""
            where = f" It failed at {frame.filename}, line {frame.lineno}{code}."
            break
    return (
        "The model's code uses a tensor's value where torch.export needs a number while "
        "tracing (a Python branch on it, or a data-dependent shape: a size computed from "
        f"it).{where} "
    )


def _has_experts(model) -> bool:
    config = getattr(model, "config", None)
    counts = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if any(isinstance(getattr(config, k, None), int) and getattr(config, k) > 1 for k in counts):
        return True
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return any("expert" in type(m).__name__.lower() for m in modules)


# -- the trace computes what the model computes --------------------------------------


def check_against_eager(graph, model, args, kwargs, values) -> None:
    """Raise if the traced graph's output of the last module it marks differs from that
    module's output when the model runs as it is. A library may take another code path
    while torch.export traces (transformers skips the attention mask under SDPA only
    outside tracing, and one model then attends differently): the pass would explain a
    function the model does not compute. Run once per traced graph."""
    if not isinstance(model, torch.nn.Module) or in_training(model):
        return  # a plain function has no module to compare
    tag, node = _last_module_output(graph)
    if node is None:
        return
    name, _, call = tag.partition("@")
    module = dict(model.named_modules()).get(name)
    if module is None:
        return
    ours = values.get(node)
    if not isinstance(ours, torch.Tensor):
        return
    k, calls, diffs = int(call) if call else 0, [0], []
    owner = threading.get_ident()

    def hook(mod, inputs, out):  # compared at once: the model may write into it later
        if threading.get_ident() != owner:  # another thread running the model
            return
        calls[0] += 1
        if calls[0] == k + 1:
            x = _first_float(out)
            diffs.append((_relative_difference(ours, x), x))

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception:  # the model fails untraced: the pass itself says so where it fails
        return
    finally:
        handle.remove()
    diff, eager = diffs[0] if diffs else (None, None)
    if diff is not None and diff > _agreement(eager):
        raise TracingError(
            f"the traced model computes something else than the model itself: the output "
            f"of {name!r} differs from the model's own by {diff:.2g} (relative to its "
            "size), more than rounding explains. A library that takes another code path "
            "while torch.export traces does this (Hugging Face attention masks under "
            "SDPA, for one). Load the model with attn_implementation='eager', or report "
            "the model."
        )


def _relative_difference(ours: torch.Tensor, eager) -> float | None:
    """``|ours - eager| / |eager|`` (2-norms), or ``None`` where they cannot be compared
    (no tensor, another shape, a norm of 0, a value not finite). Computed in the wider
    of the two dtypes (float32 at least), without a float64 copy of either: at 512
    tokens a language model's logits are 25M numbers."""
    if not isinstance(eager, torch.Tensor) or eager.shape != ours.shape:
        return None
    dtype = torch.promote_types(torch.promote_types(ours.dtype, eager.dtype), torch.float32)
    a, b = ours.detach().to(dtype), eager.detach().to(ours.device, dtype)
    scale = _norm(b)
    diff = _norm(a - b)
    if not (0 < scale < math.inf and diff < math.inf):  # (a NaN fails each comparison)
        return None
    return diff / scale


def _norm(x: torch.Tensor) -> float:
    """The 2-norm; in float64 where float32's squares overflow though every value is
    finite (then ``inf`` only for a value that is not)."""
    n = float(torch.linalg.vector_norm(x))
    if n == math.inf and bool(torch.isfinite(x).all()):
        n = float(torch.linalg.vector_norm(x.double()))
    return n


def compared(graph):
    """The node whose value :func:`check_against_eager` compares (``None``: none)."""
    return _last_module_output(graph)[1]


def _last_module_output(graph):
    """The tag and node of the last module output marked in the graph (not an input)."""
    last = (None, None)
    for tag, node in graph.tags.items():
        if tag.endswith(":input"):
            continue
        if last[1] is None or graph.ids[node] > graph.ids[last[1]]:
            last = (tag, node)
    return last


def _first_float(out):
    """The tensor of a module's output that tracing marks: the first float one."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, tuple | list) else ()
    return next((x for x in items if isinstance(x, torch.Tensor) and x.is_floating_point()), None)


def _agreement(value: torch.Tensor) -> float:
    """Relative difference rounding explains between a fused eager kernel and its
    decomposition (a float64 model may compute parts in float32)."""
    dtype = computed_in(value)
    if dtype in (torch.float16, torch.bfloat16):
        return 5e-2
    return 1e-3 if dtype == torch.float32 else 1e-5
