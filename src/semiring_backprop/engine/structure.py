"""Structural zeros: what a mask makes zero is no edge (DESIGN §1).

An attention mask selects, by position alone, a constant far below any score (``-inf``,
the dtype's lowest number, ``-1e9``, ``-1e4``) and adds it to the scores (or writes it
over them); the softmax's ``exp`` then gives exactly 0 there for every input near the
one explained, and so does every product with that 0. Such a zero belongs to the
model's structure, not to its values: its local derivatives are 0 whatever the input, so
the edges whose weight it is are not there, and where they were the only way, the
semiring's zero ("no path") results. Nothing changes under Real (still 0 there) nor the
log-space semirings, whose ``lift(0)`` is their zero; under MaxProduct an edge of weight
0 would be a path of product 0, under PathCount one more path: masked pairs and later
positions would read as reachable, as many as the attention's code (eager, SDPA) left.

Which elements are structural zeros is found per call from the graph and the values of
its *structural* nodes alone: those computed from integer or boolean tensors (token ids,
attention masks, a causal buffer), sizes and literal constants, with no float input, no
weight and no random number behind them. Masks are structural.

- *Mask minima* ``M``: the elements of a structural float tensor at or below
  :data:`MASK_VALUE`, carried through what keeps them so: a sum with anything, a
  difference with what is not itself one (the softmax's max shift of a row masked
  entirely is one, and the row then is not), a positive scale, moves of data.
- *Structural zeros* ``Z``: ``exp`` of a mask minimum (and a softmax's output there, when
  it is kept whole); the zeros of a structural ``where`` / ``masked_fill`` and of a mask
  cast to float; and, carried along, products with one (``mul``, the numerator of
  ``div``, a matmul whose every term holds one, a sum of them only), moves of data.
- A ``where`` / ``masked_fill`` moves both as it moves data; the constants it picks
  (a -inf written over the scores, a 0 over the probabilities) count only where its
  condition is structural.
- The edges taken away are those whose weight is a structural zero: under ``mul`` the
  edges of the other factor, under ``div`` the denominator's (weight ``-a/b²``) where
  the numerator is one, under ``exp`` its own, under a matmul the other operand's, under
  a softmax kept whole its Jacobian's rows and columns there. :func:`absent` hands them
  to the op's rule as ``Op.absent`` (``{slot: mask}``), which leaves them out
  (``Semiring.without``, ``Semiring.matmul_without``).

Zeros that depend on the values explained stay edges of weight 0, as DESIGN §1 states:
a ReLU's zeros, an ``exp`` that underflows on its own, a weight or an input that is 0, a
``where`` whose condition is computed from the values, a literal ``x * 0``. Paper mode
keeps the graph the paper's library built, where a masked entry is an edge of weight 0.
A rule run without a graph (``make_op(..., graph=None)``) sees no structural zeros.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch.fx.node import Node

from ..graph import is_random
from .masks import CASTS, MASK_VALUE, SAME, call

aten = torch.ops.aten

_WHERE = aten.where.self
_FILLS = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
_SIZE_OPS = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default)
_SHIFT = torch.ops.semiring_backprop.softmax_shift.default
_SOFTMAX = (aten._softmax.default, aten.softmax.int)
_MM = (aten.mm.default, aten.bmm.default)
_ADDMM = (aten.addmm.default, aten.baddbmm.default)
_SUMS = (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default)
#: ops that move the data of their first argument: run on a mask, they move it alike
_MOVES = SAME | frozenset(
    {
        aten.view.default, aten._unsafe_view.default, aten.reshape.default,
        aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
        aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
        aten.slice.Tensor, aten.select.int, aten.flatten.using_ints, aten.index_select.default,
    }
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What the graph alone says: per node, the formula of its mask minima (``m``) and of
    its structural zeros (``z``), where it may hold any; per op with edges that may not
    be there, ``{slot: formula of the mask}`` (``consumers``); and the placeholders the
    structural nodes read (a call's masks follow from their values)."""

    structural: frozenset
    m: dict
    z: dict
    consumers: dict
    inputs: tuple
    #: ``(placeholder, dim, symbol)``: the symbolic sizes of the inputs (a call binds them)
    sizes: tuple = ()


def plan(graph) -> Plan | None:
    """The graph's plan (cached on it); None where no edge can be a structural zero."""
    cache = graph.__dict__
    if "_structure" not in cache:
        cache["_structure"] = None if getattr(graph, "paper", False) else _plan(graph)
    return cache["_structure"]


def absent(graph, values, node, needed) -> dict:
    """``{slot: bool mask}``: the edges of ``node``'s argument slots (those in ``needed``)
    whose weight is a structural zero in the call whose forward values are ``values``
    (``Op.absent``); ``{}`` where there are none."""
    p = plan(graph) if graph is not None else None
    if p is None or node not in p.consumers:
        return {}
    c = call(graph, p, values)
    out = {}
    for slot, formula in p.consumers[node].items():
        arg = node.args[slot]
        if arg not in needed:
            continue
        mask = c.eval(formula, values)
        if mask is None or (mask.device.type == "cpu" and not bool(mask.any())):
            continue  # (reading a device's mask would make the pass wait: kept there)
        out[slot] = mask
    return out


def zeros(graph, values, node):
    """The structural zeros of ``node``'s value in this call (a bool mask), or None."""
    p = plan(graph) if graph is not None else None
    if p is None or node not in p.z:
        return None
    return call(graph, p, values).eval(("Z", node), values)


# -- the plan ------------------------------------------------------------------------------


def _float(a) -> bool:
    val = a.meta.get("val") if isinstance(a, Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _number(a) -> bool:
    return isinstance(a, numbers.Real) and not isinstance(a, bool)


def _plan(graph) -> Plan | None:
    structural = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and not val.is_floating_point():
                structural.add(n)  # token ids, attention masks, integer buffers
        elif n.op == "call_function" and (
            n.target in _SIZE_OPS
            or (not is_random(n) and all(a in structural for a in n.all_input_nodes))
        ):
            structural.add(n)
    m, z, consumers = {}, {}, {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        fm, fz = _formulas(n, structural, m, z)
        if fm is not None:
            m[n] = fm
        if fz is not None:
            z[n] = fz
        if n not in structural:
            slots = {s: f for s, f in _consumer(n, z).items() if f is not None}
            if slots:
                consumers[n] = slots
    if not consumers:
        return None
    inputs = {
        a
        for n in structural
        if n.op == "call_function"
        for a in n.all_input_nodes
        if a.op == "placeholder"
    }
    order = {n: i for i, n in enumerate(graph.nodes)}
    sizes = tuple(
        (n, i, d.node.expr)
        for n in graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        for i, d in enumerate(n.meta["val"].shape)
        if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol
    )
    inputs = tuple(sorted(inputs, key=order.get))
    return Plan(frozenset(structural), m, z, consumers, inputs, sizes)


def _or(a, b):
    return b if a is None else a if b is None else ("or", a, b)


def _and(a, b):
    if a is None or b is None:
        return None
    if a == ("num", True):
        return b
    return a if b == ("num", True) else ("and", a, b)


def _andnot(a, b):
    return a if a is None or b is None else ("andnot", a, b)


def _formulas(n, structural, m, z):
    """``(M formula, Z formula)`` of node ``n`` (None: it holds none)."""
    t, args = n.target, n.args
    x = args[0] if args else None

    def ref(kind, a):
        table = m if kind == "M" else z
        return (kind, a) if isinstance(a, Node) and a in table else None

    if n in structural:
        if not _float(n):
            return None, None
        if t in (_WHERE, *_FILLS) or (t in CASTS and not _float(x)):
            return ("le", n), ("eq0", n)  # (a mask chose these zeros, or made them)
        zx = ref("Z", x) if t in _MOVES else None
        return ("le", n), None if zx is None else ("move", zx, n)
    if t is _WHERE or t in _FILLS:
        cond, a, b = args[:3] if t is _WHERE else (args[1], args[2], args[0])
        fixed = cond in structural  # a mask chooses: the constants it picks are structure

        def branch(v, kind, test):
            if isinstance(v, Node) and v not in structural:
                return ref(kind, v)
            if not fixed:
                return None
            if _number(v):
                return ("num", True) if test(v) else None
            return (("le" if kind == "M" else "eq0"), v) if _float(v) else None

        fm = _where(cond, branch(a, "M", lambda v: v <= MASK_VALUE),
                    branch(b, "M", lambda v: v <= MASK_VALUE))  # fmt: skip
        fz = _where(cond, branch(a, "Z", lambda v: v == 0), branch(b, "Z", lambda v: v == 0))
        return fm, fz
    if t in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar):
        y = args[1]
        zy = ref("Z", y) if isinstance(y, Node) else ("num", True) if y == 0 else None
        fz = _and(ref("Z", x), zy)
        if t is aten.add.Tensor and n.kwargs.get("alpha", 1) > 0:
            return _or(ref("M", x), ref("M", y)), fz
        if t is aten.sub.Tensor:
            return _andnot(ref("M", x), ref("M", y)), fz
        return ref("M", x), fz
    if t in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        y = args[1]
        fm = ref("M", x) if _number(y) and y > 0 else None
        fz = ref("Z", x)
        if t is aten.mul.Tensor:
            fz = _or(fz, ref("Z", y))
        return fm, fz
    if t is aten.neg.default:
        return None, ref("Z", x)
    if t is aten.exp.default:
        return None, ref("M", x)
    if t is _SHIFT:
        return _all(ref("M", x), args[1], True), None
    if t in _SOFTMAX:
        mx = ref("M", x)
        return None, _andnot(mx, _all(mx, [args[1]], True))
    if t in _SUMS:
        dims = args[1] if len(args) > 1 else None
        keep = args[2] if len(args) > 2 else n.kwargs.get("keepdim", False)
        return None, _all(ref("Z", x), dims, keep)
    if t in _MM or t in _ADDMM:
        a, b = args[-2:] if t in _MM else args[1:3]
        za, zb = ref("Z", a), ref("Z", b)
        fz = None if za is None and zb is None else ("mm", za, zb, a, b)
        return None, fz if t in _MM else _and(ref("Z", args[0]), fz)
    if t is aten.cat.default:
        parts = args[0]
        fm = [ref("M", p) for p in parts]
        fz = [ref("Z", p) for p in parts]
        return (None if not any(fm) else ("cat", fm, n)), (None if not any(fz) else ("cat", fz, n))
    if t in _MOVES:
        mx, zx = ref("M", x), ref("Z", x)
        return (None if mx is None else ("move", mx, n)), (None if zx is None else ("move", zx, n))
    return None, None


def _where(cond, a, b):
    return None if a is None and b is None else ("where", cond, a, b)


def _all(f, dims, keepdim):
    return None if f is None else ("all", f, dims, keepdim)


def _consumer(n, z) -> dict:
    """``{slot: formula}`` of the masks of ``n``'s edges whose weight is a structural zero."""
    t, args = n.target, n.args

    def ref(a):
        return ("Z", a) if isinstance(a, Node) and a in z else None

    def full(a):  # a contraction's mask: over the operand, in its full shape
        return None if ref(a) is None else ("full", ref(a), a)

    if t is aten.mul.Tensor:
        return {0: ref(args[1]), 1: ref(args[0])}
    if t is aten.div.Tensor:
        return {1: ref(args[0])}
    if t is aten.exp.default:
        return {0: ref(n)}
    if t in _MM:
        return {0: full(args[1]), 1: full(args[0])}
    if t in _ADDMM:
        return {1: full(args[2]), 2: full(args[1])}
    if t in _SOFTMAX:
        return {0: None if ref(n) is None else ("jac", ref(n), n, args[1])}
    return {}
