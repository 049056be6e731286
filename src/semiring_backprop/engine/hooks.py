"""What a reverse pass does beside ⊕ (:func:`.reverse.propagate`): each option of a pass
is a small object that the loop calls at fixed points, and the loop itself knows none of
them.

- ``before(node_id, acc)``: before the rule of node ``node_id`` runs (``acc``: the partial
  sums, complete for that node and for none above it);
- ``done(node, d, ends)``: D at ``node`` is complete (⊕ over all its consumers); ``ends``:
  no path of the pass goes on from it;
- ``after()``: the pass is over.

:func:`options` makes them from :func:`.reverse.reverse`'s arguments, in the order they
run. The node sets a pass follows and stores are sets, or :data:`EVERY`.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import NonFiniteError, where
from ..rules.routing import only_moves
from ..semirings.base import overflowed
from . import liveness


class Hook:
    """A pass's option: every method does nothing unless the option needs it."""

    def before(self, node_id: int, acc: dict) -> None:
        pass

    def done(self, node, d: list, ends: bool) -> None:
        pass

    def after(self) -> None:
        pass


class _Every:
    """The set of every node (a pass that follows every path, or stores every D)."""

    def __contains__(self, node) -> bool:
        return True

    def __repr__(self) -> str:
        return "EVERY"


EVERY = _Every()


class Both:
    """The nodes in both of two sets."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __contains__(self, node) -> bool:
        return node in self.a and node in self.b


class Snapshots(Hook):
    """At each node id of ``at`` (``{node id: None}``), before its rule runs, a copy of
    the partial sums is put there: the state to run the pass on from (:mod:`.checkpoints`)."""

    def __init__(self, at: dict):
        self.at = at

    def before(self, node_id, acc):
        if node_id in self.at:
            self.at[node_id] = {n: list(slot) for n, slot in acc.items()}


class Lean(Hook):
    """The pass holds only what its rules still read (:mod:`.liveness`): forward values
    let go after their last reader, cheap ones recomputed before it."""

    def __init__(self, graph, needed, keep, values: dict):
        self.plan, self.values = liveness.plan(graph, needed, keep), values

    def before(self, node_id, acc):
        liveness.before_rule(self.plan, node_id, self.values)


class Checks(Hook):
    """D checked for values no finite path product gives (see :func:`.reverse.reverse`):
    the statistics go to ``flags`` (node, semiring, 0-dim tensor), read at the end with
    one host sync, or, where the caller gives ``flags``, left to it to read. A node whose
    readers only move its elements (:func:`only_moved`) is not checked but with
    ``check="every"`` or where paths end: an overflow there was in a reader's D, which
    comes first in the pass."""

    def __init__(self, graph, semirings, check: str, flags: list | None = None):
        self.graph, self.semirings, self.check = graph, semirings, check
        self.own = flags is None  # (then read here, at the end of the pass)
        self.flags = [] if flags is None else flags

    def done(self, node, d, ends):
        whole = self.check == "every" or ends
        if not whole and node in only_moved(self.graph):
            return  # its D holds only elements of its readers' D, each checked there
        at = ("node", "end") if whole else ("node",)
        for s, sr in enumerate(self.semirings):
            if sr.overflow in at:
                self.flags += [(node, sr, t) for t in sr.overflow_stats(d[s])]

    def after(self):
        if self.own:
            check_flags(self.graph, self.flags, self.check)


class Reached(Hook):
    """Collects every node that gets a D into ``nodes`` (a set)."""

    def __init__(self, nodes: set):
        self.nodes = nodes

    def done(self, node, d, ends):
        self.nodes.add(node)


def options(graph, values, semirings, needed, keep=None, snapshots=None, reached=None,
            check=None, flags=None) -> list:  # fmt: skip
    """The hooks of a pass with these options (see :func:`.reverse.reverse`), in the order
    the pass calls them."""
    hooks: list = []
    if snapshots is not None:
        hooks.append(Snapshots(snapshots))
    if keep is not None:
        hooks.append(Lean(graph, needed, keep, values))
    if check:
        hooks.append(Checks(graph, semirings, check, flags))
    if reached is not None:
        hooks.append(Reached(reached))
    return hooks


class Overflow(NonFiniteError):
    """D overflowed where paths end; the node where it first did is not known yet."""


def _overflow(graph, node, sr, cls=NonFiniteError) -> NonFiniteError:
    dtype = getattr(node.meta.get("val"), "dtype", None)
    wide = any(getattr(n.meta.get("val"), "dtype", None) == torch.float64
               for n in graph.nodes if n.op == "placeholder")  # fmt: skip
    if dtype == torch.float64:
        fix = "Use a log-space semiring"
    elif wide:  # a float64 model that computes this node in a narrower type itself
        fix = (f"The model computes this node in {dtype} although it runs in float64 (a "
               "norm that casts to float32, as LlamaRMSNorm does), so float64 weights do "
               "not widen it: use a log-space semiring")  # fmt: skip
    else:
        fix = "Run the model and inputs in float64 (model.double()), or use a log-space semiring"
    return cls(
        f"the reverse pass overflowed under {sr.name}: D at {where(node, graph.module_of(node))} "
        "holds inf or NaN although every forward value is finite (path products beyond "
        f"the float range). {fix}: MaxAbs for the top path's |product|, LogAbs for the "
        "total gradient flow."
    )


_ONLY_MOVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fx graph -> nodes


def only_moved(graph) -> frozenset:
    """Nodes of ``graph`` every reader of which moves the node's elements and nothing
    else (:func:`..rules.routing.only_moves`: a view, a permute, a module mark, a slice,
    ``where``'s branch of the output's shape, ...): a D there holds only elements of its
    readers' D, or ⊕s of them across readers, or the zero. Found once per graph."""
    found = _ONLY_MOVED.get(graph.graph)
    if found is None:
        found = _ONLY_MOVED[graph.graph] = frozenset(
            n for n in graph.nodes if n.users and all(only_moves(u, n) for u in n.users)
        )
    return found


def check_flags(graph, flags: list, check) -> None:
    """Raise for the first overflowed statistic among ``flags`` (see :func:`.reverse.reverse`)."""
    first = _first_overflow(flags) if flags else None
    if first is not None:
        node, sr = first
        late = check != "every" and sr.overflow == "end"
        raise _overflow(graph, node, sr, Overflow if late else NonFiniteError)


def _first_overflow(flags):
    """The (node, semiring) of the first statistic that is +inf or NaN (one sync)."""
    by_dtype: dict = {}
    for i, (_, _, t) in enumerate(flags):
        by_dtype.setdefault(t.dtype, []).append(i)
    first = None
    for idx in by_dtype.values():
        stats = torch.stack([flags[i][2] for i in idx])
        bad = overflowed(stats).nonzero()
        if len(bad):
            i = idx[int(bad[0, 0])]
            first = i if first is None else min(first, i)
    return None if first is None else flags[first][:2]
