"""Reductions: sum (weight 1), mean (1/n), amax/amin (edges to the selected elements),
vector norms (one edge per element, weight ∂‖x‖/∂xᵢ as autograd has it).

The reverse rules copy the output's value back over the reduced dims; the forward rules
⊗ each element by its edge weight and ⊕-reduce over them."""

from __future__ import annotations

import math

import torch

from ..semirings.base import fmap, normal_dims
from .registry import reads_nothing, register, register_forward, rows

aten = torch.ops.aten


def _reduced_dims(x, dims):
    if x.dim() == 0:  # a scalar reduced over dim 0 or -1 (torch allows both): the identity
        return ()
    if dims is None or (isinstance(dims, list | tuple) and len(dims) == 0):
        return tuple(range(x.dim()))
    return normal_dims(dims, max(x.dim(), 1))


def _spread(g, x, dims, keepdim):
    """Broadcast an output value back over the reduced dims (each input feeds one output)."""
    if not keepdim:
        for d in dims:
            g = fmap(lambda f, d=d: f.unsqueeze(d), g)
    return fmap(lambda f: f.expand(x.shape), g)


@register([aten.sum.dim_IntList, aten.sum.default], "reduction", reads=reads_nothing)
def _sum(sr, g, op, x, dims=None, keepdim=False, **kwargs):
    return [_spread(g, x, _reduced_dims(x, dims), keepdim)]


@register_forward([aten.sum.dim_IntList, aten.sum.default])
@rows
def _sum_forward(sr, a, op, x, dims=None, keepdim=False, **kwargs):
    return _reduce(sr, a[0], x, _past_rows(op, _reduced_dims(x, dims)), keepdim)


def _past_rows(op, dims):
    """``dims`` of the op's input, in a value with ``op.rows`` rows first."""
    return tuple(d + 1 for d in dims) if op.rows else dims


def _reduce(sr, value, x, dims, keepdim):
    """⊕ of ``value`` (of ``x``'s shape) over ``dims``; None stays None."""
    if value is None:
        return None
    return sr.sum(value, dims, keepdim=keepdim) if dims else value


@register([aten.mean.dim, aten.mean.default], "reduction", reads=reads_nothing)
def _mean(sr, g, op, x, dims=None, keepdim=False, **kwargs):
    dims = _reduced_dims(x, dims)
    n = math.prod(x.shape[d] for d in dims)
    return [sr.scale(_spread(g, x, dims, keepdim), 1.0 / n)]


@register_forward([aten.mean.dim, aten.mean.default])
@rows
def _mean_forward(sr, a, op, x, dims=None, keepdim=False, **kwargs):
    dims = _reduced_dims(x, dims)
    if a[0] is None:
        return None
    n = math.prod(x.shape[d] for d in dims)
    return sr.scale(_reduce(sr, a[0], x, _past_rows(op, dims), keepdim), 1.0 / n)


def _extreme_edges(op, x, dims, keepdim):
    """Where the selected elements are, and their weights: ties share the weight, as
    autograd does."""
    out = (
        op.out
        if keepdim
        else op.out.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
    )
    hit = x == out
    count = hit.sum(dims, keepdim=True)
    return hit, hit.to(x.dtype) / count


def _only(sr, value, hit, like):
    """``value`` where ``hit`` holds, the zero elsewhere (no edge there)."""
    zero = sr.zero(like.shape, like)
    return tuple(torch.where(hit, s, z) for s, z in zip(value, zero))


def _select_extreme(sr, g, op, x, dims, keepdim):
    """Edges to the selected elements only."""
    dims = _reduced_dims(x, dims)
    hit, w = _extreme_edges(op, x, dims, keepdim)
    return [_only(sr, sr.times(_spread(g, x, dims, keepdim), w), hit, x)]


def _select_extreme_forward(sr, a, op, x, dims, keepdim):
    if a is None:
        return None
    dims = _reduced_dims(x, dims)
    hit, w = _extreme_edges(op, x, dims, keepdim)
    return _reduce(sr, _only(sr, sr.times(a, w), hit, x), x, dims, keepdim)


@register([aten.amax.default, aten.amin.default], "reduction")
def _amax(sr, g, op, x, dims=(), keepdim=False):
    return _select_extreme(sr, g, op, x, dims, keepdim)


@register_forward([aten.amax.default, aten.amin.default])
def _amax_forward(sr, a, op, x, dims=(), keepdim=False):
    return _select_extreme_forward(sr, a[0], op, x, dims, keepdim)


@register([aten.max.default, aten.min.default], "reduction")
def _max_all(sr, g, op, x):
    return _select_extreme(sr, g, op, x, None, False)


@register_forward([aten.max.default, aten.min.default])
def _max_all_forward(sr, a, op, x):
    return _select_extreme_forward(sr, a[0], op, x, None, False)


@register(aten.linalg_vector_norm.default, "reduction")
def _vector_norm(sr, g, op, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """One edge from each element to its norm, of weight ``sign(x)·|x|^(p-1) / ‖x‖^(p-1)``
    (0 where the norm is 0, as autograd's subgradient); the inf-norms have edges to the
    largest (smallest) |x| only, ties sharing the weight; the 0-"norm" counts, no edges.
    (Decomposed as ``sqrt(sum(x²))`` the paths would be the same, but a zero vector
    would give 0·inf.)"""
    ord = float(ord)
    if ord == 0:
        return [None]
    dims = _reduced_dims(x, dim)
    x = x.to(op.out.dtype)
    hit, w = _norm_edges(op, x, ord, dims, keepdim)
    spread = sr.times(_spread(g, x, dims, keepdim), w)
    return [spread if hit is None else _only(sr, spread, hit, x)]


def _norm_edges(op, x, ord, dims, keepdim):
    """(where the edges are, None: everywhere; their weights)."""
    norm = (
        op.out
        if keepdim
        else op.out.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
    )
    if math.isinf(ord):
        hit = x.abs() == norm
        return hit, torch.sign(x) * hit / hit.sum(dims, keepdim=True)
    if ord == 1:
        w = torch.sign(x)
    elif ord == 2:
        w = x / norm
    else:
        w = torch.sign(x) * x.abs().pow(ord - 1) / norm.pow(ord - 1)
    return None, (torch.where(norm == 0, 0.0, w) if ord != 1 else w)


@register_forward(aten.linalg_vector_norm.default)
def _vector_norm_forward(sr, a, op, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    ord = float(ord)
    if ord == 0 or a[0] is None:
        return None
    dims = _reduced_dims(x, dim)
    x = x.to(op.out.dtype)
    hit, w = _norm_edges(op, x, ord, dims, keepdim)
    weighted = sr.times(a[0], w)
    return _reduce(sr, weighted if hit is None else _only(sr, weighted, hit, x), x, dims, keepdim)
