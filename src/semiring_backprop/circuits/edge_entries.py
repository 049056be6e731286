"""Where a circuit's edges end (:mod:`.edges`): every destination's entries (a head's
query, key and value projections' inputs, an MLP's first ops, the output) with the D
there, the ⊕ over the paths from the entry that go on through that input alone.

A head's D at its projections comes from one pass back from its slice, all heads of a
block at once (a leading head dim), or, where a block's heads are known to be apart
(each head's paths leave from columns of its own), from the reverse pass's own D on
each head's columns.
"""

from __future__ import annotations

import math

import torch

from ..analysis.heads import QKV, only_columns
from ..engine.reverse import contributions, propagate
from ..semirings import MaxProduct
from .layout import (
    BATCH_BUDGET,
    SHORT_ROLES,
    Component,
    Layout,
    head_plan,
)

#: the output projection's ops: ``x @ w`` (``mm``, ``bmm``) or ``addmm(bias, x, w)``
PROJECTIONS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default)  # fmt: skip


def _layer_entry_d(res, lay: Layout, srs, layer: int) -> list:
    """Per head of a block, ``{(role, x): [D per semiring]}``: at the input ``x`` of each
    projection, ⊕ over the paths through that role's columns that reach the head's slice
    of the output projection's input (at every position).

    Where the block's heads are known to be apart (below), each head's D at a
    projection's output is the reverse pass's own D there, on the head's columns: every
    path from those columns passes that head's slice and no other. Otherwise, and to
    find out, one pass back from the heads' site for all heads at once: a leading head
    dim, the rules under ``torch.vmap`` (the heads share the site and the region between
    it and the projections; they differ in the columns their D starts from)."""
    comps = lay.heads[layer]
    plans = [head_plan(res, lay, srs, layer, c.head) for c in comps]
    first = plans[0]
    graph, values, needed = res.graph, res.values, res.needed
    apart = graph.__dict__.setdefault("_heads_apart", {})
    # (which columns a head's paths leave from depends on the graph, not on the length:
    # a graph with symbolic sizes finds it once for every length)
    key = (first.site.name, tuple(values[first.site].shape[-1:]), len(plans))
    masks = apart.get(key)
    if masks and _still_apart(res, srs, first, masks):
        ks = [res.semirings.index(sr) for sr in srs]
        got = {p.proj: [tuple(res._store[p.proj][k]) for k in ks] for p in first.projs
               if p.proj in res._store}  # fmt: skip

        def mine(h, proj, sr, v):
            return only_columns(sr, v, masks[proj.name][h], values[proj])

        sliced = _sliced_entry_d(res, srs, plans, masks, got)
        return sliced if sliced is not None else _entry_d(res, srs, plans, mine, got)
    seeds = [tuple(torch.stack(f) for f in zip(*(tuple(pl.d[s]) for pl in plans)))
             for s in range(len(srs))]  # fmt: skip

    projs = frozenset(p.proj for p in first.projs)

    def run(d):
        store = propagate(graph, values, srs, {first.site: list(d)}, needed,
                          within=first.region, start=graph.ids[first.site] + 1,
                          stop=first.stop, store_at=projs)  # fmt: skip
        return {p.proj: [tuple(v) for v in store[p.proj]] for p in first.projs
                if p.proj in store}  # fmt: skip

    with torch.no_grad():
        got = _per_head(run, seeds, len(comps)) if _compiles(srs) else None
        if got is None:
            per = sum(values[n].numel() for n in first.region) * 2 * len(srs)
            chunk = max(1, min(len(comps), BATCH_BUDGET // max(per, 1)))
            got = torch.vmap(run, chunk_size=chunk)(seeds)
    if key not in apart and any(isinstance(sr, MaxProduct) for sr in srs):
        apart[key] = _heads_apart(res, srs, plans, got)
    return _entry_d(res, srs, plans, lambda h, proj, sr, v: tuple(f[h] for f in v), got)


def _compiles(srs) -> bool:
    """Whether a semiring's contractions run compiled kernels (which a value batched by
    ``torch.vmap`` cannot run: there, one pass per head is faster)."""
    return any(isinstance(sr, MaxProduct) and sr.neuron for sr in srs)


def _per_head(run, seeds, heads: int):
    """``run`` on each head's seeds (the leading dim of ``seeds``, per semiring) in turn,
    its outputs stacked as ``torch.vmap(run)`` stacks them; None where the heads' outputs
    are not alike (then ``vmap`` runs)."""
    outs = [run([tuple(f[h] for f in s) for s in seeds]) for h in range(heads)]
    if any(o.keys() != outs[0].keys() for o in outs):
        return None
    return {
        p: [tuple(torch.stack(fs) for fs in zip(*(o[p][s] for o in outs)))
            for s in range(len(seeds))]
        for p in outs[0]
    }  # fmt: skip


def _sliced_entry_d(res, srs, plans, masks, got):
    """:func:`_entry_d` where each projection is a matmul ``x @ w`` (``addmm``, ``mm``,
    ``bmm``) and each head has as many columns of it: each head's D through it on its
    own columns and rows of ``w`` (the others hold its zero), the heads batched; None
    where the projections are not laid out so."""
    values, needed, ids = res.values, res.needed, res.graph.ids
    out = [{} for _ in plans]
    for p in plans[0].projs:
        if p.proj not in got:
            continue
        u = p.proj
        if u.target not in PROJECTIONS or u.kwargs:
            return None
        x, w = u.args[1:3] if u.target is torch.ops.aten.addmm.default else u.args[:2]
        if x is not p.x or not isinstance(w, torch.fx.Node) or w in needed:
            return None
        cols = [masks[u.name][h] & plan.cols[p] for h, plan in enumerate(plans)]
        idx = [c.nonzero().reshape(-1) for c in cols]
        if len({len(i) for i in idx}) != 1 or not len(idx[0]):
            return None
        wt = torch.stack([values[w][..., i].transpose(-2, -1) for i in idx])
        for s, sr in enumerate(srs):
            d = tuple(torch.stack([f[..., i] for i in idx]) for f in got[u][s])
            with torch.no_grad():
                c = sr.leave(sr.inner.matmul(sr.enter(d, ids[u]), wt), ids[u])
            like = values[x]  # (in its dtype, as the rule's contribution would be)
            c = tuple(f.to(like.dtype) if f.is_floating_point() else f for f in c)
            for h in range(len(plans)):
                slot = out[h].setdefault((p.role, p.x), [None] * len(srs))
                slot[s] = sr.accumulate(slot[s], tuple(f[h] for f in c))
    return out


def _entry_d(res, srs, plans, pick, got) -> list:
    """Per head, ``{(role, x): [D per semiring]}`` from ``got`` (``{projection output:
    [value per semiring]}``, read for head ``h`` by ``pick(h, projection, semiring,
    value)``): D on the head's columns of each projection's output, through the
    projection to its input."""
    graph, values, needed = res.graph, res.values, res.needed
    out = []
    for h, plan in enumerate(plans):
        d_out: dict = {}
        for p in plan.projs:
            if p.proj not in got:
                continue
            pl = values[p.proj]
            dp = [only_columns(sr, pick(h, p.proj, sr, v), plan.cols[p], pl)
                  for sr, v in zip(srs, got[p.proj])]  # fmt: skip
            with torch.no_grad():
                for inp, s, c in contributions(graph, values, srs, graph.ids[p.proj], dp, needed):
                    if inp is p.x:
                        slot = d_out.setdefault((p.role, p.x), [None] * len(srs))
                        slot[s] = srs[s].accumulate(slot[s], c)
        out.append(d_out)
    return out


def _still_apart(res, srs, plan, masks) -> bool:
    """Whether this call's reverse pass has no path from a projection's columns that no
    head's are (checked under MaxProduct where the pass has it)."""
    k = next((res.semirings.index(sr) for sr in srs if isinstance(sr, MaxProduct)), None)
    if k is None:
        return True
    for p in plan.projs:
        if p.proj not in res._store:
            continue
        hi = res._store[p.proj][k][0]
        union = torch.stack(masks[p.proj.name]).any(0)
        if bool((hi.reshape(-1, hi.shape[-1])[:, ~union] != -math.inf).any()):
            return False
    return True


def _heads_apart(res, srs, plans, got):
    """``{projection output's name: [columns per head]}`` where the heads of a block are
    apart, else None: each head's paths leave each projection's output from columns of
    its own (no other head's paths leave there), and every path from the projection's
    output to the output passes a head's slice. Read off one call's passes from each
    head's slice (``got``, a leading head dim): under MaxProduct (whose zero is no path
    at all: a product of 0 is a path) the heads' D have disjoint columns and the reverse
    pass's D is the zero off them, and under every semiring each head's D equals the
    reverse pass's on its columns. That depends on the graph alone (which paths
    exist), so a later call of the same trace reads the reverse pass's D on each head's
    columns instead of passing back from each head."""
    m = next(i for i, sr in enumerate(srs) if isinstance(sr, MaxProduct))
    out = {}
    for p in plans[0].projs:
        if p.proj not in got or p.proj not in res._store:
            return None
        like = res.values[p.proj]
        n = like.shape[-1]
        hi = got[p.proj][m][0]
        cols = [(hi[h] != -math.inf).reshape(-1, n).any(0) for h in range(len(plans))]
        union = torch.stack(cols).sum(0)
        full_hi = res._store[p.proj][res.semirings.index(srs[m])][0]
        if bool((union > 1).any()) or bool((full_hi.reshape(-1, n)[:, union == 0]
                                           != -math.inf).any()):  # fmt: skip
            return None
        for s, sr in enumerate(srs):
            full = res._store[p.proj][res.semirings.index(sr)]
            for h in range(len(plans)):
                mine = only_columns(sr, tuple(f[h] for f in got[p.proj][s]), cols[h], like)
                theirs = only_columns(sr, full, cols[h], like)
                if not all(_same(a, b) for a, b in zip(mine, theirs)):
                    return None
        out[p.proj.name] = cols
    return out


def _same(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    tol = 1e-12 if a.dtype == torch.float64 else 1e-5
    return bool(torch.allclose(a, b, rtol=tol, atol=0.0, equal_nan=True))


def _mlp_entry_d(res, lay: Layout, srs, layer: int) -> dict:
    graph, values, needed = res.graph, res.values, res.needed
    ks = [res.semirings.index(sr) for sr in srs]
    out: dict = {}
    with torch.no_grad():
        for op, via in lay.mlp_entries[layer]:
            if op not in res._store:
                continue
            d = [res._store[op][k] for k in ks]
            for inp, s, c in contributions(graph, values, srs, graph.ids[op], d, needed):
                if inp is via:
                    slot = out.setdefault(via, [None] * len(srs))
                    slot[s] = srs[s].accumulate(slot[s], c)
    return out


def destinations(res, lay: Layout, srs):
    """``(component, input, {entry tensor: [D per semiring]})`` for every entry."""
    for layer in range(lay.layers):
        per_head = _layer_entry_d(res, lay, srs, layer)
        for comp, d in zip(lay.heads[layer], per_head):
            for role in QKV:
                acc = {x: v for (r, x), v in d.items() if r == role}
                if acc:
                    yield comp, SHORT_ROLES[role], _filled(res, srs, acc)
        acc = _mlp_entry_d(res, lay, srs, layer)
        if acc:
            yield Component("mlp", layer, ()), "mlp", _filled(res, srs, acc)
    out = lay.target
    like = res.values[out]
    yield (
        Component("target", lay.layers, ()),
        "target",
        {out: [sr.one(like.shape, like) for sr in srs]},
    )


def _filled(res, srs, acc):
    for x, slot in acc.items():
        like = res.values[x]
        for s, sr in enumerate(srs):
            if slot[s] is None:
                slot[s] = sr.zero(like.shape, like)
    return acc
