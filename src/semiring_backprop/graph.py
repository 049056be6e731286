"""The traced function: :class:`Graph`, an ATen-level FX graph with its inputs, its
constants and the place of every module in it (made by :func:`.tracing.trace`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import OutputKind


@dataclass
class Graph:
    """A traced function: the FX graph, its inputs and where each module lives in it.

    Examples:
        >>> g = sbp.trace(mlp, (x,), output=lambda y: y[0, 1])
        >>> sorted(g.user_inputs), sorted(g.tags)[:4]   # inputs; places of modules
        ([0], ['0', '0:input', '1', '1:input'])
        >>> [str(n.target) for n in g.nodes if n.op == "call_function"][:3]
        ['semiring_backprop.mark.default', 'aten.permute.default', 'aten.addmm.default']
        >>> g.module_of(g.nodes[5])
        '0'
    """

    program: torch.export.ExportedProgram
    user_inputs: dict  # key (position or keyword) -> placeholder node, in flatten order
    constants: dict  # placeholder node -> parameter / buffer / constant tensor
    tags: dict  # "module.path" / "module.path:input" -> mark node
    whole: tuple = ()  #: composite ops kept whole
    #: placeholder -> every placeholder fed the same tensor object (``mha(x, x, x)``):
    #: torch.export may read only one of them, so an input's value is their ⊕
    aliases: dict = field(default_factory=dict)
    #: module path -> class name, for every submodule of the traced model
    module_types: dict = field(default_factory=dict)
    #: module path -> the attention head counts and sizes its attributes (or its
    #: ``config`` / ``cfg``) give, for per-head branch tables (``head_attrs``)
    head_attrs: dict = field(default_factory=dict)
    #: prepared contraction weights kept across calls (``rules.Prepared``), if any
    prepared: object = None
    #: traced with the paper's library's decompositions (DESIGN §1, paper mode)
    paper: bool = False
    nodes: list = field(init=False)

    def __post_init__(self):
        self.nodes = list(self.graph.nodes)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph_module.graph

    @functools.cached_property
    def ids(self) -> dict:
        """``{node: its position in nodes}`` (the node ids of rules and pointers)."""
        return {n: i for i, n in enumerate(self.nodes)}

    @functools.cached_property
    def static(self) -> frozenset:
        """Nodes whose value is the same on every call: computed from the model's
        parameters, buffers and constants alone, by ops that draw no random numbers."""
        out = set(self.constants)
        for node in self.nodes:
            if (
                node.op == "call_function"
                and node.all_input_nodes
                and all(a in out for a in node.all_input_nodes)
                and not is_random(node)
            ):
                out.add(node)
        return frozenset(out)

    @functools.cached_property
    def input_shapes(self) -> dict:
        """Input key -> its traced shape: an int per fixed dim, a symbol name per dim that
        may vary; and the symbols' ranges ``{name: (low, high or None)}``."""
        ranges = {}
        for sym, vr in self.program.range_constraints.items():
            high = int(vr.upper) if getattr(vr.upper, "is_Integer", False) else None
            low = int(vr.lower) if getattr(vr.lower, "is_Integer", False) else 0
            ranges[str(sym)] = (low, high)  # high None: unbounded
        shapes = {}
        for key, node in self.user_inputs.items():
            dims = []
            for d in node.meta["val"].shape:
                expr = d.node.expr if isinstance(d, torch.SymInt) else d
                dims.append(int(expr) if getattr(expr, "is_number", True) else str(expr))
            shapes[key] = tuple(dims)
        return {"shapes": shapes, "ranges": ranges}

    @functools.cached_property
    def _guards(self):
        """torch.export's checks on the inputs beyond size ranges (``size()[1] != 5``
        where the model branched on a size), as a function of the flat inputs."""
        if not getattr(self.program, "_guards_code", None):
            return None
        return getattr(self.program.module(), "_guards_fn", None)

    def accepts(self, given: dict, leaves: list | None = None) -> bool:
        """Whether input tensors ``{key: tensor}`` fit this graph: fixed dims equal, and
        each varying size consistent across inputs and within its traced range; with
        ``leaves`` (every input, flattened), also the other checks torch.export
        recorded, such as a size the model branched on."""
        if not self._fits(given):
            return False
        if leaves is not None and self._guards is not None:
            try:
                self._guards(*leaves)
            except Exception:  # noqa: BLE001  (a failed guard: another trace is needed)
                return False
        return True

    def _fits(self, given: dict) -> bool:
        spec, bound = self.input_shapes, {}
        for key, dims in spec["shapes"].items():
            x = given.get(key)
            if not isinstance(x, torch.Tensor) or x.dim() != len(dims):
                return False
            for want, got in zip(dims, x.shape):
                if isinstance(want, int):
                    if want != got:
                        return False
                    continue
                if bound.setdefault(want, got) != got:
                    return False
                low, high = spec["ranges"].get(want, (0, None))
                if got < low or (high is not None and got > high):
                    return False
        return True

    @property
    def user_outputs(self) -> list:
        """What ``output(model(...))`` returned, without the inputs and buffers the model
        wrote into in place (torch.export returns their new values too)."""
        specs = self.program.graph_signature.output_specs
        outs = self.nodes[-1].args[0]
        return [o for o, s in zip(outs, specs) if s.kind == OutputKind.USER_OUTPUT]

    @property
    def output_node(self) -> torch.fx.Node:
        (out,) = self.user_outputs
        return out

    def module_of(self, node: torch.fx.Node) -> str | None:
        """The owning module path of a node, as the user names it."""
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return None
        path = list(stack.values())[-1][0]
        path = path.removeprefix("L['self']").removeprefix(".")
        # the traced wrapper holds the user's model as ``model``
        path = "" if path == "model" else path.removeprefix("model.")
        return path or None


def is_random(node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags
