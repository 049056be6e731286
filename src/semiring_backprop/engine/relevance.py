"""Edge weights under ``weights="relevance"`` (DESIGN §3c): the local rules of relevance
propagation as RelP applies them (Jafari et al. 2025), found in the traced graph.

Every op keeps its local derivative but these, each found by the pattern the graph
shows it in (the decompositions' own primitives, and the same ops written out in a
model's Python code), never by module names:

- *LN-rule* (Ali et al. 2022): a norm's scale held constant. In ``a * rsqrt(mean(z²) + ε)``
  (``a / sqrt(...)``), where ``z`` is ``a`` (RMS norm) or the centred input (layer norm,
  whose centring keeps its edges), the scale's slot has no edges: the edge of ``a`` keeps
  the weight 1/σ.
- *Identity rule* (LRP for transformers; AttnLRP, Achtibat et al. 2024): an element-wise
  activation ``y = f(x)`` is one edge of weight ``f(x)/x`` (0 where x = 0). A one-op
  activation (``tanh``, ``sigmoid``, ``gelu`` kept whole, ...) gets that weight; a gated
  one written as a product ``(c·x) * g(x)`` (GELU through erf or tanh, SiLU as
  ``x * sigmoid(x)``), where ``g`` is computed from ``x`` element-wise alone, keeps the
  edge of the ``c·x`` factor only, of weight ``y / (c·x)``: the path from ``x`` has
  the product ``f(x)/x``, and nothing goes through ``g``.
- *Half rule* (AttnLRP's uniform rule): any other product of two factors that both depend
  on the input (SwiGLU's ``act(gate) * up``): each factor's edge has half its derivative.
- *CP-LRP* (Ali et al. 2022, as RelP uses it): the attention pattern held constant. A
  contraction one of whose operands is a softmax's output (through moves, casts, and a
  mask's ``where``) has no edges into that operand: nothing reaches the scores, queries
  and keys through it; the value path keeps the probabilities as weights.

What a rule removes is no edge (``Op.cut``: the rule computes nothing for those slots),
not an edge of weight 0. The plan is made once per graph; under ``"gradient"`` (the
default) no node has one, and every rule runs as it always did.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch.fx.node import Node

from ..errors import InputError
from ..rules.shapes import broadcast, unbroadcast
from .masks import SAME

aten = torch.ops.aten

#: the edge weights a pass may use (DESIGN §3c)
WEIGHTS = ("gradient", "relevance")

_SHIFT = torch.ops.semiring_backprop.softmax_shift.default
_SOFTMAX = (aten._softmax.default, aten.softmax.int)
#: one-op activations: the identity rule's weight f(x)/x differs from f'(x) (relu, leaky
#: relu: the same weights, so they keep their own rule)
ACTIVATIONS = frozenset(
    {
        aten.tanh.default, aten.sigmoid.default, aten.gelu.default, aten.silu.default,
        aten.elu.default, aten.celu.default, aten.selu.default, aten.softplus.default,
        aten.mish.default, aten.hardswish.default, aten.hardsigmoid.default,
        aten.hardtanh.default,
    }
)  # fmt: skip
_MUL = aten.mul.Tensor
_CONTRACTIONS = (aten.bmm.default, aten.mm.default)
#: moves of data on the way from a softmax to the contraction that reads it
_PROBS_MOVES = SAME | frozenset(
    {
        aten.view.default, aten._unsafe_view.default, aten.reshape.default,
        aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
        aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    }
)  # fmt: skip
_WHERE = aten.where.self
_SIZE_OPS = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default)
#: a table read at the inputs' ids (a token's embedding)
_LOOKUPS = (aten.embedding.default, aten.index.Tensor, aten.index_select.default,
            aten.gather.default)  # fmt: skip
_FILLS = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)


@dataclass(frozen=True)
class Edit:
    """How the relevance rule ``rule`` changes one node's edges: the argument ``slots``
    with no edges (``cut``), every remaining edge's weight times ``scale``, or (``ratio``
    a slot) a single edge from that argument of weight ``out / argument``."""

    rule: str
    cut: frozenset = frozenset()
    scale: float = 1.0
    ratio: int | None = None


def check(weights, paper: bool = False, whole=()) -> str:
    """``weights`` if it is one of :data:`WEIGHTS` and fits the other options, else an
    :class:`InputError` saying what does."""
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise InputError(
            f"weights={weights!r} is not one of {', '.join(map(repr, WEIGHTS))}: "
            "'gradient' (the local derivatives, the default) or 'relevance' (the local rules "
            "of relevance propagation as RelP applies them)"
        )
    if weights == "relevance" and paper:
        raise InputError(
            "weights='relevance' with paper=True: paper mode reproduces the gradient graph "
            "of the paper's library (brunoflow), which has no relevance rules; drop one of them"
        )
    if weights == "relevance" and "layer_norm" in tuple(whole):
        raise InputError(
            "weights='relevance' with whole=('layer_norm',): the LN-rule holds the norm's "
            "scale constant, which needs the norm decomposed; leave layer_norm out of whole"
        )
    return weights


def edit(graph, node) -> Edit | None:
    """The relevance edit of ``node`` in ``graph`` (None: its rule as it is)."""
    if graph is None or getattr(graph, "weights", "gradient") == "gradient":
        return None
    return plan(graph).get(node)


def plan(graph) -> dict:
    """``{node: Edit}`` for the graph (made once, cached on it)."""
    cache = graph.__dict__
    if "_relevance" not in cache:
        cache["_relevance"] = _plan(graph)
    return cache["_relevance"]


def reads(graph, node, default):
    """The forward values ``node``'s rule reads under the graph's weights: ``default``
    (the rule's own), and a ratio's argument and output besides."""
    e = edit(graph, node)
    if e is None or e.ratio is None:
        return default
    return [*default, node.args[e.ratio], node]


# -- applying an edit to a rule --------------------------------------------------------


def reverse_rule(fn, e: Edit):
    """The reverse rule ``fn`` under the edit ``e``."""
    if e.ratio is not None:
        return _ratio_rule(e.ratio)

    def rule(sr, g, op, *args, **kwargs):
        if e.scale != 1:
            g = sr.scale(g, e.scale)
        res = list(fn(sr, g, op, *args, **kwargs))
        for i in e.cut:
            res[i] = None
        return res

    return rule


def forward_rule(fn, e: Edit):
    """The forward (alpha) rule ``fn`` under the edit ``e``."""
    if e.ratio is not None:
        return _ratio_forward(e.ratio)

    def forward(sr, a, op, *args, **kwargs):
        a = [None if i in e.cut else x for i, x in enumerate(a)]
        if all(x is None for x in a):
            return None
        out = fn(sr, a, op, *args, **kwargs)
        return out if out is None or e.scale == 1 else sr.scale(out, e.scale)

    return forward


def _ratio(op, i: int) -> torch.Tensor:
    """``out / x`` for argument ``i``, 0 where x = 0 (once per node)."""

    def make():
        x, out = op.args[i], op.out
        zero = x == 0
        return torch.where(zero, 0.0, out / torch.where(zero, 1.0, x)).to(out.dtype)

    return op.cached(("ratio", i), make)


def _ratio_rule(i: int):
    def rule(sr, g, op, *args, **kwargs):
        res = [None] * len(args)
        if op.needs(i):
            res[i] = unbroadcast(sr, sr.times(g, _ratio(op, i)), args[i].shape)
        return res

    return rule


def _ratio_forward(i: int):
    def forward(sr, a, op, *args, **kwargs):
        if i >= len(a) or a[i] is None:
            return None
        return sr.times(broadcast(a[i], op.out.shape, op.rows), _ratio(op, i))

    return forward


# -- the plan ------------------------------------------------------------------------------


def _plan(graph) -> dict:
    live = _live(graph)
    edits = {}
    for n in graph.nodes:
        if n.op != "call_function" or n not in live:
            continue
        e = _edit(n, live)
        if e is not None:
            edits[n] = e
    return edits


def _live(graph) -> frozenset:
    """Float nodes whose values follow from the values explained: the float inputs, what
    a lookup of a table by the inputs' ids gives (embeddings), and what float ops compute
    from them; not masks or positions (floats made from integers or sizes by casts)."""
    dep = set(graph.user_inputs.values())  # anything computed from an input
    live = {n for n in dep if _is_float(n)}
    for n in graph.nodes:
        if n.op != "call_function" or n.target in _SIZE_OPS:
            continue
        ins = n.all_input_nodes
        if any(a in dep for a in ins):
            dep.add(n)
        if _is_float(n) and (
            any(a in live for a in ins) or (n.target in _LOOKUPS and any(a in dep for a in ins))
        ):
            live.add(n)
    return frozenset(live)


def _is_float(n) -> bool:
    val = n.meta.get("val") if isinstance(n, Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _edit(n, live) -> Edit | None:
    t, args = n.target, n.args
    if t in ACTIVATIONS:
        return Edit("identity", cut=frozenset(range(1, len(args))), ratio=0)
    if t in _CONTRACTIONS:
        cut = frozenset(i for i in (0, 1) if args[i] in live and _is_probs(args[i]))
        return Edit("attention", cut=cut) if cut else None
    if t is aten.div.Tensor and args[0] in live and args[1] in live:
        if _is_sigma(args[1], args[0], root=True):
            return Edit("norm", cut=frozenset({1}))
        return None
    if t is not _MUL or not all(isinstance(a, Node) and a in live for a in args[:2]):
        return None
    for s in (1, 0):  # a * rsqrt(mean(a²) + eps)
        if _is_sigma(args[s], args[1 - s], root=False):
            return Edit("norm", cut=frozenset({s}))
    for g in (1, 0):  # (c·x) * g(x)
        x = _scaled_root(args[1 - g])
        if _strip(args[g]) is not x and _elementwise_of(args[g], x, live, {}):
            return Edit("identity", cut=frozenset({g}), ratio=1 - g)
    return Edit("half", scale=0.5)


def _strip(a):
    """``a`` before the copies, casts and marks that leave its values as they are."""
    while isinstance(a, Node) and a.op == "call_function" and a.target in SAME:
        a = a.args[0]
    return a


def _number(a) -> bool:
    return isinstance(a, numbers.Real) and not isinstance(a, bool)


def _scaled_root(a):
    """``x`` of ``a = c · x`` (through copies and products with numbers)."""
    while True:
        a = _strip(a)
        if not (isinstance(a, Node) and a.op == "call_function"):
            return a
        if a.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            if _number(a.args[1]):
                a = a.args[0]
                continue
            if a.target is aten.mul.Tensor and _number(a.args[0]):
                a = a.args[1]
                continue
        return a


def _elementwise_of(b, x, live, memo, depth: int = 0) -> bool:
    """Whether ``b`` is computed from ``x`` alone, element by element (and constants)."""
    if b is x:
        return True
    if not isinstance(b, Node) or b not in live:
        return True  # a number, a weight, a constant
    if b in memo:
        return memo[b]
    ok = (
        depth < 32
        and b.op == "call_function"
        and isinstance(b.target, torch._ops.OpOverload)
        and (torch.Tag.pointwise in b.target.tags or b.target in SAME)
        and all(_elementwise_of(a, x, live, memo, depth + 1) for a in b.all_input_nodes)
    )
    memo[b] = ok
    return ok


def _is_sigma(r, a, root: bool) -> bool:
    """Whether ``r`` is a norm's 1/σ (``root``: its σ) of ``a``: ``rsqrt(mean(z²) + ε)``
    (``sqrt``; ``mean`` also as a sum times or over a number, ε also outside the root),
    with ``z`` the same values as ``a``."""
    r = _past_eps(r)
    want = (aten.sqrt.default,) if root else (aten.rsqrt.default,)
    if not (isinstance(r, Node) and r.op == "call_function"):
        return False
    if r.target not in want:
        if root or r.target is not aten.reciprocal.default:
            return False
        r = _past_eps(r.args[0])  # 1 / sqrt(...)
        if not (isinstance(r, Node) and r.target is aten.sqrt.default):
            return False
    v = _past_eps(r.args[0])
    v = _scaled_root(v) if isinstance(v, Node) and v.target is not aten.mean.dim else v
    if not (isinstance(v, Node) and v.target in (aten.mean.dim, aten.sum.dim_IntList)):
        return False
    w = _strip(v.args[0])
    if not isinstance(w, Node):
        return False
    if w.target is aten.pow.Tensor_Scalar and w.args[1] == 2:
        z = w.args[0]
    elif w.target is aten.mul.Tensor and _strip(w.args[0]) is _strip(w.args[1]):
        z = w.args[0]
    else:
        return False
    return _strip(z) is _strip(a)


def _past_eps(a):
    """``a`` before copies and an added constant (a norm's ε)."""
    a = _strip(a)
    while (
        isinstance(a, Node)
        and a.op == "call_function"
        and a.target in (aten.add.Tensor, aten.add.Scalar)
        and _number(a.args[1])
    ):
        a = _strip(a.args[0])
    return a


def _is_probs(a, depth: int = 0) -> bool:
    """Whether ``a`` is a softmax's output (through moves, casts and a mask's ``where``)."""
    while depth < 16 and isinstance(a, Node) and a.op == "call_function":
        t = a.target
        if t in _SOFTMAX:
            return True
        if t is aten.div.Tensor:
            e, s = a.args[:2]
            return (
                _is_exp_shifted(e)
                and isinstance(s, Node)
                and s.target in (aten.sum.dim_IntList, aten.sum.default)
                and _strip(s.args[0]) is _strip(e)
            )
        if t in _PROBS_MOVES:
            a = a.args[0]
        elif t is _WHERE:  # a mask's where: whichever float branch holds the probabilities
            picks = [x for x in a.args[1:3] if isinstance(x, Node) and _is_float(x)]
            return any(_is_probs(x, depth + 1) for x in picks)
        elif t in _FILLS:
            a = a.args[0]
        else:
            return False
        depth += 1
    return False


def _is_exp_shifted(e) -> bool:
    """``exp(x - softmax_shift(x))``: the numerator of a decomposed softmax."""
    e = _strip(e)
    if not (isinstance(e, Node) and e.target is aten.exp.default):
        return False
    d = _strip(e.args[0])
    return (
        isinstance(d, Node)
        and d.target is aten.sub.Tensor
        and isinstance(d.args[1], Node)
        and d.args[1].target is _SHIFT
    )
