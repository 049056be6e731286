"""The reverse pass (Algorithm 2 of the paper): micrograd's loop with ⊕ for +=.

Walk the graph backwards from the output; at each node apply its op's rule under every
semiring and ⊕ the results into the node's inputs. Several argument slots of one op
that read the same tensor are aggregated inside the op (``sr.sum``); several ops that
read it are combined by ``sr.plus``.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.node import map_arg

from .. import rules
from ..errors import InputError, UnsupportedOpError, where
from ..rules.routing import reshape_back
from ..semirings.base import fmap, stack
from . import liveness, relevance, structure
from .hooks import EVERY, Both, options


def needed_nodes(graph, start) -> frozenset:
    """Float nodes on a path to ``start`` that depend on a user input (not on weights only).

    Computed once per graph and start (the graph does not change once traced).
    """
    cache = graph.__dict__.setdefault("_needed", {})
    if start not in cache:
        cache[start] = _needed_nodes(graph, start)
    return cache[start]


#: ops that read only an input's size: what is computed from them (positions made by
#: ``arange(seq_len)`` in a graph traced for any length) is no function of its values
_SIZE_OPS = frozenset(
    {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default}
)


def _needed_nodes(graph, start) -> frozenset:
    from_input = set(graph.user_inputs.values())
    for node in graph.nodes:
        if node.op != "call_function" or node.target in _SIZE_OPS:
            continue
        if any(a in from_input for a in node.all_input_nodes):
            from_input.add(node)
    reach, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n not in reach:
            reach.add(n)
            todo.extend(n.all_input_nodes)
    on_path = reach & from_input
    for node in graph.nodes:  # values the pass cannot carry would silently cut paths
        if node not in on_path:
            continue
        if _is_complex(node):
            raise _unsupported(
                graph, node, "it makes a complex tensor; only real-valued graphs can be explained"
            )
        if node.target is operator.getitem and liveness.float_node(node):
            raise _unsupported(
                graph, node.args[0], "it returns several tensors; rules cover single-output ops"
            )
    return frozenset(n for n in on_path if liveness.float_node(n))


def _is_complex(node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_complex()


def reverse(
    graph, values: dict, semirings: list, seed_node, keep=None, snapshots=None, reached=None,
    check: str = "pass", flags: list | None = None, store_at=None,
) -> dict:  # fmt: skip
    """D(v) for every needed node v, as ``{node: [value per semiring]}``.

    With ``keep`` (a set of nodes), D is stored for those nodes only, and the pass
    holds only what its rules still read (:mod:`liveness`: forward values let go after
    their last reader, cheap ones recomputed, each D released once its rule has run).

    D is checked for values no finite path product gives (float overflow: the forward
    values are checked finite), with one host sync at the end: at every node for
    semirings whose ops can hide one (``Semiring.overflow == "node"``; but nodes whose
    readers only move their elements, ``hooks.only_moved``: a reader's D had it first),
    where paths end for the others. A :class:`NonFiniteError` names the first node
    (from the output) where one appears; an :class:`~.hooks.Overflow` seen only where
    paths end asks the caller to run the pass again with ``check="every"`` to find that
    node. With ``flags`` (a list), the statistics are appended to it instead, and not
    read: the caller reads them with :func:`~.hooks.check_flags` (a pass captured as a
    CUDA graph reads them after each replay). ``store_at`` (a set of nodes): D is stored
    for those only, while every forward value stays (unlike ``keep``). ``snapshots``
    (``{node id: None}``): at each of these ids, before its node's rule runs, the
    partial sums are copied there (the state to run the pass on from, see
    :mod:`checkpoints`); ``reached`` (a set) collects every node that gets a D. Each
    option is a hook of :mod:`.hooks`.
    """
    needed = needed_nodes(graph, seed_node)
    if seed_node not in needed:
        raise InputError(
            "the output does not depend on any float input of the model: nothing to explain"
        )
    out = values[seed_node]
    acc = {seed_node: [sr.one(out.shape, out) for sr in semirings]}
    hooks = options(graph, values, semirings, needed, keep, snapshots, reached, check, flags)
    if keep is not None:
        store_at = keep if store_at is None else Both(keep, store_at)
    return propagate(graph, values, semirings, acc, needed, hooks, store_at=store_at)


def propagate(
    graph, values, semirings, acc: dict, needed, hooks=(), *, within=None, store_at=None,
    start=None, stop=0,
) -> dict:  # fmt: skip
    """Run the pass from the partial sums ``acc`` (``{node: [value per semiring]}``):
    micrograd's loop, with ⊕ for ``+=``. Returns ``{node: D}`` for the nodes of
    ``store_at`` (None: every node the pass reaches).

    With ``within`` (a set of nodes), only paths inside it are followed: the pass then
    gives ⊕ over the paths that start at a node of ``within`` and reach a seed through
    ``within`` alone (used for the contribution of one branch). ``start`` / ``stop``:
    only the nodes with ids ``start - 1`` down to ``stop``. ``hooks``: what else the
    pass does, each called at its fixed points (:mod:`.hooks`).
    """
    within = EVERY if within is None else within
    store_at = EVERY if store_at is None else store_at
    plan = reverse_plan(graph, needed)
    start = len(graph.nodes) if start is None else start
    store = {}
    for node_id in range(start - 1, stop - 1, -1):
        for hook in hooks:
            hook.before(node_id, acc)
        node = graph.nodes[node_id]
        d = acc.pop(node, None)
        if d is None:
            continue
        inputs, reshapes = plan[node_id]
        inputs = [n for n in inputs if n in within]
        for hook in hooks:  # D at this node is complete: ⊕ over all its consumers
            hook.done(node, d, not inputs)
        stored = node in store_at
        if stored:
            store[node] = d
        if not inputs:
            continue
        if reshapes:  # views, copies, marks: D(x) is d in x's shape (no rule call)
            gen = _reshaped(values, semirings, node, node_id, d)
        else:
            gen = contributions(graph, values, semirings, node_id, d, needed, release=not stored)
        for inp, s, c in gen:
            if inp in within:
                slot = acc.setdefault(inp, [None] * len(semirings))
                slot[s] = semirings[s].accumulate(slot[s], c)
    for hook in hooks:
        hook.after()
    return store


def _reshaped(values, semirings, node, node_id, d):
    """``(input, semiring index, value)``: D at a reshaping node, in its input's shape."""
    x = node.args[0]
    shape = values[x].shape
    for s, sr in enumerate(semirings):
        moved = sr.enter(d[s], node_id)
        if moved[0].shape != shape:  # marks and same-shape views move nothing
            moved = fmap(lambda f, shape=shape: f.reshape(shape), moved)
        yield x, s, sr.leave(moved, node_id)


def reverse_plan(graph, needed) -> list:
    """Per node id: (needed inputs, whether the rule only reshapes); inputs are empty for
    nodes the pass does not go through. Cached per graph and needed set."""
    cache = graph.__dict__.setdefault("_reverse_plan", {})
    if needed not in cache:
        plan = []
        for node in graph.nodes:
            inputs = [n for n in node.all_input_nodes if n in needed]
            if node.op != "call_function":
                inputs = []
            plan.append((inputs, bool(inputs) and _reshapes(node)))
        cache[needed] = plan
    return cache[needed]


def _reshapes(node) -> bool:
    """Ops whose rule only reshapes D back to the input (one tensor argument)."""
    rule = rules.lookup(node.target)
    return rule is not None and rule.fn is reshape_back


def contributions(graph, values, semirings, node_id, d: list, needed, op=None, release=False):
    """Apply node ``node_id``'s rule to its values ``d`` (one per semiring).

    Yields ``(input node, semiring index, value)``; the argument slots of one op that
    read the same input are ⊕-ed inside the op (``sr.sum``). With ``release``, each
    ``d[s]`` is let go (set to None) once its rule has run, for memory.
    """
    node = graph.nodes[node_id]
    rule = rules.lookup(node.target)
    if rule is None:
        raise _unsupported(graph, node)
    if op is None:
        op = make_op(node, values, needed, graph)
    fn = _edited(graph, node, rule.fn, op)
    for s, sr in enumerate(semirings):
        per_input: dict = {}
        inner = sr.inner
        g = sr.enter(d[s], node_id)
        if release:
            d[s] = None
        res = fn(inner, g, op, *op.args, **op.kwargs)
        del g
        for inp, c in _pair(node.args, res):
            if inp in needed and c is not None:
                per_input.setdefault(inp, []).append(c)
        for inp, cs in per_input.items():
            c = cs[0] if len(cs) == 1 else inner.sum(stack(cs), 0)
            _check_shape(graph, node, inp, c, values)
            yield inp, s, sr.leave(_in_dtype(c, values[inp]), node_id)


def slot_values(graph, values, sr, node_id: int, g, needed, op=None):
    """The rule's value for every argument slot, unsummed: ``[(input node, value)]``,
    computed with ``sr`` itself and its ``tag`` (full back-pointers: what path reading
    uses to find the element a lazy pointer stands for)."""
    node = graph.nodes[node_id]
    rule = rules.lookup(node.target)
    if rule is None:
        raise _unsupported(graph, node)
    if op is None:
        op = make_op(node, values, needed, graph)
    fn = _edited(graph, node, rule.fn, op)
    res = fn(sr, sr.tag(g, node_id), op, *op.args, **op.kwargs)
    return [(inp, c) for inp, c in _pair(node.args, res) if inp in needed and c is not None]


def _edited(graph, node, fn, op):
    """The rule ``fn`` of ``node`` under the graph's edge weights (``engine.relevance``);
    the slots it cuts are marked on ``op``."""
    e = relevance.edit(graph, node)
    if e is None:
        return fn
    op.cut = e.cut
    return relevance.reverse_rule(fn, e)


def make_op(node, values, needed, graph=None) -> rules.Op:
    """What ``node``'s rule sees: its forward values, and with ``graph`` the prepared
    weights and the edges whose weight is a structural zero (:mod:`.structure`)."""
    prepared = getattr(graph, "prepared", None)
    return rules.Op(
        node,
        map_arg(node.args, values.__getitem__),
        map_arg(node.kwargs, values.__getitem__),
        values[node],
        needed,
        prepared=prepared,
        static=graph.static if prepared is not None else frozenset(),
        absent=structure.absent(graph, values, node, needed),
    )


def _pair(args, res):
    """Pair each fx Node among ``args`` (lists included) with the rule's value for it."""
    if isinstance(args, torch.fx.Node):
        yield args, res
    elif isinstance(args, list | tuple) and isinstance(res, list | tuple) and not _is_value(res):
        for a, r in zip(args, res):
            yield from _pair(a, r)


def _is_value(res) -> bool:
    return isinstance(res, tuple) and len(res) > 0 and isinstance(res[0], torch.Tensor)


def _in_dtype(c, x):
    """``c`` in the input's float dtype: an op that promotes (``f32 + f64``) reads its
    input as if cast, so the input's value follows the model's own cast back, as its
    gradient does in autograd (a float32 island in a float64 model stays float32)."""
    if c[0].dtype == x.dtype or not x.is_floating_point():
        return c
    return fmap(lambda f: f.to(x.dtype) if f.is_floating_point() else f, c)


def _check_shape(graph, node, inp, c, values):
    want = tuple(values[inp].shape)
    if tuple(c[0].shape) != want:
        raise RuntimeError(
            f"internal error: the rule of {node.target} at {where(node, graph.module_of(node))} "
            f"returned shape {tuple(c[0].shape)} for input `{inp.name}` of shape {want}"
        )


def _unsupported(graph, node, reason: str = "") -> UnsupportedOpError:
    why = f" ({reason})" if reason else ""
    return UnsupportedOpError(
        f"no semiring rule for {node.target} at {where(node, graph.module_of(node))}{why}. "
        "Register one with semiring_backprop.rules.register(<op>, kind) (kinds: pointwise, "
        "composite, routing, contraction, reduction, nondifferentiable), keep the module out "
        "of the explained function, or report the op; sbp.supported_ops() lists the rules."
    )
