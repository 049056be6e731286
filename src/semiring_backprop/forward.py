"""Runs a traced :class:`Graph` on concrete inputs and keeps every node's value."""

from __future__ import annotations

import torch
from torch.fx.node import map_arg

from . import rules
from .errors import InputError, NonFiniteError, where
from .tracing import Graph, input_tensors, mark_op

# ops that may pass inf through or write it on purpose (masks): not an overflow
_INF_OK_KINDS = ("routing", "nondifferentiable")


def run(graph: Graph, args: tuple, kwargs: dict) -> dict:
    """Values of every node for these inputs (inputs must match the traced ones' kinds)."""
    given = input_tensors(args, kwargs)
    values: dict = {}
    for key, node in graph.user_inputs.items():
        if key not in given:
            raise InputError(f"input {key!r} was traced but is missing from this call")
        values[node] = given[key]
    values.update(graph.constants)
    checked = []  # (node, sum of its value): one reduction per node, one sync at the end
    for node, check in _plan(graph):
        a = map_arg(node.args, values.__getitem__)
        k = map_arg(node.kwargs, values.__getitem__)
        out = a[0] if node.target is mark_op else node.target(*a, **k)
        values[node] = out
        if check and isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
            checked.append((node, out.sum()))
    finite = torch.isfinite(torch.stack([s.float() for _, s in checked])) if checked else None
    if finite is not None and not bool(finite.all()):
        for (node, _), ok in zip(checked, finite.tolist()):  # in graph order: the first
            if not ok:  # a mask may hold -inf, and a sum may overflow: look closer
                _check_finite(graph, node, values[node], map_arg(node.args, values.__getitem__))
    return values


def _plan(graph: Graph) -> list:
    """``[(node, whether its value is checked for NaN / inf)]`` for the graph's ops."""
    plan = getattr(graph, "_forward_plan", None)
    if plan is None:
        plan = [(n, not _moves_only(n)) for n in graph.nodes if n.op == "call_function"]
        graph._forward_plan = plan
    return plan


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
