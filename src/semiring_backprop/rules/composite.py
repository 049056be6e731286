"""Composite ops kept whole (``whole=``): their dense per-row Jacobian
defines the edges, one edge from every input element of a row to every output element
of that row."""

from __future__ import annotations

import math

import torch

from ..semirings.base import fmap
from .registry import register
from .shapes import unbroadcast

aten = torch.ops.aten


def _rowwise(sr, g, jac, dim):
    """``D(x)[..., i] = ⊕_j g[..., j] ⊗ jac[..., j, i]`` along ``dim``."""
    g = fmap(lambda f: f.movedim(dim, -1).unsqueeze(-2), g)
    d = sr.matmul(g, jac)
    return fmap(lambda f: f.squeeze(-2).movedim(-1, dim), d)


def _softmax_jacobian(y):
    return torch.diag_embed(y) - y.unsqueeze(-1) * y.unsqueeze(-2)


@register([aten.softmax.int, aten._softmax.default], "composite")
def _softmax(sr, g, op, x, dim, *args):
    y = op.out.movedim(dim, -1)
    return [_rowwise(sr, g, op.cached("jac", lambda: _softmax_jacobian(y)), dim)]


@register([aten.log_softmax.int, aten._log_softmax.default], "composite")
def _log_softmax(sr, g, op, x, dim, *args):
    p = torch.exp(op.out.movedim(dim, -1))

    def jac():
        eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
        return eye - p.unsqueeze(-2)  # [j, i] = δ_ji - p_i

    return [_rowwise(sr, g, op.cached("jac", jac), dim)]


@register(aten.layer_norm.default, "composite")
def _layer_norm(sr, g, op, x, shape, weight=None, bias=None, eps=1e-5, *args):
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

    xhat, jac = op.cached("parts", parts)
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
