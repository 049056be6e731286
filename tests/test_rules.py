"""Every rule in the registry against torch.autograd (DESIGN §4, STYLE "Registries").

``CASES`` maps each registered overload to small functions that exercise it (with
broadcasting where the op broadcasts). The test is parametrized over the registry itself,
so a new rule without a case here fails. Two kinds of case:

- ``Traced``: the function is run through ``sbp.backprop`` (Real, float64) and compared
  with ``torch.autograd.grad``; the test also checks that the op is really in the traced
  graph, and that every other semiring runs on it without NaN.
- ``Direct``: ops that torch's default decompositions lower before our pass when a user
  writes them the usual way (``x.t()`` -> ``permute``, ``x + 1`` -> ``add.Tensor``, ...).
  Their rules still matter (direct ``aten`` calls, other decomposition tables, other torch
  versions), so the rule is called directly on one FX node and compared with autograd's
  vector-Jacobian product; the op called directly is also run through ``sbp.backprop``.

Nondifferentiable ops are checked to carry no edges: a ``Traced`` case with ``paths``
builds ``x * op(x)`` (or similar), whose only path per element bypasses the op, and checks
the path count; a ``Direct`` case checks the rule returns no value for any input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import oracles
import semiring_backprop as sbp
from semiring_backprop import rules
from semiring_backprop.engine.reverse import _pair

aten = torch.ops.aten
sbp_ops = torch.ops.semiring_backprop

ALL = oracles.all_semirings()


def r(*shape, seed=0, low=None):
    """Seeded float64 normals; ``low``: magnitudes at least ``low`` (away from poles),
    positive."""
    g = torch.Generator().manual_seed(seed + 17 * len(shape) + sum(shape))
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    return t if low is None else t.abs() + low


def ids(*values):
    return torch.tensor(values)


@dataclass(frozen=True)
class Traced:
    fn: Callable
    inputs: Callable[[], tuple]
    whole: tuple = ()
    paths: float | None = None  # expected log #paths at every element of input 0
    rtol: float = 1e-10


@dataclass(frozen=True)
class Direct:
    args: Callable[[], tuple]
    kwargs: dict = field(default_factory=dict)
    rtol: float | None = None  # default: by the output's dtype


class _Linear(torch.nn.Module):
    """An nn.Module: its input and output are wrapped in the ``mark`` op."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3).double()
        self.eval()

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _ties():
    x = r(3, 4)
    x[0, 1] = x[0, 3] = x[0].abs().max() + 1  # a tied maximum in row 0
    x[2, 0] = x[2, 2] = -(x[2].abs().max() + 1)  # a tied minimum in row 2
    return (x,)


def _all_tied_max():
    x = r(3, 4)
    x[0, 0] = x[2, 3] = x.abs().max() + 1
    x[1, 1] = x[1, 2] = -(x.abs().max() + 1)
    return (x,)


X = lambda: (r(3, 4),)  # noqa: E731
XY2 = lambda: (r(3, 4), r(3, 4, seed=1))  # noqa: E731


def _grouped_fallback():
    """transformers' mixture-of-experts matmul (a custom op), when transformers has it."""
    moe = pytest.importorskip("transformers.integrations.moe")
    return moe.torch.ops.transformers.grouped_mm_fallback


def _write(t, index, value):
    """``t[index] = value``: an in-place write into a view (``aten.copy`` once traced)."""
    t[index] = value
    return t


XY = lambda: (r(3, 4), r(4, seed=1))  # noqa: E731
X3 = lambda: (r(2, 3, 4),)  # noqa: E731

CASES: dict[object, list] = {
    # -- composite ops kept whole (whole=...) -------------------------------------------
    aten.softmax.int: [
        Traced(lambda x: torch.softmax(x, -1), X3, whole=("softmax",)),
        Traced(lambda x: torch.softmax(x, 1) * x, X3, whole=("softmax",)),
    ],
    aten._softmax.default: [
        Traced(lambda x: aten._softmax(x, 0, False), X3, whole=("softmax",)),
    ],
    aten.log_softmax.int: [
        Traced(lambda x: torch.log_softmax(x, -1), X3, whole=("log_softmax",)),
        Traced(lambda x: torch.log_softmax(x, 1), X3, whole=("log_softmax",)),
    ],
    aten._log_softmax.default: [
        Traced(lambda x: aten._log_softmax(x, 0, False), X3, whole=("log_softmax",)),
    ],
    aten.layer_norm.default: [
        Traced(
            lambda x, w, b: F.layer_norm(x, (4,), w, b),
            lambda: (r(2, 3, 4), r(4, seed=1), r(4, seed=2)),
            whole=("layer_norm",),
        ),
        Traced(lambda x: F.layer_norm(x, (3, 4), eps=1e-3), X3, whole=("layer_norm",)),
        Traced(
            lambda x, w: F.layer_norm(x, (3, 4), w),
            lambda: (r(2, 3, 4), r(3, 4, seed=1)),
            whole=("layer_norm",),
        ),
    ],
    # -- pointwise (formula table) ------------------------------------------------------
    aten.add.Tensor: [
        Traced(lambda x, y: x + y, XY),
        Traced(lambda x, y: torch.add(x, y[:, None], alpha=2.5), lambda: (r(3, 4), r(3))),
        Traced(lambda x: x + x, X),
        Traced(lambda x: x + 1.5, X),
    ],
    aten.add.Scalar: [Direct(lambda: (r(3, 4), 1.5), {"alpha": 2})],
    aten.sub.Tensor: [
        Traced(lambda x, y: x - y, XY),
        Traced(lambda x, y: torch.sub(y[:, None], x, alpha=0.5), lambda: (r(3, 4), r(3))),
        Traced(lambda x: 1.0 - x, X),
    ],
    aten.sub.Scalar: [Direct(lambda: (r(3, 4), 1.5))],
    aten.rsub.Scalar: [Direct(lambda: (r(3, 4), 1.5), {"alpha": 2})],
    aten.mul.Tensor: [
        Traced(lambda x, y: x * y, lambda: (r(2, 1, 4), r(3, 1, seed=1))),
        Traced(lambda x: x * x, X),
        Traced(lambda x: x * 3.0, X),
    ],
    aten.mul.Scalar: [Direct(lambda: (r(3, 4), -2.5))],
    aten.div.Tensor: [
        Traced(lambda x, y: x / y, lambda: (r(3, 4), r(4, seed=1, low=0.5))),
        Traced(lambda x, y: y / x, lambda: (r(3, 1, low=0.5), r(4, seed=1))),
        Traced(lambda x: x / 4.0, X),
    ],
    aten.div.Scalar: [Direct(lambda: (r(3, 4), 4.0))],
    aten.neg.default: [Traced(lambda x: -x, X)],
    aten.exp.default: [Traced(torch.exp, X)],
    aten.log.default: [Traced(torch.log, lambda: (r(3, 4, low=0.1),))],
    aten.tanh.default: [Traced(torch.tanh, X)],
    aten.sigmoid.default: [Traced(torch.sigmoid, X)],
    aten.relu.default: [Traced(torch.relu, X)],
    aten.rsqrt.default: [Traced(torch.rsqrt, lambda: (r(3, 4, low=0.1),))],
    aten.sqrt.default: [Traced(torch.sqrt, lambda: (r(3, 4, low=0.1),))],
    aten.erf.default: [Traced(torch.erf, X)],
    aten.sin.default: [Traced(torch.sin, X)],
    aten.cos.default: [Traced(torch.cos, X)],
    aten.reciprocal.default: [Traced(torch.reciprocal, lambda: (r(3, 4, low=0.3),))],
    aten.pow.Tensor_Scalar: [
        Traced(lambda x: x**2, X),
        Traced(lambda x: x**3, X),
        Traced(lambda x: x**0.5, lambda: (r(3, 4, low=0.1),)),
        Traced(lambda x: x**-1.5, lambda: (r(3, 4, low=0.1),)),
        Traced(lambda x: x**1 * x, X),
        Traced(lambda x: x**0 * x, X),
    ],
    aten.leaky_relu.default: [
        Traced(F.leaky_relu, X),
        Traced(lambda x: F.leaky_relu(x, 0.2), X),
    ],
    aten.abs.default: [Traced(torch.abs, X)],
    # -- routing -------------------------------------------------------------------------
    sbp_ops.mark.default: [Traced(_Linear(), X)],
    aten.view.default: [Traced(lambda x: x.view(2, 6), X)],
    aten._unsafe_view.default: [Direct(lambda: (r(3, 4), [2, 6]))],
    aten.reshape.default: [Direct(lambda: (r(3, 4), [4, 3]))],
    aten.flatten.using_ints: [Direct(lambda: (r(2, 3, 4), 1, 2))],
    aten.unsqueeze.default: [Traced(lambda x: x.unsqueeze(1) * x[:, None, :1], X)],
    aten.squeeze.default: [Direct(lambda: (r(3, 1, 4),))],
    aten.squeeze.dim: [Direct(lambda: (r(3, 1, 4), 1))],
    aten.squeeze.dims: [Traced(lambda x: x[:, None, :, None].squeeze((1, 3)), X)],
    aten.alias.default: [Traced(aten.alias, X)],
    aten.clone.default: [Traced(lambda x: x.clone() * x, X)],
    aten.lift_fresh_copy.default: [Direct(lambda: (r(3, 4),))],
    aten.contiguous.default: [Direct(lambda: (r(3, 4),))],
    aten._to_copy.default: [
        Traced(lambda x: x.to(torch.float32).to(torch.float64) * x, X),
        Traced(lambda x, i: x * i.to(torch.float64), lambda: (r(3, 4), ids(1, 2, 3, 4))),
    ],
    aten.to.dtype: [Direct(lambda: (r(3, 4), torch.float32))],
    aten.permute.default: [Traced(lambda x: x.permute(2, 0, 1), X3)],
    aten.transpose.int: [Direct(lambda: (r(2, 3, 4), 0, -1))],
    aten.t.default: [Direct(lambda: (r(3, 4),))],
    aten.expand.default: [
        Traced(lambda x: x[:, :1].expand(3, 4) * x, X),
        Traced(lambda x: x[None].expand(2, 3, 4), X),
    ],
    aten.slice.Tensor: [
        Traced(lambda x: x[1:], X),
        Traced(lambda x: x[:, 1::2] * x[:, :2], X),
        Traced(lambda x: x[..., -3:-1], X3),
    ],
    aten.select.int: [Traced(lambda x: x[1] * x[:, -1, None], X3)],
    aten.cat.default: [
        Traced(lambda x, y: torch.cat([x, y[None], x * 2], 0), XY),
        Traced(lambda x: torch.cat([x[:, :1], x], 1), X),
        Traced(lambda x: torch.cat([x, torch.empty(0, dtype=x.dtype)], 0), X),
        Traced(lambda x: torch.stack([x, x.flip(0)], -1), X),
    ],
    aten.index.Tensor: [
        Traced(lambda x: x[ids(0, 2, 0)], X),
        Traced(lambda x: x[:, ids(3, 1, 3, 3)], X),
        Traced(lambda x: x[ids(0, 2, 0)[:, None], ids(1, 3)], X),
        Traced(lambda x: x[:, torch.tensor([True, False, True, True])], X),
    ],
    aten.gather.default: [Traced(lambda x: x.gather(1, ids(0, 0, 3, 1).expand(3, 4)), X)],
    aten.index_select.default: [Traced(lambda x: x.index_select(1, ids(2, 0, 2)), X)],
    aten.flip.default: [Traced(lambda x: x.flip(0, 2), X3)],
    aten.roll.default: [Direct(lambda: (r(3, 4), [1, -1], [0, 1]))],
    aten.diagonal.default: [
        Traced(lambda x: x.diagonal(), X),
        Traced(lambda x: x.diagonal(1, -2, -1), X3),
    ],
    aten.embedding.default: [
        Traced(lambda w: F.embedding(ids(0, 2, 0, 4, 0), w), lambda: (r(5, 3),)),
        Traced(lambda w: F.embedding(ids(1, 1)[None].expand(2, 2), w, padding_idx=1), X),
    ],
    aten.where.self: [
        Traced(lambda x, y: torch.where(x > 0, x, y), XY),
        Traced(lambda x: torch.where(x > 0, x, 0.5), X),
        Traced(lambda x: x.masked_fill(x > 0, -2.0), X),
        Traced(lambda x: x.tril(), X),
    ],
    aten.masked_fill.Scalar: [Direct(lambda: (r(3, 4), r(3, 4, seed=1) > 0, 2.0))],
    aten.masked_fill.Tensor: [
        Direct(lambda: (r(3, 4), r(4, seed=1) > 0, torch.tensor(2.0, dtype=torch.float64)))
    ],
    aten.constant_pad_nd.default: [
        Traced(lambda x: F.pad(x, (1, 2)), X),
        Traced(lambda x: F.pad(x, (1, -1, 0, 1), value=3.0), X),
    ],
    aten.index_put.default: [
        Traced(lambda x, y: x.index_put((ids(0, 2),), y[:2]), lambda: (r(3, 4), r(3, 4, seed=1))),
        Traced(
            lambda x, y: x.index_put((ids(0, 0, 2),), y, accumulate=True),
            lambda: (r(3, 4), r(3, 4, seed=1)),
        ),
    ],
    aten.slice_scatter.default: [
        Traced(
            lambda x, y: torch.slice_scatter(x, y[:, :2], 1, 1, 4, 2),
            lambda: (r(3, 4), r(3, 4, seed=1)),
        ),
    ],
    aten.select_scatter.default: [Direct(lambda: (r(3, 4), r(4, seed=1), 0, 1))],
    aten.scatter.src: [
        Traced(
            lambda x, y: x.scatter(1, ids(0, 2, 1)[:, None], y[:, :1]),
            lambda: (r(3, 4), r(3, 2, seed=1)),
        ),
    ],
    aten.scatter.value: [Traced(lambda x: x.scatter(1, ids(0, 2, 1)[:, None], 2.0), X)],
    aten.repeat.default: [Traced(lambda x: x.repeat(2, 1, 2), X)],
    aten.copy.default: [  # ``y[:, :2] = ...`` on a fresh tensor: the old values are gone
        Traced(lambda x, y: _write(x.clone(), (slice(None), slice(0, 2)), y[:, 1:3] * 2), XY2),
        Traced(lambda x, y: _write(x * 1.0, (slice(None),), y[0].float()), XY2),  # cast, bcast
    ],
    aten.unfold.default: [Traced(lambda x: x.unfold(1, 2, 1), X)],
    # -- contractions --------------------------------------------------------------------
    aten.mm.default: [Traced(lambda a, b: a @ b, lambda: (r(3, 4), r(4, 2, seed=1)))],
    aten.bmm.default: [
        Traced(torch.bmm, lambda: (r(2, 3, 4), r(2, 4, 2, seed=1))),
        Traced(lambda a, b: a @ b, lambda: (r(2, 1, 3, 4), r(3, 4, 2, seed=1))),
    ],
    aten.addmm.default: [
        Traced(F.linear, lambda: (r(3, 4), r(2, 4, seed=1), r(2, seed=2))),
        Traced(
            lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
            lambda: (r(3, 1, seed=2), r(3, 4), r(4, 2, seed=1)),
        ),
    ],
    aten.baddbmm.default: [
        Direct(lambda: (r(1, 3, 2, seed=2), r(2, 3, 4), r(2, 4, 2, seed=1)), {"beta": 0.5}),
        Direct(lambda: (r(2, 3, 2, seed=2), r(2, 3, 4), r(2, 4, 2, seed=1)), {"alpha": 3.0}),
    ],
    aten.convolution.default: [
        Traced(
            lambda x, w: F.conv1d(x, w, stride=2, padding=1, groups=2),
            lambda: (r(2, 4, 9), r(6, 2, 3, seed=1)),
        ),  # fmt: skip
        Traced(
            lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=(2, 1)),
            lambda: (r(2, 2, 7, 6), r(3, 2, 3, 2, seed=1), r(3, seed=2)),
        ),  # fmt: skip
        Traced(lambda x, w: F.conv3d(x, w), lambda: (r(1, 2, 3, 3, 3), r(2, 2, 2, 1, 2, seed=1))),
        # padding="valid" (SigLIP's patch embedding) is traced as one padding for all dims
        Traced(
            lambda x, w: F.conv2d(x, w, stride=2, padding="valid", dilation=(1, 2)),
            lambda: (r(1, 2, 7, 8), r(3, 2, 3, 2, seed=1)),
        ),  # fmt: skip
        # fewer input than output channels: D(x) contracts over the output channels first
        Traced(
            lambda x, w: F.conv2d(x, w, stride=2, padding=1),
            lambda: (r(1, 2, 5, 5), r(8, 2, 3, 3, seed=1)),
        ),  # fmt: skip
        Traced(
            lambda x, w: F.conv1d(x, w, stride=2, groups=2),
            lambda: (r(2, 2, 9), r(8, 1, 3, seed=1)),
        ),  # fmt: skip
        Traced(
            lambda x, w: F.conv_transpose2d(x, w, groups=2),
            lambda: (r(1, 2, 3, 3), r(2, 4, 3, 3, seed=1)),
        ),  # fmt: skip
        Traced(
            lambda x, w: F.conv_transpose2d(
                x,
                w,
                stride=(2, 3),
                padding=(1, 0),
                output_padding=(1, 1),
                dilation=(1, 2),
                groups=2,
            ),
            lambda: (r(2, 4, 3, 4), r(4, 3, 3, 2, seed=1)),
        ),
        Traced(
            lambda x, w: F.conv_transpose1d(x, w, stride=2, padding=1),
            lambda: (r(2, 5), r(2, 3, 3, seed=1)),
        ),  # unbatched  # fmt: skip
    ],
    aten._grouped_mm.default: [
        Direct(  # bfloat16: all torch's CPU kernel takes (rounding: a loose tolerance)
            lambda: (
                r(7, 8).bfloat16(),
                r(3, 8, 8, seed=1).bfloat16(),  # strides of 16 bytes, as the kernel wants
                # every row in a group: rows past the last offset are left unwritten
                torch.tensor([2, 2, 7], dtype=torch.int32),
            ),
            rtol=2e-2,
        )
    ],
    "transformers.grouped_mm_fallback.default": [
        Traced(
            lambda x, w: _grouped_fallback()(x, w, torch.tensor([3, 3, 5], dtype=torch.int32)),
            lambda: (r(6, 4), r(3, 4, 2, seed=1)),
        )
    ],
    # -- reductions ----------------------------------------------------------------------
    aten.sum.dim_IntList: [
        Traced(lambda x: x.sum((0, 2), keepdim=True) * x, X3),
        Traced(lambda x: x.sum(-1), X3),
    ],
    aten.sum.default: [Direct(lambda: (r(3, 4),))],
    aten.mean.dim: [
        Traced(lambda x: x.mean(1), X3),
        Traced(lambda x: x.mean((0, -1), keepdim=True) * x, X3),
    ],
    aten.mean.default: [Traced(lambda x: x.mean() * x, X)],
    aten.amax.default: [
        Traced(lambda x: x.amax(1), _ties),
        Traced(lambda x: x.amax((0, 1), keepdim=True) * x, _all_tied_max),
    ],
    aten.amin.default: [Traced(lambda x: x.amin(-1, keepdim=True) * x, _ties)],
    aten.max.default: [Traced(lambda x: x.max() * x, _all_tied_max)],
    aten.avg_pool2d.default: [
        Traced(lambda x: F.avg_pool2d(x, 2, padding=1), lambda: (r(1, 2, 5, 5),)),
        Traced(
            lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
            lambda: (r(1, 2, 6, 5),),
        ),
        Traced(lambda x: F.avg_pool2d(x, 2, divisor_override=3), lambda: (r(2, 4, 4),)),
        Traced(lambda x: F.avg_pool1d(x, 3, 2), lambda: (r(1, 2, 7),)),
    ],
    aten.avg_pool3d.default: [Traced(lambda x: F.avg_pool3d(x, 2, 1), lambda: (r(1, 1, 3, 3, 3),))],
    aten.cumsum.default: [  # every input feeds the outputs from it on (Mamba2's scans)
        Traced(lambda x: x.cumsum(-1) * x, lambda: (r(2, 5),)),
        Traced(lambda x: x.cumsum(0), lambda: (r(4, 3),)),
        Traced(lambda x: torch.tanh(x).cumsum(1).exp(), lambda: (r(2, 3, 4),)),
    ],
    aten._adaptive_avg_pool2d.default: [
        Traced(lambda x: F.adaptive_avg_pool2d(x, (2, 3)), lambda: (r(1, 2, 5, 7),)),
        Traced(lambda x: F.adaptive_avg_pool1d(x, 3), lambda: (r(1, 2, 7),)),
    ],
    aten._adaptive_avg_pool3d.default: [
        Traced(lambda x: F.adaptive_avg_pool3d(x, (2, 1, 2)), lambda: (r(1, 2, 3, 3, 5),))
    ],
    aten.linalg_vector_norm.default: [
        Traced(lambda x: torch.linalg.vector_norm(x, dim=-1) * x[:, 0], X),
        Traced(lambda x: torch.linalg.vector_norm(x, 1, dim=(0, 1), keepdim=True) * x, X),
        Traced(lambda x: torch.linalg.vector_norm(x, 3.5, dim=0), X),
        Traced(lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1), _ties),
        Traced(lambda x: torch.linalg.vector_norm(x, -float("inf")), X),
        Traced(lambda x: F.normalize(x, dim=-1), X),
        # a zero row: autograd's subgradient is 0 there, not 0·inf
        Traced(lambda x: x.norm(dim=1) * x[:, 0], lambda: (r(3, 4) * ids(0, 1, 1)[:, None],)),
    ],
    aten.min.default: [Traced(lambda x: x.min() * x, _all_tied_max)],
    # -- nondifferentiable: x * op(x) has one path per element, through x alone ----------
    sbp_ops.softmax_shift.default: [
        # softmax decomposed: x_i -> exp_i -> (y_i, and the row sum -> every y_j): 1 + n
        Traced(lambda x: torch.softmax(x, -1), X, paths=math.log(1 + 4)),
    ],
    aten.detach.default: [Traced(lambda x: x.detach() * x, X, paths=0.0)],
    aten.sign.default: [Traced(lambda x: x.sign() * x, X, paths=0.0)],
    aten.floor.default: [Traced(lambda x: torch.floor(x * 3) * x, X, paths=0.0)],
    aten.ceil.default: [Traced(lambda x: torch.ceil(x * 3) * x, X, paths=0.0)],
    aten.round.default: [Traced(lambda x: torch.round(x * 3) * x, X, paths=0.0)],
    aten.trunc.default: [Traced(lambda x: torch.trunc(x * 3) * x, X, paths=0.0)],
    aten.full_like.default: [Traced(lambda x: torch.full_like(x, 2.0) * x, X, paths=0.0)],
    aten.zeros_like.default: [Direct(lambda: (r(3, 4),))],
    aten.ones_like.default: [Direct(lambda: (r(3, 4),))],
    aten.empty_like.default: [Direct(lambda: (r(3, 4),))],
    aten.rand_like.default: [Traced(lambda x: (torch.rand_like(x) * 0 + 1) * x, X, paths=0.0)],
    aten.randn_like.default: [Traced(lambda x: (torch.randn_like(x) * 0 + 1) * x, X, paths=0.0)],
    aten.bernoulli.default: [Direct(lambda: (torch.full((3, 4), 0.5, dtype=torch.float64),))],
    aten.argmax.default: [
        Traced(lambda x: x.gather(1, x.argmax(1, keepdim=True)), X),
        Traced(lambda x: x.max(-1).values, X),
    ],
    aten.argmin.default: [Traced(lambda x: x.min(0).values, X)],
}

# Ops without a registered rule that the generic pointwise rule (forward-mode autograd)
# handles because they carry torch.Tag.pointwise.
GENERIC: dict[object, list] = {
    aten.gelu.default: [
        Traced(F.gelu, X, whole=("gelu",)),
        Traced(lambda x: F.gelu(x, approximate="tanh"), X, whole=("gelu",)),
    ],
    aten.hardtanh.default: [Traced(F.hardtanh, lambda: (r(3, 4) * 2,)), Traced(F.relu6, X)],
    aten.clamp.default: [Traced(lambda x: x.clamp(-0.5, 0.5), X)],
    aten.clamp.Tensor: [Traced(lambda x, lo: x.clamp(min=lo), XY)],
    aten.elu.default: [Traced(F.elu, X)],
    aten.atan2.default: [Traced(torch.atan2, XY)],
    aten.maximum.default: [Traced(torch.maximum, XY)],
    aten.expm1.default: [Traced(torch.expm1, X)],
    aten.log1p.default: [Traced(torch.log1p, lambda: (r(3, 4, low=0.1),))],
    aten.pow.Tensor_Tensor: [
        Traced(torch.pow, lambda: (r(3, 4, low=0.2), r(4, seed=1))),
    ],
}


def _params():
    ops = set(rules.registered()) | set(CASES)
    out = []
    for op in sorted(ops, key=str):
        cases = CASES.get(op) or [None]
        out += [pytest.param(op, i, c, id=f"{op}-{i}") for i, c in enumerate(cases)]
    for op, cases in GENERIC.items():
        out += [pytest.param(op, i, c, id=f"generic:{op}-{i}") for i, c in enumerate(cases)]
    return out


@pytest.mark.parametrize(("op", "i", "case"), _params())
def test_rule_matches_autograd(op, i, case):
    assert case is not None, (
        f"{op} has a rule but no test case: add one to CASES in {__file__} "
        "(a Traced function that exercises it, or a Direct call if tracing lowers it)"
    )
    if isinstance(case, Direct):
        _check_direct(op, case)
    else:
        _check_traced(op, case)


def test_generic_ops_really_use_the_fallback():
    for op in GENERIC:
        assert op not in rules.registered()
        rule = rules.lookup(op)
        assert rule is not None and rule.fn is rules.pointwise.generic_pointwise


# -- traced cases ------------------------------------------------------------------------


def _floats(xs):
    return [i for i, x in enumerate(xs) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _autograd(fn, inputs, weight):
    leaves = [
        x.clone().requires_grad_() if i in _floats(inputs) else x for i, x in enumerate(inputs)
    ]
    y = fn(*leaves)
    out = (y * weight).sum()
    want = [leaves[i] for i in _floats(inputs)]
    grads = torch.autograd.grad(out, want, allow_unused=True)
    return {
        i: (torch.zeros_like(inputs[i]) if g is None else g) for i, g in zip(_floats(inputs), grads)
    }


def _check_traced(op, case: Traced, require_op: bool = True):
    inputs = case.inputs()
    torch.manual_seed(0)  # rand_like and friends
    with torch.no_grad():
        shape = case.fn(*inputs).shape
    weight = r(*shape, seed=99)
    output = lambda y: (y * weight).sum()  # noqa: E731
    res = sbp.backprop(case.fn, args=inputs, output=output, semirings=ALL, whole=case.whole)
    targets = {n.target for n in res.graph.nodes}
    assert op in targets or str(op) in set(map(str, targets)) or not require_op, (
        f"the case does not exercise {op}; the traced graph has {targets}"
    )
    want = _autograd(case.fn, inputs, weight)
    for k, g in want.items():
        try:
            got = res.at(k, sbp.Real())
        except sbp.InputError:  # no path from this input: autograd must agree
            assert not g.any(), f"input {k} has no path but a nonzero gradient"
            continue
        scale = max(1.0, float(g.abs().max()))
        torch.testing.assert_close(got, g, rtol=case.rtol, atol=case.rtol * 1e-2 * scale)
        for sr in ALL[1:]:
            value = res.value(k, sr)
            assert not any(bool(torch.isnan(f).any()) for f in value), f"NaN under {sr.name}"
            assert all(f.shape == inputs[k].shape for f in value), sr.name
    if case.paths is not None:
        count = res.at(0, sbp.PathCount()).log_count
        torch.testing.assert_close(count, torch.full_like(count, case.paths))


# -- direct cases --------------------------------------------------------------------------


def _check_direct(op, case: Direct):
    args = case.args()
    leaves, spec = pytree.tree_flatten((args, case.kwargs))
    is_float = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves]

    # the op as a user would call it (torch may or may not lower it first)
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def call(*tensors):
        new = list(leaves)
        for i, t in zip(tensor_at, tensors):
            new[i] = t
        a, k = pytree.tree_unflatten(new, spec)
        return op(*a, **k)

    if any(is_float) and rules.registered()[op].kind != "nondifferentiable":
        inputs = lambda: tuple(leaves[i] for i in tensor_at)  # noqa: E731
        # autograd rounds gradients to each tensor's dtype; we keep float64 throughout
        rtol = case.rtol or (1e-10 if op(*args, **case.kwargs).dtype == torch.float64 else 1e-6)
        _check_traced(op, Traced(call, inputs, rtol=rtol), require_op=False)

    fx = torch.fx.Graph()
    nodes = [
        fx.placeholder(f"a{i}") if isinstance(x, torch.Tensor) else x for i, x in enumerate(leaves)
    ]
    node_args, node_kwargs = pytree.tree_unflatten(nodes, spec)
    node = fx.call_function(op, tuple(node_args), node_kwargs)
    needed = frozenset(n for n, f in zip(nodes, is_float) if f)

    grad_leaves = [x.clone().requires_grad_() if f else x for x, f in zip(leaves, is_float)]
    a, k = pytree.tree_unflatten(grad_leaves, spec)
    out = op(*a, **k)
    seed = r(*out.shape, seed=5).to(out.dtype)
    with torch.no_grad():
        a0, k0 = pytree.tree_unflatten(leaves, spec)
        rule = rules.registered()[op]
        res = rule.fn(sbp.Real(), (seed,), rules.Op(node, a0, k0, out.detach(), needed), *a0, **k0)
    got = dict(_pair(node.args, res))

    if rule.kind == "nondifferentiable":
        assert all(v is None for v in got.values()), f"{op} must carry no edges"
        return
    floats = [x for x, f in zip(grad_leaves, is_float) if f]
    grads = torch.autograd.grad(out, floats, seed, allow_unused=True)
    float_nodes = [n for n, f in zip(nodes, is_float) if f]
    for n, g in zip(float_nodes, grads):
        v = got.get(n)
        if v is None:
            assert g is None or not g.any(), f"the rule gave no value for {n.name}"
            continue
        torch.testing.assert_close(v[0], g, rtol=1e-10, atol=1e-12)


# -- whole= on every keepable composite -------------------------------------------------------

KEEPABLE = {
    "softmax": (lambda x: torch.softmax(x @ x.transpose(-1, -2), -1) @ x, aten.softmax.int),
    "log_softmax": (lambda x: torch.log_softmax(x * 2, 1) * x, aten.log_softmax.int),
    "layer_norm": (lambda x: F.layer_norm(x.transpose(0, 1), (4,)) * 3, aten.layer_norm.default),
    "gelu": (lambda x: F.gelu(x) * x, aten.gelu.default),
}


def test_keepable_list_is_covered():
    from semiring_backprop.tracing.decompositions import KEEPABLE as names

    assert set(names) == set(KEEPABLE)


@pytest.mark.parametrize("name", sorted(KEEPABLE))
@pytest.mark.parametrize("kept", [True, False], ids=["kept", "decomposed"])
def test_keep_composite(name, kept):
    fn, op = KEEPABLE[name]
    x = r(2, 3, 4)
    weight = r(*fn(x).shape, seed=3)
    keep = (name,) if kept else ()
    res = sbp.backprop(fn, args=(x,), output=lambda y: (y * weight).sum(), whole=keep)
    assert (op in {n.target for n in res.graph.nodes}) == kept
    want = _autograd(fn, (x,), weight)[0]
    torch.testing.assert_close(res.at(0, sbp.Real()), want, rtol=1e-10, atol=1e-12)


def test_keep_unknown_name_is_an_error():
    with pytest.raises(ValueError, match="softmax"):
        sbp.backprop(torch.tanh, args=(r(3),), output=lambda y: y.sum(), whole=("conv",))


def test_no_grad_block_carries_no_edges():
    """Values computed under ``torch.no_grad()`` are constants to autograd, and so here."""

    def fn(x):
        with torch.no_grad():
            y = x * 2
            s = x.sum()
        return y * x + s * torch.tanh(x)

    x = r(3, 4)
    res = sbp.backprop(
        fn, args=(x,), output=lambda y: y.sum(), semirings=[sbp.Real(), sbp.PathCount()]
    )
    want = _autograd(fn, (x,), torch.ones(3, 4, dtype=torch.float64))[0]
    torch.testing.assert_close(res.at(0, sbp.Real()), want, rtol=1e-10, atol=1e-12)
    # one path through each product's x slot: x -> y*x and x -> tanh -> s*tanh
    count = res.at(0, sbp.PathCount()).log_count
    torch.testing.assert_close(count, torch.full_like(count, math.log(2)))
