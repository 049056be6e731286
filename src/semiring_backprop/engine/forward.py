"""Runs a traced :class:`Graph` on concrete inputs and keeps every node's value."""

from __future__ import annotations

import torch
from torch.fx.node import map_arg

from .. import rules
from ..errors import ForwardError, InputError, NonFiniteError, where
from ..rules.routing import where_value
from ..tracing.trace import Graph, input_tensors, mark_op
from . import relevance
from .liveness import stand_in

# ops that may pass inf through or write it on purpose (masks): not an overflow
_INF_OK_KINDS = ("routing", "nondifferentiable")

aten = torch.ops.aten

#: ops whose value is finite wherever their inputs are, short of float overflow: their
#: values are not checked one by one. An overflow there is an inf that reaches the
#: output or a checked op (then every value is checked and the first one named), or is
#: squashed (tanh(inf) = 1), which leaves every edge weight finite.
_FINITE_IF_INPUTS_ARE = frozenset(
    {
        aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.neg.default,
        aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
        aten.sum.dim_IntList, aten.mean.dim, aten.erf.default, aten.tanh.default,
        aten.sigmoid.default, aten.relu.default, aten.clone.default,
        aten.embedding.default, aten.abs.default,
    }
)  # fmt: skip


def run(graph: Graph, args: tuple, kwargs: dict, drop: dict | None = None) -> dict:
    """Values of every node for these inputs (inputs must match the traced ones' kinds).

    ``drop`` (``{node: [nodes]}``, from ``memory.unread_values``): values replaced, once
    ``node`` is computed, by a stand-in of the same shape, dtype and device that holds
    no memory (its elements are NaN: no rule reads them).
    """
    values, confirm = run_deferred(graph, args, kwargs, drop)
    return confirm() or values


def run_deferred(graph: Graph, args: tuple, kwargs: dict, drop: dict | None = None):
    """:func:`run` without reading its check for non-finite values: ``(values, confirm)``,
    where ``confirm()`` reads it (one host synchronization on a GPU) and raises as
    :func:`run` would, or returns new values where it had to run again to name the bad
    one (None: the values are good). On a GPU the caller queues the reverse pass first
    and confirms at the end, so the device never waits for the host in between."""
    given = input_tensors(args, kwargs)
    values: dict = {}
    for key, node in graph.user_inputs.items():
        if key not in given:
            raise InputError(f"input {key!r} was traced but is missing from this call")
        values[node] = given[key]
    values.update(graph.constants)
    checked = []  # (node, sum of its value): one reduction per node, one sync at the end
    for node in graph.user_inputs.values():  # a NaN input: refused wherever it is
        if _is_float(values[node]):
            checked.append((node, values[node].sum()))
    # values of the weights alone are the same on every call: checked on the first one
    first = not getattr(graph, "_static_checked", False)
    for node, check in _plan(graph):
        a = map_arg(node.args, values.__getitem__)
        k = map_arg(node.kwargs, values.__getitem__)
        try:
            if node.target is mark_op:
                out = a[0]
            elif node.target is aten.where.self and not k:
                out = where_value(*a)
            else:
                out = node.target(*a, **k)
        except Exception as e:  # torch raises many types: say where, in the user's model
            raise _failed(graph, node, e, a) from e
        values[node] = out
        if (check is True or (check and first)) and _is_float(out):
            checked.append((node, out.sum()))
        for n in drop.get(node, ()) if drop else ():
            values[n] = stand_in(values[n])
    out = values.get(graph.output_node)
    if isinstance(out, torch.Tensor) and _is_float(out):
        checked.append((graph.output_node, out.sum()))
    finite = torch.isfinite(torch.stack([s.float() for _, s in checked])) if checked else None
    finite = None if finite is None else finite.all()

    def confirm():
        if finite is not None and not bool(finite):  # look at every value, in graph order
            return _name_the_first(graph, args, kwargs, values, drop)
        graph._static_checked = True
        return None

    confirm.finite = finite  # (0-dim bool, or None: nothing checked) read without naming
    return values, confirm


def _name_the_first(graph, args, kwargs, values, drop):
    """Raise for the first non-finite value; returns the values of a run that keeps
    every value where a dropped one may be the culprit (that run raises)."""
    _check_inputs(graph, values)
    dropped = {n for nodes in drop.values() for n in nodes} if drop else set()
    try:
        for node, check in _plan(graph):
            out = values[node]
            # (a mask may hold -inf: _check_finite tells)
            if check is not None and node not in dropped and _is_float(out):
                _check_finite(graph, node, out, map_arg(node.args, values.__getitem__))
    except NonFiniteError:
        if dropped:  # again with every value, to name the first bad one
            return run(graph, args, kwargs)
        raise
    if dropped:  # the bad value may be one of those dropped: look again at every value
        return run(graph, args, kwargs)
    graph._static_checked = True
    return None


def _failed(graph, node, e, args=()) -> ForwardError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if node.target is aten.embedding.default and isinstance(e, IndexError) and len(args) > 1:
        table, ids = args[0], args[1]
        rows = table.shape[0]
        bad = ids[(ids < 0) | (ids >= rows)]
        if bad.numel():
            return ForwardError(
                f"an id is outside the table of {where(node, graph.module_of(node))}: "
                f"{int(bad[0])} (of {bad.numel()} such ids), where the table has {rows} "
                f"rows (ids 0..{rows - 1}). Encode the text with the model's own tokenizer."
            )
    return ForwardError(
        f"running the traced model failed at {where(node, graph.module_of(node))} "
        f"({node.target}): {type(e).__name__}: {first[:500]}\n"
        "The model's own forward fails the same way on these inputs (the trace runs the "
        "same ops): check their dtypes and devices against the model's (some kernels, "
        "such as torch's grouped matmul on a CPU, have no float64 version)."
    )


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def _plan(graph: Graph) -> list:
    """``[(node, check)]`` for the graph's ops: whether its value is checked for NaN /
    inf on every call (True), on the first call only ("once": it depends on the
    weights alone), only when a bad value was seen elsewhere (False: it moves checked
    values, or is finite wherever its inputs are), or never (None: no path and no edge
    weight depends on it, see :func:`_relevant`)."""
    plan = getattr(graph, "_forward_plan", None)
    if plan is None:
        from_input = set(graph.user_inputs.values())
        relevant = _relevant(graph)
        plan = []
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            varies = any(a in from_input for a in n.all_input_nodes)
            if varies:
                from_input.add(n)
            if n not in relevant:
                plan.append((n, None))  # never looked at, not even to name a bad value
            elif _moves_only(n):
                plan.append((n, False))
            elif not varies:
                plan.append((n, "once"))
            else:
                plan.append((n, n.target not in _FINITE_IF_INPUTS_ARE))
        graph._forward_plan = plan
    return plan


def _relevant(graph: Graph) -> frozenset:
    """Values whose being finite matters: those on a path to the output (they carry the
    pass) and those a rule of the pass reads (edge weights are made from them).

    Anything else may hold inf or NaN without harm: a value computed from positions
    alone and masked away later (T5's relative-position buckets take ``log(0)``), or
    one that only feeds an integer index.
    """
    from .reverse import needed_nodes  # the pass's own notion of "on a path"

    if graph.output_node not in graph.ids:  # the output is an input: nothing is computed
        return frozenset()
    needed = needed_nodes(graph, graph.output_node)
    out = set(needed)
    for node in needed:
        rule = rules.lookup(node.target) if node.op == "call_function" else None
        if rule is None:
            continue
        if rule.reads is None:
            out.update(node.all_input_nodes)
        else:  # (a relevance rule may read more: engine.relevance)
            out.update(relevance.reads(graph, node, rule.reads(node, needed)))
    return frozenset(out)


def _moves_only(node) -> bool:
    """Ops that only move or select values of their (already checked) inputs."""
    if node.target is mark_op:
        return True
    rule = rules.lookup(node.target)
    return (
        rule is not None
        and rule.kind == "routing"
        and all(n.op != "placeholder" for n in node.all_input_nodes)
        and bool(node.all_input_nodes)
    )


def _check_inputs(graph, values) -> None:
    """NaN in an input is an error wherever it sits (inf may be a mask)."""
    for key, node in graph.user_inputs.items():
        v = values[node]
        nan = torch.isnan(v) if _is_float(v) else None
        if nan is not None and bool(nan.any()):
            at = tuple(int(i) for i in nan.nonzero()[0])
            raise NonFiniteError(
                f"input {key!r} holds NaN (first at index {at}, {int(nan.sum())} "
                "in all). Every element of an input must be a number, also where the output "
                "does not depend on it: replace NaN (torch.nan_to_num) or drop those rows."
            )


def _check_finite(graph, node, out, args):
    if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
        return
    if out.numel() == 0 or bool(torch.isfinite(out).all()):
        return
    module = graph.module_of(node)
    if bool(torch.isnan(out).any()):
        raise NonFiniteError(
            f"the forward pass produced NaN at {where(node, module)} "
            f"({node.target}). Check the inputs and the model's weights; "
            "explanations of a NaN output are meaningless."
        )
    rule = rules.lookup(node.target)
    if rule is not None and rule.kind in _INF_OK_KINDS:
        return
    float_inputs = [
        x
        for x in torch.utils._pytree.tree_leaves(args)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]
    # creation ops (no float inputs) may write inf on purpose: masks
    if float_inputs and not any(bool(torch.isinf(x).any()) for x in float_inputs):
        raise NonFiniteError(
            f"the forward pass produced inf at {where(node, module)} ({node.target}) from "
            "finite inputs (overflow, or log of 0). Use float32/float64 or rescale the "
            "inputs; edge weights there would be infinite."
        )
