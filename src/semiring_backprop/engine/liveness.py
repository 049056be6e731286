"""What a pass with ``keep=`` holds: forward values dropped, freed and recomputed.

Each rule declares which forward values it reads (``Rule.reads``). With ``keep=``:

- the forward drops a value no rule reads as soon as the forward has used it
  (:func:`unread_values`);
- the reverse pass lets a value go once the last rule that reads it has run
  (``Plan.free``);
- a value that rules read but that is a cheap pointwise function of one other value
  (its *root*) is not held through the forward at all: the root is, and the value is
  computed again from it just before the first rule of the reverse pass that reads it.
  Composite ops decompose into such chains: GELU is ``x·0.5·(1 + erf(x/√2))``, whose
  rules read ``0.5x``, ``x/√2`` and ``1 + erf(x/√2)`` where autograd's fused GELU saves
  ``x`` alone. Views (reshapes, permutes, expands) continue a chain. Inputs broadcast
  along a dimension of the output (a row statistic: a softmax's shift and sum, a norm's
  mean, a mask) do not end one: they are held beside the root, a dimension's worth
  smaller than the output. The same ops run on the same inputs: the same values, bit
  for bit. A group of such values is recomputed only where that holds fewer values:
  when the root is held anyway, or when the group has two values or more (a pointwise
  op's output is at least as large as each of its inputs); all of a group is computed
  at once, before the first rule (in the reverse order) that reads one of them. Where
  one value of a group comes before all the others and the root is held for the group
  alone, that value is held instead of the root: as much memory, fewer ops run again.
  So attention holds the exponentials ``exp(s - max)`` and computes the probabilities
  (``/ sum``, and the masks' ``where``) again from them, where the forward would hold
  both.

A value let go is replaced by a stand-in of the same shape, dtype and device that holds
no memory (NaN elements: no rule reads them), so rules still see every argument's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx.node import map_arg

from .. import rules
from ..rules.routing import where_value
from ..tracing.trace import mark_op
from . import relevance

_WHERE = torch.ops.aten.where.self

#: the most ops run again to recompute one value (a bound on the extra time)
MAX_OPS = 16


@dataclass(frozen=True)
class Plan:
    held: frozenset  #: values the forward holds for the pass (and the kept ones)
    recomputed: frozenset  #: values the reverse pass computes again from a root
    #: node -> float values the forward drops once it is computed (their last use)
    drop: dict
    #: node id -> values to let go before that node's rule runs
    free: dict
    #: node id -> (ops to run in graph order, values to put back, roots to let go after):
    #: done before that node's rule runs, the first (in reverse order) to read them
    restore: dict


def plan(graph, needed, keep) -> Plan:
    """The plan for a pass over ``needed`` keeping ``keep`` (cached per graph, needed
    set and kept set)."""
    cache = graph.__dict__.setdefault("_memory_plan", {})
    key = (needed, frozenset(keep))
    if key not in cache:
        cache[key] = _make_plan(graph, needed, frozenset(keep))
    return cache[key]


def unread_values(graph, needed, keep) -> dict:
    """``{node: [values to drop once it is computed]}``: float values that no rule of the
    pass reads, or that it recomputes, each dropped after its last use in the forward.
    Values kept for the result (``keep``) and the output are never dropped."""
    return plan(graph, needed, keep).drop


def before_rule(p: Plan, node_id: int, values: dict) -> None:
    """Let go of the values no rule from ``node_id`` down reads, and put back the
    recomputed values the rules from here read."""
    for n in p.free.get(node_id, ()):
        if n in values:
            values[n] = stand_in(values[n])
    step = p.restore.get(node_id)
    if step is None:
        return
    ops, put, release = step
    env: dict = {}
    get = lambda a: env[a] if a in env else values[a]  # noqa: E731  (a root or a constant)
    for node in ops:
        args, kwargs = map_arg(node.args, get), map_arg(node.kwargs, get)
        if node.target is mark_op:
            env[node] = args[0]
        elif node.target is _WHERE and not kwargs:
            env[node] = where_value(*args)  # as the forward computed it
        else:
            env[node] = node.target(*args, **kwargs)
    for m in put:
        values[m] = env[m]
    for r in release:
        values[r] = stand_in(values[r])


_NAN: dict = {}


def stand_in(t):
    """A NaN broadcast to ``t``'s shape (dtype and device kept; no memory)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    key = (t.dtype, t.device)
    if key not in _NAN:
        _NAN[key] = torch.full((), math.nan, dtype=t.dtype, device=t.device)
    return _NAN[key].expand(t.shape)


# -- planning -----------------------------------------------------------------------------


def _make_plan(graph, needed, keep) -> Plan:
    index = graph.ids
    readers: dict = {}  # value -> ids of the nodes whose rule reads it
    for node in graph.nodes:
        if node.op != "call_function" or node not in needed:
            continue  # a rule runs only at nodes the pass goes through
        rule = rules.lookup(node.target)
        if rule is None or rule.reads is None:
            read = [*node.all_input_nodes, node]
        else:
            read = relevance.reads(graph, node, rule.reads(node, needed))
        for v in read:
            if isinstance(v, torch.fx.Node):  # not a number argument
                readers.setdefault(v, []).append(index[node])
    stay = keep | {graph.output_node}
    roots, restore_at = _recompute(graph, readers, stay)
    recomputed = frozenset(m for _, put in restore_at.values() for m in put)
    held = (frozenset(readers) - recomputed) | frozenset(roots) | stay

    drop: dict = {}  # in the forward: after the value's last use
    for node in graph.nodes:
        if node.op != "call_function" or node in held or not float_node(node):
            continue
        users = list(node.users)
        if any(u.op != "call_function" for u in users):
            continue  # returned by the graph
        drop.setdefault(max(users, key=index.__getitem__, default=node), []).append(node)

    free: dict = {}  # a value goes after the last (lowest) rule reading it has run
    release: dict = {}  # ... or right after the last restore that reads it (a root)
    for node in graph.nodes:
        if node in keep or node.op != "call_function":
            continue
        last = min(readers.get(node, [index[node]]))
        if node in roots and (node not in readers or roots[node] < last):
            release.setdefault(roots[node], []).append(node)
        else:
            free.setdefault(last - 1, []).append(node)
    restore = {
        p: (sorted(ops, key=index.__getitem__), put, release.get(p, []))
        for p, (ops, put) in restore_at.items()
    }
    return Plan(held, recomputed, drop, free, restore)


def _recompute(graph, readers, stay):
    """``(roots, restore)``: root -> the last (lowest) node id at which a value is
    recomputed from it; node id -> (ops to run, values to put back) before its rule."""
    root: dict = {}  # chain node -> its root
    for node in graph.nodes:
        r = _root_of(node, root, graph.constants)
        if r is not None:
            root[node] = r
    groups: dict = {}
    for node in readers:
        if node in root and node not in stay:
            groups.setdefault(root[node], []).append(node)
    held = set(readers) | stay | set(graph.user_inputs.values())
    roots, restore = {}, {}
    for r, group in groups.items():
        programs = {m: _program(m, root) for m in group}
        group = [m for m in group if len(programs[m]) <= MAX_OPS]
        if not group or (r not in held and len(group) < 2):
            continue  # holding the root instead would hold as much
        if r not in held:  # held for this group alone: a member all others follow from
            anchor = next((m for m in group if all(m in programs[o] for o in group)), None)
            if anchor is not None:  # is held instead (as much memory, fewer ops again)
                group = [m for m in group if m is not anchor]
                programs = {m: programs[m] - programs[anchor] for m in group}
        # the first rule, in reverse order, to read one of them: all are computed there
        p = max(max(readers[m]) for m in group)
        ops, put = restore.setdefault(p, (set(), []))
        program = set().union(*(programs[m] for m in group))
        ops.update(program)
        put.extend(group)
        # what the program reads besides itself: the root, the row statistics beside it
        # (and the model's constants, which are always there)
        reads = {a for n in program for a in n.all_input_nodes if a not in program}
        for v in reads - set(graph.constants):
            roots[v] = min(roots.get(v, p), p)
    return roots, restore


def _root_of(node, root: dict, constants):
    """The one value ``node`` is a cheap function of (with the model's constants and
    inputs broadcast along one of its dimensions), if any; else None."""
    if node.op != "call_function" or not _cheap(node):
        return None
    sources = set()
    for a in node.all_input_nodes:
        if a in constants:
            continue
        if _beside(a, node) and not (a in root and float_node(a)):
            continue  # held beside the root (a float that is computed again is not)
        sources.add(root.get(a, a))
    return next(iter(sources)) if len(sources) == 1 else None


def _beside(a, node) -> bool:
    """Whether input ``a`` of ``node`` is smaller by at least one of the output's
    dimensions (it is broadcast along it): a row statistic or a mask, or a number."""
    av, ov = a.meta.get("val"), node.meta.get("val")
    if not isinstance(av, torch.Tensor):
        return True  # a size or a number
    if not isinstance(ov, torch.Tensor) or av.dim() > ov.dim():
        return False
    if av.dim() < ov.dim():
        return True
    return any(_one(x) and not _one(y) for x, y in zip(av.shape, ov.shape))


def _one(size) -> bool:
    """A size known to be 1 (symbolic sizes are not: torch.export fixes sizes 0 and 1)."""
    return isinstance(size, int) and size == 1


_aten = torch.ops.aten
#: ops that give a view of their one tensor input (no computation, no memory)
_VIEWS = frozenset(
    {
        _aten.view.default, _aten._unsafe_view.default, _aten.expand.default,
        _aten.permute.default, _aten.unsqueeze.default, _aten.squeeze.dim,
        _aten.squeeze.dims, _aten.transpose.int, _aten.t.default, _aten.alias.default,
    }
)  # fmt: skip


def _cheap(node) -> bool:
    """Deterministic elementwise ops, views and marks with a tensor output."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    target = node.target
    if target is mark_op or target in _VIEWS:
        return True
    return (
        isinstance(target, torch._ops.OpOverload)
        and torch.Tag.pointwise in target.tags
        and torch.Tag.nondeterministic_seeded not in target.tags
    )


def _program(member, root: dict) -> set:
    """The chain nodes between ``member`` and its root (``member`` included)."""
    out, todo = set(), [member]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(a for a in n.all_input_nodes if a in root)
    return out


def float_node(node) -> bool:
    """Whether the node makes a floating-point tensor (from the trace)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()
