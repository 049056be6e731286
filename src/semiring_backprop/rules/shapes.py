"""Shapes shared by the rules of several kinds."""

from __future__ import annotations

from ..semirings.base import fmap, stack


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


def broadcast(value, shape, rows: int = 0):
    """Copy a value along the dims an op broadcasts it over (the forward direction of
    :func:`unbroadcast`); ``rows``: the value has that many rows first (``Op.rows``),
    each broadcast alike."""
    if not rows:
        if tuple(value[0].shape) == tuple(shape):
            return value
        return fmap(lambda f: f.expand(shape), value)
    if tuple(value[0].shape[1:]) == tuple(shape):
        return value

    def each(f):
        lead, own = f.shape[:1], f.shape[1:]
        ones = (1,) * (len(shape) - len(own))
        return f.reshape(*lead, *ones, *own).expand(*lead, *shape)

    return fmap(each, value)


def oplus(sr, parts):
    """⊕ of the values of several argument slots inside one op (``None``: no part): the
    ⊕ over a stacked dim, or for two parts ``sr.plus`` where that is the same, bit for bit
    (``Semiring.plus_is_sum``: no stacked copy)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2 and sr.plus_is_sum:
        return sr.plus(*parts)
    return sr.sum(stack(parts), 0)
