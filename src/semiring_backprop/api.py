"""``backprop``: trace, run forward, run the reverse pass, return a :class:`Result`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import engine, forward
from .errors import InputError
from .result import Result
from .semirings import Real, Semiring
from .tracing import trace


def backprop(
    model,
    args=(),
    kwargs: dict | None = None,
    output: Callable | None = None,
    semirings: Sequence[Semiring] = (Real(),),
    *,
    keep: tuple[str, ...] = (),
    allow_training: bool = False,
    per_example: bool = False,
) -> Result:
    """Semiring backpropagation of ``output(model(*args, **kwargs))``.

    Args:
        model: an ``nn.Module`` (in eval mode) or a plain callable of tensors.
        args, kwargs: example inputs, exactly as the model takes them.
        output: picks the scalar to explain from the model's output.
        semirings: computed together in one pass.
        keep: composite ops to keep whole (``"softmax"``, ``"log_softmax"``,
            ``"layer_norm"``, ``"gelu"``); by default they are decomposed.
        allow_training: explain a model in training mode as it is (random edges).
        per_example: allow a 1-D output of per-example scalars (examples must not
            interact); all are seeded at once.

    >>> res = backprop(mlp, (x,), output=lambda y: y[0, 1], semirings=[Real(), Entropy()])
    >>> res.at(0, Real())  # == torch.autograd.grad(mlp(x)[0, 1], x)
    """
    semirings = list(semirings)
    if not semirings or not all(isinstance(s, Semiring) for s in semirings):
        raise InputError(
            f"semirings must be a non-empty list of Semiring instances, got {semirings!r}"
        )
    if len(set(semirings)) != len(semirings):
        raise InputError(f"semirings contains duplicates: {semirings}")
    args = tuple(args) if isinstance(args, tuple | list) else (args,)
    kwargs = dict(kwargs or {})
    graph = trace(model, args, kwargs, output, keep=keep, allow_training=allow_training)
    _check_output(graph, per_example)
    with torch.no_grad():
        values = forward.run(graph, args, kwargs)
        store = engine.reverse(graph, values, semirings, graph.output_node)
    return Result(graph, values, store, semirings)


def _check_output(graph, per_example: bool):
    outputs = graph.nodes[-1].args[0]
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
