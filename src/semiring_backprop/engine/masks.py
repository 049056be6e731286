"""One call's structural masks: the formulas of :mod:`.structure` evaluated on the
values of a call, each when first asked for.

The structural values (masks, positions, sizes) are computed again from the call's
inputs; the shapes of the others are read from the trace (its symbolic sizes bound by
the inputs'), not from the forward values, which a pass may have let go. The masks of
the last :data:`KEPT_CALLS` calls are kept on the graph, found again by their inputs
(the same tensors, unchanged: held weakly).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.fx.node import Node, map_arg

from ..rules.routing import where_value
from ..tracing.trace import mark_op

aten = torch.ops.aten

#: a structural float at or below this is a mask's: exp of it plus a score (minus the
#: row's max) is exactly 0 in every float dtype, scores being far below 10^4 (torch's and
#: transformers' masks write -inf or the dtype's lowest number; older models -1e9, -1e4)
MASK_VALUE = -1e4

_WHERE = aten.where.self
CASTS = (aten._to_copy.default, aten.to.dtype)
#: ops that copy their first argument as it is (a mask stays the mask)
SAME = frozenset(
    {
        aten.clone.default, aten.alias.default, aten.contiguous.default,
        aten.lift_fresh_copy.default, mark_op, *CASTS,
    }
)  # fmt: skip
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SIZES = (aten.sym_size.int, aten.sym_numel.default)

#: calls whose masks a graph keeps (an explainer's calls come one after another)
KEPT_CALLS = 2


def call(graph, p, values) -> _Call:
    """The masks of the call whose inputs ``values`` holds: found again where the same
    input tensors (unchanged) were seen last, else a new record."""
    inputs = [values[a] for a in p.inputs]
    kept = graph.__dict__.get("_structure_calls", [])
    for c in kept:
        if c.same(inputs):
            return c
    c = _Call(p, inputs)
    graph.__dict__["_structure_calls"] = [c, *kept][:KEPT_CALLS]
    return c


class _Call:
    """One call's masks, each computed when first asked for (the structural values again
    from the inputs, the shapes from the trace)."""

    def __init__(self, p, inputs: list):
        self.plan = p
        self.key = [_key(v) for v in inputs]  # (the inputs held weakly)
        self.values: dict = {}  # structural values computed
        self.memo: dict = {}
        self.sizes: dict | None = None

    def same(self, inputs) -> bool:
        return all(_same(k, v) for k, v in zip(self.key, inputs, strict=True))

    # structural values, computed again from the inputs (they are few and small)
    def value(self, a, values):
        if not isinstance(a, Node):
            return a
        if a not in self.plan.structural or a.op == "placeholder":
            return values[a]  # (an input; a condition read from the values)
        if a.target in _SIZES:  # (a size of a tensor of the values: from the trace)
            shape = self.shape(a.args[0], values)
            return shape[a.args[1]] if a.target is _SIZES[0] else math.prod(shape)
        if a not in self.values:
            get = lambda b: self.value(b, values)  # noqa: E731
            args, kwargs = map_arg(a.args, get), map_arg(a.kwargs, get)
            if a.target is mark_op:
                out = args[0]
            elif a.target is _WHERE and not kwargs:
                out = where_value(*args)
            else:
                out = a.target(*args, **kwargs)
            self.values[a] = out
        return self.values[a]

    def shape(self, a, values) -> tuple:
        if a in self.plan.structural:
            return tuple(self.value(a, values).shape)
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return tuple(values[a].shape)
        sizes = [d if isinstance(d, int) else d.node.expr.xreplace(self._bound(values))
                 for d in val.shape]  # fmt: skip
        if all(isinstance(d, int) or d.is_Integer for d in sizes):
            return tuple(int(d) for d in sizes)
        return tuple(values[a].shape)  # (a size the inputs' do not give)

    def _bound(self, values) -> dict:
        """The symbolic sizes of the trace, bound to this call's inputs'."""
        if self.sizes is None:
            self.sizes = {sym: values[n].shape[i] for n, i, sym in self.plan.sizes}
        return self.sizes

    def eval(self, f, values):
        """The bool mask of formula ``f`` (None: nowhere)."""
        if f is None:
            return None
        kind = f[0]
        if kind in ("M", "Z"):
            key = (kind, f[1])
            if key in self.memo:
                return self.memo[key]
            g = (self.plan.m if kind == "M" else self.plan.z)[f[1]]
            got = _ndim(self.eval(g, values), f[1])
            if g[0] not in ("move", "cat"):  # (moves are made again: a reshape copies)
                self.memo[key] = got
            return got
        return getattr(self, "_" + kind)(f, values)

    def _le(self, f, values):
        v = self.value(f[1], values)
        return v <= MASK_VALUE

    def _eq0(self, f, values):
        v = self.value(f[1], values)
        return v == 0

    def _or(self, f, values):
        a, b = self.eval(f[1], values), self.eval(f[2], values)
        return b if a is None else a if b is None else a | b

    def _and(self, f, values):
        a, b = self.eval(f[1], values), self.eval(f[2], values)
        return None if a is None or b is None else a & b

    def _andnot(self, f, values):
        a, b = self.eval(f[1], values), self.eval(f[2], values)
        return a if a is None or b is None else a & ~b

    def _where(self, f, values):
        cond = self.value(f[1], values)
        parts = []
        for keep, g in ((cond, f[2]), (None, f[3])):
            if g is None:
                continue
            keep = ~cond if keep is None else keep
            # ("num", True): a constant the mask picks, a mask minimum or a zero everywhere
            parts.append(keep if g == ("num", True) else keep & self.eval(g, values))
        return parts[0] if len(parts) == 1 else parts[0] | parts[1]

    def _all(self, f, values):
        mask, dims, keepdim = self.eval(f[1], values), f[2], f[3]
        if mask is None:
            return None
        if not dims:  # every dim
            return mask.all() if not keepdim else mask.all().reshape([1] * mask.dim())
        dims = [d % mask.dim() for d in ([dims] if isinstance(dims, int) else dims)]
        return mask.all(dims, keepdim=keepdim) if dims else mask

    def _full(self, f, values):
        mask = self.eval(f[1], values)
        return None if mask is None else mask.expand(self.shape(f[2], values))

    def _move(self, f, values):
        mask, n = self.eval(f[1], values), f[2]
        if mask is None:
            return None
        if n.target in SAME:
            return mask
        x = n.args[0]
        mask = mask.expand(self.shape(x, values))
        get = lambda b: self.value(b, values)  # noqa: E731  (sizes: ints of the call)
        rest, kwargs = map_arg(n.args[1:], get), map_arg(n.kwargs, get)
        if n.target in _RESHAPES:
            return mask.reshape(*rest[0])
        return n.target(mask, *rest, **kwargs)

    def _cat(self, f, values):
        n = f[2]
        parts, dim = n.args[0], n.args[1] if len(n.args) > 1 else 0
        masks = [self.eval(g, values) for g in f[1]]
        device = next(m.device for m in masks if m is not None)
        return torch.cat([
            torch.zeros(self.shape(part, values), dtype=torch.bool, device=device)
            if m is None else m.expand(self.shape(part, values))
            for m, part in zip(masks, parts)
        ], dim)  # fmt: skip

    def _mm(self, f, values):
        za, zb = self.eval(f[1], values), self.eval(f[2], values)
        if zb is None:  # an output element is zero where its row of a is one throughout
            return za.expand(self.shape(f[3], values)).all(-1, keepdim=True)
        if za is None:
            return zb.expand(self.shape(f[4], values)).all(-2, keepdim=True)
        ra = (~za.expand(self.shape(f[3], values))).float()
        rb = (~zb.expand(self.shape(f[4], values))).float()
        return torch.matmul(ra, rb) == 0  # no term without a structural zero

    def _jac(self, f, values):
        mask, n, dim = self.eval(f[1], values), f[2], f[3]
        if mask is None:
            return None
        mask = mask.expand(self.shape(n, values)).movedim(dim, -1)
        return mask[..., :, None] | mask[..., None, :]  # [j, i]: y_j or y_i is one


def _ndim(mask, node):
    """``mask`` with as many dims as ``node``'s value (ones in front: it broadcasts)."""
    if mask is None:
        return None
    val = node.meta.get("val")
    nd = val.dim() if isinstance(val, torch.Tensor) else mask.dim()
    return mask.reshape((1,) * (nd - mask.dim()) + tuple(mask.shape)) if mask.dim() < nd else mask


def _key(v):
    return (weakref.ref(v), v._version) if isinstance(v, torch.Tensor) else (None, v)


def _same(key, v) -> bool:
    """Whether ``v`` is the input ``key`` was made from, unchanged since."""
    ref, mark = key
    if ref is None:
        return not isinstance(v, torch.Tensor) and type(v) is type(mark) and v == mark
    return ref() is v and v._version == mark
