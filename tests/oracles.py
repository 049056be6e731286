"""Brute-force ground truth: the explicit scalar gradient graph and every path in it.

The oracle reads only the traced graph and the forward values of a :class:`Result`; it
never calls the library's rules or semirings. For every op and every argument slot it
takes the Jacobian of the op with respect to that slot alone (the other slots held
fixed, so ``mul(x, x)`` gives two parallel edges) and turns it into scalar edges
(DESIGN §1):

- pointwise ops: one edge from the broadcast-corresponding input element to each output
  element, even where the derivative is exactly 0 (relu of a negative value);
- contractions: dense, every (i, k) -> (i, j) whatever the other operand's values;
- in both, but where the derivative is 0 because of the structure: 0 at the values and
  at every one of :data:`REDRAWS` draws of the model's float values (weights, float
  inputs, the op's own float numbers; the integer inputs kept), as a masked attention
  probability is (DESIGN §1, ``engine.structure``); a relu's 0, a weight of 0 or an
  ``x * 0.0`` moves with the draws;
- every other op: the nonzero entries of the Jacobian (routing picks its sources);
- ``softmax_shift`` and non-differentiable ops: no edges; ``mark``: identity.

Then every path from an element to the scalar output is listed explicitly (as its
product of edge weights, float64), and each semiring's answer is computed from that
list directly: sums, max/min, sorting, counting.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch.fx.node import map_arg

import semiring_backprop  # noqa: F401  (defines the custom ops the tracer inserts)

aten = torch.ops.aten
_MARK = torch.ops.semiring_backprop.mark.default
_SHIFT = torch.ops.semiring_backprop.softmax_shift.default

# pointwise-tagged ops that route (choose a source per element): edges = Jacobian nonzeros
_ROUTING_POINTWISE = {aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor}
# dense by definition: structure does not depend on the other operand's values
_CONTRACTIONS = {
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.convolution.default,  # every tap inside the input; padding is not an element
}
# ops autograd cannot differentiate as called, and the same function written so it can
_DIFFERENTIABLE = {
    # ``dst.copy_(src)`` made functional: the result is ``src`` (cast, broadcast); the old
    # values of ``dst`` are gone (no edges from them)
    aten.copy.default: lambda dst, src, non_blocking=False: src.to(dst.dtype).expand(dst.shape),
}
# declared without edges (DESIGN §1: non-differentiable inputs and outputs)
_NO_EDGES = {
    _SHIFT,
    aten.detach.default,
    aten.sign.default,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.trunc.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    aten.argmax.default,
    aten.argmin.default,
}

MAX_PATHS = 2_000_000  # total path products held at once; keep oracle graphs tiny
#: draws of the float values in which a zero edge weight must stay 0 to be structure
REDRAWS = 16


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _slots(node):
    """(path, fx node) for every fx Node among the args (list items are their own slots)."""
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node):
            out.append((("args", i, None), a))
        elif isinstance(a, list | tuple):
            out.extend((("args", i, j), x) for j, x in enumerate(a) if isinstance(x, torch.fx.Node))
    for k, a in node.kwargs.items():
        if isinstance(a, torch.fx.Node):
            out.append((("kwargs", k, None), a))
    return out


def _replace(args, kwargs, path, x):
    where, i, j = path
    args, kwargs = list(args), dict(kwargs)
    if where == "kwargs":
        kwargs[i] = x
    elif j is None:
        args[i] = x
    else:
        items = list(args[i])
        items[j] = x
        args[i] = items
    return args, kwargs


def _jacobian(target, args, kwargs, path, x):
    """d target / d (slot at ``path``), shaped (out numel, in numel)."""
    target = _DIFFERENTIABLE.get(target, target)

    def f(v):
        a, k = _replace(args, kwargs, path, v)
        return target(*a, **k)

    out = f(x)
    jac = torch.autograd.functional.jacobian(f, x.detach().clone())
    return jac.reshape(out.numel(), x.numel())


def _redrawn(graph, values, k: int) -> dict:
    """Every node's value with the float placeholders (weights, float inputs) drawn anew
    (draw ``k``, seeded), the integer inputs as they are."""
    g = torch.Generator().manual_seed(7919 + k)
    out = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            v = values[node]
            out[node] = torch.randn(v.shape, generator=g, dtype=v.dtype) if _is_float(v) else v
        elif node.op == "call_function":
            args = map_arg(node.args, out.__getitem__)
            kwargs = map_arg(node.kwargs, out.__getitem__)
            out[node] = args[0] if node.target is _MARK else node.target(*args, **kwargs)
    return out


_DRAWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _draws(result) -> list:
    if result not in _DRAWS:
        _DRAWS[result] = [_redrawn(result.graph, result.values, k) for k in range(REDRAWS)]
    return _DRAWS[result]


def _generic(a):
    """Tensors in float64; a finite float number of the op itself (``x * 0.0``: an edge
    of weight 0, DESIGN §1) made generic: structure comes from the tensors it reads."""
    if _is_float(a):
        return a.double()
    return 1.5 if type(a) is float and math.isfinite(a) else a


def _structural_zeros(node, result, path, src, jac):
    """Where ``jac`` (the slot's Jacobian at the values) is 0 in every draw too."""
    zero = jac == 0
    for drawn in _draws(result) if bool(zero.any()) else ():
        args = map_arg(node.args, drawn.__getitem__)
        kwargs = map_arg(node.kwargs, drawn.__getitem__)
        args, kwargs = torch.utils._pytree.tree_map(_generic, (args, kwargs))
        zero &= _jacobian(node.target, args, kwargs, path, drawn[src].double()) == 0
    return zero


def _edges(node, values, path, src, result=None):
    """(mask, weight): (out numel, in numel) edge structure and weights of one slot;
    with ``result`` (whose values these are), without the edges whose weight is a
    structural zero."""
    target = node.target
    out = values[node]
    x = values[src]
    n_out, n_in = out.numel(), x.numel()
    if target is _MARK:
        eye = torch.eye(n_out, dtype=torch.float64)
        return eye.bool(), eye
    args = map_arg(node.args, values.__getitem__)
    kwargs = map_arg(node.kwargs, values.__getitem__)
    args, kwargs = torch.utils._pytree.tree_map(
        lambda t: t.double() if _is_float(t) else t, (args, kwargs)
    )
    jac = _jacobian(target, args, kwargs, path, x.double())
    if torch.Tag.pointwise in target.tags and target not in _ROUTING_POINTWISE:
        src_index = torch.arange(n_in).view(x.shape).broadcast_to(out.shape).reshape(-1)
        mask = torch.zeros(n_out, n_in, dtype=torch.bool)
        mask[torch.arange(n_out), src_index] = True
    elif target in _CONTRACTIONS:
        # structure from the same op on generic (nonzero) operands: dense
        generic = torch.utils._pytree.tree_map(
            lambda t: torch.rand_like(t) + 1.0 if _is_float(t) else t, (args, kwargs)
        )
        mask = _jacobian(target, *generic, path, x.double()) != 0
    else:
        mask = jac != 0
        result = None  # (routing and the rest: their zeros are no edges already)
    if result is not None:
        mask &= ~_structural_zeros(node, result, path, src, jac)
    return mask, torch.where(mask, jac, torch.zeros_like(jac))


@dataclass
class PathOracle:
    """All path products from every element of every live float node to the output."""

    products: dict  # fx node -> list (one per flat element) of np.ndarray path products
    shapes: dict

    def paths(self, node) -> list[np.ndarray]:
        return self.products[node]

    def readouts(self, node, k: int = 3, dims: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
        """Each semiring's expected readout at ``node``, as arrays of the node's shape.

        With ``dims``, the paths of all elements along those dims are pooled first: the
        aggregated derivative (DESIGN §1, Eq. 3) over those elements."""
        shape = self.shapes[node]
        dims = tuple(sorted(d % len(shape) for d in dims))
        cells = np.empty(len(self.products[node]), dtype=object)
        cells[:] = self.products[node]
        cells = cells.reshape(shape)
        if dims:
            rest = [d for d in range(len(shape)) if d not in dims]
            cells = cells.transpose(*rest, *dims).reshape(*[shape[d] for d in rest], -1)
            pooled = np.empty(cells.shape[:-1], dtype=object)
            for idx in np.ndindex(*cells.shape[:-1]):
                pooled[idx] = np.concatenate(list(cells[idx]))
            cells = pooled
        per = [_stats(p, k) for p in cells.reshape(-1)]
        out = {}
        for key in per[0]:
            arr = np.stack([d[key] for d in per])
            out[key] = arr.reshape((*cells.shape, *arr.shape[1:]))
        return out

    def count(self, node) -> np.ndarray:
        return np.array([len(p) for p in self.products[node]]).reshape(self.shapes[node])


def _stats(p: np.ndarray, k: int) -> dict:
    a = np.abs(p)
    n = len(p)
    z = a.sum()
    with np.errstate(divide="ignore"):
        log_z = math.log(z) if z > 0 else -math.inf
        nz = a[a > 0] / z if z > 0 else a[:0]
        entropy = float(-(nz * np.log(nz)).sum()) if z > 0 else 0.0
        max_abs = a.max() if n else 0.0
        order = np.argsort(-a, kind="stable")[:k]
        top = np.zeros(k)
        top[: len(order)] = p[order]
        return {
            "real": p.sum(),
            "hi": p.max() if n else -math.inf,
            "lo": p.min() if n else math.inf,
            "max_abs": max_abs,
            "max_abs_log": math.log(max_abs) if max_abs > 0 else -math.inf,
            "log_abs": log_z,
            "entropy": entropy,
            "log_z": log_z,
            "log_count": math.log(n) if n else -math.inf,
            "topk": top,
        }


def _live_nodes(graph) -> set:
    """Nodes that depend on a user input (weights-only nodes start no path of interest)."""
    live = set(graph.user_inputs.values())
    for node in graph.nodes:
        if node.op == "call_function" and any(a in live for a in node.all_input_nodes):
            live.add(node)
    return live


def build(result) -> PathOracle:
    """Expand ``result.graph`` at ``result.values`` into its scalar DAG and list all paths."""
    graph, values = result.graph, result.values
    live = _live_nodes(graph)
    out_node = graph.output_node
    assert values[out_node].numel() == 1, "the oracle explains one scalar output"
    products: dict = {out_node: [np.ones(1)]}
    # consumers of each node: (consumer, mask, weight) per slot, in graph order
    consumers: dict = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target in _NO_EDGES:
            continue
        if not _is_float(values.get(node)):
            continue
        for path, src in _slots(node):
            if src in live and _is_float(values.get(src)):
                mask, w = _edges(node, values, path, src, result)
                consumers.setdefault(src, []).append((node, mask.numpy(), w.numpy()))
    total = 1
    for node in reversed(graph.nodes):
        if node is out_node or not _is_float(values.get(node)) or node not in live:
            continue
        n = values[node].numel()
        elems = []
        for i in range(n):
            parts = []
            for dst, mask, w in consumers.get(node, []):
                if dst not in products:
                    continue
                for o in np.nonzero(mask[:, i])[0]:
                    parts.append(w[o, i] * products[dst][o])
            elems.append(np.concatenate(parts) if parts else np.zeros(0))
            total += len(elems[-1])
        if total > MAX_PATHS:
            raise ValueError(f"oracle graph too large: {total} path products")
        products[node] = elems
    shapes = {node: tuple(values[node].shape) for node in products}
    return PathOracle(products, shapes)


# -- paths with identity ----------------------------------------------------------------
# ``build`` keeps only path products. The functions below list every path together with
# its hops, so a path read from back-pointers can be checked to exist and to carry the
# product it claims. A hop is ``(node name, flat element index, slot)``: ``slot`` numbers
# the argument slots of the consumer op the edge enters, in the order of ``node.args``
# (list items are their own slots; kwargs after them), counting only slots that read a
# float tensor depending on a user input and leading to the output, i.e. the slots that
# carry a value in the reverse pass. The first hop (the source element) has slot None.


def _reaches(graph, start) -> set:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


_CARRIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def carried_slots(result, node) -> list:
    """``[(slot number, args path, input node)]`` for the value-carrying slots of ``node``."""
    graph, values = result.graph, result.values
    if result not in _CARRIED:
        _CARRIED[result] = _live_nodes(graph) & _reaches(graph, graph.output_node)
    carried = _CARRIED[result]
    out = []
    for path, src in _slots(node):
        if src in carried and _is_float(values.get(src)):
            out.append((len(out), path, src))
    return out


@dataclass
class ScalarDag:
    """The explicit scalar gradient graph, with each edge's consumer, slot and weight."""

    out_node: object
    consumers: dict  # fx node -> [(consumer, slot, mask (out, in), weight (out, in))]
    shapes: dict
    _memo: dict

    def suffixes(self, node, flat: int) -> list:
        """``[(product, hops after node[flat])]`` for every path from ``node[flat]``."""
        key = (node, flat)
        if key in self._memo:
            return self._memo[key]
        if node is self.out_node:
            out = [(1.0, ())]
        else:
            out = []
            for dst, slot, mask, w in self.consumers.get(node, []):
                for o in np.nonzero(mask[:, flat])[0]:
                    o = int(o)
                    for p, tail in self.suffixes(dst, o):
                        out.append((float(w[o, flat]) * p, ((dst.name, o, slot), *tail)))
        if len(out) > MAX_PATHS:
            raise ValueError(f"oracle graph too large: {len(out)} paths from {node.name}")
        self._memo[key] = out
        return out

    def paths(self, node, flat: int) -> list:
        """``[(product, hops)]`` for every path from ``node[flat]`` to the output."""
        return [(p, ((node.name, flat, None), *tail)) for p, tail in self.suffixes(node, flat)]


def scalar_dag(result) -> ScalarDag:
    """The scalar DAG of ``result.graph`` at ``result.values`` (same edges as ``build``)."""
    graph, values = result.graph, result.values
    out_node = graph.output_node
    assert values[out_node].numel() == 1, "the oracle explains one scalar output"
    consumers: dict = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target in _NO_EDGES:
            continue
        if not _is_float(values.get(node)):
            continue
        for slot, path, src in carried_slots(result, node):
            mask, w = _edges(node, values, path, src, result)
            consumers.setdefault(src, []).append((node, slot, mask.numpy(), w.numpy()))
    shapes = {n: tuple(v.shape) for n, v in values.items() if isinstance(v, torch.Tensor)}
    return ScalarDag(out_node, consumers, shapes, {})


def enumerate_paths(result, node, dag: ScalarDag | None = None) -> list:
    """Every path from every element of ``node`` to the output: a list, one entry per flat
    element, of ``[(product, hops)]`` (product in float64; hops as described above)."""
    dag = dag if dag is not None else scalar_dag(result)
    n = result.values[node].numel()
    return [dag.paths(node, i) for i in range(n)]


def local_derivative(result, node, slot: int, out_flat: int) -> torch.Tensor:
    """d node[out_flat] / d (the input in argument ``slot``), flat over that input's
    elements, by torch.autograd on the op itself (float64; a vector-Jacobian product)."""
    values = result.values
    slots = {s: (path, src) for s, path, src in carried_slots(result, node)}
    path, src = slots[slot]
    x = values[src].detach().double()
    if node.target is _MARK:
        g = torch.zeros(x.numel(), dtype=torch.float64)
        g[out_flat] = 1.0
        return g
    args = map_arg(node.args, values.__getitem__)
    kwargs = map_arg(node.kwargs, values.__getitem__)
    args, kwargs = torch.utils._pytree.tree_map(
        lambda t: t.double() if _is_float(t) else t, (args, kwargs)
    )
    x = x.clone().requires_grad_()
    with torch.enable_grad():
        a, k = _replace(args, kwargs, path, x)
        out = node.target(*a, **k)
        seed = torch.zeros(out.numel(), dtype=out.dtype)
        seed[out_flat] = 1.0
        (g,) = torch.autograd.grad(out, x, seed.view(out.shape), allow_unused=True)
    return torch.zeros(x.numel(), dtype=torch.float64) if g is None else g.reshape(-1)


def all_semirings() -> list:
    """Every semiring the library ships, both MaxProduct granularities included."""
    sbp = semiring_backprop
    return [
        sbp.Real(), sbp.MaxProduct(), sbp.MaxProduct("tensor"), sbp.MaxAbs(), sbp.LogAbs(),
        sbp.Entropy(), sbp.PathCount(), sbp.TopK(3),
    ]  # fmt: skip


# -- paths from the sources (the forward pass) ------------------------------------------


def sources(result) -> list:
    """Nodes that carry values and read none that do: where every path starts."""
    graph, values = result.graph, result.values
    if result not in _CARRIED:
        _CARRIED[result] = _live_nodes(graph) & _reaches(graph, graph.output_node)
    carried = _CARRIED[result]
    return [
        n
        for n in graph.nodes
        if n in carried and _is_float(values.get(n)) and not carried_slots(result, n)
    ]


def prefixes(result, dag: ScalarDag, seeds: dict) -> dict:
    """``{node: [np.ndarray per flat element]}``: the product of every path from a seeded
    source element to that element, times the seed (``seeds``: ``{node: flat array}``)."""
    into: dict = {}  # node -> [(src, mask, w)]
    for src, outs in dag.consumers.items():
        for dst, _, mask, w in outs:
            into.setdefault(dst, []).append((src, mask, w))
    out: dict = {}
    for node in result.graph.nodes:
        if node not in seeds and node not in into:
            continue
        n = result.values[node].numel()
        elems = []
        for o in range(n):
            parts = [np.asarray(seeds[node][o : o + 1], dtype=np.float64)] if node in seeds else []
            for src, mask, w in into.get(node, []):
                if src not in out:
                    continue
                for i in np.nonzero(mask[o])[0]:
                    parts.append(w[o, i] * out[src][i])
            elems.append(np.concatenate(parts) if parts else np.zeros(0))
        out[node] = elems
    return out


def through(prefix: list, dag: ScalarDag, node) -> list:
    """Per flat element of ``node``: every whole path's product through it (its
    prefixes times its suffixes)."""
    return [
        np.outer(p, np.array([s for s, _ in dag.suffixes(node, o)])).reshape(-1)
        for o, p in enumerate(prefix)
    ]


def stats(products: list, shape, k: int) -> dict:
    """Each semiring's readout of lists of path products, as arrays of ``shape``."""
    per = [_stats(np.asarray(p, dtype=np.float64), k) for p in products]
    return {key: np.stack([d[key] for d in per]).reshape((*shape, *np.shape(per[0][key])))
            for key in per[0]}  # fmt: skip


# -- paths grouped by the events they pass (the edges of a circuit) ---------------------


def grouped_suffixes(dag: ScalarDag, event) -> callable:
    """A function ``(node, flat) -> {events: np.ndarray of products}``: every path from
    ``node[flat]`` to the output, grouped by the tuple of ``event(node, flat)`` values
    (None: no event) of the elements it passes, ``node[flat]`` itself first. The products
    are each path's own, listed one by one (nothing is summed or maximized)."""
    memo: dict = {}

    def suffixes(node, flat):
        key = (node, flat)
        if key in memo:
            return memo[key]
        if node is dag.out_node:
            groups = {(): [np.ones(1)]}
        else:
            groups = {}
            for dst, _, mask, w in dag.consumers.get(node, []):
                for o in np.nonzero(mask[:, flat])[0]:
                    for sig, arr in suffixes(dst, int(o)).items():
                        groups.setdefault(sig, []).append(float(w[o, flat]) * arr)
        ev = event(node, flat)
        out = {((ev, *sig) if ev is not None else sig): np.concatenate(parts)
               for sig, parts in groups.items()}  # fmt: skip
        memo[key] = out
        return out

    return suffixes


def grouped_paths(result, dag: ScalarDag, seeds: dict, event) -> dict:
    """``{events: np.ndarray}``: every whole path from a seeded source element (``seeds``:
    ``{node: flat array}``, each path's product times its seed) to the output, grouped by
    the events it passes (see :func:`grouped_suffixes`)."""
    suffixes = grouped_suffixes(dag, event)
    out: dict = {}
    for node, seed in seeds.items():
        for i in range(result.values[node].numel()):
            for sig, arr in suffixes(node, i).items():
                out.setdefault(sig, []).append(seed[i] * arr)
    return {sig: np.concatenate(parts) for sig, parts in out.items()}
