"""Max-product: the most positive and most negative path product (top gradient path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..errors import InputError
from ..kernels import native
from ..kernels.pairs import maxtimes_pairs
from .base import (
    INF,
    Dense,
    Semiring,
    Value,
    constant,
    dense_if,
    fmap,
    full_int,
    has_storage,
    move_to_end,
    normal_dims,
    reduced_shape,
    retype,
)

#: a back-pointer (what path reading runs rules with, see ``MaxProduct.pointed``) packs
#: (consumer node id, element index) into one int64: node << PTR_SHIFT | index (-1: none)
PTR_SHIFT = 40


def unpack_pointer(p: int) -> tuple[int, int]:
    """``(node id, element index)`` of a packed neuron pointer; ``(-1, ...)`` for none."""
    return p >> PTR_SHIFT, p & ((1 << PTR_SHIFT) - 1)


@dataclass(frozen=True)
class MaxProductReadout:
    hi: torch.Tensor  #: the most positive path product (-inf where no path)
    lo: torch.Tensor  #: the most negative path product (+inf where no path)


def _nan_to(t: torch.Tensor, fill: float, out: torch.Tensor | None = None) -> torch.Tensor:
    # 0 · ±inf arises only from a zero-weight edge times the semiring zero: still zero
    return torch.nan_to_num(t, nan=fill, posinf=INF, neginf=-INF, out=out)


def _nan_to_(t: torch.Tensor, fill: float) -> torch.Tensor:
    """:func:`_nan_to` in place (``t`` a fresh result; a method, not ``out=``, which has
    no batching rule under ``torch.vmap``)."""
    return t.nan_to_num_(nan=fill, posinf=INF, neginf=-INF)


# What the tensor-granularity operations know of a value as a whole, as its tuple type
# (kept by moves, see ``fmap``): normalized (hi >= lo wherever there is a path) and / or
# dense (every element has a path: hi and lo finite, no zero to keep). A dense value
# needs none of the zero's NaN marks: two passes per op instead of six or seven.


class _Normal(tuple):
    """A tensor-granularity value already normalized (hi ≥ lo wherever there is a path)."""

    __slots__ = ()


class _Dense(Dense):
    """A tensor-granularity value with a path at every element (not yet normalized)."""

    __slots__ = ()


class _NormalDense(_Normal, _Dense):
    """Both."""

    __slots__ = ()


def batch_broadcast(fields, w):
    if fields[0].shape[:-2] == w.shape[:-2]:  # nothing to broadcast (a 2-D matmul)
        return fields, w
    batch = torch.broadcast_shapes(fields[0].shape[:-2], w.shape[:-2])
    fields = fmap(lambda f: f.expand(*batch, *f.shape[-2:]), fields)
    return fields, w.expand(*batch, *w.shape[-2:])


@dataclass(frozen=True)
class MaxProduct(Semiring):
    """Fields ``(hi, lo)``: the largest and the smallest product over paths.

    ``granularity="neuron"`` (default) is the exact max over paths of the scalar graph;
    ``granularity="tensor"`` reproduces the paper's code: inside one op, hi and lo are
    aggregated by the real sum and swapped where the sign flips; max/min only where a
    tensor feeds several ops.

    Back-pointers (for every element, the winning consumer op and, at neuron
    granularity, the element of that op's output, for hi and for lo) are not carried by
    the pass: ⊕ keeps hi and lo only, and path reading finds the winner again from the
    consumers' stored values (``pointed``), once per step it takes.

    The readout has ``hi`` and ``lo`` (``-inf`` and ``+inf`` where no path leaves).

    Examples:
        >>> top = mlp_res.at(0, sbp.MaxProduct())
        >>> torch.equal(top.hi[0], paths.amax(0)), torch.equal(top.lo[0], paths.amin(0))
        (True, True)
        >>> sbp.MaxProduct("tensor")    # the paper's granularity
        MaxProduct(granularity='tensor')
    """

    granularity: str = "neuron"
    selective = True
    fields = ("hi", "lo")
    rows = True

    def __post_init__(self):
        if self.granularity not in ("neuron", "tensor"):
            raise InputError(
                f"MaxProduct(granularity={self.granularity!r}): use 'neuron' or 'tensor'"
            )

    @property
    def neuron(self) -> bool:
        return self.granularity == "neuron"

    @property
    def plus_is_sum(self) -> bool:
        # (at tensor granularity an op's parts are summed as reals, hi and lo apart)
        return self.neuron

    @property
    def name(self) -> str:
        return f"MaxProduct({self.granularity})"

    @property
    def pointed(self) -> MaxProduct:
        """The same semiring with back-pointer fields (consumer op and element, packed:
        see PTR_SHIFT; the consumer op alone at tensor granularity): what path reading
        runs a rule with to name the element a step comes from."""
        return _POINTED[self.granularity]

    # -- values -------------------------------------------------------------------
    def _make(self, hi, lo):
        return (hi, lo) if self.neuron else _Normal((hi, lo))

    def zero(self, shape, like):
        shape = tuple(shape)
        hi = torch.full(shape, -INF, dtype=like.dtype, device=like.device)
        return self._make(hi, torch.full_like(hi, INF))

    def one(self, shape, like):
        hi = torch.ones(tuple(shape), dtype=like.dtype, device=like.device)
        one = self._make(hi, hi.clone())
        return Dense(one) if self.neuron else _NormalDense(one)

    def enter(self, a: Value, node_id: int) -> Value:
        return a

    def leave(self, c: Value, node_id: int) -> Value:
        return c if self.neuron else self._normalize(c)  # the swap at the end of an op

    @staticmethod
    def _is_zero(a: Value) -> torch.Tensor:
        # hi is -inf only for the zero: any path has a finite product
        return a[0] == -INF

    def _split(self, a: Value):
        n = (len(a) - 2) // 2
        return a[0], a[1], a[2 : 2 + n], a[2 + n :]

    def _normalize(self, a: Value) -> Value:
        """Tensor granularity keeps hi and lo unswapped inside an op; swap at its end."""
        if self.neuron or isinstance(a, _Normal):
            return a
        hi, lo, ph, pl = self._split(a)
        if not ph and isinstance(a, _Dense):  # no zero to keep
            return _NormalDense((torch.maximum(hi, lo), torch.minimum(hi, lo)))
        if not ph:  # arithmetic only (comparisons and selects are the slow ops on CPU)
            nan = hi - hi  # NaN at the zero (-inf, inf), which must stay as it is
            return _Normal(
                (
                    _nan_to_(torch.maximum(hi, lo).add_(nan), -INF),
                    _nan_to_(torch.minimum(hi, lo).add_(nan), INF),
                )
            )
        swap = (hi < lo) & (hi != -INF)  # the zero (-inf, inf) is not swapped
        if hi.device.type == "cpu" and not bool(swap.any()):  # (a device would wait)
            return _Normal(a)
        return _Normal(
            (
                torch.where(swap, lo, hi),
                torch.where(swap, hi, lo),
                *(torch.where(swap, y, x) for x, y in zip(ph, pl)),
                *(torch.where(swap, x, y) for x, y in zip(ph, pl)),
            )
        )

    def accumulate(self, prev, c):
        return self._normalize(c) if prev is None else self.plus(prev, c)

    def plus(self, a: Value, b: Value) -> Value:
        a, b = self._normalize(a), self._normalize(b)
        ahi, alo, aph, apl = self._split(a)
        bhi, blo, bph, bpl = self._split(b)
        if aph:  # ties keep a (the engine's running sum): the pass's order
            th, tl = ahi >= bhi, alo <= blo
            out = (
                torch.where(th, ahi, bhi),
                torch.where(tl, alo, blo),
                *(torch.where(th, x, y) for x, y in zip(aph, bph)),
                *(torch.where(tl, x, y) for x, y in zip(apl, bpl)),
            )
        else:
            out = (torch.maximum(ahi, bhi), torch.minimum(alo, blo))
        # the max of a path and anything is a path
        dense = isinstance(a, Dense) or isinstance(b, Dense)
        if self.neuron:
            return dense_if(dense, out)
        return _NormalDense(out) if dense else _Normal(out)

    def times(self, a: Value, w: torch.Tensor) -> Value:
        hi, lo, ph, pl = self._split(a)
        # Arithmetic only: comparisons and selects are several times slower on CPU.
        if not self.neuron and not ph and isinstance(a, _Dense):  # no zero to keep
            return _Dense((hi * w, lo * w))
        if not self.neuron:  # unswapped; the zero (-inf, inf) stays the zero
            nan = lo - lo  # NaN at the zero, 0 elsewhere
            out = (_nan_to_((hi * w).add_(nan), -INF), _nan_to_((lo * w).add_(nan), INF))
            return (*out, *(p.expand(out[0].shape) for p in (*ph, *pl)))
        # hi is w·hi where w >= 0 and w·lo where w < 0: one of the two terms is 0 (NaN,
        # then -inf, at the zero, whose products are infinite); the negative part first,
        # into fresh tensors, then the positive part added in place (one temporary less)
        wn = w.clamp(max=0)
        out_hi = lo * wn
        out_lo = wn.mul_(hi) if wn.shape == hi.shape and has_storage(hi) else hi * wn
        wp = w.clamp(min=0)
        if has_storage(hi):
            out_hi, out_lo = out_hi.addcmul_(hi, wp), out_lo.addcmul_(lo, wp)
        else:  # batched (``torch.vmap``): addcmul_ has no batching rule
            out_hi, out_lo = out_hi.add_(hi * wp), out_lo.add_(lo * wp)
        out = (_nan_to_(out_hi, -INF), _nan_to_(out_lo, INF))
        if not ph:
            return retype(a, out)
        pos = w >= 0
        return (
            *out,
            *(torch.where(pos, x, y) for x, y in zip(ph, pl)),
            *(torch.where(pos, y, x) for x, y in zip(ph, pl)),
        )

    def scale(self, a: Value, c: float) -> Value:
        if c == 1 or c == 0 or len(a) > 2:  # pointers: through times
            return super().scale(a, c)
        w = constant(c, a[0])
        hi, lo = a[0] * w, a[1] * w
        # a negative weight swaps hi and lo; the zero (-inf, inf) stays the zero
        return retype(a, (hi, lo) if c > 0 else (lo, hi))

    def mul(self, a: Value, b: Value) -> Value:
        a, b = self._normalize(a), self._normalize(b)
        ahi, alo, aph, apl = self._split(a)
        zero = self._is_zero(a) | self._is_zero(b)
        if not aph:  # no pointers: the best and the worst of the four, without indices
            c = (ahi * b[0], ahi * b[1], alo * b[0], alo * b[1])  # (NaN: skipped by fmax)
            hi = _nan_to_(torch.fmax(torch.fmax(c[0], c[1]), torch.fmax(c[2], c[3])), -INF)
            lo = _nan_to_(torch.fmin(torch.fmin(c[0], c[1]), torch.fmin(c[2], c[3])), INF)
            return (torch.where(zero, -INF, hi), torch.where(zero, INF, lo))
        cands = torch.stack([ahi * b[0], ahi * b[1], alo * b[0], alo * b[1]])
        hi, ih = _nan_to(cands, -INF).max(0)
        lo, il = _nan_to(cands, INF).min(0)
        ptr_hi = tuple(torch.where(ih < 2, x, y) for x, y in zip(aph, apl))
        ptr_lo = tuple(torch.where(il < 2, x, y) for x, y in zip(aph, apl))
        return (
            torch.where(zero, -INF, hi),
            torch.where(zero, INF, lo),
            *ptr_hi,
            *ptr_lo,
        )

    def sum(self, a: Value, dims, keepdim=False) -> Value:
        dims = normal_dims(dims, a[0].dim())
        if not dims:
            return a
        out_shape = reduced_shape(a[0].shape, dims, keepdim)
        flat = [move_to_end(f, dims) for f in a]
        hi, lo, ph, pl = self._split(flat)
        if self.neuron and not ph and not pl:  # (no indices to find: several times faster)
            hi, lo = hi.amax(-1), lo.amin(-1)
        elif self.neuron:
            hi, ih = hi.max(-1)
            lo, il = lo.min(-1)
            ph = tuple(p.gather(-1, ih[..., None])[..., 0] for p in ph)
            pl = tuple(p.gather(-1, il[..., None])[..., 0] for p in pl)
        elif isinstance(a, _Dense) and not ph:  # real sums of paths only (keep hi >= lo)
            return retype(a, (hi.sum(-1).reshape(out_shape), lo.sum(-1).reshape(out_shape)))
        else:
            live = ~self._is_zero(flat)
            any_live = live.any(-1)
            hi = torch.where(any_live, torch.where(live, hi, 0).sum(-1), -INF)
            lo = torch.where(any_live, torch.where(live, lo, 0).sum(-1), INF)
            ph = tuple(p.amax(-1) for p in ph)
            pl = tuple(p.amax(-1) for p in pl)
        return retype(a, tuple(f.reshape(out_shape) for f in (hi, lo, *ph, *pl)))

    def prepare(self, w: torch.Tensor):
        """The weights transposed (the reduced dim contiguous), as the kernels read them;
        packed for the native kernel too where it runs (:func:`..kernels.native.pack`)."""
        if not self.neuron:
            return None
        wt = w.transpose(-2, -1).contiguous()
        return native.pack(wt) or wt

    def contract(self, a: Value, b: Value) -> Value:
        """One max-times kernel over the four products of ``a``'s and ``b``'s hi and lo
        (:func:`..kernels.pairs.maxtimes_pairs`): for one pair, the best and the worst
        of the four are the pair's hi and lo. The zero (no path) on either side never
        wins; with pointers, the broadcast of the base class."""
        a, b = self._normalize(a), self._normalize(b)
        if not self.neuron or len(a) > 2 or len(b) > 2:
            return super().contract(a, b)
        return maxtimes_pairs(a[0], a[1], b[0], b[1])

    def matmul(self, a: Value, w: torch.Tensor, prep=None) -> Value:
        if not self.neuron:
            return self._matmul_tensor(*batch_broadcast(a, w))
        wt = self.prepare(w) if prep is None else prep
        hi, lo, ph, pl = self._split(a)
        if not ph:  # no pointers to carry: the values alone (several times faster)
            return retype(a, kernels.maxtimes(hi, lo, wt, argmax=False))
        out_hi, jh, out_lo, jl = kernels.maxtimes(hi, lo, wt)
        a, w = batch_broadcast(a, w)
        hi, lo, ph, pl = self._split(a)
        pos_h, pos_l = torch.gather(w, -2, jh) >= 0, torch.gather(w, -2, jl) >= 0

        def pick(ptrs_if_pos, ptrs_if_neg, j, sel):
            return tuple(
                torch.where(sel, x.gather(-1, j), y.gather(-1, j))
                for x, y in zip(ptrs_if_pos, ptrs_if_neg)
            )

        return (out_hi, out_lo, *pick(ph, pl, jh, pos_h), *pick(pl, ph, jl, pos_l))

    def without(self, a: Value, absent: torch.Tensor) -> Value:
        out = super().without(a, absent)
        return _Normal(out) if isinstance(a, _Normal) else out  # (normalized still)

    def matmul_without(self, a: Value, w: torch.Tensor, absent: torch.Tensor) -> Value:
        if self.neuron:
            return super().matmul_without(a, w, absent)
        # tensor granularity: the real sums, where a weight of 0 adds nothing; an output
        # element has a path where some path meets an edge that is there
        out = self.matmul(a, w.masked_fill(absent, 0))
        live = (~self._is_zero(a)).to(w.dtype)
        reached = torch.matmul(live, (~absent).to(w.dtype)) > 0
        return self.without(out, ~reached)

    def _matmul_tensor(self, a: Value, w: torch.Tensor) -> Value:
        hi, lo, ph, pl = self._split(a)
        n = hi.shape[-2]
        if hi.shape[-1] == 0:  # an empty sum: no path
            return self.zero((*hi.shape[:-1], w.shape[-1]), hi)
        # the zero (-inf, inf) adds nothing to the real sums: 0 there; hi and lo in one
        # matmul (one pass over the weights)
        dense = isinstance(a, _Dense)
        both = torch.cat([hi, lo], -2)
        if not dense:
            both.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        out = torch.matmul(both, w)
        if not ph:
            # Every rule's matmul is its op's last aggregation (only moves follow), so
            # the swap at the end of the op can be done here: max / min of the two real
            # sums. An output row has a path wherever its input row has one; rows
            # without get -inf / +inf (a row penalty: two passes over the output
            # instead of the NaN marks' six).
            swapped = self._normalize(_Dense((out[..., :n, :], out[..., n:, :])))
            if dense:
                return swapped
            pen = (a[0].amax(-1, keepdim=True) * 0).nan_to_num_(nan=-INF)  # 0 or -inf
            # (one small check, on the CPU: a device would wait) a path in every row
            if pen.device.type == "cpu" and not bool(pen.isneginf().any()):
                return swapped
            return _Normal((swapped[0].add_(pen), swapped[1].sub_(pen)))
        nan = hi.amax(-1, keepdim=True) * 0  # NaN on rows without a path, 0 elsewhere
        out_hi = _nan_to_(out[..., :n, :] + nan, -INF)
        out_lo = _nan_to_(out[..., n:, :] + nan, INF)
        shape = out_hi.shape
        return (
            out_hi,
            out_lo,
            *(p.amax(-1, keepdim=True).expand(shape) for p in (*ph, *pl)),
        )

    def scalar(self, a: Value) -> torch.Tensor:
        return self.finalize(a).hi

    overflow = "node"  # times and mul read NaN (0 x inf) as "no path"

    def overflow_stats(self, a: Value) -> tuple[torch.Tensor, ...]:
        # "no path" is (-inf, +inf); a path's hi is never +inf nor its lo -inf (a
        # negative hi overflowed to -inf leaves lo at -inf too)
        if not a[0].numel():
            return ()
        return (a[0].amax(), -a[1].amin())

    def rank(self, a: Value) -> torch.Tensor:
        return self.finalize(a).hi

    def finalize(self, a: Value) -> MaxProductReadout:
        a = self._normalize(a)
        return MaxProductReadout(hi=a[0], lo=a[1])


@dataclass(frozen=True)
class _Pointed(MaxProduct):
    """MaxProduct with back-pointer fields ``(hi, lo, hi_ptr, lo_ptr)``: the same values
    (the same formulas) and, for every element, where each came from. Path reading runs
    a consumer's rule with it to name the element a step comes from; a pass run with it
    carries every pointer (the plain implementation the tests compare against)."""

    fields = ("hi", "lo", "hi_ptr", "lo_ptr")
    rows = False  # (pointers number the elements of one value)
    plus_is_sum = False  # (ties: the sum over a dim keeps the first, plus keeps a)

    @property
    def prepares_as(self) -> MaxProduct:
        return MaxProduct(self.granularity)  # the same transposed weights

    def _make(self, hi, lo):
        # a tensor per field: routing rules write into a fresh zero in place only then
        ptr = full_int(hi.shape, -1, hi)
        return (hi, lo, ptr, ptr.clone()) if self.neuron else _Normal((hi, lo, ptr, ptr.clone()))

    def enter(self, a: Value, node_id: int) -> Value:
        return self.tag(a, node_id)

    def tag(self, a: Value, node_id: int) -> Value:
        hi, lo = a[0], a[1]
        if self.neuron:
            base = node_id << PTR_SHIFT
            ptr = torch.arange(base, base + hi.numel(), device=hi.device).view(hi.shape)
            return (hi, lo, ptr, ptr)
        # one pointer for the whole tensor: a broadcast scalar, not a filled tensor
        node = torch.tensor(node_id, device=hi.device).expand(hi.shape)
        return retype(a, (hi, lo, node, node))


_POINTED = {g: _Pointed(g) for g in ("neuron", "tensor")}
