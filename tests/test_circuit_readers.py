"""The circuit's files read by the real readers, where they are installed.

- EAP-IG (the ``eap`` package of github.com/hannamw/EAP-IG; not on the package index,
  whose ``eap`` is another project; install it from its repository with
  ``transformer-lens<3``): ``Graph.from_json``, which the MIB circuit track's
  ``load_graph_from_json`` repeats line for line, loads ``Circuit.to_eap_json``'s file;
  every node's and edge's score and ``in_graph`` as loaded equal the frames' sums over
  positions (computed here with pandas), and EAP-IG's own ``prune`` (drop nodes without
  edges in and out, edges without both ends) changes nothing in a pruned circuit.
- circuit-tracer (``pip install circuit-tracer``): its pydantic ``Model`` of an
  attribution graph validates ``Circuit.to_neuronpedia``'s file and dumps it back
  unchanged (no field it drops or adds); its ``add_graph_metadata`` writes the same
  ``graph-metadata.json``. Its viewer's ``formatData`` (``util-cg.js``) runs on the file
  under node where node and d3 v7 with d3-jetpack (``npm install d3-jetpack``; the
  viewer loads the same from a CDN) are found.
- Always: what that ``formatData`` reads of each node, restated (a logit's label is
  ``Output "TOKEN" (p=P)``, which it splits; ids unique; links between listed nodes).

The circuits: the hand-built one of ``tests/test_circuit.py`` (two layers, two heads,
three positions, signed values, MaxProduct sites of no path) and the circuit of a
one-layer ``nn.TransformerEncoderLayer`` model (``tests/test_circuit_mha.py``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")

from test_circuit import MP, hand_built  # noqa: E402


@pytest.fixture(scope="module")
def hb():
    return hand_built()


@pytest.fixture(scope="module")
def mha():
    import test_circuit_mha

    return test_circuit_mha.built("post1", "x")[0]


def _na(x):
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def _name(role, layer, head):
    if role == "embedding":
        return "input"
    if role == "target":
        return "logits"
    return f"m{int(layer)}" if role == "mlp" else f"a{int(layer)}.h{int(head)}"


def _frame_sums(c, col):
    """``(nodes, edges)``: ``{EAP-IG name: the column summed over positions}``."""
    nodes, edges = {}, {}
    for r in c.nodes.to_dict("records"):
        if r["role"] != "residual":
            n = _name(r["role"], r["layer"], None if _na(r["head_index"]) else r["head_index"])
            nodes[n] = nodes.get(n, 0.0) + r[col]
    for r in c.edges.to_dict("records"):
        n = (f"{_name(r['src_role'], r['src_layer'], r['src_head_index'])}->"
             f"{_name(r['dst_role'], r['dst_layer'], r['dst_head_index'])}")  # fmt: skip
        n += f"<{r['input']}>" if r["dst_role"] == "head" else ""
        edges[n] = edges.get(n, 0.0) + r[col]
    return nodes, edges


# -- EAP-IG / MIB -----------------------------------------------------------------------


def _eap_load(c, tmp_path, **kw):
    graph = pytest.importorskip("eap.graph")
    file = tmp_path / "graph.json"
    c.to_eap_json(file, **kw)
    return graph.Graph.from_json(str(file)), json.loads(file.read_text())


@pytest.mark.parametrize("which", ["hb", "mha"])
def test_eap_ig_reads_the_whole_circuit(which, request, tmp_path):
    pytest.importorskip("eap.graph")  # before the circuit is built
    c = request.getfixturevalue(which)
    g, _ = _eap_load(c, tmp_path)
    assert (g.cfg["n_layers"], g.cfg["n_heads"], g.cfg["d_model"]) == (c.n_layers, c.n_heads,
                                                                       c.d_model)  # fmt: skip
    assert g.cfg["parallel_attn_mlp"] is False
    nodes, edges = _frame_sums(c, "Real")
    assert set(g.edges) == set(edges)  # the complete graph: every edge has rows
    for name, node in g.nodes.items():
        if name != "logits":
            assert math.isclose(float(node.score), nodes[name], rel_tol=1e-6, abs_tol=1e-6), name
            assert bool(node.in_graph), name
    for name, edge in g.edges.items():
        assert math.isclose(float(edge.score), edges[name], rel_tol=1e-6, abs_tol=1e-6), name
        assert bool(edge.in_graph), name
    assert g.count_included_edges() == len(edges)


def test_eap_ig_reads_a_pruned_circuit(hb, tmp_path):
    small = hb.prune(top_n=3)
    g, d = _eap_load(small, tmp_path, semiring=MP)
    kept = {_name(r["role"], r["layer"], None if _na(r["head_index"]) else r["head_index"])
            for r in small.nodes.to_dict("records") if r["role"] in ("head", "mlp")}  # fmt: skip
    assert {n for n, node in g.nodes.items() if node.in_graph} == kept | {"input", "logits"}
    _, in_circuit = _frame_sums(small, MP)
    assert {n for n, e in g.edges.items() if e.in_graph} == set(in_circuit)
    # scores: the whole circuit's, ⊕ over positions (MaxProduct: the value of largest size;
    # no path, -inf, written as 0)
    for name, edge in g.edges.items():
        rows = [r for r in hb.edges.to_dict("records") if _edge(r) == name]
        finite = [r[MP] for r in rows if math.isfinite(r[MP])]
        want = max(finite, key=abs) if finite else 0.0
        assert math.isclose(float(edge.score), want, rel_tol=1e-6, abs_tol=1e-6), name
    assert d["cfg"]["semiring"] == MP
    nodes, edges = g.nodes_in_graph.clone(), g.in_graph.clone()
    g.prune()  # EAP-IG's own connectivity rule
    assert bool((g.nodes_in_graph == nodes).all()) and bool((g.in_graph == edges).all())


def _edge(r):
    n = (f"{_name(r['src_role'], r['src_layer'], r['src_head_index'])}->"
         f"{_name(r['dst_role'], r['dst_layer'], r['dst_head_index'])}")  # fmt: skip
    return n + (f"<{r['input']}>" if r["dst_role"] == "head" else "")


# -- circuit-tracer / Neuronpedia -----------------------------------------------------


def _viewer_reads(graph: dict):
    """What circuit-tracer's viewer (``formatData`` in ``util-cg.js``) reads of each node
    and link, restated: it splits a logit's ``clerp`` at ``(p=`` and ``)``, counts
    positions from ``metadata.prompt_tokens``, and keys nodes by ``node_id``."""
    tokens = graph["metadata"]["prompt_tokens"]
    ids = [n["node_id"] for n in graph["nodes"]]
    assert len(ids) == len(set(ids))
    for n in graph["nodes"]:
        assert 0 <= n["ctx_idx"] < len(tokens)
        assert n["layer"] == "E" or n["layer"].isdigit()
        if n["feature_type"] == "logit":
            clerp = n["clerp"]
            assert "(p=" in clerp and ")" in clerp.split("(p=")[1], clerp
            assert clerp.startswith('Output "') and clerp.count('"') == 2, clerp
    assert all(link["source"] in ids and link["target"] in ids for link in graph["links"])
    return ids


@pytest.mark.parametrize("which", ["hb", "mha"])
def test_viewer_reads_the_attribution_graph(which, request):
    c = request.getfixturevalue(which)
    for circuit in (c, c.prune(top_n=3)):
        graph = circuit.to_neuronpedia()
        _viewer_reads(graph)
        logit = next(n for n in graph["nodes"] if n["feature_type"] == "logit")
        target = circuit.nodes[circuit.nodes.role == "target"]["Real"].item()
        assert logit["influence"] == target and f"Real {target:.4g}" in logit["clerp"]


def test_circuit_tracer_models_read_the_file(hb, tmp_path):
    models = pytest.importorskip("circuit_tracer.frontend.graph_models")
    utils = pytest.importorskip("circuit_tracer.frontend.utils")
    small = hb.prune(top_n=5)
    small.to_neuronpedia(tmp_path / "ours", slug="g", scan="tiny")
    text = (tmp_path / "ours" / "g.json").read_text()
    model = models.Model.model_validate_json(text)
    assert json.loads(model.model_dump_json()) == json.loads(text)  # nothing dropped
    (tmp_path / "theirs").mkdir()
    utils.add_graph_metadata(model.metadata.model_dump(), str(tmp_path / "theirs"))
    ours = json.loads((tmp_path / "ours" / "graph-metadata.json").read_text())
    theirs = json.loads((tmp_path / "theirs" / "graph-metadata.json").read_text())
    assert ours == theirs


_RUN_VIEWER = """
const fs = require('fs'), vm = require('vm');
const [d3js, utilcg, file] = process.argv.slice(2);
const ctx = {console, URL, Promise, setTimeout};
ctx.window = ctx; ctx.self = ctx;
vm.createContext(ctx);
vm.runInContext(fs.readFileSync(d3js, 'utf8'), ctx);
ctx.util = {ppToken: d => d, params: {get: () => null, set: () => null}};
vm.runInContext(fs.readFileSync(utilcg, 'utf8'), ctx);
ctx.utilCg.formatData(JSON.parse(fs.readFileSync(file, 'utf8')), {pinnedIds: []})
  .then(out => console.log(JSON.stringify({nodes: out.nodes.length, links: out.links.length})))
  .catch(e => { console.error(e.stack); process.exit(1); });
"""


def _d3_jetpack(node: str) -> str | None:
    """d3 v7 with d3-jetpack, as npm's ``d3-jetpack`` builds it (local or global)."""
    roots = [os.getcwd()]
    npm = shutil.which("npm")
    if npm:
        out = subprocess.run([npm, "root", "-g"], capture_output=True, text=True, timeout=30)
        roots.append(str(Path(out.stdout.strip()).parent))
    for root in roots:
        file = Path(root) / "node_modules" / "d3-jetpack" / "build" / "d3v7+jetpack.js"
        if file.is_file():
            return str(file)
    return None


def test_circuit_tracer_viewer_formats_the_file(hb, tmp_path):
    pytest.importorskip("circuit_tracer")
    import circuit_tracer

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    d3js = _d3_jetpack(node)
    if d3js is None:
        pytest.skip("d3-jetpack is not installed (npm install d3-jetpack)")
    utilcg = Path(circuit_tracer.__file__).parent / "frontend/assets/attribution_graph/util-cg.js"
    script = tmp_path / "run.cjs"
    script.write_text(_RUN_VIEWER)
    for k, c in enumerate((hb, hb.prune(top_n=4))):
        graph = c.to_neuronpedia(tmp_path / f"g{k}.json")
        out = subprocess.run([node, str(script), d3js, str(utilcg), str(tmp_path / f"g{k}.json")],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["nodes"] == len(graph["nodes"]) and got["links"] == len(graph["links"])
