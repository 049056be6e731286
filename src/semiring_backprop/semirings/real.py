"""The real semiring (+, ×): ordinary backpropagation, the gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Dense, Semiring, Value, dense_if, normal_dims, retype


@dataclass(frozen=True)
class Real(Semiring):
    """``D(v)`` is the gradient of the output with respect to ``v``: the sum over paths
    of the product of their edge weights.

    Examples:
        ``paths[j, i]`` is the product along the MLP's path from input ``i`` through
        hidden unit ``j``:

        >>> grad = mlp_res.at(0, sbp.Real())
        >>> torch.allclose(grad[0], paths.sum(0))
        True
    """

    fields = ("g",)
    rows = True
    plus_is_sum = True
    zero_weight_is_no_edge = True

    def zero(self, shape, like):
        return (torch.zeros(tuple(shape), dtype=like.dtype, device=like.device),)

    def one(self, shape, like):
        return Dense((torch.ones(tuple(shape), dtype=like.dtype, device=like.device),))

    # a path times an edge, a sum of paths, a path plus anything: still a path (Dense
    # is kept, see semirings.base.Dense)

    def plus(self, a: Value, b: Value) -> Value:
        return dense_if(isinstance(a, Dense) or isinstance(b, Dense), (a[0] + b[0],))

    def accumulate(self, prev, c):
        return c if prev is None else self.plus(prev, c)

    def times(self, a: Value, w: torch.Tensor) -> Value:
        return retype(a, (a[0] * w,))

    def mul(self, a: Value, b: Value) -> Value:
        return (a[0] * b[0],)

    def sum(self, a: Value, dims, keepdim=False) -> Value:
        dims = normal_dims(dims, a[0].dim())
        return retype(a, (a[0].sum(dims, keepdim=keepdim),)) if dims else a

    def matmul(self, a: Value, w: torch.Tensor, prep=None) -> Value:
        return retype(a, (torch.matmul(a[0], w),))

    def contract(self, a: Value, b: Value) -> Value:
        return (torch.matmul(a[0], b[0]),)

    def finalize(self, a: Value) -> torch.Tensor:
        return a[0]

    def scalar(self, a: Value) -> torch.Tensor:
        return a[0]

    overflow = "end"

    def overflow_stats(self, a: Value) -> tuple[torch.Tensor, ...]:
        if not a[0].numel():
            return ()
        lo, hi = torch.aminmax(a[0])  # a sum of finite path products is finite
        return (hi, -lo)
