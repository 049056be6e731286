"""Runs a traced :class:`Graph` on concrete inputs and keeps every node's value."""

from __future__ import annotations

import torch
from torch.fx.node import map_arg

from . import rules
from .errors import InputError, NonFiniteError, where
from .tracing import Graph, mark_op

# ops that may pass inf through or write it on purpose (masks): not an overflow
_INF_OK_KINDS = ("routing", "nondifferentiable")


def run(graph: Graph, args: tuple, kwargs: dict) -> dict:
    """Values of every node for these inputs (inputs must match the traced ones' kinds)."""
    from torch.utils import _pytree as pytree

    from .tracing import _key

    given = {
        _key(path): leaf
        for path, leaf in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
        if isinstance(leaf, torch.Tensor)
    }
    values: dict = {}
    for key, node in graph.user_inputs.items():
        if key not in given:
            raise InputError(f"input {key!r} was traced but is missing from this call")
        values[node] = given[key]
    values.update(graph.constants)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        a = map_arg(node.args, values.__getitem__)
        k = map_arg(node.kwargs, values.__getitem__)
        if node.target is mark_op:
            out = a[0]  # identity: no copy
        else:
            out = node.target(*a, **k)
        values[node] = out
        if not _moves_only(node):
            _check_finite(graph, node, out, a)
    return values


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
    # one reduction decides the common case; a sum can overflow, so look closer then
    if out.numel() == 0 or bool(torch.isfinite(out.sum())) or bool(torch.isfinite(out).all()):
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
