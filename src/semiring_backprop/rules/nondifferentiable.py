"""Ops declared to carry no edges: their output does not depend differentiably on
their inputs (rounding, signs, shapes of ``*_like``) or, like the stability shift of
softmax, must not (DESIGN §1)."""

from __future__ import annotations

import torch

from ..tracing import ops as _ops  # noqa: F401  (defines softmax_shift)
from .registry import reads_nothing, register, register_forward

aten = torch.ops.aten


NO_EDGES = [
    torch.ops.semiring_backprop.softmax_shift.default,
    aten.detach.default,
    aten.sign.default,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.trunc.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.bernoulli.default,
    aten.argmax.default,
    aten.argmin.default,
]


@register(
    NO_EDGES,
    "nondifferentiable",
    reads=reads_nothing,
)
def _no_edges(sr, g, op, *args, **kwargs):
    return [None] * len(args)


@register_forward(NO_EDGES)
def _no_edges_forward(sr, a, op, *args, **kwargs):
    return None
