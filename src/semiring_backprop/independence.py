"""``per_example=True`` is exact only for examples that do not interact: checked per call.

A pass seeded at every example's scalar at once gives, at an example's inputs, the ⊕ over
the paths from *every* example's output. That is the example's own answer only when no
other example's output reads its inputs. Some models break this:

- a mixture of experts whose capacity the batch shares;
- an output function that mixes the examples (``y - y.mean()``).

With them the pass would return a plausible, wrong answer. So every call runs each
example alone (no autograd, the model as it is) and compares its output with the
batched one. The inputs split into examples along their first dimension: every tensor
input whose first size is the number of outputs is cut into rows, and the others are
shared. The check is left out when it cannot be made: a batch of one, or no input with
a row per example, or a model or output function that cannot run on one example alone.
A model in training mode (``allow_training``) has random edges, so no run alone
compares: it is not checked.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from .errors import InputError


def check(model, output, args: tuple, kwargs: dict, batched: torch.Tensor) -> None:
    """Raise if an example's output alone differs from its output in the batch."""
    n = batched.shape[0] if batched.dim() == 1 else 0
    if n < 2 or in_training(model):
        return
    together = batched.detach().double().cpu()
    if not torch.isfinite(together).all():
        return  # the pass reports where a value stopped being finite
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    rows = [isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == n for x in leaves]
    if not any(rows):
        return
    tol = _tolerance(batched) * max(1.0, float(together.abs().max()))
    for b in range(n):
        alone = _alone(model, output, leaves, rows, spec, b)
        if alone is None:
            return
        if abs(alone - float(together[b])) > tol:
            raise InputError(
                f"per_example=True: the examples of this batch of {n} interact: example "
                f"{b}'s output is {alone:.6g} when it runs alone and {float(together[b]):.6g} "
                "in the batch, so a pass seeded at every example at once would mix their "
                "paths (a mixture of experts whose capacity the batch shares does this, or "
                "an output function that mixes examples: y - y.mean()). Explain one example "
                "at a time (a batch of one), or make the examples independent."
            )


def _alone(model, output, leaves, rows, spec, b: int) -> float | None:
    """Example ``b``'s output when it runs alone (``None``: it cannot)."""
    one = [x[b : b + 1] if row else x for x, row in zip(leaves, rows)]
    args, kwargs = pytree.tree_unflatten(one, spec)
    try:
        with torch.no_grad():
            y = model(*args, **kwargs)
            y = output(y) if output is not None else y
    except Exception:  # e.g. an output function that indexes every row of the batch
        return None
    if not isinstance(y, torch.Tensor) or y.numel() != 1:
        return None
    return float(y.detach().double().reshape(()))


def _tolerance(value: torch.Tensor) -> float:
    """Relative difference allowed between one example alone and in a batch: another
    batch size may sum in another order."""
    return 4 * math.sqrt(torch.finfo(computed_in(value)).eps)


def computed_in(value: torch.Tensor) -> torch.dtype:
    """The precision ``value``'s matmuls ran at: its dtype, except float32 on a GPU that
    allows TF32 (10-bit mantissas), bounded by bfloat16's (coarser: a safe bound)."""
    tf32 = value.is_cuda and torch.backends.cuda.matmul.allow_tf32
    return torch.bfloat16 if value.dtype == torch.float32 and tf32 else value.dtype


def in_training(model) -> bool:
    """Any module in training mode (``allow_training``): random edges, no run compares."""
    return isinstance(model, torch.nn.Module) and any(m.training for m in model.modules())
