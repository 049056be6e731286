"""Custom ops the tracer inserts into graphs.

``mark(x, tag)`` is an identity that names a module's input or output in the graph.
``softmax_shift(x, dims)`` is the max subtracted for numerical stability inside
softmax, log_softmax and logsumexp: it does not change the function and its paths
cancel in the gradient, so it carries no edges (DESIGN §1).
``block(inputs, key)`` stands for a block of a model while it is traced, where the block's
trace is a copy of another block's (``tracing.blocks``); no graph that is used holds it.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("semiring_backprop::mark", mutates_args=())
def mark(x: torch.Tensor, tag: str) -> torch.Tensor:
    return x.clone()


@mark.register_fake
def _(x, tag):
    return torch.empty_like(x)


@torch.library.custom_op("semiring_backprop::softmax_shift", mutates_args=())
def softmax_shift(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    m = x.amax(dims, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


@softmax_shift.register_fake
def _(x, dims):
    shape = [1 if (d in dims or d - x.dim() in dims) else s for d, s in enumerate(x.shape)]
    return x.new_empty(shape)


#: output layouts of the ``block`` stand-ins of the trace under way: key -> [(shape,
#: strides, dtype, device)]
BLOCK_OUTPUTS: dict = {}


@torch.library.custom_op("semiring_backprop::block", mutates_args=())
def block(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """Stands, while a model is traced, for a block whose trace is a copy of another's
    (``tracing.blocks``); replaced by that copy before the graph is used, never run."""
    raise RuntimeError(f"the stand-in for block {key!r} was left in a traced graph")


@block.register_fake
def _(inputs, key):
    return [
        torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for shape, stride, dtype, device in BLOCK_OUTPUTS[key]
    ]
