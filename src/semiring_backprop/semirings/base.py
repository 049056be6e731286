"""The semiring interface shared by every rule and by the engine.

A semiring value is a plain tuple of tensors ("fields"), every field of the node's
shape. Rules never look inside a value: they move it with :func:`fmap` (routing) or
combine it through the semiring's own operations.

The operations (pytorch-struct style):

- ``zero(shape, like)`` / ``one(shape, like)``: identities of ⊕ and ⊗.
- ``lift(w)``: the value of a single edge of real weight ``w``.
- ``plus(a, b)``: ⊕, used by the engine where a node has several consumers.
- ``times(a, w)``: ``a ⊗ lift(w)`` for a real tensor ``w`` (broadcasts); ``scale(a, c)``
  the same for a constant ``c`` (a Python number).
- ``mul(a, b)``: ``a ⊗ b`` for two values.
- ``sum(a, dims)``: ⊕-reduce over ``dims`` inside one op.
- ``matmul(a, w, prep=None)``: ``out[..., i, k] = ⊕_j a[..., i, j] ⊗ lift(w[..., j, k])``;
  ``prep`` is ``prepare(w)``, the work that depends on ``w`` alone (``log |w|``, a
  transposed copy), which callers may keep across calls for a constant ``w``.
- ``finalize(a)``: the readout users see.
- ``tag(a, node_id)``: stamp back-pointers (selective semirings only).
- ``without(a, absent)`` / ``matmul_without(a, w, absent)``: ``a``, or ``matmul``,
  without the edges that are not there (a structural zero for weight, see
  :mod:`..engine.structure`); where ``zero_weight_is_no_edge``, an edge of weight 0
  is no path anyway (Real, the log-space semirings but PathCount), elsewhere it would
  be one (MaxProduct: a product of 0; PathCount: a path counted).

The engine calls a rule through ``enter`` / ``inner`` / ``leave``: the rule computes
with ``inner`` on ``enter(a, node_id)`` and each result goes back through ``leave``. By
default that is the semiring itself with ``tag``. MaxProduct carries no back-pointers
in the pass (path reading finds the winners again) and does its tensor granularity's
swap of hi and lo in ``leave``, once per result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..kernels import chunk_rows, has_storage  # noqa: F401  (re-exported for the semirings)

Value = tuple[torch.Tensor, ...]

INF = math.inf


def fmap(fn: Callable[[torch.Tensor], torch.Tensor], value: Value) -> Value:
    """Apply a data-movement function to every field (routing ops).

    Moving elements keeps what a semiring knows of a value as a whole (the type of a
    tuple subclass, such as MaxProduct's "already normalized"), so it is kept.
    """
    return retype(value, tuple(fn(f) for f in value))


def fmap2(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], a: Value, b: Value) -> Value:
    """:func:`fmap` over two values (moving the elements of ``b`` into ``a``); the type
    is kept where both have it."""
    out = tuple(fn(x, y) for x, y in zip(a, b, strict=True))
    return retype(a, out) if type(a) is type(b) else out


def retype(value: Value, fields: tuple) -> Value:
    """``fields`` as a value of ``value``'s type (what a semiring knows of it as a whole,
    as a tuple subclass; a plain tuple stays plain)."""
    return fields if type(value) is tuple else type(value)(fields)


class Dense(tuple):
    """A value with a path at every element, known as its tuple type: kept by moves
    (:func:`fmap`) and by the operations of a semiring that keep it (a path times an
    edge, a sum of paths, a path ⊕ anything). A contraction need not look for rows
    without a path in it. (Where a semiring counts only paths of nonzero weight, as
    Entropy does, an element may still be its zero: a contraction gives the same
    result for such a row either way.)"""

    __slots__ = ()


def dense_if(dense: bool, fields: tuple) -> Value:
    return Dense(fields) if dense else fields


_CONSTANTS: dict = {}


def constant(c: float, like: torch.Tensor) -> torch.Tensor:
    """``c`` as a 0-dim tensor of ``like``'s dtype and device (made once per value)."""
    key = (c, like.dtype, like.device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(c, dtype=like.dtype, device=like.device)
    return t


def stack(values: Sequence[Value], dim: int = 0) -> Value:
    return tuple(torch.stack(fs, dim) for fs in zip(*values, strict=True))


def normal_dims(dims, ndim: int) -> tuple[int, ...]:
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted(d % ndim for d in dims))


def move_to_end(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Move ``dims`` to the end and flatten them into one trailing dim."""
    rest = [d for d in range(t.dim()) if d not in dims]
    if list(dims) != list(range(len(rest), t.dim())):  # not already the trailing dims
        t = t.permute(*rest, *dims)
    return t.reshape(*t.shape[: len(rest)], math.prod(t.shape[len(rest) :]))  # 0 elements too


def reduced_shape(shape, dims, keepdim):
    if keepdim:
        return tuple(1 if d in dims else s for d, s in enumerate(shape))
    return tuple(s for d, s in enumerate(shape) if d not in dims)


def log_abs(w: torch.Tensor) -> torch.Tensor:
    """``log |w|`` as a fresh tensor (callers may write into it)."""
    return torch.abs(w).log_()


def node_index(shape, like: torch.Tensor) -> torch.Tensor:
    """Flat element index of every position of a tensor of ``shape``."""
    n = math.prod(shape)
    return torch.arange(n, device=like.device).view(shape)


def overflowed(stats: torch.Tensor) -> torch.Tensor:
    """Where statistics of ``Semiring.overflow_stats`` say "overflow": +inf or NaN."""
    return stats.isnan() | (stats == INF)


def full_int(shape, fill: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full(tuple(shape), fill, dtype=torch.long, device=like.device)


@dataclass(frozen=True)
class Semiring:
    """Base class; subclasses are frozen dataclasses so equal parameters hash equal.

    A value is a tuple of tensors (``fields``); ``zero``, ``one``, ``lift``, ``plus``,
    ``times``, ``mul``, ``sum``, ``matmul`` and ``finalize`` are all that rules and the
    engine call.

    Examples:
        >>> sr = sbp.Real()
        >>> one = sr.one((2,), like=x)
        >>> w = torch.tensor([2.0, 3.0], dtype=torch.float64)
        >>> sr.finalize(sr.plus(one, sr.times(one, w)))     # 1 ⊕ (1 ⊗ w)
        tensor([3., 4.], dtype=torch.float64)
        >>> sbp.TopK(3) == sbp.TopK(3), isinstance(sbp.TopK(3), sbp.Semiring)
        (True, True)
    """

    #: names of the fields of a value, in order
    fields = ("g",)
    #: True where ⊕ selects one argument (max, top-k): such semirings keep back-pointers
    selective = False
    #: True where ``plus(a, b)`` equals ``sum`` over a dim of the two stacked, bit for bit
    #: (inside one op, :func:`rules.shapes.oplus` then adds two parts without stacking)
    plus_is_sum = False
    #: True where every field is shaped as the node's value and ``times``, ``scale``,
    #: ``plus`` and ``sum`` broadcast as torch's elementwise ops do: then a forward rule
    #: that takes rows (:func:`rules.takes_rows`) runs on values with a leading dim
    rows = False

    def zero(self, shape, like: torch.Tensor) -> Value:
        raise NotImplementedError

    def one(self, shape, like: torch.Tensor) -> Value:
        raise NotImplementedError

    def lift(self, w: torch.Tensor) -> Value:
        return self.times(self.one(w.shape, w), w)

    def plus(self, a: Value, b: Value) -> Value:
        raise NotImplementedError

    def times(self, a: Value, w: torch.Tensor) -> Value:
        raise NotImplementedError

    def scale(self, a: Value, c: float) -> Value:
        """``a ⊗ lift(c)`` for a constant edge weight ``c``, a Python number (``add``'s 1,
        ``sub``'s -1, ``mean``'s 1/n). An edge of weight 1 changes no path product, so
        that is ``a`` itself; a semiring whose ``lift(1)`` is not its one overrides this."""
        if c == 1:
            return a
        return self.times(a, constant(c, a[0]))

    def accumulate(self, prev: Value | None, c: Value) -> Value:
        """``prev ⊕ c``, where ``prev`` None is the zero (the engine's running sums)."""
        if prev is None:
            prev = self.zero(c[0].shape, c[0])
        return self.plus(prev, c)

    def mul(self, a: Value, b: Value) -> Value:
        raise NotImplementedError

    def sum(self, a: Value, dims, keepdim: bool = False) -> Value:
        raise NotImplementedError

    def prepare(self, w: torch.Tensor):
        """What ``matmul`` derives from ``w`` alone (default: nothing)."""
        return None

    @property
    def prepares_as(self) -> Semiring:
        """The semiring whose ``prepare`` this one's is (prepared weights kept
        across calls are shared with it)."""
        return self

    def matmul(self, a: Value, w: torch.Tensor, prep=None) -> Value:
        raise NotImplementedError

    def contract(self, a: Value, b: Value) -> Value:
        """``⊕_j a[..., i, j] ⊗ b[..., j, k]``: the matmul of two values (of paths that
        meet at ``j``; ``matmul`` is a value times edge weights). By default ``mul`` over
        the broadcast, in chunks of rows, then ``sum`` over ``j``."""
        n, m, p = a[0].shape[-2], a[0].shape[-1], b[0].shape[-1]
        lead = math.prod(torch.broadcast_shapes(a[0].shape[:-2], b[0].shape[:-2]))
        step = chunk_rows(n, 4 * m * p * max(lead, 1))
        parts = []
        for r in range(0, n, step):
            left = tuple(f[..., r : r + step, :, None] for f in a)
            right = tuple(f[..., None, :, :] for f in b)
            full = torch.broadcast_shapes(left[0].shape, right[0].shape)
            x = self.mul(tuple(f.expand(full) for f in left), tuple(f.expand(full) for f in right))
            parts.append(self.sum(x, (x[0].dim() - 2,)))
        return tuple(torch.cat(f, -2) for f in zip(*parts))

    #: whether an edge of weight 0 is no edge at all (``lift(0)`` is the zero: Real, and the
    #: log-space semirings but PathCount); where it is a path (MaxProduct: a product of 0;
    #: PathCount: one more path), edges that are not there must be left out explicitly
    zero_weight_is_no_edge = False

    def without(self, a: Value, absent: torch.Tensor) -> Value:
        """``a`` with the zero where ``absent`` (a bool tensor broadcast with ``a``'s
        fields) holds: what reaches there only through edges that are not there (the
        structural zeros of :mod:`..engine.structure`)."""
        zero = self.zero((), a[0])
        return tuple(torch.where(absent, z, f) for f, z in zip(a, zero, strict=True))

    def matmul_without(self, a: Value, w: torch.Tensor, absent: torch.Tensor) -> Value:
        """``matmul(a, w)`` without the edges where ``absent`` (bool, ``w``'s shape) holds:
        ``out[..., i, k] = ⊕_j a[..., i, j] ⊗ lift(w[..., j, k])`` over the ``j`` whose
        edge is there (no path where none is). By default a weight of 0 where that is no
        edge, else ``contract`` with the lifted weights (the zero where absent)."""
        if self.zero_weight_is_no_edge:
            return tuple(self.matmul(a, w.masked_fill(absent, 0)))
        edges = self.without(self.times(self.one(w.shape, w), w), absent)
        return tuple(self.contract(a, edges))

    def finalize(self, a: Value):
        raise NotImplementedError

    def tag(self, a: Value, node_id: int) -> Value:
        return a

    @property
    def inner(self) -> Semiring:
        """The semiring rules compute with (see the module docstring)."""
        return self

    def enter(self, a: Value, node_id: int) -> Value:
        """The value a rule of node ``node_id`` computes on."""
        return self.tag(a, node_id)

    def leave(self, c: Value, node_id: int) -> Value:
        """A rule's result (computed with ``inner``) as a value of this semiring."""
        return c

    #: where the pass looks for float overflow in D (:func:`engine.reverse`): None (log
    #: space: none possible), "end" (inf and NaN carry on to where paths end: checked
    #: there), "node" (an op may turn one into "no path": checked at every node)
    overflow = None

    def overflow_stats(self, a: Value) -> tuple[torch.Tensor, ...]:
        """0-dim tensors, one reduction each, of which one is +inf or NaN exactly where
        ``a`` holds a value no finite path product gives (with ``overflow``)."""
        return ()

    def scalar(self, a: Value) -> torch.Tensor:
        """The one number per element that tables show (the readout's headline)."""
        raise NotImplementedError

    def rank(self, a: Value) -> torch.Tensor:
        """What ⊕ selects on, per element (selective semirings only)."""
        raise TypeError(f"{self.name} does not select: ⊕ combines, so nothing wins")

    @property
    def name(self) -> str:
        return type(self).__name__
