"""The forward semiring pass: alpha(v) = ⊕ over paths from the sources to v of the ⊗ of
their edge weights, in one sweep over the graph in order (DESIGN §3b).

It is the reverse pass run the other way: at each node the op's forward rule (the
transpose of its reverse rule, :func:`rules.register_forward`) takes the values at the
op's inputs to its output. Paths start at the sources, each element with its seed:
the semiring's one ("structural": every path counts as its edges alone) or an edge
weight of its own (``lift(x)``: each path times the input it starts from). With the
reverse pass's D (beta), ``alpha(v) ⊗ D(v)`` is the ⊕ over the whole paths through v.
"""

from __future__ import annotations

import torch

from .. import rules
from ..errors import UnsupportedOpError, where
from ..semirings.base import fmap
from . import relevance
from .reverse import make_op, reverse_plan


def sources(graph, needed) -> list:
    """The nodes where the reverse pass ends: needed nodes none of whose inputs is
    needed (float inputs of the model, embeddings looked up from token ids, masks made
    from integer inputs)."""
    plan = reverse_plan(graph, needed)
    return [n for i, n in enumerate(graph.nodes) if n in needed and not plan[i][0]]


def alpha(graph, values, semirings, seeds: dict, needed, keep=None, reached=None) -> dict:
    """alpha(v) for every needed node v that a path from a seed reaches, as
    ``{node: [value per semiring, None where no path]}``.

    ``seeds``: ``{node: [value per semiring]}``, each ⊕-ed into the node's value (paths
    of length 0 starting there). With ``keep`` (a set of nodes), only those are kept:
    the others are let go once their last consumer has run. ``reached`` (a set)
    collects every node that gets a value, kept or not.
    """
    plan = reverse_plan(graph, needed)
    last = _last_use(graph, needed) if keep is not None else {}
    store: dict = {}
    n_sr = len(semirings)
    for node_id, node in enumerate(graph.nodes):
        if node not in needed:
            continue
        out = list(seeds.get(node, [None] * n_sr))
        inputs = plan[node_id][0]
        if any(i in store for i in inputs):
            for s, c in enumerate(apply_rule(graph, values, semirings, node_id, store, needed)):
                if c is not None:
                    out[s] = c if out[s] is None else semirings[s].plus(out[s], c)
        if any(v is not None for v in out):
            store[node] = out
            if reached is not None:
                reached.add(node)
        if keep is not None:
            for i in inputs:
                if last.get(i) == node_id and i not in keep:
                    store.pop(i, None)
    if keep is not None:
        store = {n: v for n, v in store.items() if n in keep}
    return store


def _last_use(graph, needed) -> dict:
    ids = graph.ids
    return {
        n: max((ids[u] for u in n.users if u in needed), default=ids[n])
        for n in graph.nodes
        if n in needed
    }


def apply_rule(graph, values, semirings, node_id, store, needed, rows: int = 0) -> list:
    """The forward rule of node ``node_id`` under every semiring: a value (or None)
    per semiring. ``rows``: the values in ``store`` have that many rows first, and so
    do the results (the rule must take rows: :func:`rules.takes_rows`)."""
    node = graph.nodes[node_id]
    fn = rules.lookup_forward(node.target)
    if fn is None:
        raise _no_forward_rule(graph, node)
    if rows and not rules.takes_rows(node.target, semirings):
        raise RuntimeError(f"internal error: the forward rule of {node.target} takes no rows")
    op = make_op(node, values, needed, graph)
    op.rows = rows
    e = relevance.edit(graph, node)
    if e is not None:  # the graph's edge weights are relevance rules
        op.cut = e.cut
        fn = relevance.forward_rule(fn, e)
    out_value = values[node]
    shape = (rows, *out_value.shape) if rows else tuple(out_value.shape)
    results = []
    for s, sr in enumerate(semirings):

        def at(n, s=s):
            slot = store.get(n) if n in needed else None
            return None if slot is None else _as_dtype(slot[s], out_value)

        alphas = [_mirror(a, at) for a in node.args]
        c = fn(sr.inner, alphas, op, *op.args, **op.kwargs)
        if c is not None:
            if tuple(c[0].shape) != shape:
                raise RuntimeError(
                    f"internal error: the forward rule of {node.target} at "
                    f"{where(node, graph.module_of(node))} returned shape "
                    f"{tuple(c[0].shape)} for an output of shape {shape}"
                )
            c = sr.leave(_as_dtype(c, out_value), node_id)
        results.append(c)
    return results


def _mirror(arg, at):
    """``arg`` with each fx Node replaced by ``at(node)`` and anything else by None."""
    if isinstance(arg, torch.fx.Node):
        return at(arg)
    if isinstance(arg, list | tuple):
        return [_mirror(a, at) for a in arg]
    return None


def _as_dtype(value, like):
    """A value in ``like``'s float dtype (an op that promotes reads its inputs as cast)."""
    if not isinstance(like, torch.Tensor) or not like.is_floating_point():
        return value
    if value[0].dtype == like.dtype:
        return value
    return fmap(lambda f: f.to(like.dtype) if f.is_floating_point() else f, value)


def _no_forward_rule(graph, node) -> UnsupportedOpError:
    rule = rules.lookup(node.target)
    has = (
        f"its reverse rule ({rule.kind}) has" if rule is not None else "it has no rule at all, and"
    )
    return UnsupportedOpError(
        f"no forward (alpha) rule for {node.target} at {where(node, graph.module_of(node))}: "
        f"{has} no forward counterpart yet, so alpha and marginals cannot pass it. "
        "Register one with semiring_backprop.register_forward(<op>), keep the module out "
        "of the explained function, or report the op; "
        "semiring_backprop.rules.without_forward() lists the ops without one."
    )
