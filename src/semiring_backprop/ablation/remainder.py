"""The patched forward of :class:`.patching.Patching` from the patched nodes on: only the
ops that read a patched value, directly or not, run again; every other value is the
clean run's (it is what the whole forward would compute again, the same op on the same
inputs). Values are freed after their last read, so that a batch of variants (along a
new leading dimension, ``torch.vmap``) holds only what is still to be read.

Where the output reads a matrix product only through ops that move elements (views,
selects, slices, marks; a language model's unembedding read at the last position), only
the rows it reads are computed (:class:`Tail`): those rows' values are what the whole
product gives them (each row of ``a @ b`` is that row of ``a`` times ``b``), and no
other row reaches the output.

Examples::

    rest = p.remainder([site])                  # p: a Patching
    m = rest(p.base, {site: lambda v: 0 * v})   # the output with the site zeroed
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tracing.trace import mark_op
from .patching_edges import args_of, call

__all__ = ["Remainder", "Tail", "tail"]

aten = torch.ops.aten
#: ops that move the elements of their one tensor input (no arithmetic)
_MOVES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.alias.default, aten.clone.default, aten.select.int, aten.slice.Tensor,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.permute.default,
          aten.transpose.int, aten.t.default, aten.expand.default, mark_op}  # fmt: skip


@dataclass(frozen=True)
class Tail:
    """A matrix product ``mm`` (``a @ b``) the output reads only at ``rows`` through the
    moves ``skipped``; ``reads``: ``{node read past them: index into the rows' product,
    flattened, of each of its elements}``."""

    mm: torch.fx.Node
    rows: torch.Tensor
    skipped: frozenset
    reads: dict

    @property
    def moved(self) -> set:
        """The moves' nodes: none of them may be patched."""
        return set(self.skipped) | set(self.reads)


def tail(order, out, base) -> Tail | None:
    """The :class:`Tail` of a forward (``order``: its ops, ``base``: their values), or None
    where the output reads no product through moves alone, or reads every row of it."""
    for mm in reversed(order):
        if mm.target is aten.mm.default:
            break
    else:
        return None
    value = base[mm]
    moved = {mm: torch.arange(value.numel()).reshape(value.shape)}
    todo, reads = [mm], {}
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in moved:
                continue
            if u.target in _MOVES and u.all_input_nodes == [n]:
                moved[u] = call(u, *args_of(u, moved, base))
                todo.append(u)
            elif n is mm:
                return None  # something computes with the product itself
            else:
                reads[n] = moved[n]
    if out in moved:
        reads[out] = moved[out]
    if not reads:
        return None
    width = value.shape[1]
    rows = torch.unique(torch.cat([i.reshape(-1) for i in reads.values()]) // width)
    if len(rows) == value.shape[0]:
        return None
    place = torch.full((value.shape[0],), -1, dtype=torch.long)
    place[rows] = torch.arange(len(rows))
    at = {n: place[i // width] * width + i % width for n, i in reads.items()}
    return Tail(
        mm,
        rows.to(value.device),
        frozenset(moved) - {mm} - set(reads),
        {n: i.to(value.device) for n, i in at.items()},
    )


class Remainder:
    """The ops of ``order`` (a forward's ops, in graph order) that read one of ``starts``
    (the patched nodes, themselves included), with what each may drop once it ran;
    ``tail``: the forward's :class:`Tail`, if any."""

    def __init__(self, order, starts, out, tail: Tail | None = None):
        starts = set(starts)
        changed: set = set()
        self.order = []
        for n in order:
            if n in starts or any(a in changed for a in n.all_input_nodes):
                changed.add(n)
                self.order.append(n)
        self.out = out
        if tail is not None and (
            tail.mm not in changed or starts & (tail.skipped | set(tail.reads))
        ):
            tail = None
        self.tail = tail
        if self.tail is not None:
            self.order = [n for n in self.order if n not in self.tail.skipped]
        #: whether an op reads a value this run changes (else it keeps its clean value)
        self.fresh = [any(a in changed for a in n.all_input_nodes) for n in self.order]
        last = {}
        for i, n in enumerate(self.order):
            for a in self._inputs(n):
                if a in changed:
                    last[a] = i
        self.drop: list[list] = [[] for _ in self.order]
        for a, i in last.items():
            if a is not out:
                self.drop[i].append(a)

    def _inputs(self, n):
        if self.tail is not None and n in self.tail.reads:
            return [self.tail.mm]
        return n.all_input_nodes

    @property
    def reaches(self) -> bool:
        """Whether the output reads a patched node at all (else it is the clean one)."""
        return bool(self.order) and self.order[-1] is self.out

    def __call__(self, base: dict, replace: dict):
        """The output with each node of ``replace`` (``{node: function of its value}``)
        replaced, every value not downstream of one read from ``base``."""
        if not self.reaches:
            return base[self.out]
        local: dict = {}
        t = self.tail
        for node, fresh, drop in zip(self.order, self.fresh, self.drop):
            if t is not None and node is t.mm:
                a, b = args_of(node, local, base)[0]
                out = torch.mm(a.index_select(0, t.rows), b)
            elif t is not None and node in t.reads:
                out = local[t.mm].reshape(-1)[t.reads[node]]
            else:
                out = call(node, *args_of(node, local, base)) if fresh else base[node]
            if node in replace:
                out = replace[node](out)
            local[node] = out
            for n in drop:
                del local[n]
        return local[self.out]
