"""Composite ops kept whole (``whole=``): their dense per-row Jacobian
defines the edges, one edge from every input element of a row to every output element
of that row. The forward rules read the same Jacobian transposed."""

from __future__ import annotations

import math

import torch

from ..semirings.base import fmap
from .registry import register, register_forward
from .shapes import broadcast, oplus, unbroadcast

aten = torch.ops.aten


def _rowwise(sr, g, jac, dim, absent=None):
    """``D(x)[..., i] = ⊕_j g[..., j] ⊗ jac[..., j, i]`` along ``dim``; without the edges
    where ``absent`` (over ``jac``, ``Op.absent``) holds."""
    g = fmap(lambda f: f.movedim(dim, -1).unsqueeze(-2), g)
    d = sr.matmul(g, jac) if absent is None else sr.matmul_without(g, jac, absent)
    return fmap(lambda f: f.squeeze(-2).movedim(-1, dim), d)


def _rowwise_forward(sr, a, jac, dim, absent=None):
    """``alpha(y)[..., j] = ⊕_i a[..., i] ⊗ jac[..., j, i]`` along ``dim``."""
    if a is None:
        return None
    flip = None if absent is None else absent.transpose(-2, -1)
    return _rowwise(sr, a, jac.transpose(-2, -1), dim, flip)


def _softmax_jacobian(y):
    return torch.diag_embed(y) - y.unsqueeze(-1) * y.unsqueeze(-2)


@register([aten.softmax.int, aten._softmax.default], "composite")
def _softmax(sr, g, op, x, dim, *args):
    return [_rowwise(sr, g, _softmax_jac(op, dim), dim, op.absent.get(0))]


def _softmax_jac(op, dim):
    return op.cached("jac", lambda: _softmax_jacobian(op.out.movedim(dim, -1)))


@register_forward([aten.softmax.int, aten._softmax.default])
def _softmax_forward(sr, a, op, x, dim, *args):
    return _rowwise_forward(sr, a[0], _softmax_jac(op, dim), dim, op.absent.get(0))


@register([aten.log_softmax.int, aten._log_softmax.default], "composite")
def _log_softmax(sr, g, op, x, dim, *args):
    return [_rowwise(sr, g, _log_softmax_jac(op, dim), dim)]


def _log_softmax_jac(op, dim):
    def jac():
        p = torch.exp(op.out.movedim(dim, -1))
        eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
        return eye - p.unsqueeze(-2)  # [j, i] = δ_ji - p_i

    return op.cached("jac", jac)


@register_forward([aten.log_softmax.int, aten._log_softmax.default])
def _log_softmax_forward(sr, a, op, x, dim, *args):
    return _rowwise_forward(sr, a[0], _log_softmax_jac(op, dim), dim)


def _layer_norm_parts(op, x, shape, weight, eps):
    """(x̂ in x's shape, the per-row Jacobian [..., j, i]), once per node."""
    k = len(shape)
    rows = x.shape[:-k]
    h = math.prod(shape)
    xf = x.reshape(*rows, h)

    def parts():
        mu = xf.mean(-1, keepdim=True)
        sigma = torch.sqrt(((xf - mu) ** 2).mean(-1, keepdim=True) + eps)
        xhat = (xf - mu) / sigma
        w = weight.reshape(h) if weight is not None else xf.new_ones(h)
        eye = torch.eye(h, dtype=x.dtype, device=x.device)
        inner = eye - 1.0 / h - xhat.unsqueeze(-1) * xhat.unsqueeze(-2) / h  # [j, i]
        jac = (w.reshape(h, 1) / sigma.unsqueeze(-1)) * inner
        return xhat.reshape(x.shape), jac

    return op.cached("parts", parts)


@register(aten.layer_norm.default, "composite")
def _layer_norm(sr, g, op, x, shape, weight=None, bias=None, eps=1e-5, *args):
    rows, h = x.shape[: -len(shape)], math.prod(shape)
    xhat, jac = _layer_norm_parts(op, x, shape, weight, eps)
    gf = fmap(lambda f: f.reshape(*rows, h), g)
    dx = None
    if op.needs(0):
        dx = fmap(lambda f: f.reshape(x.shape), _rowwise(sr, gf, jac, -1))
    dw = (
        unbroadcast(sr, sr.times(g, xhat), weight.shape)
        if weight is not None and op.needs(2)
        else None
    )
    db = unbroadcast(sr, g, bias.shape) if bias is not None and op.needs(3) else None
    return [dx, None, dw, db]


@register_forward(aten.layer_norm.default)
def _layer_norm_forward(sr, a, op, x, shape, weight=None, bias=None, eps=1e-5, *args):
    rows, h = x.shape[: -len(shape)], math.prod(shape)
    xhat, jac = _layer_norm_parts(op, x, shape, weight, eps)
    parts = [None, None, None]
    if a[0] is not None:
        af = fmap(lambda f: f.reshape(*rows, h), a[0])
        parts[0] = fmap(lambda f: f.reshape(x.shape), _rowwise_forward(sr, af, jac, -1))
    if weight is not None and len(a) > 2 and a[2] is not None:
        parts[1] = sr.times(broadcast(a[2], x.shape), xhat)
    if bias is not None and len(a) > 3 and a[3] is not None:
        parts[2] = broadcast(a[3], x.shape)
    return oplus(sr, parts)
