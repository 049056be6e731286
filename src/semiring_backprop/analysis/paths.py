"""Top gradient paths, read by following the back-pointers of a selective semiring.

Every selective value has, per element, a back-pointer: the consumer op that won (and,
at neuron granularity, the element of that op's output). MaxAbs and TopK store them;
MaxProduct's are found again when a path is read (see ``_Pointers``). A path is read
from a source element to the output by following them; each step's edge weight is
recomputed from the op's own rule under the real semiring (the partial derivative of
that output element with respect to that input element, per argument slot), which also
tells where the sign flips: a negative edge continues from the consumer's most negative
value.

Every reader checks what it read against the pass, and raises ``PathMismatchError``
rather than return a path that does not hold: at neuron granularity the product of the
edge weights must be the semiring's value at the source (MaxAbs and TopK compare in log
space, as they store it); MaxProduct's replayed ⊕ must give the stored value at every
element the path passes (at tensor granularity, where a path has no edge weights, this
is the whole check).
"""

from __future__ import annotations

import math

import torch

from ..errors import InputError, NotFoundError, PathMismatchError
from ..semirings import MaxAbs, MaxProduct, TopK
from ..semirings.topk import unpack_pointers
from ..tracing.trace import mark_module
from ._pointers import _STALE, _broken, _Edges, _Pointers, _raw, _tol, _unravel
from .steps import Path, Step

# -- sources --------------------------------------------------------------------------


def resolve_source(res, source):
    """``where`` or ``(where, index)`` -> (node, bool mask of candidate elements)."""
    if isinstance(source, tuple) and len(source) == 2:
        where, index = source
    else:
        where, index = source, ()
    node = res.node(where)
    val = res.values.get(node)
    if not isinstance(val, torch.Tensor):
        raise InputError(f"{where!r} is not a tensor in the traced graph")
    index = index if isinstance(index, tuple) else (index,)
    mask = torch.zeros(tuple(val.shape), dtype=torch.bool, device=val.device)
    try:
        mask[index] = True
    except (IndexError, TypeError) as e:
        raise InputError(
            f"index {index!r} does not fit {where!r} of shape {tuple(val.shape)} ({e}); give "
            "a tuple of ints (a prefix selects all elements below it) or slices"
        ) from None
    return node, mask


def _node_label(res, node) -> tuple[str | None, str]:
    if node.op == "placeholder":
        return None, "input"
    return res.graph.module_of(node), str(node.target)


def _step(res, node, index, w, running, slot=None) -> Step:
    module, op = _node_label(res, node)
    module = mark_module(node) or module  # a mark belongs to the module it marks
    return Step(
        node=node.name,
        module=module,
        op=op,
        index=None if index is None else tuple(int(i) for i in index),
        edge_weight=None if w is None else float(w),
        running=None if running is None else float(running),
        slot=slot,
    )


# -- following pointers ---------------------------------------------------------------


def _semiring_index(res, semiring):
    try:
        return res.semirings.index(semiring)
    except ValueError:
        raise InputError(
            f"{semiring} was not computed in this pass; pass semirings=[..., {semiring}] "
            f"to backprop (computed: {res.semirings})"
        ) from None


def top_path(res, source, semiring=None, sign: str = "+") -> Path:
    semiring = semiring if semiring is not None else MaxProduct()
    if sign not in ("+", "-"):
        raise InputError(
            f"sign must be '+' (most positive path) or '-' (most negative), got {sign!r}"
        )
    if isinstance(semiring, MaxProduct):
        return _top_path_maxproduct(res, source, semiring, sign)
    if isinstance(semiring, MaxAbs):
        if sign != "+":
            raise InputError("MaxAbs ranks paths by |product|: sign='-' needs MaxProduct()")
        return _top_path_maxabs(res, source, semiring)
    if isinstance(semiring, TopK):
        paths = top_paths(res, source, 1, semiring)
        return paths[0]
    raise InputError(
        f"top_path follows the back-pointers of MaxProduct, MaxAbs or TopK; got {semiring}"
    )


def _pick_source(res, source, semiring, k, score):
    node, mask = resolve_source(res, source)
    group = [n for n in res.graph.aliases.get(node, (node,)) if n in res._store]
    if not group:
        raise _no_value(res, source, node)
    best = None
    for n in group:
        s = score(_raw(res, n, k)).cpu()
        s = torch.where(mask.cpu(), s, torch.full_like(s, -math.inf))
        flat = int(s.reshape(-1).argmax())
        v = float(s.reshape(-1)[flat])
        if best is None or v > best[0]:
            best = (v, n, flat)
    if best is None or best[0] == -math.inf:
        raise NotFoundError(
            f"no path with nonzero weight leads from {source!r} to the output under {semiring}"
        )
    return best[1], best[2]


def _top_path_maxproduct(res, source, sr: MaxProduct, sign: str) -> Path:
    k = _semiring_index(res, sr)
    f = 0 if sign == "+" else 1
    score = (lambda a: a[0]) if f == 0 else (lambda a: -a[1])
    node, e = _pick_source(res, source, sr, k, score)
    ro = sr.finalize(_raw(res, node, k))
    value = float((ro.hi, ro.lo)[f].reshape(-1)[e])
    if not sr.neuron:
        return _tensor_path(res, node, e, k, f, sr, sign, value)
    edges, graph, out_node = _Edges(res), res.graph, res.graph.output_node
    pointers = _Pointers(res, k, sr)
    shape = lambda n: res.values[n].shape  # noqa: E731
    steps = [_step(res, node, _unravel(e, shape(node)), None, 1.0)]
    running = 1.0
    while node is not out_node:
        c_id = pointers.consumer(node, e, f)
        if c_id < 0:
            raise _broken(node)
        c_idx = pointers.element(c_id, node, e, f)
        c = graph.nodes[c_id]
        ac = _raw(res, c, k)
        best = None
        for slot, w in edges.weights(c_id, c_idx, node):
            w = float(w[e])
            g = f if w >= 0 else 1 - f
            cand = float(ac[g].reshape(-1)[c_idx]) * w
            if math.isnan(cand):
                continue
            better = best is None or (cand > best[0] if f == 0 else cand < best[0])
            if better:
                best = (cand, slot, w, g)
        if best is None:
            raise _broken(node)
        _, slot, w, f = best
        running *= w
        node, e = c, c_idx
        steps.append(_step(res, node, _unravel(e, shape(node)), w, running, slot))
    _check(running, value, _tol(res), sr, steps[0])
    return Path(tuple(steps), value, sr.name, sign)


def _tensor_path(res, node, e, k, f, sr, sign, value) -> Path:
    """Tensor granularity: a sequence of ops. Each tensor's pointers name the winning
    consumer op only; the path follows the pointer of the tensor's most extreme element."""
    graph, out_node = res.graph, res.graph.output_node
    pointers = _Pointers(res, k, sr)
    steps = [_step(res, node, None, None, None)]
    while node is not out_node:
        c_id = pointers.consumer(node, e, f)
        if c_id < 0:
            raise _broken(node)
        node = graph.nodes[c_id]
        steps.append(_step(res, node, None, None, None))
        ac = sr._normalize(_raw(res, node, k))
        field = ac[f].reshape(-1)
        e = int(field.argmax() if f == 0 else field.argmin())
    return Path(tuple(steps), value, sr.name, sign)


def _top_path_maxabs(res, source, sr: MaxAbs) -> Path:
    k = _semiring_index(res, sr)
    node, e = _pick_source(res, source, sr, k, lambda a: a[0])
    log_value = float(_raw(res, node, k)[0].reshape(-1)[e])
    edges, graph, out_node = _Edges(res), res.graph, res.graph.output_node
    shape = lambda n: res.values[n].shape  # noqa: E731
    steps = [_step(res, node, _unravel(e, shape(node)), None, 1.0)]
    running, log_running = 1.0, 0.0
    while node is not out_node:
        a = _raw(res, node, k)
        c_id, c_idx = int(a[1].reshape(-1)[e]), int(a[2].reshape(-1)[e])
        if c_id < 0:
            raise _broken(node)
        c = graph.nodes[c_id]
        lc = float(_raw(res, c, k)[0].reshape(-1)[c_idx])
        best = None
        for slot, w in edges.weights(c_id, c_idx, node):
            w = float(w[e])
            cand = lc + _log_abs(w)
            if best is None or cand > best[0]:
                best = (cand, slot, w)
        if best is None:
            raise _broken(node)
        _, slot, w = best
        running *= w
        log_running += _log_abs(w)
        node, e = c, c_idx
        steps.append(_step(res, node, _unravel(e, shape(node)), w, running, slot))
    _check_log(log_running, log_value, _tol(res), sr, steps[0])
    return Path(tuple(steps), running, sr.name, "+")


def top_paths(res, source, k: int, semiring=None) -> list[Path]:
    """The ``k`` heaviest distinct paths (by |product|) from ``source``, heaviest first."""
    sr = semiring if semiring is not None else _find_topk(res, k)
    if not isinstance(sr, TopK):
        raise InputError(f"top_paths reads TopK back-pointers; got {sr}")
    if k > sr.k:
        raise InputError(f"asked for {k} paths but the pass computed {sr}; use TopK({k}) or more")
    s_idx = _semiring_index(res, sr)
    node, mask = resolve_source(res, source)
    group = [n for n in res.graph.aliases.get(node, (node,)) if n in res._store]
    if not group:
        raise _no_value(res, source, node)
    cands = []  # (log|value|, node, flat element, rank)
    for n in group:
        v = sr._pack(_raw(res, n, s_idx))[0].cpu()  # (..., K)
        v = torch.where(mask.cpu()[..., None], v, torch.full_like(v, -math.inf)).reshape(-1)
        top, j = v.topk(min(k, v.numel()))
        for lv, flat in zip(top.tolist(), j.tolist()):
            cands.append((lv, n, flat // sr.k, flat % sr.k))
    cands = sorted(cands, key=lambda c: -c[0])[:k]
    cands = [c for c in cands if c[0] > -math.inf]
    if not cands:
        raise NotFoundError(f"no path with nonzero weight leads from {source!r} to the output")
    edges = _Edges(res)
    return [_follow_topk(res, sr, s_idx, edges, n, e, r) for _, n, e, r in cands]


def _find_topk(res, k):
    have = [s for s in res.semirings if isinstance(s, TopK) and s.k >= k]
    if not have:
        raise InputError(
            f"top_paths needs TopK(k) back-pointers with k >= {k}; pass "
            f"semirings=[..., sbp.TopK({k})] to backprop (computed: {res.semirings})"
        )
    return min(have, key=lambda s: s.k)


def _follow_topk(res, sr, s_idx, edges, node, e, r) -> Path:
    graph, out_node = res.graph, res.graph.output_node
    shape = lambda n: res.values[n].shape  # noqa: E731
    groups = sr._pack(_raw(res, node, s_idx))
    log_value = float(groups[0].reshape(-1, sr.k)[e, r])
    sign = float(groups[1].reshape(-1, sr.k)[e, r])
    steps = [_step(res, node, _unravel(e, shape(node)), None, 1.0)]
    running, log_running = 1.0, 0.0
    while node is not out_node:
        v, _, ptr = (g.reshape(-1, sr.k)[e] for g in sr._pack(_raw(res, node, s_idx)))
        pn, pi, pr = unpack_pointers(ptr)  # (this element's alone)
        c_id, c_idx, c_rank = int(pn[r]), int(pi[r]), int(pr[r])
        if c_id < 0:
            raise _broken(node)
        # entries of this element that share the pointer differ only in the slot taken
        twins = [
            j for j in range(sr.k) if (int(pn[j]), int(pi[j]), int(pr[j])) == (c_id, c_idx, c_rank)
        ]
        twins.sort(key=lambda j: (-float(v[j]), j))
        c = graph.nodes[c_id]
        lc = float(sr._pack(_raw(res, c, s_idx))[0].reshape(-1, sr.k)[c_idx, c_rank])
        slots = []
        for slot, w in edges.weights(c_id, c_idx, node):
            w = float(w[e])
            cand = lc + _log_abs(w)
            slots.append((cand, slot, w))
        if not slots:
            raise _broken(node)
        slots.sort(key=lambda t: (-t[0], t[1]))
        _, slot, w = slots[min(twins.index(r), len(slots) - 1)]
        running *= w
        log_running += _log_abs(w)
        node, e, r = c, c_idx, c_rank
        steps.append(_step(res, node, _unravel(e, shape(node)), w, running, slot))
    value = sign * math.exp(log_value)
    if (running < 0) != (sign < 0):
        _mismatch(f"is {running!r}", f"{value!r}", sr, steps[0])
    _check_log(log_running, log_value, _tol(res), sr, steps[0])
    return Path(tuple(steps), value, sr.name, "+" if value >= 0 else "-")


def _log_abs(w: float) -> float:
    return math.log(abs(w)) if w != 0 else -math.inf


def _check(got: float, want: float, tol: float, sr, source: Step):
    """The product along the path must be the semiring's value at its source."""
    if not (got == want or math.isclose(got, want, rel_tol=tol, abs_tol=1e-300)):
        _mismatch(f"is {got!r}", f"{want!r}", sr, source)


def _check_log(got: float, want: float, tol: float, sr, source: Step):
    """The same in log space (MaxAbs and TopK store log |product|; the product itself
    may underflow): the sum of log |edge weight| along the path."""
    if not (got == want or math.isclose(got, want, rel_tol=tol / 100, abs_tol=tol)):
        _mismatch(f"has log |product| {got!r}", f"log |value| {want!r}", sr, source)


def _mismatch(got: str, want: str, sr, source: Step):
    raise PathMismatchError(
        f"{sr.name} path reading: the path from `{source.node}` element {source.index} "
        f"{got}, but the semiring's value there is {want}. {_STALE}"
    )


def _no_value(res, source, node):
    where = source[0] if isinstance(source, tuple) and len(source) == 2 else source
    source = where if isinstance(where, str) and where == node.name else f"{where} ({node.name})"
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_floating_point():
        return InputError(res._why_missing(source, node))
    return NotFoundError("no path: " + res._why_missing(source, node))
