"""The edges of a circuit: the ⊕ over the whole paths that leave one component and enter
the next through the residual stream alone, split by the input they enter (DESIGN §3b).

Components are the sites of :func:`.nodes.circuit_nodes` other than the residual
stream: the token embedding, each attention head (its slice of the output projection's
input), each MLP (its output) and the target. A path passes a chain of them; between two
that follow each other it runs through the residual stream only (adds, norms, the output
projection, the lm head: nothing that is another component; the residual sites, the
layers' inputs, included). The edge ``u -> v`` is the ⊕ over the whole paths that pass
``u`` and then ``v``, entering ``v`` by

- ``"q"``, ``"k"``, ``"v"`` (a head): that head's columns of the query / key / value
  projection, i.e. the paths from the projection's input that reach the head's slice of
  the output projection's input (under grouped-query attention: the paths through the
  shared K/V columns that reach this query head);
- ``"mlp"`` (an MLP): the MLP's first ops;
- ``"target"``: the output itself.

Each entry point is a tensor ``x`` (the projection's input, the tensor the MLP reads, the
output) with ``D_e(x)``, the ⊕ over the paths from ``x`` that go on through that entry
alone. A reverse pass from ``x``, restricted to the nodes between the components (it
ends at every component's site and may not enter one), gives at a site ``u`` the ⊕ over
the residual-only paths from ``u`` to ``x`` times ``D_e``; ``alpha(u) ⊗`` that, ⊕-ed over
the hidden units of ``u`` at each position, is the edge. Residual paths keep their
position (norms mix the units of one position), so an edge's position is the position of
``u`` and of the entry both.

The entries and their D are found in :mod:`.edge_entries`, the components' values carried
forward to them in :mod:`.edge_sources`; here the two meet, per entry, into the edges.
"""

from __future__ import annotations

import torch

from ..engine.reverse import propagate
from .edge_entries import destinations
from .edge_sources import source_passes
from .layout import (
    EDGE_COLUMNS,
    Layout,
    alpha_or_zero,
    check_semirings,
    circuit_alphas,
    layout,
    pinned,
    residual_region,
    text_column,
)
from .nodes import readout, site_labels

# -- residual passes -------------------------------------------------------------------


def residual_pass(res, lay: Layout, srs, acc: dict) -> dict:
    """``{component node: [value per semiring]}``: from the entry values ``acc``
    (``{tensor: [D per semiring]}``), the ⊕ over the paths from each component's node
    that reach an entry through the residual stream alone, times its D."""
    needed = res.needed
    region = residual_region(res, lay, acc)
    graph = res.graph
    start = max(graph.ids[n] for n in acc) + 1
    with torch.no_grad():
        store = propagate(graph, res.values, srs, dict(acc), needed, within=region, start=start,
                          stop=min(graph.ids[n] for n in region), store_at=lay.stops)  # fmt: skip
    return {n: v for n, v in store.items() if n in lay.stops}


def _by_position(res, lay: Layout, x) -> bool:
    """Whether ``x`` is laid out (…, positions, hidden) as the components are (a residual
    path keeps its position: its edge's position can be read at the entry)."""
    shape = res.values[x].shape
    lead = 1
    for d in shape[:-1]:
        lead *= int(d)
    return len(shape) >= 2 and lead == lay.positions and shape[-2] == lay.positions


def _backward_edge_values(res, lay: Layout, srs, acc, al):
    """Per semiring, (components, positions): the edges into the entries ``acc`` by one
    residual pass back from them, read at each component's nodes (zero where the pass
    does not reach them)."""
    store = residual_pass(res, lay, srs, acc)
    groups: dict = {}
    for c, comp in enumerate(lay.components):
        groups.setdefault(comp.nodes, []).append(c)
    parts = [None] * len(lay.components)
    like = res.values[lay.target]
    for cs in groups.values():
        comps = [lay.components[c] for c in cs]
        got = _per_group(res, lay, comps, srs, store, al)
        for i, c in enumerate(cs):
            if got is None:
                parts[c] = [sr.zero((lay.positions,), like) for sr in srs]
            else:
                parts[c] = [tuple(f[i] for f in v) for v in got]
    return [tuple(torch.stack(f) for f in zip(*(p[s] for p in parts))) for s in range(len(srs))]


def _meeting(res, lay: Layout, srs, meeting) -> dict:
    """``{entry: (rows, [per semiring: the D of the destinations there])}`` from
    ``meeting`` (``[(row, {entry: [D per semiring]})]``): the destinations that share an
    entry stacked once as (positions, destinations, hidden), where a D has no dims of its
    own (else a list, one D per destination, met one at a time). Each destination's own D
    is let go as its entry is stacked."""
    by_entry: dict = {}
    for r, acc in meeting:
        for x, slot in acc.items():
            by_entry.setdefault(x, []).append((r, slot))
        acc.clear()
    out = {}
    for x in list(by_entry):
        group = by_entry.pop(x)
        dim = res.values[x].dim()
        per = []
        for s in range(len(srs)):
            ds = [slot[s] for _, slot in group]
            if all(f.dim() == dim for d in ds for f in d):
                ds = tuple(torch.stack(fs).reshape(len(group), lay.positions, -1)
                           .transpose(0, 1).contiguous() for fs in zip(*ds))  # fmt: skip
            per.append(ds)
        out[x] = ([r for r, _ in group], per)
    return out


def _meet(res, lay: Layout, srs, fwd, dests, total) -> list:
    """``total`` (per semiring, (destinations, components, positions)) with the values
    of the components ``fwd`` (``{entry: (components, [stacked value per semiring])}``)
    met with the destinations' D at each entry (``dests``, from :func:`_meeting`)
    ⊕-added in. The destinations that share an entry at once, as one contraction of
    values per semiring (``Semiring.contract``: the components' values at the entry
    against the destinations' D, over the hidden units, per position), ⊕-added into the
    rows of those destinations and components at once."""
    positions = lay.positions
    like = res.values[lay.target]
    for x, (idx, rows) in fwd.items():
        if x not in dests or not idx:
            continue
        rws, ds = dests[x]
        at = (torch.as_tensor(rws, device=like.device)[:, None],
              torch.as_tensor(idx, device=like.device)[None, :])  # fmt: skip
        dim = res.values[x].dim()
        for s, sr in enumerate(srs):
            if isinstance(ds[s], tuple) and all(f.dim() == 1 + dim for f in rows[s]):
                a = tuple(f.reshape(len(idx), positions, -1).transpose(0, 1) for f in rows[s])
                b = tuple(f.transpose(-2, -1) for f in ds[s])  # (positions, hidden, dests)
                m = sr.contract(a, b)  # (positions, components, destinations)
                part = tuple(f.permute(2, 1, 0) for f in m)  # (dests, components, positions)
            else:  # (fields with dims of their own: one destination at a time)
                each = [_edge_value(res, lay, sr, rows[s], x, d) for d in _each(ds[s], x, res)]
                part = tuple(torch.stack(fs) for fs in zip(*each))
            new = sr.plus(tuple(t[at] for t in total[s]), part)
            for t, f in zip(total[s], new):
                t[at] = f.to(t.dtype)
    return total


def _each(ds, x, res) -> list:
    """The D of each destination at ``x``: ``ds`` itself (a list) or unstacked."""
    if isinstance(ds, list):
        return ds
    shape = res.values[x].shape
    return [tuple(f[:, i].reshape(shape) for f in ds) for i in range(ds[0].shape[1])]


def _edge_value(res, lay: Layout, sr, rows, x, d):
    """(components, positions): ⊕ over the elements at each position of the components'
    values ``rows`` at ``x`` ⊗ the destination's D there."""
    shape = res.values[x].shape
    n = rows[0].shape[0]
    m = sr.mul(rows, tuple(f.expand(n, *f.shape) for f in d))
    flat = tuple(f.reshape(n, lay.positions, -1, *f.shape[1 + len(shape) :]) for f in m)
    return sr.sum(flat, (2,))


def _per_group(res, lay: Layout, comps, srs, store, al):
    """The value at each position of components on the same nodes (the heads of one
    block), stacked: per semiring a value of shape (components, positions, …): the ⊕
    over the component's elements of ``alpha ⊗`` the residual pass's value (taken once
    per node); None where no node was reached."""
    nodes = comps[0].nodes
    if not any(n in store for n in nodes):
        return None
    out = []
    for s, sr in enumerate(srs):
        totals = [None] * len(comps)
        for node in nodes:
            if node not in store:
                continue
            like = res.values[node]
            m = sr.mul(alpha_or_zero(res, al, node, sr), store[node][s])
            flat = tuple(f.reshape(lay.positions, -1, *f.shape[like.dim() :]) for f in m)
            for c, comp in enumerate(comps):
                per = sr.sum(tuple(f[:, comp.cols or slice(None)] for f in flat), (1,))
                totals[c] = per if totals[c] is None else sr.plus(totals[c], per)
        zero = None
        for c, t in enumerate(totals):  # a node reached by none of this group's passes
            if t is None:
                like = res.values[lay.target]
                zero = zero or sr.zero((lay.positions,), like)
                totals[c] = zero
        out.append(tuple(torch.stack(fs) for fs in zip(*totals)))
    return out


def _has_path_rows(sr, value) -> torch.Tensor:
    """:func:`_has_path` of a stacked value: (components, positions)."""
    zero = sr.zero(value[0].shape, value[0])
    f = value[0]
    return (f != zero[0]).reshape(f.shape[0], f.shape[1], -1).any(-1)


def circuit_edges(res, semirings=None, seed="structural", baseline=None, tokens=None,
                  heads=None, roles=None):  # fmt: skip
    """Tidy DataFrame, one row per edge between two components and position: ``src_layer``,
    ``src_role``, ``src_head_index``, ``dst_layer``, ``dst_role``, ``dst_head_index``,
    ``input``, ``position``, ``token`` and one value column per semiring (named by it).

    Components (``src_role`` / ``dst_role``): ``"embedding"`` (layer -1, a source only),
    ``"head"``, ``"mlp"`` and ``"target"`` (layer = the number of layers, a destination
    only), as in :func:`.nodes.circuit_nodes`. The value of ``u -> v`` at position ``p``
    is the ⊕ over the whole paths (source to output, with ``seed`` and ``baseline`` as in
    ``res.marginal``) that pass ``u`` at ``p``, then only the residual stream, then enter
    ``v`` through ``input``: ``"q"``, ``"k"``, ``"v"`` (the head's columns of that
    projection), ``"mlp"``, ``"target"``. Readouts as in ``circuit_nodes``: under Real
    the flow, under MaxProduct the signed best path (-inf where none), under Entropy the
    entropy of the paths, under TopK the best of the k. Under Real, the edges into one
    input of ``v`` sum to that input's marginal (every path into it has one last
    component).

    Rows: the edges some path takes, i.e. those where a semiring's value is not its zero
    (a Real sum can be 0 where paths exist; MaxProduct, PathCount and TopK see them).
    ``tokens``, ``heads``, ``roles``: as for ``circuit_nodes``.
    """

    srs = check_semirings(res, semirings)
    res = pinned(res)
    lay = layout(res, heads, roles)
    al = circuit_alphas(res, srs, seed, baseline, lay)
    labels = site_labels(tokens, lay.positions)
    rows: list = []
    dests = list(destinations(res, lay, srs))
    # (each region refuses a residual stream that enters a component)
    regions = [residual_region(res, lay, acc) for _, _, acc in dests]
    forward = [all(_by_position(res, lay, x) for x in acc) for _, _, acc in dests]
    reached = {x for (_, _, acc), f in zip(dests, forward) if f for x in acc}
    between = set().union(*(r for r, f in zip(regions, forward) if f))
    row = {i: r for r, i in enumerate(i for i, f in enumerate(forward) if f)}
    like = res.values[lay.target]
    met = [tuple(sr.zero((len(row), len(lay.components), lay.positions), like)) for sr in srs]
    meeting = _meeting(res, lay, srs, [(row[i], d[2]) for i, d in enumerate(dests) if forward[i]])
    for part in source_passes(res, lay, srs, al, reached, between):
        met = _meet(res, lay, srs, part, meeting, met)
    comps = lay.components
    for i, ((dst, inp, acc), f) in enumerate(zip(dests, forward)):
        if f:
            values = [tuple(t[row[i]] for t in met[s]) for s in range(len(srs))]
        else:  # an entry without positions (the output): a pass back from it
            values = _backward_edge_values(res, lay, srs, acc, al)
        has = torch.stack([_has_path_rows(sr, v) for sr, v in zip(srs, values)]).any(0)
        c, p = (t.cpu().numpy() for t in has.nonzero(as_tuple=True))
        if len(c):
            read = [readout(sr, v).detach().cpu().double().numpy()[c, p]
                    for sr, v in zip(srs, values)]  # fmt: skip
            rows.append((c, p, dst, inp, read))
    return _frame(rows, comps, labels, srs)


def _frame(rows, comps, labels, srs):
    """One DataFrame of the edges found per destination (``rows``: per destination, the
    components' indices, positions, the destination, its input and the values per
    semiring), built once (a frame per destination cost more than the edges' ⊕)."""
    import numpy as np
    import pandas as pd

    columns = [*EDGE_COLUMNS, *(sr.name for sr in srs)]
    if not rows:
        frame = pd.DataFrame({c: pd.Series(dtype="object") for c in columns})
        for col in ("src_layer", "src_head_index", "dst_layer", "dst_head_index", "position"):
            frame[col] = frame[col].astype("Int64")
        return frame
    c = np.concatenate([r[0] for r in rows])
    p = np.concatenate([r[1] for r in rows])
    count = [len(r[0]) for r in rows]

    at_dst = np.repeat(np.arange(len(rows)), count)

    def ints(a):
        return pd.array(a, dtype="Int64")

    src_layer = np.array([x.layer for x in comps], dtype=np.int64)[c]
    src_head = pd.array([x.head for x in comps], dtype="Int64")[c]
    cols = {
        "src_layer": ints(src_layer),
        "src_role": text_column((x.role for x in comps), c),
        "src_head_index": src_head,
        "dst_layer": ints(np.repeat([r[2].layer for r in rows], count)),
        "dst_role": text_column((r[2].role for r in rows), at_dst),
        "dst_head_index": pd.array([r[2].head for r in rows], dtype="Int64").take(at_dst),
        "input": text_column((r[3] for r in rows), at_dst),
        "position": ints(p),
        "token": text_column(labels, p),
    }
    for s, sr in enumerate(srs):
        cols[sr.name] = np.concatenate([r[4][s] for r in rows])
    return pd.DataFrame(cols, copy=False)[columns]  # (its own arrays: not copied)
