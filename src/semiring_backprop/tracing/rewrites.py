"""The exported program's graph, rewritten in place around the decompositions
(:func:`.trace.trace` runs them in turn): what ``torch.export`` keeps of eager's
kernels and grad modes made into ops the pass reads as autograd does. Each rewrite
returns whether it changed the graph (the caller recompiles the graph's code once).
"""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

aten = torch.ops.aten


def detach_no_grad_blocks(program) -> bool:
    """Values computed under ``torch.no_grad()`` carry no edges, as in autograd.

    ``torch.export`` keeps such a block as ``wrap_with_set_grad_enabled(False, ...)`` until
    ``run_decompositions`` inlines it and the grad mode is lost; detach its outputs first.
    """
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    graph = program.graph_module.graph
    outs = [
        user
        for node in graph.nodes
        if hop is not None and node.target is hop and node.args[0] is False
        for user in node.users
        if user.target is operator.getitem
    ]
    for out in outs:
        with graph.inserting_after(out):
            detached = graph.call_function(torch.ops.aten.detach.default, (out,))
        detached.meta = dict(out.meta)
        out.replace_all_uses_with(detached, delete_user_cb=lambda n, d=detached: n is not d)
    return bool(outs)


# ops returning (values, indices) where the values are the input's elements at the
# indices: op -> (keyword, position, default) of the dim they select along, and of keepdim
_ALONG_DIM = {
    aten.topk.default: (("dim", 2, -1), None),
    aten.sort.default: (("dim", 1, -1), None),
    aten.sort.stable: (("dim", None, -1), None),
    aten.cummax.default: (("dim", 1, None), None),
    aten.cummin.default: (("dim", 1, None), None),
    aten.kthvalue.default: (("dim", 2, -1), ("keepdim", 3, False)),
    aten.median.dim: (("dim", 1, None), ("keepdim", 2, False)),
    aten.nanmedian.dim: (("dim", 1, None), ("keepdim", 2, False)),
    aten.mode.default: (("dim", 1, -1), ("keepdim", 2, False)),
}
# pooling ops whose indices are flat positions in each input plane (volume) of n dims
_IN_PLANE = {
    aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
    aten.adaptive_max_pool2d.default: 2,
    aten.adaptive_max_pool3d.default: 3,
}


def _arg(node, spec):
    name, pos, default = spec
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[pos] if pos is not None and pos < len(node.args) else default


def select_by_indices(program) -> bool:
    """Selections (topk, sort, max pooling, ...) read their values back from the input
    at their indices: ``gather(x, dim, indices)``. The values then have edges to the
    selected elements only, as in autograd, and the indices (integers) none; the op
    itself, a node with two outputs, is left with its indices alone.
    """
    graph = program.graph_module.graph
    changed = False
    order = {n: i for i, n in enumerate(graph.nodes)}  # of the traced nodes (inserts come after)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (_ALONG_DIM.keys() | _IN_PLANE.keys()):
            continue
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        values = outs.get(0)
        if values is None or not values.users:
            continue
        idx = outs.get(1)
        at = values if idx is None or order[values] > order[idx] else idx
        emit = _Emitter(graph, node, at)
        if idx is None:
            idx = emit(operator.getitem, node, 1)
        x = node.args[0]
        if node.target in _IN_PLANE:  # flat positions in each plane of the last n dims
            n = _IN_PLANE[node.target]
            val = idx.meta["val"]
            shape = [
                emit(aten.sym_size.int, idx, d) if isinstance(s, torch.SymInt) else int(s)
                for d, s in enumerate(val.shape)
            ]
            flat_x = emit(aten.flatten.using_ints, x, -n, -1)
            flat_i = emit(aten.flatten.using_ints, idx, -n, -1)
            out = emit(aten.view.default, emit(aten.gather.default, flat_x, -1, flat_i), shape)
        else:
            dim_spec, keep_spec = _ALONG_DIM[node.target]
            dim = _arg(node, dim_spec)
            if keep_spec is None or _arg(node, keep_spec):
                out = emit(aten.gather.default, x, dim, idx)
            else:
                wide = emit(aten.unsqueeze.default, idx, dim)
                out = emit(aten.squeeze.dims, emit(aten.gather.default, x, dim, wide), [dim])
        values.replace_all_uses_with(out)
        graph.erase_node(values)
        changed = True
    if changed:
        graph.lint()
    return changed


def views_as_reshapes(program) -> bool:
    """Every ``view`` of the exported graph becomes a ``reshape`` before the
    decompositions run. Export records the strides that eager's kernels gave: after a
    fused attention kernel, ``out.permute(2, 0, 1, 3).contiguous()`` is already
    contiguous and leaves no copy, and the ``view`` that follows is valid only for that
    kernel's layout. Our decomposition of the kernel (matmul / softmax / matmul) lays its
    output out otherwise, and the ``view`` would fail. A ``reshape`` is that ``view``
    wherever the ``view`` is valid, and a copy elsewhere: the same values either way."""
    graph = program.graph_module.graph
    views = [n for n in graph.nodes if n.target is aten.view.default]
    for node in views:
        node.target = aten.reshape.default
    return bool(views)


def unwrap_bool_checks(program) -> bool:
    """``cast_symbool_to_symint_guardless(b) == 1`` becomes ``b``. torch 2.11 writes a
    check on a tensor's truth (``torch._check_tensor_all``, as transformers' LLaVA checks
    that the image tokens match the image features) this way, and its own
    ``run_decompositions`` cannot trace the cast again; later versions write a
    ``sym_ite`` instead. The runtime assertion stays, on the bool itself."""
    graph = program.graph_module.graph
    changed = False
    for node in list(graph.nodes):
        if getattr(node.target, "__name__", None) != "cast_symbool_to_symint_guardless":
            continue
        for user in list(node.users):
            if user.target is operator.eq and user.args == (node, 1) and not user.kwargs:
                user.replace_all_uses_with(node.args[0])
                graph.erase_node(user)
                changed = True
        if not node.users:
            graph.erase_node(node)
    if changed:
        graph.lint()
    return changed


def drop_identity_restrides(program) -> bool:
    """``as_strided`` that only restates a contiguous tensor's own layout (export keeps
    eager's strides, e.g. after a pooling that reads a transposed input) is the
    identity: its users read the input. Any other ``as_strided`` stays, and the pass
    refuses it (it reads memory, not values). So is a ``view`` to the shape its input
    has (transformers 5.24's SDPA attention reshapes its output to its own shape; 5.17's
    does not): the graph, its node count and its paths' steps do not depend on it."""
    graph = program.graph_module.graph
    changed = False
    for node in list(graph.nodes):
        if (node.target is aten.as_strided.default and _is_identity_restride(node)) or (
            node.target is aten.view.default and _is_identity_view(node)
        ):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed = True
    if changed:
        graph.lint()
    return changed


def _is_identity_view(node) -> bool:
    x, val = node.args[0], node.meta.get("val")
    before = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(before, torch.Tensor):
        return False
    return val.dim() == before.dim() and all(
        statically_known_true(a == b) for a, b in zip(val.shape, before.shape)
    )


def _is_identity_restride(node) -> bool:
    x, size, stride = node.args[:3]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or offset not in (None, 0):
        return False
    if len(size) != val.dim() or not val.is_contiguous():
        return False
    expected = 1
    for d in reversed(range(val.dim())):
        n = val.shape[d]
        if not statically_known_true(size[d] == n):
            return False
        if not statically_known_true(n == 1) and not statically_known_true(stride[d] == expected):
            return False
        expected = expected * n
    return True


class _Emitter:
    """Inserts ops one after another after ``at``, each with its traced value (computed
    on the trace's fake tensors) and the module of ``like``."""

    def __init__(self, graph, like, at):
        self.graph, self.like, self.prev = graph, like, at
        self.fake = next(
            v.fake_mode for v in pytree.tree_leaves(like.meta["val"]) if hasattr(v, "fake_mode")
        )

    def __call__(self, target, *args):
        with self.graph.inserting_after(self.prev):
            node = self.graph.call_function(target, args)
        vals = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        with self.fake:
            node.meta["val"] = target(*vals)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in self.like.meta:
                node.meta[key] = self.like.meta[key]
        self.prev = node
        return node
