"""The rule table, keyed by ATen overload (torch._decomp style).

A rule has the signature ``rule(sr, g, op, *args, **kwargs) -> per-argument values``:
``g`` is the semiring value at the op's output, ``args``/``kwargs`` the op's forward
arguments, and the return value mirrors ``args`` (a value for each tensor argument that
carries edges, ``None`` for the others, a list for a list argument).

Its transpose, the forward rule (the forward semiring pass, :mod:`..engine.alpha`), is
``forward(sr, a, op, *args, **kwargs) -> the value at the output (None: no path)``,
where ``a`` mirrors ``args`` the same way: the semiring value at each tensor argument
that paths reach, ``None`` elsewhere. For every edge ``x[i] -> out[j]`` of weight ``w``
the reverse rule sends ``g[j] ⊗ w`` to ``x[i]``, the forward rule ``a[i] ⊗ w`` to
``out[j]``. Forward rules live in a second table, keyed the same way
(:func:`register_forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import InputError, SemiringBackpropError

KINDS = ("pointwise", "routing", "contraction", "reduction", "nondifferentiable", "composite")


@dataclass(frozen=True)
class Rule:
    fn: Callable
    kind: str
    op: object
    #: which forward values the rule reads, as ``reads(node, needed) -> nodes`` (its
    #: inputs, and the node itself for its output); None: all of them. Values no rule
    #: reads are dropped during the forward when ``keep=`` is given (only their shape,
    #: dtype and device stay). Shapes, dtypes and integer tensors are always there.
    reads: Callable | None = None


def reads_nothing(node, needed):
    """``reads`` of a rule that uses shapes, dtypes and integer arguments only."""
    return ()


def reads_each_for_the_other(i: int, j: int) -> Callable:
    """``reads`` of a bilinear rule (a product, a matmul): argument ``i`` is read only
    for ``j``'s edges and ``j`` only for ``i``'s; never the output."""

    def reads(node, needed):
        a, b = node.args[i], node.args[j]
        return [x for x, other in ((b, a), (a, b)) if other in needed]

    return reads


_RULES: dict[object, Rule] = {}


def _overloads(ops):
    if not isinstance(ops, list | tuple):
        ops = [ops]
    for op in ops:
        if isinstance(op, str):  # "namespace.op.overload": an op of a library not imported
            yield op
        elif isinstance(op, torch._ops.OpOverloadPacket):
            yield from (getattr(op, name) for name in op.overloads())
        else:
            yield op


def register(ops, kind: str, reads: Callable | None = None):
    """Register ``fn`` as the rule of ``ops`` (an overload, a packet, a name such as
    ``"transformers.grouped_mm_fallback.default"`` for an op of a library that may not be
    imported, or a list); ``reads`` as for ``Rule`` (default: every value).

    ``kind`` is one of ``"pointwise"``, ``"routing"``, ``"contraction"``,
    ``"reduction"``, ``"nondifferentiable"``, ``"composite"``. A rule is
    ``rule(sr, g, op, *args, **kwargs)``: ``g`` is the semiring value at the op's
    output, ``args`` the op's forward arguments; it returns one value per argument
    (``None`` for an argument without edges). Each overload has one rule.

    Examples:
        A custom op that triples its input: each path through it gains an edge of
        weight 3.

        >>> @torch.library.custom_op("apidoc::triple", mutates_args=())
        ... def triple(v: torch.Tensor) -> torch.Tensor:
        ...     return 3 * v
        >>> @triple.register_fake
        ... def _(v):
        ...     return torch.empty_like(v)
        >>> @sbp.register(torch.ops.apidoc.triple.default, "pointwise")
        ... def triple_rule(sr, g, op, v):
        ...     return [sr.scale(g, 3.0)]
        >>> sbp.backprop(lambda v: triple(v).sum(), (x,)).at(0, sbp.Real())
        tensor([[3., 3., 3., 3.]], dtype=torch.float64)
    """
    if kind not in KINDS:
        raise InputError(f"rule kind {kind!r} is not one of {KINDS}")

    def deco(fn):
        overloads = list(_overloads(ops))
        for op in overloads:  # all or nothing: check before registering any
            if op in _RULES:
                old = _RULES[op]
                raise SemiringBackpropError(
                    f"a rule for {op} is already registered ({old.kind}, "
                    f"{getattr(old.fn, '__qualname__', old.fn)}); each overload has one rule: "
                    "register a different overload, or fix the existing rule"
                )
        for op in overloads:
            _RULES[op] = Rule(fn, kind, op, reads)
        return fn

    return deco


_FORWARD: dict[object, Callable] = {}


def register_forward(ops):
    """Register ``fn`` as the forward rule (the transpose) of ``ops``, named as for
    :func:`register`: ``fn(sr, a, op, *args, **kwargs)`` returns the semiring value at
    the op's output, ``⊕`` over the argument slots and input elements of
    ``a[slot][i] ⊗ w(i -> out element)`` (``a`` mirrors ``args``: the value at each
    argument that paths reach, ``None`` elsewhere), or ``None`` where no path arrives.
    Each overload has one forward rule.

    Examples:
        >>> @torch.library.custom_op("apidoc::triple_fwd", mutates_args=())
        ... def triple_fwd(v: torch.Tensor) -> torch.Tensor:
        ...     return 3 * v
        >>> @triple_fwd.register_fake
        ... def _(v):
        ...     return torch.empty_like(v)
        >>> @sbp.register(torch.ops.apidoc.triple_fwd.default, "pointwise")
        ... def triple_rule(sr, g, op, v):
        ...     return [sr.scale(g, 3.0)]
        >>> @sbp.register_forward(torch.ops.apidoc.triple_fwd.default)
        ... def triple_forward(sr, a, op, v):
        ...     return None if a[0] is None else sr.scale(a[0], 3.0)
        >>> r = sbp.backprop(lambda v: triple_fwd(v).sum(), (x,))
        >>> torch.allclose(r.alpha(r.graph.output_node, sbp.Real(), seed="x"), 3 * x.sum())
        True
    """

    def deco(fn):
        overloads = list(_overloads(ops))
        for op in overloads:  # all or nothing, as for register
            if op in _FORWARD:
                old = _FORWARD[op]
                raise SemiringBackpropError(
                    f"a forward rule for {op} is already registered "
                    f"({getattr(old, '__qualname__', old)}); each overload has one"
                )
        for op in overloads:
            _FORWARD[op] = fn
        return fn

    return deco


#: the rule of pointwise-tagged ops that have none registered (see :func:`fallback`)
_pointwise_fallback = None
_pointwise_fallback_forward = None


def fallback(fn):
    """Install ``fn`` as the rule of every op tagged ``torch.Tag.pointwise`` that has no
    rule registered: :mod:`.pointwise` installs its generic rule here, so that the
    registry imports no rule module."""
    global _pointwise_fallback
    _pointwise_fallback = fn
    return fn


def fallback_forward(fn):
    """The forward rule of the ops :func:`fallback`'s rule serves."""
    global _pointwise_fallback_forward
    _pointwise_fallback_forward = fn
    return fn


def lookup_forward(target) -> Callable | None:
    """The registered forward rule, else the generic pointwise one for pointwise-tagged
    ops with no rule of their own (a registered reverse rule without a forward rule has
    none: the generic one might not be its transpose)."""
    fn = _FORWARD.get(target)
    if fn is None and isinstance(target, torch._ops.OpOverload):
        fn = _FORWARD.get(str(target))
        registered_rule = target in _RULES or str(target) in _RULES
        if fn is None and not registered_rule and torch.Tag.pointwise in target.tags:
            return _pointwise_fallback_forward
    return fn


def rows(fn):
    """Mark the forward rule ``fn`` as one that takes rows: given values with a leading
    dim of ``op.rows`` rows (the same node's values for several sets of sources, under
    a semiring whose ``rows`` is True), it returns each row's result, as ``torch.vmap``
    over that dim would."""
    fn.takes_rows = True
    return fn


def takes_rows(target, semirings=()) -> bool:
    """Whether the forward rule of ``target`` takes rows (:func:`rows`), under every one
    of ``semirings`` (those whose values are shaped as the node's: ``Semiring.rows``)."""
    marked = getattr(lookup_forward(target), "takes_rows", False)
    return marked and all(sr.rows for sr in semirings)


def without_forward() -> list[str]:
    """Registered overloads that have a reverse rule but no forward rule yet."""
    return sorted(str(op) for op in _RULES if op not in _FORWARD)


def lookup(target) -> Rule | None:
    """The registered rule, else the generic pointwise rule for pointwise-tagged ops."""
    rule = _RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = _RULES.get(str(target))  # registered by name (see ``register``)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        if torch.Tag.pointwise in target.tags and _pointwise_fallback is not None:
            return Rule(_pointwise_fallback, "pointwise", target)
    return rule


def supported_ops() -> dict[str, str]:
    """Every registered overload and its rule kind; any other op tagged pointwise is
    handled by the generic pointwise rule (derivatives by forward-mode autograd).

    Examples:
        >>> ops = sbp.supported_ops()
        >>> ops["aten.mm.default"], ops["aten.tanh.default"], ops["aten.gather.default"]
        ('contraction', 'pointwise', 'routing')
    """
    return {str(op): r.kind for op, r in sorted(_RULES.items(), key=lambda kv: str(kv[0]))}


def registered() -> dict[object, Rule]:
    return dict(_RULES)


class Prepared:
    """Weight-only work of contractions (``Semiring.prepare``: ``log |w|``, a transposed
    copy), kept across calls for weights that are constants of the model, up to
    ``budget`` bytes; past it, the work is redone on every call."""

    def __init__(self, budget: int):
        self.budget, self.used, self.items = int(budget), 0, {}

    def get(self, key, make, base: torch.Tensor):
        hit = self.items.get(key)
        if hit is None:
            hit = make()
            size = sum(
                t.numel() * t.element_size()
                for t in torch.utils._pytree.tree_leaves(hit)
                if isinstance(t, torch.Tensor) and t.data_ptr() != base.data_ptr()
            )
            if self.used + size <= self.budget:
                self.items[key] = hit
                self.used += size
        return hit


@dataclass
class Op:
    """What a rule sees of one graph node: forward values and a per-pass memo shared by
    every semiring (so local derivatives are computed once per node)."""

    node: torch.fx.Node
    args: tuple
    kwargs: dict
    out: object
    needed: frozenset
    memo: dict = field(default_factory=dict)
    #: cross-call store of prepared weights, and the nodes constant across calls
    prepared: Prepared | None = None
    static: frozenset = frozenset()
    #: a leading dim of this many rows on every semiring value a forward rule is given
    #: (0: none); only rules marked by :func:`rows` are run so
    rows: int = 0
    #: ``{slot: bool mask}``: the edges of that argument slot that are not there, their
    #: weight being a structural zero (``engine.structure``): a pointwise op's over its
    #: output's elements, a contraction's over the other operand's (the weight's), a
    #: row-wise composite's over its Jacobian's; the rule drops them (``Semiring.without``,
    #: ``Semiring.matmul_without``)
    absent: dict = field(default_factory=dict)
    #: argument slots with no edges at all under the pass's edge weights (a relevance
    #: rule's, ``engine.relevance``): the rule computes nothing for them
    cut: frozenset = frozenset()

    def needs(self, i: int) -> bool:
        if i in self.cut:
            return False
        a = self.node.args[i] if i < len(self.node.args) else None
        if isinstance(a, list | tuple):
            return any(x in self.needed for x in a)
        return a in self.needed

    def weight(self, sr, i: int, make: Callable):
        """``(w, sr.prepare(w))`` for a contraction weight ``w = make()`` read from
        argument ``i``; kept across calls when that argument is a constant of the model
        (same parameters, so the same value on every call)."""

        def both():
            w = make()
            return w, sr.prepare(w)

        if self.prepared is None or self.node.args[i] not in self.static:
            return both()
        return self.prepared.get((sr.prepares_as, self.node, i), both, self.args[i])

    def cached(self, key, fn):
        if key not in self.memo:
            self.memo[key] = fn()
        return self.memo[key]
