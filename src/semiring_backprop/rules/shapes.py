"""Shapes shared by the rules of several kinds."""

from __future__ import annotations

from ..semirings.base import fmap


def unbroadcast(sr, value, shape):
    """⊕-reduce a value of a broadcast shape back to ``shape``."""
    vshape = value[0].shape
    if tuple(vshape) == tuple(shape):
        return value
    lead = len(vshape) - len(shape)
    dims = list(range(lead)) + [
        lead + i for i, s in enumerate(shape) if s == 1 and vshape[lead + i] != 1
    ]
    value = sr.sum(value, dims, keepdim=True)
    return fmap(lambda f: f.reshape(shape), value)
