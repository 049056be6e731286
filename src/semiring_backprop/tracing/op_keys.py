"""What the decomposer (:mod:`.decompose`) reads of an exported program before it traces
an op: whether it takes the graph at all (:func:`check`: functional ops, tensors of fixed
size; else :class:`Unsupported`, and ``run_decompositions`` decomposes it whole), the key
of an op (:func:`op_key`: the op, its non-tensor arguments and the layout of each tensor
input; ops of one key decompose alike), and the order ``run_decompositions`` gives the
program's inputs (:func:`input_order`).
"""

from __future__ import annotations

import operator

import torch
from torch.export.graph_signature import InputKind, OutputKind

DETACH_ = torch.ops.aten.detach_.default
_CONSTANT = 64  # constants of at most this many elements are compared by value


class Unsupported(Exception):
    """This graph is decomposed by ``run_decompositions`` itself."""


def check(program) -> None:
    """Raise :class:`Unsupported` unless every op is functional and every size fixed."""
    sig = program.graph_signature
    if any(s.kind != OutputKind.USER_OUTPUT for s in sig.output_specs):
        raise Unsupported("the graph writes into inputs or buffers")
    if any(s.kind not in (InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER,
                          InputKind.CONSTANT_TENSOR) for s in sig.input_specs):  # fmt: skip
        raise Unsupported("inputs other than tensors")
    for node in program.graph_module.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            if not isinstance(node.args[0].meta.get("val"), tuple | list):
                raise Unsupported("getitem on a non-tuple")
            continue
        if node.op == "call_function":
            if not isinstance(node.target, torch._ops.OpOverload):
                raise Unsupported(f"{node.target}")
            schema = node.target._schema
            if node.target is DETACH_ and node.args[0].op == "call_function":
                continue  # (an intermediate's requires_grad: no op once traced, see _emit)
            if schema.is_mutable or any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
            ):
                raise Unsupported(f"in-place {node.target}")
        elif node.op != "placeholder":
            raise Unsupported(f"a {node.op} node")
        vals = node.meta.get("val")
        if vals is None and node.op == "call_function" and not node.target._schema.returns:
            continue  # an op returning nothing (a check on a tensor's metadata)
        for v in vals if isinstance(vals, tuple | list) else [vals]:
            if not isinstance(v, torch.Tensor) or not all(isinstance(d, int) for d in v.shape):
                raise Unsupported(f"{node.name}'s value is not a tensor of fixed size")


def input_order(program) -> list:
    """The inputs in the order ``run_decompositions`` puts them: the parameters, then the
    buffers and constants, each in the order of the module tree that
    ``ExportedProgram.module()`` builds (the modules in the order they were called, then
    any others as their buffers, parameters and constants are assigned; constants are
    registered as buffers after), then the user's inputs."""
    sig = program.graph_signature
    kinds = {InputKind.PARAMETER: 0, InputKind.BUFFER: 1, InputKind.CONSTANT_TENSOR: 1}
    by_kind = {k: [s for s in sig.input_specs if s.kind == k] for k in kinds}
    children: dict = {"": []}  # module path -> its submodules, in order of creation
    own: dict = {}  # module path -> ([parameters], [buffers and constants])

    def create(path):
        parts = path.split(".") if path else []
        for i in range(len(parts)):
            parent, child = ".".join(parts[:i]), ".".join(parts[: i + 1])
            if child not in children:
                children[child] = []
                children[parent].append(child)
        return path

    def place(spec, group):
        own.setdefault(create(spec.target.rpartition(".")[0]), ([], []))[group].append(spec)

    for entry in program.module_call_graph:
        create(entry.fqn)
    for spec in by_kind[InputKind.BUFFER]:
        place(spec, 1)
    for spec in by_kind[InputKind.PARAMETER]:
        place(spec, 0)
    for spec in by_kind[InputKind.CONSTANT_TENSOR]:
        place(spec, 1)
    params, buffers, stack = [], [], [""]
    while stack:  # pre-order, children in order of creation
        path = stack.pop()
        p, b = own.get(path, ([], []))
        params += p
        buffers += b
        stack.extend(reversed(children[path]))
    users = [s for s in sig.input_specs if s.kind not in kinds]
    return params + buffers + users


def layout(v):
    """What of a tensor input may decide what an op becomes: its layout, and the value
    of a fake tensor that carries a real one (a constant, which fake kernels may read)."""
    if not isinstance(v, torch.Tensor):
        raise Unsupported(f"an input of type {type(v).__name__}")
    const = getattr(v, "constant", None)
    if const is not None:
        if const.numel() > _CONSTANT:
            raise Unsupported("a large constant")
        const = (const.dtype, tuple(const.flatten().tolist()))
    return (
        tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, v.layout,
        v.requires_grad, const,
    )  # fmt: skip


def op_key(node, vals: dict):
    """What decides what ``node`` becomes: its op, its non-tensor arguments and the
    layout of each of its distinct tensor inputs (``vals``)."""
    slots: dict = {}

    def enc(a):
        if isinstance(a, torch.fx.Node):
            if a not in slots:
                slots[a] = (len(slots), layout(vals[a]))
            return ("n", slots[a])
        if isinstance(a, list | tuple):
            return (type(a).__name__, tuple(enc(x) for x in a))
        if isinstance(a, dict):
            return ("d", tuple((k, enc(v)) for k, v in a.items()))
        if isinstance(a, float):
            return ("f", repr(a))
        if a is None or isinstance(a, bool | int | str | torch.dtype | torch.device
                                   | torch.layout | torch.memory_format):  # fmt: skip
            return (type(a).__name__, a)
        raise Unsupported(f"an argument of type {type(a).__name__}")

    key = (node.target, enc(node.args), enc(node.kwargs))
    order = tuple(slots)
    if order != tuple(node.all_input_nodes):  # inputs numbered as all_input_nodes lists them
        raise Unsupported("input order")
    return key


def same_layouts(a, b) -> bool:
    """Whether two values (tensors, or tuples and lists of them) have one layout."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return layout(a) == layout(b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list) and len(a) == len(b):
        return all(same_layouts(x, y) for x, y in zip(a, b))
    return a is None and b is None
