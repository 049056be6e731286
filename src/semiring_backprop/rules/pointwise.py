"""Pointwise ops: one edge per output element per argument slot, weight ∂out/∂arg.

Derivatives come from a formula table for common ops and from forward-mode autograd
for every other op tagged ``torch.Tag.pointwise``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .registry import (
    fallback,
    fallback_forward,
    reads_each_for_the_other,
    reads_nothing,
    register,
    register_forward,
    rows,
)
from .shapes import broadcast, oplus, unbroadcast

aten = torch.ops.aten


def _jvp_derivative(target, args, kwargs, i):
    def f(x):
        a = list(args)
        a[i] = x
        return target(*a, **kwargs)

    x = args[i]
    with warnings.catch_warnings():
        # torch.func.jvp's first use loads torch's own decompositions through a
        # deprecated torch.jit.script call; nothing the user can act on
        warnings.filterwarnings(
            "ignore", message=".*torch.jit.script.*", category=DeprecationWarning
        )
        return torch.func.jvp(f, (x,), (torch.ones_like(x),))[1]


def _float_tensor(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _slot_fn(derivs, i):
    return derivs(i) if callable(derivs) else (derivs[i] if i < len(derivs) else None)


def _slot_derivative(op, d_fn, i, args, kwargs):
    """Slot ``i``'s local derivative, computed once per node (shared by every semiring
    and by both directions)."""
    return op.cached(("d", i), lambda: _derivative(d_fn(op, *args, **kwargs), op.out))


@dataclass(frozen=True)
class Factored:
    """A slot's derivative as the product ``outer * inner``: ``outer`` at the output's
    elements, ``inner`` at the slot's own (a broadcast denominator's ``-out / b`` is
    ``out`` times ``-1 / b``). The rule ⊗ ``outer``, ⊕-reduces over the broadcast dims,
    then ⊗ ``inner``: the same paths with the same products (⊗ distributes over ⊕, and
    lifting a product is the ⊗ of the lifts), without making the product at the
    output's shape. A float factor is a constant (``sr.scale``)."""

    outer: torch.Tensor | float
    inner: torch.Tensor | float


def _times(sr, value, d):
    return sr.scale(value, d) if isinstance(d, float) else sr.times(value, d)


def _backward(sr, op, i, g, d, shape):
    """Slot ``i``'s part of the rule: ``g`` ⊗ its derivative ``d``, ⊕-reduced to the
    slot's ``shape``."""
    if isinstance(d, Factored):
        reduced = unbroadcast(sr, _edges(sr, op, i, _times(sr, g, d.outer)), shape)
        return _times(sr, reduced, d.inner)
    return unbroadcast(sr, _edges(sr, op, i, _times(sr, g, d)), shape)


def _forward(sr, op, i, alpha, d):
    """The transpose of :func:`_backward`: slot ``i``'s value copied along the broadcast
    dims, ⊗ its derivative."""
    if isinstance(d, Factored):
        spread = broadcast(_times(sr, alpha, d.inner), op.out.shape, op.rows)
        return _edges(sr, op, i, _times(sr, spread, d.outer))
    return _edges(sr, op, i, _times(sr, broadcast(alpha, op.out.shape, op.rows), d))


def _edges(sr, op, i, value):
    """``value`` (at the output's elements) without slot ``i``'s edges that are not there
    (``Op.absent``: a structural zero for weight)."""
    absent = op.absent.get(i)
    return value if absent is None else sr.without(value, absent)


def _pointwise_rule(derivs):
    """Build a rule from one derivative function per argument slot (None: no edge)."""

    def rule(sr, g, op, *args, **kwargs):
        out = []
        for i, a in enumerate(args):
            d_fn = _slot_fn(derivs, i)
            if d_fn is None or not _float_tensor(a) or not op.needs(i):
                out.append(None)
                continue
            d = _slot_derivative(op, d_fn, i, args, kwargs)
            out.append(_backward(sr, op, i, g, d, a.shape))
        return out

    return rule


def _pointwise_forward(derivs):
    """The transpose of :func:`_pointwise_rule`: each slot's value copied along the
    broadcast dims, ⊗ its derivative, ⊕ over the slots."""

    def forward(sr, alphas, op, *args, **kwargs):
        parts = []
        for i, a in enumerate(args):
            d_fn = _slot_fn(derivs, i)
            alpha = alphas[i] if i < len(alphas) else None
            if d_fn is None or alpha is None or not _float_tensor(a):
                continue
            d = _slot_derivative(op, d_fn, i, args, kwargs)
            parts.append(_forward(sr, op, i, alpha, d))
        return oplus(sr, parts)

    return rows(forward)


def _derivative(d, like):
    """A tensor in ``like``'s dtype, or a Python float for a constant (``sr.scale``)."""
    if isinstance(d, Factored):
        return Factored(_derivative(d.outer, like), _derivative(d.inner, like))
    if isinstance(d, torch.Tensor):
        return d.to(like.dtype)
    return float(d)


@fallback  # the registry's rule for pointwise-tagged ops without one of their own
def generic_pointwise(sr, g, op, *args, **kwargs):
    """Fallback for any pointwise op: derivatives by torch.func.jvp, one slot at a time."""
    return _pointwise_rule(_jvp_slots(op.node.target))(sr, g, op, *args, **kwargs)


@fallback_forward
@rows
def generic_pointwise_forward(sr, a, op, *args, **kwargs):
    """The forward rule of :func:`generic_pointwise`."""
    return _pointwise_forward(_jvp_slots(op.node.target))(sr, a, op, *args, **kwargs)


def _jvp_slots(target):
    return lambda i: lambda op, *a, **k: _jvp_derivative(target, a, k, i)


def pointwise(ops, *derivs, reads=None):
    """Register a pointwise op by its per-slot derivative formulas (JAX's ``defjvp``);
    ``reads`` as for ``register`` (constant derivatives read nothing). Its forward rule
    comes from the same formulas."""
    register(ops, "pointwise", reads)(_pointwise_rule(derivs))
    register_forward(ops)(_pointwise_forward(derivs))


def _alpha(kw):
    return kw.get("alpha", 1)


NONE = reads_nothing
_READS_MUL = reads_each_for_the_other(0, 1)  # each factor only for the other's edge


def _reads_input(node, needed):  # a derivative of the input alone
    return [node.args[0]]


def _reads_output(node, needed):  # a derivative of the output alone (exp, tanh, ...)
    return [node]


IN, OUT = _reads_input, _reads_output


def _reads_div(node, needed):  # a / b: b for both edges, the output for b's
    a, b = node.args[:2]
    return [b, node] if b in needed else [b] if a in needed else []


# fmt: off
pointwise(aten.add.Tensor, lambda op, a, b, **k: 1.0, lambda op, a, b, **k: _alpha(k), reads=NONE)
pointwise(aten.add.Scalar, lambda op, a, b, alpha=1: 1.0, reads=NONE)  # alpha is positional here
pointwise(aten.sub.Tensor, lambda op, a, b, **k: 1.0, lambda op, a, b, **k: -_alpha(k), reads=NONE)
pointwise(aten.sub.Scalar, lambda op, a, b, alpha=1: 1.0, reads=NONE)
pointwise(aten.rsub.Scalar, lambda op, a, b, alpha=1: -alpha, reads=NONE)
pointwise(aten.mul.Tensor, lambda op, a, b: b, lambda op, a, b: a, reads=_READS_MUL)
pointwise(aten.mul.Scalar, lambda op, a, b: b, reads=NONE)
pointwise(aten.div.Tensor, lambda op, a, b: 1.0 / b, lambda op, a, b: Factored(op.out, -1.0 / b),
          reads=_reads_div)
pointwise(aten.div.Scalar, lambda op, a, b: 1.0 / b, reads=NONE)
pointwise(aten.neg.default, lambda op, a: -1.0, reads=NONE)
pointwise(aten.exp.default, lambda op, a: op.out, reads=OUT)
pointwise(aten.log.default, lambda op, a: 1.0 / a, reads=IN)
pointwise(aten.tanh.default, lambda op, a: 1.0 - op.out * op.out, reads=OUT)
pointwise(aten.sigmoid.default, lambda op, a: op.out * (1.0 - op.out), reads=OUT)
pointwise(aten.relu.default, lambda op, a: (a > 0).to(a.dtype), reads=IN)
pointwise(aten.rsqrt.default, lambda op, a: -0.5 * op.out ** 3, reads=OUT)
pointwise(aten.sqrt.default, lambda op, a: 0.5 / op.out, reads=OUT)
pointwise(
    aten.erf.default, lambda op, a: (2.0 / math.sqrt(math.pi)) * torch.exp(-a * a), reads=IN
)
pointwise(aten.sin.default, lambda op, a: torch.cos(a), reads=IN)
pointwise(aten.cos.default, lambda op, a: -torch.sin(a), reads=IN)
pointwise(aten.reciprocal.default, lambda op, a: -op.out * op.out, reads=OUT)
pointwise(
    aten.pow.Tensor_Scalar, lambda op, a, e: e * a ** (e - 1) if e != 0 else 0.0 * a, reads=IN
)
pointwise(
    aten.leaky_relu.default,
    lambda op, a, slope=0.01: torch.where(a > 0, 1.0, a.new_tensor(slope)),
    reads=IN,
)
pointwise(aten.abs.default, lambda op, a: torch.sign(a), reads=IN)
# fmt: on
