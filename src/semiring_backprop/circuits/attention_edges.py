"""The attention edges of a circuit: per head, the ⊕ over the whole paths that enter its
value input at one position and leave the head at another (DESIGN §3b), read at the
attention's ``A @ V`` matmul where the value path is laid out so, else by a pass back
from the head's slice at every position.
"""

from __future__ import annotations

import torch

from .. import rules
from ..analysis.fanout import ancestors
from ..analysis.heads import only_columns
from ..engine import structure
from ..engine.alpha import apply_rule
from ..engine.reverse import propagate
from .layout import (
    ATTENTION_COLUMNS,
    BATCH_BUDGET,
    HeadPlan,
    Projection,
    alpha_or_zero,
    at_positions,
    check_semirings,
    circuit_alphas,
    has_path,
    head_plan,
    layout,
    pinned,
    text_column,
)
from .nodes import readout, site_labels

aten = torch.ops.aten


def attention_edges(res, semirings=None, seed="structural", baseline=None, tokens=None,
                    heads=None, roles=None):  # fmt: skip
    """Tidy DataFrame, one row per head and pair of positions: ``layer``, ``head_index``,
    ``src_position``, ``dst_position``, ``src_token``, ``dst_token`` and one value column
    per semiring: the ⊕ over the whole paths that enter the head's value input (its
    columns of the value projection) at ``src_position`` and leave the head (its slice
    of the output projection's input) at ``dst_position``; readouts and the other
    arguments as in :func:`circuit_edges`. Every pair is a row: a pair that no path
    takes holds the semiring's zero (a pair the attention mask keeps apart among them:
    its probability is a structural zero, no edge, ``engine.structure``; under Real the
    flow there is 0, under MaxProduct -inf, under PathCount no path).
    Under Real, the rows of one head summed over both positions equal the sum of
    ``circuit_edges``' edges into that head's ``"v"`` input.
    """

    srs = check_semirings(res, semirings)
    res = pinned(res)
    lay = layout(res, heads, roles)
    al = circuit_alphas(res, srs, seed, baseline, lay)
    labels = site_labels(tokens, lay.positions)
    n = lay.positions
    keys, values = [], [[] for _ in srs]
    for layer in range(lay.layers):
        for comp in lay.heads[layer]:
            plan = head_plan(res, lay, srs, layer, comp.head, roles=("value",))
            got = _attention_by_contraction(res, lay, srs, plan, al)
            if got is None:  # the value path is not one A @ V between moves of data
                got = _attention_by_positions(res, lay, srs, plan, al)
            keys.append((layer, comp.head))
            for s, (sr, v) in enumerate(zip(srs, got)):
                values[s].append(readout(sr, v).detach().cpu().double().reshape(-1).numpy())
    return _frame(keys, values, n, labels, srs)


def _frame(keys, values, n, labels, srs):
    """One row per head (``keys``: (layer, head) in order) and pair of positions, the
    destination position major, with the heads' values per semiring (``values``)."""
    import numpy as np
    import pandas as pd

    columns = [*ATTENTION_COLUMNS, *(sr.name for sr in srs)]
    if not keys:
        frame = pd.DataFrame(columns=columns)
        for col in ("layer", "head_index", "src_position", "dst_position"):
            frame[col] = frame[col].astype("Int64")
        return frame
    per = n * n
    src = np.tile(np.arange(n), n * len(keys))
    dst = np.tile(np.repeat(np.arange(n), n), len(keys))
    cols = {
        "layer": pd.array(np.repeat([k[0] for k in keys], per), dtype="Int64"),
        "head_index": pd.array(np.repeat([k[1] for k in keys], per), dtype="Int64"),
        "src_position": pd.array(src, dtype="Int64"),
        "dst_position": pd.array(dst, dtype="Int64"),
        "src_token": text_column(labels, src),
        "dst_token": text_column(labels, dst),
    }
    for sr, v in zip(srs, values):
        cols[sr.name] = np.concatenate(v)
    return pd.DataFrame(cols, copy=False)[columns]  # (its own arrays: not copied)


def _attention_by_contraction(res, lay, srs, plan: HeadPlan, al):
    """Per semiring, the head's value (dst positions, src positions), where its value
    path is one batched matmul ``A @ V`` between ops that only move data (as attention
    is written): the paths from ``V[q, j]`` to the head's slice at ``p`` are the one
    edge of weight ``A[p, q]``, so the edge is ``⊕_j alpha(V)[q, j] ⊗ A[p, q] ⊗
    D(A @ V)[p, j]``, the matmul's edge marginals ⊕-ed over ``j`` (and over its batch,
    where only this head's slice holds D). None where the path is not laid out so."""
    graph, values, ids = res.graph, res.values, res.graph.ids
    mm = _last_contraction(res, plan)
    if mm is None or mm.target is not aten.bmm.default or not _only_as_values(res, plan, mm):
        return None
    a, v = mm.args[:2]
    n = lay.positions
    att, like = values[a], values[mm]
    if tuple(att.shape[1:]) != (n, n):
        return None
    within = {m for m in plan.region if ids[m] > ids[mm]} | {mm}
    masked = structure.zeros(graph, values, a)  # (pairs a mask keeps apart: no edge)
    if masked is not None:
        masked = masked.expand(att.shape)
    with torch.no_grad():
        store = propagate(graph, values, srs, {plan.site: list(plan.d)}, res.needed,
                          within=within, start=ids[plan.site] + 1, stop=ids[mm],
                          store_at=frozenset([mm]))  # fmt: skip
        out = []
        for s, sr in enumerate(srs):
            if mm not in store:
                out.append(sr.zero((n, n), like))
                continue
            d = store[mm][s]
            live = has_path(sr, d).nonzero().reshape(-1)  # this head's slice of the batch
            if not len(live):
                out.append(sr.zero((n, n), like))
                continue
            av = tuple(f[live] for f in alpha_or_zero(res, al, v, sr))
            d = tuple(f[live] for f in d)
            # ⊕_j D[p, j] ⊗ alpha[q, j], then ⊗ A[p, q] (⊗ by a weight distributes over ⊕)
            met = sr.contract(d, tuple(f.transpose(-2, -1) for f in av))
            edge = sr.times(met, att[live])
            if masked is not None:
                edge = sr.without(edge, masked[live])
            out.append(sr.sum(edge, (0,)))
    return out


def _last_contraction(res, plan: HeadPlan):
    """The contraction whose output reaches the head's slice through ops that only move
    data (the attention's ``A @ V``), or None."""
    n = plan.site
    for _ in range(64):
        ins = [i for i in n.all_input_nodes if i in plan.region]
        kind = getattr(rules.lookup(n.target), "kind", None)
        if kind == "contraction":
            return n
        if kind != "routing" or len(ins) != 1:
            return None
        n = ins[0]
    return None


def _only_as_values(res, plan: HeadPlan, mm) -> bool:
    """Whether the value columns reach ``mm`` only as its second operand ``V``: back from
    ``V`` through ops of one input that only move data, the value projection comes
    before any tensor that ``A`` (the first operand) reads; or where they share one (a
    fused q/k/v projection), ``V``'s side leaves it through a slice of columns that no
    slice on ``A``'s side overlaps."""
    a, v = mm.args[:2]
    if not isinstance(a, torch.fx.Node) or v not in plan.region:
        return False
    feeds_a = ancestors(a, plan.region)
    projs = {p.proj for p in plan.projs}
    n, prev = v, None
    for _ in range(64):
        if n in feeds_a:
            return prev is not None and _disjoint_slice(res, n, prev, feeds_a)
        if n in projs:
            return True
        ins = [i for i in n.all_input_nodes if i in res.needed]
        if getattr(rules.lookup(n.target), "kind", None) != "routing" or len(ins) != 1:
            return False
        prev, n = n, ins[0]
    return False


def _disjoint_slice(res, fork, mine, feeds_a) -> bool:
    def cols(s):
        if s.target is not aten.slice.Tensor:
            return None
        x = res.values[fork]
        args = [*s.args[1:5], *[None] * 4][:4]
        dim = (0 if args[0] is None else args[0]) % x.dim()
        return dim, range(*slice(*args[1:4]).indices(x.shape[dim]))

    got = cols(mine)
    if got is None:
        return False
    for u in fork.users:
        if u is mine or u not in feeds_a:
            continue
        other = cols(u)
        if other is None or other[0] != got[0] or set(other[1]) & set(got[1]):
            return False
    return True


def _attention_by_positions(res, lay, srs, plan: HeadPlan, al):
    """Per semiring, the head's value (dst positions, src positions), by a pass from the
    head's slice at each position (all positions at once: a leading position dim under
    ``torch.vmap``), met at the value projection by alpha there (:func:`_value_entry`)."""
    n = lay.positions
    like = res.values[plan.site]
    for p in plan.projs:
        _projected_alpha(res, srs, p, al)  # (computed once, outside the batch)
    seeds = torch.eye(n, dtype=torch.bool, device=like.device)

    def run(keep):
        return [tuple(v) for v in _value_entry(res, lay, srs, plan, keep, al)]

    per = sum(res.values[m].numel() for m in plan.region) * 2 * len(srs)
    chunk = max(1, min(n, BATCH_BUDGET // max(per, 1)))
    with torch.no_grad():
        return torch.vmap(run, chunk_size=chunk)(seeds)


def _value_entry(res, lay, srs, plan: HeadPlan, keep, al):
    """Per semiring, per position ``q``: the ⊕ over the paths that enter the head's value
    columns at ``q`` and leave its slice at the positions ``keep`` (a bool mask). The
    pass from the slice stops at the value projection's output ``v`` (only the nodes
    between them are followed); the paths into ``v``'s columns ``j`` through the
    projection, ⊕_i alpha(x_i) ⊗ w_ij, are the projection's forward rule on alpha at its
    input, once per projection (the same ⊕ as ⊕_i alpha(x_i) ⊗ (⊕_j w_ij ⊗ D(v_j)),
    grouped the other way)."""
    site, d = plan.site, plan.d
    like = res.values[site]
    d = [at_positions(sr, v, like, lay.positions, keep) for sr, v in zip(srs, d)]
    graph, values = res.graph, res.values
    store = propagate(graph, values, srs, {site: d}, plan.region, within=plan.region,
                      start=graph.ids[site] + 1, stop=plan.stop,
                      store_at=frozenset(p.proj for p in plan.projs))  # fmt: skip
    out = [None] * len(srs)
    for p in plan.projs:
        if p.proj not in store:
            continue
        pl = values[p.proj]
        a = _projected_alpha(res, srs, p, al)
        for s, sr in enumerate(srs):
            if a[s] is None:
                continue
            dp = only_columns(sr, store[p.proj][s], plan.cols[p], pl)
            flat = tuple(f.reshape(lay.positions, -1, *f.shape[pl.dim() :])
                         for f in sr.mul(a[s], dp))  # fmt: skip
            per = sr.sum(flat, (1,))
            out[s] = per if out[s] is None else sr.plus(out[s], per)
    for s, sr in enumerate(srs):
        if out[s] is None:
            out[s] = sr.zero((lay.positions,), res.values[lay.target])
    return out


def _projected_alpha(res, srs, p: Projection, al) -> list:
    """Per semiring: ⊕ over the paths into the projection's output through its input
    ``p.x`` (None where no path reaches ``p.x``), kept on ``al``."""
    cache = al.setdefault(("projected", tuple(srs)), {})
    if p.proj not in cache:
        got = [al[sr].get(p.x) for sr in srs]
        out = [None] * len(srs)
        if any(g is not None for g in got):
            graph = res.graph
            with torch.no_grad():
                out = apply_rule(graph, res.values, srs, graph.ids[p.proj], {p.x: got},
                                    res.needed)  # fmt: skip
        cache[p.proj] = out
    return cache[p.proj]
