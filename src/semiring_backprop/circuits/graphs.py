"""A circuit as a networkx ``MultiDiGraph`` and as Graphviz DOT text, one node per site
(named as :mod:`.exports` names them) and one edge per row of ``Circuit.edges`` and
``Circuit.attention_edges``; tokens as people read them (`` Mary``), the raw token
kept in networkx's ``token_raw``."""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..errors import InputError
from ..tokens import readable_tokens
from . import bulk, sites
from .exports import as_ints, read_sites


def graph_nodes(circuit):
    """``(site id, attributes)`` of every row of ``circuit.nodes`` (``read`` False) and
    of every :func:`read_sites` site (``read`` True, its values NaN); ``token`` as people
    read it (`` Mary``), ``token_raw`` as the tokenizer wrote it (``ĠMary``)."""
    names = circuit.names
    raw = circuit.token_list
    shown = readable_tokens(raw)
    nodes = circuit.nodes
    ids = sites.site_names(sites.node_codes(nodes)).tolist()
    ints = [as_ints(nodes[k]) for k in ("layer", "head_index", "position")]
    values = [sites.floats(nodes[n]).tolist() for n in names]
    for sid, role, layer, head, p, token, *vals in zip(
        ids, nodes["role"].tolist(), *ints, nodes["token"].tolist(), *values
    ):
        attrs = {"role": role, "layer": layer, "head_index": head, "position": p, "token": token}
        _tokens(attrs, raw, shown)
        attrs.update(zip(names, vals), read=False)
        yield sid, attrs
    for site in read_sites(circuit):
        attrs = {k: site[k] for k in ("role", "layer", "head_index", "position", "token")}
        _tokens(attrs, raw, shown)
        attrs.update({n: math.nan for n in names}, read=True, read_by=site["read_by"])
        yield site["id"], attrs


def _tokens(attrs, raw, shown) -> None:
    p = attrs["position"]
    if p is not None and 0 <= p < len(raw) and str(attrs["token"]) in (raw[p], shown[p]):
        attrs["token"], attrs["token_raw"] = shown[p], raw[p]
    else:
        attrs["token_raw"] = attrs["token"]


def graph_edges(circuit):
    """``(source id, destination id, key, attributes)`` of every row of ``circuit.edges``
    (key: the input entered, q, k, v, mlp or target) and of
    ``circuit.attention_edges`` (key ``attention``)."""
    e = sites.edge_arrays(circuit)
    yield from _edge_tuples(e, sites.site_names(e.src), sites.site_names(e.dst))


def _edge_tuples(e, src, dst):
    n, names = e.n_residual, e.names
    values = [e.value(name) for name in names]
    keys = e.key[:n].tolist()
    cols = ("kind", "input", "position", *names)
    rows = zip(itertools.repeat("residual"), keys, e.position[:n].tolist(),
               *(v[:n].tolist() for v in values))  # fmt: skip
    for s, d, k, row in zip(src[:n].tolist(), dst[:n].tolist(), keys, rows):
        yield s, d, k, dict(zip(cols, row))
    cols = ("kind", "input", "src_position", "dst_position", *names)
    rows = zip(itertools.repeat("attention"), itertools.repeat("attention"),
               e.src_position[n:].tolist(), e.dst_position[n:].tolist(),
               *(v[n:].tolist() for v in values))  # fmt: skip
    for s, d, row in zip(src[n:].tolist(), dst[n:].tolist(), rows):
        yield s, d, "attention", dict(zip(cols, row))


def to_networkx(circuit):
    """A ``networkx.MultiDiGraph``: a node per row of ``circuit.nodes`` (its columns as
    attributes), an edge per row of ``circuit.edges`` and ``circuit.attention_edges``
    (:func:`graph_edges`, the same graph as ``add_edges_from`` of them makes)."""
    try:
        import networkx as nx
    except ImportError:
        raise InputError("Circuit.to_networkx needs networkx: pip install networkx") from None
    g = nx.MultiDiGraph(semirings=list(circuit.names), tokens=readable_tokens(circuit.token_list),
                        tokens_raw=list(circuit.token_list))  # fmt: skip
    nodes = list(graph_nodes(circuit))
    for node, attrs in nodes:
        g.add_node(node, **attrs)
    cols = [[a[k] for _, a in nodes] for k in ("role", "layer", "head_index", "position")]
    codes = sites.site_codes(np.array(cols[0], dtype=object), *cols[1:])
    _add_edges(g, sites.edge_arrays(circuit), codes, [name for name, _ in nodes])
    return g


def _add_edges(g, e, codes, names: list) -> None:
    """Add every edge of ``e`` to ``g`` (whose nodes are ``names``, of site ``codes``) as
    ``g.add_edges_from`` of :func:`graph_edges` does (nodes new to ``g`` in the order
    met, neighbours and keys in the order of their first edge, the same attribute
    dicts), filling the adjacency dicts directly: ``add_edge`` takes microseconds an
    edge, seconds for a circuit of millions. A networkx ``MultiDiGraph`` holds an edge
    as ``g._succ[u][v][key]`` (its attributes), the key dict shared with
    ``g._pred[v][u]`` (the layout networkx's class docs state under "Subclasses
    (Advanced)"). Where an edge repeats (one source, destination and key twice: no
    circuit's frames have it) networkx's own ``add_edges_from`` adds them."""
    n = len(e)
    if not n:
        return
    rows, run = bulk.runs(e.src, e.dst)  # (ends found once a run: a third of the rows)
    names, u, v = _ends(g, e.src[rows], e.dst[rows], codes, names)
    m = len(names)
    pair, first = bulk.factorize(u * m + v)
    pair = pair[run]
    keys = e.key
    with bulk.gc_paused():
        keydicts = [{} for _ in range(len(first))]
        of_edge = np.fromiter(keydicts, dtype=object, count=len(keydicts))[pair]
        for at in sites.chunks(n, "networkx edges"):
            _store_attributes(e, of_edge[at].tolist(), keys, at)
        if sum(map(len, keydicts)) != n:  # a repeated edge updates its first's attributes
            g.add_edges_from(_edge_tuples(e, names[u][run], names[v][run]))
            return
        succ, pred = g._succ, g._pred  # (pairs in order: each key dict touched once)
        for u, v, kd in zip(names[first // m].tolist(), names[first % m].tolist(), keydicts):
            succ[u][v] = kd
            pred[v][u] = kd


def _ends(g, src, dst, codes, names: list):
    """``(names, u, v)``: the index in ``names`` (an object array) of each source and
    destination (site codes ``src`` and ``dst`` of the edges in order), the graph's nodes
    found by their ``codes``; the ends that are none of them added to ``g`` and ``names``
    in the order ``add_edge`` meets them."""
    import pandas as pd

    found_u, u = sites.lookup(src, codes)
    found_v, v = sites.lookup(dst, codes)
    if not (found_u.all() and found_v.all()):
        ends = np.empty(2 * len(src), dtype=np.int64)
        ends[0::2], ends[1::2] = src, dst
        found = np.empty(2 * len(src), dtype=bool)
        found[0::2], found[1::2] = found_u, found_v
        new = pd.unique(ends[~found])
        added = [sites.name_of(c) for c in new.tolist()]
        for name in added:
            g.add_node(name)
        names = [*names, *added]
        codes = np.concatenate([codes, new])
        u, v = sites.lookup(src, codes)[1], sites.lookup(dst, codes)[1]
    return np.array(names, dtype=object), u, v


def _store_attributes(e, targets: list, keys, at: slice) -> None:
    """``targets[i][key] = attributes`` of the edges ``at`` (``keys``: every edge's
    key), the attributes of :func:`graph_edges`."""
    n = e.n_residual
    res = slice(min(at.start, n), min(at.stop, n))
    att = slice(max(at.start, n), max(at.stop, n))
    split = res.stop - res.start
    values = {name: e.value(name) for name in e.names}
    inputs = keys[res].tolist()
    bulk.store_records(targets[:split], inputs, {
        "kind": "residual", "input": inputs, "position": e.position[res].tolist(),
        **{name: v[res].tolist() for name, v in values.items()}})  # fmt: skip
    bulk.store_records(targets[split:], keys[att].tolist(), {
        "kind": "attention", "input": "attention", "src_position": e.src_position[att].tolist(),
        "dst_position": e.dst_position[att].tolist(),
        **{name: v[att].tolist() for name, v in values.items()}})  # fmt: skip


def _q(s) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(circuit, semiring=None) -> str:
    """Graphviz DOT: a box per site (filled by its value under ``semiring``: red
    positive, blue negative; its token as people read it), an edge per edge row (pen
    width by |value|), layers as ranks from the embeddings (bottom) to the target (top);
    residual sites left out."""
    from ..views.colors import Scale  # (one colour scale, the views')

    col = circuit.column(semiring)
    rows = [(n, a) for n, a in graph_nodes(circuit) if a["role"] != "residual"]
    scale = Scale([a[col] for _, a in rows if not a["read"]], signed=True)
    out = [
        "digraph circuit {",
        "  rankdir=BT;",
        '  node [shape=box, style=filled, fontname="Helvetica"];',
    ]
    ranks: dict = {}
    for name, a in rows:
        quoted = _q(name)
        ranks.setdefault(a["layer"], []).append(quoted)
        what = name if a["role"] == "target" else f"{name}\\n{_label(a['token'])}"
        if a["read"]:  # a kept head reads here; its value belongs to where it writes
            out.append(f'  {quoted} [label="{what}\\nread", style=dashed];')
            continue
        out.append(
            f'  {quoted} [label="{what}\\n{a[col]:.3g}", fillcolor="{scale.color(a[col])}"];'
        )
    for layer in sorted(ranks, key=lambda x: -2 if x is None else x):
        out.append("  { rank=same; " + "; ".join(ranks[layer]) + "; }")
    pieces = ["\n".join(out) + "\n"]
    _dot_edges(pieces, sites.edge_arrays(circuit), col)
    pieces.append("}\n")
    return "".join(pieces)


def _label(token) -> str:
    """A token inside a DOT label (quotes and backslashes escaped)."""
    return str(token).replace("\\", "\\\\").replace('"', '\\"')


def _dot_edges(pieces: list, e, col) -> None:
    """The DOT lines of the edges, appended to ``pieces`` as pieces to join. Only a
    line's ends differ from edge to edge; the rest (key, pen width to hundredths,
    colour, style) is one of a few thousand endings, each written once, and each site's
    name is quoted once."""
    v = e.value(col)
    finite = np.isfinite(v)
    top = float(np.abs(v[finite]).max()) if finite.any() else 0.0
    top = top or 1.0
    width = np.where(finite, 0.3 + 3.7 * np.abs(np.where(finite, v, 0)) / top, 0.3)
    scaled = width * 100
    pen = np.clip(np.rint(scaled), 0, 400).astype(np.int64)
    # where the product with 100 lies too near a half to round alike: as f"{w:.2f}" does
    near = np.flatnonzero(np.abs(scaled - np.floor(scaled) - 0.5) < 1e-6)
    pen[near] = [round(float(f"{w:.2f}") * 100) for w in width[near].tolist()]
    with np.errstate(invalid="ignore"):
        color = np.where(v > 0, 0, np.where(v < 0, 1, 2))
    code = ((e.entry * 401 + pen) * 3 + color) * 2 + e.attention
    colors = ("#B2182B", "#2166AC", "#999999")
    endings = np.array([
        f"[label={k}, penwidth={w / 100:.2f}, color=\"{c}\"{', style=dashed' * a}];\n"
        for k in map(_q, e.keys) for w in range(401) for c in colors for a in (0, 1)
    ] or [""], dtype=object)[code]  # fmt: skip
    n = len(e)
    at, codes = bulk.factorize(np.concatenate([e.src, e.dst]))
    quoted = [_q(sites.name_of(c)) for c in codes.tolist()]
    heads = np.array([f"  {q} -> " for q in quoted] or [""], dtype=object)
    tails = np.array([f"{q} " for q in quoted] or [""], dtype=object)
    src, dst = at[:n], at[n:]
    for at in sites.chunks(n, "DOT edges"):
        pieces += bulk.interleaved(heads[src[at]], tails[dst[at]], endings[at])
