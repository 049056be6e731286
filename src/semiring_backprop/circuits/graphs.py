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
from . import sites
from .exports import as_int, read_sites, site_id


def graph_nodes(circuit):
    """``(site id, attributes)`` of every row of ``circuit.nodes`` (``read`` False) and
    of every :func:`read_sites` site (``read`` True, its values NaN); ``token`` as people
    read it (`` Mary``), ``token_raw`` as the tokenizer wrote it (``ĠMary``)."""
    names = circuit.names
    raw = circuit.token_list
    shown = readable_tokens(raw)
    for row in circuit.nodes.to_dict("records"):
        attrs = {k: row[k] for k in ("role", "layer", "head_index", "position", "token")}
        attrs = {k: (as_int(v) if k in ("layer", "head_index", "position") else v)
                 for k, v in attrs.items()}  # fmt: skip
        _tokens(attrs, raw, shown)
        attrs.update({n: float(row[n]) for n in names}, read=False)
        yield site_id(row["role"], row["layer"], row["head_index"], row["position"]), attrs
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
    attributes), an edge per row of ``circuit.edges`` and ``circuit.attention_edges``.
    (A graph of millions of edges takes seconds: networkx holds a dict per edge.)"""
    try:
        import networkx as nx
    except ImportError:
        raise InputError("Circuit.to_networkx needs networkx: pip install networkx") from None
    g = nx.MultiDiGraph(semirings=list(circuit.names), tokens=readable_tokens(circuit.token_list),
                        tokens_raw=list(circuit.token_list))  # fmt: skip
    for node, attrs in graph_nodes(circuit):
        g.add_node(node, **attrs)
    e = sites.edge_arrays(circuit)
    edges = _edge_tuples(e, sites.site_names(e.src), sites.site_names(e.dst))
    for at in sites.chunks(len(e), "networkx edges", 2**16):
        g.add_edges_from(itertools.islice(edges, at.stop - at.start))
    return g


def _q(s) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(circuit, semiring=None) -> str:
    """Graphviz DOT: a box per site (filled by its value under ``semiring``: red
    positive, blue negative; its token as people read it), an edge per edge row (pen
    width by |value|), layers as ranks from the embeddings (bottom) to the target (top);
    residual sites left out."""
    from ..views.colors import Scale

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
        ranks.setdefault(a["layer"], []).append(name)
        what = name if a["role"] == "target" else f"{name}\\n{_label(a['token'])}"
        if a["read"]:  # a kept head reads here; its value belongs to where it writes
            out.append(f'  {_q(name)} [label="{what}\\nread", style=dashed];')
            continue
        out.append(
            f'  {_q(name)} [label="{what}\\n{a[col]:.3g}", fillcolor="{scale.color(a[col])}"];'
        )
    for layer in sorted(ranks, key=lambda x: -2 if x is None else x):
        out.append("  { rank=same; " + "; ".join(_q(n) for n in ranks[layer]) + "; }")
    out += _dot_edges(sites.edge_arrays(circuit), col)
    out.append("}")
    return "\n".join(out) + "\n"


def _label(token) -> str:
    """A token inside a DOT label (quotes and backslashes escaped)."""
    return str(token).replace("\\", "\\\\").replace('"', '\\"')


def _dot_edges(e, col) -> list[str]:
    """The DOT line of each edge. Only its ends differ from edge to edge; the rest (key,
    pen width to hundredths, colour, style) is one of a few thousand endings, each
    written once."""
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
        f"[label={_q(k)}, penwidth={w / 100:.2f}, color=\"{c}\"{', style=dashed' * a}];"
        for k in e.keys for w in range(401) for c in colors for a in (0, 1)
    ] or [""], dtype=object)  # fmt: skip
    ends = sites.site_names(np.concatenate([e.src, e.dst]), lambda c: _q(sites.name_of(c)))
    n = len(e)
    src, dst, endings = ends[:n], ends[n:], endings[code]
    lines = []
    for at in sites.chunks(n, "DOT edges"):
        lines += [f"  {s} -> {d} {t}" for s, d, t in zip(src[at].tolist(), dst[at].tolist(),
                                                         endings[at].tolist())]  # fmt: skip
    return lines
