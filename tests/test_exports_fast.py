"""networkx, DOT and circuit-tracer exports built in bulk (``circuits/bulk.py``) equal
the same exports built row by row, here, the way ``add_node``/``add_edge``, one f-string
per line and ``json.dumps`` of one dict per link make them: the same graph (node order,
neighbour and key order, attribute order, the key dict shared between successors and
predecessors), the same DOT text, the same JSON file. Circuits: whole and pruned, tied
values, padding, one and three semirings, an edge whose ends are no nodes, a repeated
edge (its later row updates the first's attributes) and none at all.
"""

from __future__ import annotations

import gc
import json
import math

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

from semiring_backprop.circuits import Circuit, bulk, exports  # noqa: E402
from semiring_backprop.tokens import readable_tokens  # noqa: E402
from semiring_backprop.views.colors import Scale  # noqa: E402
from test_circuit import MP, hand_built  # noqa: E402
from test_exports_speed import CASES, _oplus, _rows, _site  # noqa: E402


def _one_semiring():
    c = hand_built(seed=11)
    drop = [MP]
    return Circuit(c.nodes.drop(columns=drop), c.edges.drop(columns=drop),
                   c.attention_edges.drop(columns=drop), ["Real"], c.tokens)  # fmt: skip


def _three_semirings():
    c = hand_built(seed=12)
    frames = [f.assign(LogAbs=np.log(np.abs(f["Real"]))) for f in
              (c.nodes, c.edges, c.attention_edges)]  # fmt: skip
    return Circuit(*frames, ["Real", MP, "LogAbs"], c.tokens).prune(top_n=5)


def _ends_no_nodes():
    """Edges into sites that have no row of ``nodes`` (an MLP of layer 1, the target)."""
    c = hand_built(seed=13)
    gone = (c.nodes.role == "target") | ((c.nodes.role == "mlp") & (c.nodes.layer == 1))
    return Circuit(c.nodes[~gone].reset_index(drop=True), c.edges, c.attention_edges,
                   ["Real", MP], c.tokens)  # fmt: skip


def _repeated_edge():
    """Rows 4 and 9 of the edges again, with other values; an attention edge again; and
    a row of edges that joins the same sites with the same key as an attention edge
    (head 0.0 at position 1 into itself, entering "attention"): networkx updates the
    first row's attributes with the later's, keys of both kinds."""
    c = hand_built(seed=14)
    again = c.edges.iloc[[4, 9]].assign(Real=[7.0, -8.0], **{MP: [0.5, -math.inf]})
    into_itself = c.edges.iloc[[0]].assign(src_layer=0, src_role="head", src_head_index=0,
                                           dst_layer=0, dst_role="head", dst_head_index=0,
                                           input="attention", position=1)  # fmt: skip
    edges = pd.concat([c.edges, again, into_itself], ignore_index=True)
    for col in ("src_layer", "src_head_index", "dst_layer", "dst_head_index", "position"):
        edges[col] = edges[col].astype("Int64")
    att = c.attention_edges
    att = pd.concat([att, att.iloc[[2]].assign(Real=3.0)], ignore_index=True)
    return Circuit(c.nodes, edges, att, ["Real", MP], c.tokens)


def _no_edges():
    c = hand_built(seed=15)
    return Circuit(c.nodes, None, None, ["Real", MP], c.tokens)


MORE = {
    "one semiring": _one_semiring,
    "three semirings, pruned": _three_semirings,
    "edges whose ends are no nodes": _ends_no_nodes,
    "a repeated edge": _repeated_edge,
    "no edges": _no_edges,
}


@pytest.fixture(params=[*CASES, *MORE], scope="module")
def circuit(request):
    return {**CASES, **MORE}[request.param]()


# -- references, row by row -----------------------------------------------------------


def _int(x):
    return None if x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x)) else int(x)


def _ref_nodes(circuit):
    """(site, attributes) of each row of nodes, then of each read site."""
    raw = circuit.token_list
    shown = readable_tokens(raw)

    def tokens(a):
        p = a["position"]
        if p is not None and 0 <= p < len(raw) and str(a["token"]) in (raw[p], shown[p]):
            a["token"], a["token_raw"] = shown[p], raw[p]
        else:
            a["token_raw"] = a["token"]

    out = []
    for r in circuit.nodes.to_dict("records"):
        a = {"role": r["role"], "layer": _int(r["layer"]), "head_index": _int(r["head_index"]),
             "position": _int(r["position"]), "token": r["token"]}  # fmt: skip
        tokens(a)
        a.update({n: float(r[n]) for n in circuit.names}, read=False)
        out.append((_site(r["role"], r["layer"], r["head_index"], r["position"]), a))
    for s in circuit.read_sites():
        a = {k: s[k] for k in ("role", "layer", "head_index", "position", "token")}
        tokens(a)
        a.update({n: math.nan for n in circuit.names}, read=True, read_by=s["read_by"])
        out.append((s["id"], a))
    return out


def _ref_networkx(circuit):
    nx = pytest.importorskip("networkx")
    g = nx.MultiDiGraph(semirings=list(circuit.names),
                        tokens=readable_tokens(circuit.token_list),
                        tokens_raw=list(circuit.token_list))  # fmt: skip
    for name, attrs in _ref_nodes(circuit):
        g.add_node(name, **attrs)
    for s, d, key, r in _rows(circuit):
        values = {n: float(r[n]) for n in circuit.names}
        if "src_position" in r:  # an attention edge
            attrs = {"kind": "attention", "input": "attention",
                     "src_position": int(r["src_position"]),
                     "dst_position": int(r["dst_position"]), **values}  # fmt: skip
        else:
            attrs = {"kind": "residual", "input": key, "position": int(r["position"]), **values}
        g.add_edge(s, d, key=key, **attrs)
    return g


def _q(s):
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _ref_dot(circuit, col):
    rows = [(n, a) for n, a in _ref_nodes(circuit) if a["role"] != "residual"]
    scale = Scale([a[col] for _, a in rows if not a["read"]], signed=True)
    out = ["digraph circuit {", "  rankdir=BT;",
           '  node [shape=box, style=filled, fontname="Helvetica"];']  # fmt: skip
    ranks: dict = {}
    for name, a in rows:
        ranks.setdefault(a["layer"], []).append(name)
        token = str(a["token"]).replace("\\", "\\\\").replace('"', '\\"')
        what = name if a["role"] == "target" else f"{name}\\n{token}"
        if a["read"]:
            out.append(f'  {_q(name)} [label="{what}\\nread", style=dashed];')
        else:
            out.append(f'  {_q(name)} [label="{what}\\n{a[col]:.3g}", '
                       f'fillcolor="{scale.color(a[col])}"];')  # fmt: skip
    for layer in sorted(ranks, key=lambda x: -2 if x is None else x):
        out.append("  { rank=same; " + "; ".join(_q(n) for n in ranks[layer]) + "; }")
    rows = _rows(circuit)
    values = [float(r[col]) for *_, r in rows]
    top = max((abs(v) for v in values if math.isfinite(v)), default=0.0) or 1.0
    for (s, d, key, r), v in zip(rows, values):
        width = 0.3 + 3.7 * abs(v) / top if math.isfinite(v) else 0.3
        color = "#B2182B" if v > 0 else "#2166AC" if v < 0 else "#999999"
        dashed = ", style=dashed" if "src_position" in r else ""  # an attention edge
        out.append(f'  {_q(s)} -> {_q(d)} [label={_q(key)}, penwidth={width:.2f}, '
                   f'color="{color}"{dashed}];')  # fmt: skip
    out.append("}")
    return "\n".join(out) + "\n"


def _ref_neuronpedia_links(circuit, graph, col):
    """The links of ``graph``'s nodes, row by row: the ⊕ over the rows joining two of
    its nodes (a head's own position left out), in the order of their first row."""
    node_of = {}
    for n in graph["nodes"]:
        kind, p = n["feature_type"], n["ctx_idx"]
        site = {"embedding": f"input@{p}", "logit": "logits", "mlp": f"m{n['layer']}@{p}"}
        node_of[site.get(kind, f"a{n['layer']}.h{n['feature']}@{p}")] = n["node_id"]
    weights: dict = {}
    for s, d, _, r in _rows(circuit):
        if s in node_of and d in node_of and s != d:
            weights.setdefault((node_of[s], node_of[d]), []).append(float(r[col]))
    links = [{"source": s, "target": t, "weight": _in_order(col, v)} for (s, t), v in
             weights.items()]  # fmt: skip
    return [x for x in links if math.isfinite(x["weight"])]


def _in_order(col, values):
    """⊕ of ``values`` (NaN left out); Real summed left to right, as the export does."""
    if col != "Real":
        return _oplus(col, values)
    total = 0.0
    for v in values:
        if not math.isnan(v):
            total += v
    return total


# -- the exports against them ---------------------------------------------------------


def _same_adjacency(a, b):
    """Equal dicts of dicts of ..., in the same order at every level (NaN equal NaN)."""
    assert repr(a) == repr(b)


def test_networkx_is_the_graph_add_edge_builds(circuit):
    g, want = circuit.to_networkx(), _ref_networkx(circuit)
    assert g.graph == want.graph
    assert repr(list(g.nodes(data=True))) == repr(list(want.nodes(data=True)))
    _same_adjacency(g._succ, want._succ)
    _same_adjacency(g._pred, want._pred)
    for u, nbrs in g._succ.items():
        for v, keydict in nbrs.items():
            assert g._pred[v][u] is keydict  # one key dict, as add_edge shares it
    assert g.number_of_edges() == want.number_of_edges()
    # a graph made so is an ordinary one: it grows and reads as networkx's
    g.add_edge("input@0", "logits", key="extra", Real=1.0)
    want.add_edge("input@0", "logits", key="extra", Real=1.0)
    assert repr(list(g.edges(keys=True, data=True))) == repr(
        list(want.edges(keys=True, data=True)))  # fmt: skip
    assert sorted(g.in_degree()) == sorted(want.in_degree())


def test_dot_is_the_text_written_line_by_line(circuit):
    for col in circuit.names:
        assert circuit.to_dot(col) == _ref_dot(circuit, col)


def test_neuronpedia_file_is_json_of_the_graph_built_row_by_row(circuit, tmp_path):
    for col in circuit.names:
        if col == "LogAbs":
            continue
        graph = circuit.to_neuronpedia(tmp_path / "g.json", semiring=col, slug="s")
        shape = exports._shape(circuit)
        rows = circuit.nodes[circuit.nodes.role != "residual"].to_dict("records")
        nodes = [exports._np_node(shape, r, col) for r in rows]
        assert graph["nodes"][: len(nodes)] == nodes
        links = _ref_neuronpedia_links(circuit, graph, col)
        assert graph["links"] == links
        text = (tmp_path / "g.json").read_text()
        assert text == json.dumps({**graph, "links": links}, allow_nan=False)
        assert exports.neuronpedia_graph(circuit, col, slug="s") == graph


# -- the pieces -----------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {}, {"a": "x"}, {"a": [1, 2, 3]}, {"k": "r", "i": ["q", "k", "q"], "p": [0, 1, 2]},
    {"a": [1.0, 2.0, 3.0], "b": "c", "c": [None, "x", math.nan], "d": "e", "e": [4, 5, 6]},
])  # fmt: skip
def test_store_records_is_the_plain_loop(fields):
    keys = ["q", "k", "q"]
    got = [{}, {}, {"v": 0}]
    targets = [got[0], got[1], got[0]]
    bulk.store_records(targets, keys, fields)
    want = [{}, {}, {"v": 0}]
    for i, (t, k) in enumerate(zip([want[0], want[1], want[0]], keys)):
        t[k] = {n: v if isinstance(v, str) else v[i] for n, v in fields.items()}
    assert repr(got) == repr(want)


def test_interleaved_and_gc_paused():
    a = np.array(["a", "b"], dtype=object)
    assert "".join(bulk.interleaved(a, "-", ["1", "2"], "\n")) == "a-1\nb-2\n"
    assert bulk.interleaved(np.array([], dtype=object), "-") == []
    was = gc.isenabled()
    try:
        for start in (True, False):
            (gc.enable if start else gc.disable)()
            with bulk.gc_paused():
                assert not gc.isenabled()
            assert gc.isenabled() == start
            with pytest.raises(KeyError), bulk.gc_paused():
                raise KeyError
            assert gc.isenabled() == start
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("n", [0, 1, 2, 7, 500])
def test_factorize_is_pandas_factorize(n):
    rng = np.random.default_rng(n)
    for values in (rng.integers(0, 5, n), np.repeat(rng.integers(-3, 9, n), 3)[:n],
                   np.arange(n)[::-1] * 2**40):  # fmt: skip
        codes, uniques = bulk.factorize(values)
        want_codes, want_uniques = pd.factorize(values)
        assert codes.tolist() == want_codes.tolist()
        assert uniques.tolist() == want_uniques.tolist()
