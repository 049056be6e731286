"""The stand-ins of an export (``tracing.blocks``) replaced by copies of their templates.

Each ``block`` stand-in becomes a copy of its template's nodes, in order, where the
stand-in was: the template's inputs read the stand-in's, the template's parameters and
buffers read the member's own (same names under the member's path), a constant the
template made (``torch.tensor([])``, a cache's start) is made again for the member, and
module paths (in ``nn_module_stack`` and in the ``mark`` tags) are the member's. Then the
constants are numbered, named and ordered as torch.export numbers them, in the order the
graph first reads them: the program is the one a full trace gives.
"""

from __future__ import annotations

import re

import torch
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.fx.node import map_aggregate

from .blocks import INPUTS, OUTPUTS, REGION, Retry
from .record import rename

_block = torch.ops.semiring_backprop.block.default
_LIFTED = re.compile(r"(?:^|\.)lifted_tensor_(\d+)$")
_WRAPPER = "model."  # the tracing wrapper holds the user's model as ``model``


class _Unstitchable(Exception):
    pass


def stitch(program, attempt):
    """``program`` (an export of ``attempt``) with every stand-in replaced; the program
    is changed in place. Raises :class:`Retry` (the group then traced in full) where a
    template's nodes cannot stand for a member."""
    graph = program.graph_module.graph
    specs = dict(zip((n for n in graph.nodes if n.op == "placeholder"),
                     program.graph_signature.input_specs, strict=True))  # fmt: skip
    regions: dict = {}  # tag -> its constants, then its nodes from first to last
    ins: dict = {}
    outs: dict = {}
    open_: dict = {}  # tag -> nodes since its last node, not tagged (a pass put them there)
    for n in graph.nodes:
        tag = n.meta.get(REGION)
        if tag is not None:
            regions.setdefault(tag, []).extend(open_.pop(tag, []))
            regions[tag].append(n)
        if n.op != "placeholder":
            for t in open_:
                open_[t].append(n)
            if tag is not None:
                open_[tag] = []
        for tag, i in n.meta.get(INPUTS, ()):
            ins.setdefault(tag, {}).setdefault(i, n)
        for tag, m in n.meta.get(OUTPUTS, ()):
            outs.setdefault(tag, {})[m] = n
    stand_ins = [n for n in graph.nodes if n.op == "call_function" and n.target is _block]
    made: list = []  # (placeholder, spec, value) of the constants made again
    for s in stand_ins:
        stub = attempt.stubs[s.args[1]]
        tag = stub.template.tag
        try:
            _copy(program, graph, s, stub, regions.get(tag, []), ins.get(tag, {}),
                  outs.get(tag, {}), specs, made)  # fmt: skip
        except _Unstitchable as e:
            stub.group.off = True
            attempt.retry = f"{stub.group.paths[stub.index]}: {e}"
            raise Retry(attempt.retry) from None
    for n in graph.nodes:
        for key in (REGION, INPUTS, OUTPUTS):
            n.meta.pop(key, None)
    if made:
        _constants(program, graph, specs, made)
    return program


def _copy(program, graph, s, stub, region, ins, outs, specs, made) -> None:
    template = stub.template
    old_user, new_user = template.group.paths[template.index], stub.group.paths[stub.index]
    old, new = _WRAPPER + old_user, _WRAPPER + new_user
    inside = set(region)
    for n in region:
        if n not in outs.values() and any(u not in inside for u in n.users):
            raise _Unstitchable(
                f"{n.name}, made inside the template, is read after it "
                f"(by {[u.name for u in n.users if u not in inside]})"
            )
    by_target = {spec.target: n for n, spec in specs.items()}
    env = {n: s.args[0][i] for i, n in ins.items()}
    prefix = list((s.meta.get("nn_module_stack") or {}).items())

    def look(a):
        if a in env:
            return env[a]
        spec = specs.get(a)
        if spec is None or spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            raise _Unstitchable(f"the template reads {a.name}, made outside it")
        target = rename(spec.target, old, new)
        if target == spec.target or target not in by_target:
            raise _Unstitchable(f"the template reads {spec.target}, not one of its own")
        return by_target[target]

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return look(a)
        return rename(a, old_user, new_user) if isinstance(a, str) else a

    first_input = next(n for n, spec in specs.items() if spec.kind == InputKind.USER_INPUT)
    for n in region:
        if n.op == "placeholder":  # a constant the template made: made again
            spec = specs[n]
            with graph.inserting_before(first_input):
                c = graph.placeholder(n.name)
            c.meta = dict(n.meta)
            value = program.constants[spec.target].clone()
            made.append((c, rename(spec.target, old, new), value))
            env[n] = c
            continue
        with graph.inserting_before(s):
            c = graph.create_node(n.op, n.target, map_aggregate(n.args, arg),
                                  map_aggregate(n.kwargs, arg), name=n.name)  # fmt: skip
        c.meta = dict(n.meta)
        for key in (REGION, INPUTS, OUTPUTS):
            c.meta.pop(key, None)
        stack = n.meta.get("nn_module_stack")
        if stack is not None:
            c.meta["nn_module_stack"] = _stack(stack, prefix, old, new)
        env[n] = c
    for u in list(s.users):
        u.replace_all_uses_with(look(outs[u.args[1]]))
        graph.erase_node(u)
    graph.erase_node(s)


def _stack(stack: dict, prefix: list, old: str, new: str) -> dict:
    """A template node's module stack as the member's: the stand-in's own stack, then
    the template's modules below the template, renamed."""
    items = list(stack.items())
    depth = len(prefix) - 1  # the member's place in the stack
    if len(items) <= depth or items[:depth] != prefix[:depth] or items[depth][1][0] != old:
        raise _Unstitchable("a node outside the template's module")
    key = items[depth][0]
    out = dict(prefix)
    for k, (path, cls) in items[depth + 1 :]:
        out[prefix[-1][0] + k[len(key) :] if k.startswith(key) else k] = (
            rename(path, old, new), cls,
        )  # fmt: skip
    return out


def _constants(program, graph, specs, made) -> None:
    """The constants numbered, named and ordered as torch.export does: ``lifted_tensor_N``
    in the order the graph first reads them, each under its module's path."""
    sig = program.graph_signature
    for c, target, value in made:
        specs[c] = InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name=c.name), target,
                             persistent=None)  # fmt: skip
        program.constants[target] = value
    order = {n: i for i, n in enumerate(graph.nodes)}
    lifted = [
        n for n, spec in specs.items()
        if spec.kind == InputKind.CONSTANT_TENSOR and _LIFTED.search(spec.target)
    ]  # fmt: skip
    first = min(int(_LIFTED.search(specs[n].target).group(1)) for n in lifted)
    lifted.sort(key=lambda n: min((order[u] for u in n.users), default=len(order)))
    values = {specs[n].target: program.constants.pop(specs[n].target) for n in lifted}
    first_input = next(n for n, spec in specs.items() if spec.kind == InputKind.USER_INPUT)
    for number, n in enumerate(lifted, start=first):
        spec = specs[n]
        m = _LIFTED.search(spec.target)
        target = spec.target[: m.start(1)] + str(number)
        _set_name(n, "c_" + re.sub(r"[^a-zA-Z0-9]", "_", target.lower()))
        program.constants[target] = values[spec.target]
        specs[n] = InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name=n.name), target,
                             persistent=None)  # fmt: skip
        first_input.prepend(n)
    sig.input_specs[:] = [specs[n] for n in graph.nodes if n.op == "placeholder"]


def _set_name(node, name: str) -> None:
    """Names are set as torch.export's placeholder naming sets them: the name itself
    (``_rename`` would add a suffix where another constant held it before)."""
    node.name = node.target = name
    node.graph._graph_namespace._rename_object(node, name)
