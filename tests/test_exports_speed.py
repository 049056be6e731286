"""The circuit's exports and drawing written from arrays (``circuits/sites.py``), read back
and checked against the frames they come from.

Each file is parsed (JSON, DOT, the SVG as XML) and every edge, score and token is
compared with an oracle written here, row by row from ``Circuit.edges`` and
``Circuit.attention_edges`` in plain Python: EAP-IG's scores as the ⊕ over the rows of
each name, circuit-tracer's links as the ⊕ over the rows joining two kept sites, DOT's
pen widths and colours from each row's value, networkx's edges with each row's values,
the drawn edges as the strongest rows. Values include ties of equal size and opposite
sign, NaN, 0 and -inf (no path). Speed itself is measured by
``benchmarks/bench_exports.py``, not here.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

from semiring_backprop.circuits import Circuit, exports, sites  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402
from semiring_backprop.tokens import readable_tokens  # noqa: E402
from semiring_backprop.views.circuit import circuit_svg  # noqa: E402
from test_circuit import MP, hand_built  # noqa: E402

NS = "{http://www.w3.org/2000/svg}"
COLS = ("Real", MP)


def _tied(seed=5):
    """A hand-built circuit whose values repeat in size with both signs, with NaN and 0,
    and byte-level tokens."""
    c = hand_built(seed=seed)
    rng = np.random.default_rng(seed)
    pool = np.array([0.5, -0.5, 0.25, -0.25, 0.0, np.nan, -np.inf, 1.0])
    for frame in (c.nodes, c.edges, c.attention_edges):
        for col in COLS:
            frame[col] = pool[rng.integers(0, len(pool), len(frame))]
    toks = ["When", "ĠMary", "Ġgave"]
    return Circuit(c.nodes.assign(token=[toks[int(p)] if p is not pd.NA else ""
                                         for p in c.nodes.position]),
                   c.edges, c.attention_edges, list(COLS), toks, what="tied",
                   token_ids=[7, 8, 9], d_model=8)  # fmt: skip


CASES = {
    "whole": lambda: hand_built(seed=1),
    "pruned": lambda: hand_built(seed=2).prune(top_n=5),
    "pruned by MaxProduct": lambda: hand_built(seed=3).prune(top_n=6, semiring=MP),
    "tied": _tied,
    "tied, pruned": lambda: _tied(6).prune(top_n=4),
    "padded, pruned": lambda: hand_built(seed=7, mask=[1, 0, 1]).prune(top_n=5),
}


@pytest.fixture(params=list(CASES), scope="module")
def circuit(request):
    return CASES[request.param]()


# -- oracles, row by row --------------------------------------------------------------


def _na(x):
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def _name(role, layer, head):
    if role == "embedding":
        return "input"
    if role == "target":
        return "logits"
    return f"m{int(layer)}" if role == "mlp" else f"a{int(layer)}.h{int(head)}"


def _site(role, layer, head, p):
    name = _name(role, layer, head) if role != "residual" else f"r{int(layer)}"
    return name if role == "target" else f"{name}@{int(p)}"


def _oplus(col, values):
    vals = [v for v in values if not math.isnan(v)]
    if col == "Real":
        return math.fsum(vals)
    best = None
    for v in vals:  # the first of largest size
        if math.isfinite(v) and (best is None or abs(v) > abs(best)):
            best = v
    return -math.inf if best is None else best


def _rows(circuit):
    """(src site, dst site, key, row) of every edge and attention edge, in order."""
    out = []
    for r in circuit.edges.to_dict("records"):
        p = r["position"]
        out.append((_site(r["src_role"], r["src_layer"], r["src_head_index"], p),
                    _site(r["dst_role"], r["dst_layer"], r["dst_head_index"], p),
                    r["input"], r))  # fmt: skip
    for r in circuit.attention_edges.to_dict("records"):
        out.append((_site("head", r["layer"], r["head_index"], r["src_position"]),
                    _site("head", r["layer"], r["head_index"], r["dst_position"]),
                    "attention", r))  # fmt: skip
    return out


def _close(a, b):
    return a == b or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


# -- the files ------------------------------------------------------------------------


@pytest.mark.parametrize("col", COLS)
def test_eap_json_edges_and_scores(circuit, col, tmp_path):
    file = tmp_path / "eap.json"
    graph = circuit.to_eap_json(file, semiring=col)
    text = file.read_text()
    assert text == json.dumps(graph, allow_nan=False)  # the file: the dict, as json writes it
    d = json.loads(text)
    sums: dict = {}
    for r in circuit.full.edges.to_dict("records"):
        name = (f"{_name(r['src_role'], r['src_layer'], r['src_head_index'])}->"
                f"{_name(r['dst_role'], r['dst_layer'], r['dst_head_index'])}")  # fmt: skip
        name += f"<{r['input']}>" if r["dst_role"] == "head" else ""
        sums.setdefault(name, []).append(r[col])
    kept = set()
    for r in circuit.edges.to_dict("records"):
        name = (f"{_name(r['src_role'], r['src_layer'], r['src_head_index'])}->"
                f"{_name(r['dst_role'], r['dst_layer'], r['dst_head_index'])}")  # fmt: skip
        kept.add(name + (f"<{r['input']}>" if r["dst_role"] == "head" else ""))
    assert set(d["edges"]) >= set(sums)
    for name, e in d["edges"].items():
        want = _oplus(col, sums.get(name, []))
        assert _close(e["score"], want if math.isfinite(want) else 0.0), name
        assert e["in_graph"] == (name in kept), name
    nodes: dict = {}
    for r in circuit.full.nodes.to_dict("records"):
        if r["role"] != "residual":
            nodes.setdefault(_name(r["role"], r["layer"], r["head_index"]), []).append(r[col])
    for name, values in nodes.items():
        want = _oplus(col, values)
        assert _close(d["nodes"][name]["score"], want if math.isfinite(want) else 0.0)


@pytest.mark.parametrize("col", COLS)
def test_neuronpedia_links_weights_and_tokens(circuit, col, tmp_path):
    file = tmp_path / "np.json"
    graph = circuit.to_neuronpedia(file, semiring=col)
    text = file.read_text()
    assert text == json.dumps(graph, allow_nan=False)
    d = json.loads(text)
    node_of = {}  # site -> node id
    for n in d["nodes"]:
        kind, p = n["feature_type"], n["ctx_idx"]
        if kind == "embedding":
            node_of[f"input@{p}"] = n["node_id"]
        elif kind == "logit":
            node_of["logits"] = n["node_id"]
        elif kind == "mlp":
            node_of[f"m{n['layer']}@{p}"] = n["node_id"]
        else:
            node_of[f"a{n['layer']}.h{n['feature']}@{p}"] = n["node_id"]
    weights: dict = {}
    for src, dst, _, r in _rows(circuit):
        if src in node_of and dst in node_of and src != dst:
            weights.setdefault((node_of[src], node_of[dst]), []).append(r[col])
    want = [(s, t, _oplus(col, v)) for (s, t), v in weights.items()]
    want = [(s, t, w) for s, t, w in want if math.isfinite(w)]
    got = [(x["source"], x["target"], x["weight"]) for x in d["links"]]
    assert [(s, t) for s, t, _ in got] == [(s, t) for s, t, _ in want]  # order: first rows
    assert all(_close(a[2], b[2]) for a, b in zip(got, want))
    shown = readable_tokens(circuit.token_list)
    assert d["metadata"]["prompt_tokens"] == shown
    ids = circuit.token_ids or list(range(len(shown)))
    for n in d["nodes"]:
        if n["feature_type"] == "embedding":
            p = n["ctx_idx"]
            assert n["node_id"] == f"E_{ids[p]}_{p}" and repr(shown[p]) in n["clerp"]


@pytest.mark.parametrize("col", COLS)
def test_dot_edges_widths_and_colours(circuit, col):
    dot = circuit.to_dot(col)
    lines = re.findall(r'^  "([^"]+)" -> "([^"]+)" \[label="([^"]+)", penwidth=([0-9.]+), '
                       r'color="(#[0-9A-F]+)"(, style=dashed)?\];$', dot, re.M)  # fmt: skip
    rows = _rows(circuit)
    assert len(lines) == len(rows) == dot.count(" -> ")
    values = [r[col] for *_, r in rows]
    top = max((abs(v) for v in values if math.isfinite(v)), default=0.0) or 1.0
    for (src, dst, key, width, color, dashed), (s, d, k, r) in zip(lines, rows):
        v = r[col]
        assert (src, dst, key) == (s, d, k)
        assert width == f"{0.3 + 3.7 * abs(v) / top if math.isfinite(v) else 0.3:.2f}"
        assert color == ("#B2182B" if v > 0 else "#2166AC" if v < 0 else "#999999")
        assert bool(dashed) == (k == "attention")
    shown = readable_tokens(circuit.token_list)
    for p, t in enumerate(shown):
        if not circuit.mask or circuit.mask[p]:  # (padding has no site)
            assert f'"input@{p}" [label="input@{p}\\n{t}\\n' in dot


def test_networkx_edges_carry_the_rows(circuit):
    pytest.importorskip("networkx")
    g = circuit.to_networkx()
    got = sorted((s, d, k, tuple(a[c] for c in COLS)) for s, d, k, a in
                 g.edges(keys=True, data=True))  # fmt: skip
    want = sorted((s, d, k, tuple(r[c] for c in COLS)) for s, d, k, r in _rows(circuit))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a[:3] == b[:3] and all(x == y or (math.isnan(x) and math.isnan(y))
                                      for x, y in zip(a[3], b[3]))  # fmt: skip


@pytest.mark.parametrize("col", COLS)
@pytest.mark.parametrize("max_edges", [0, 5, 10_000])
def test_drawn_edges_are_the_strongest_rows(circuit, col, max_edges):
    svg, drawn = circuit_svg(circuit, col, max_edges=max_edges)
    root = ET.fromstring(svg)
    boxes = {e.get("data-id") for e in root.iter(f"{NS}rect") if e.get("class") in
             ("comp", "read")}  # fmt: skip
    items = [
        (abs(r[col]), i, s, d, k, r[col])
        for i, (s, d, k, r) in enumerate(_rows(circuit))
        if s in boxes and d in boxes and s != d and math.isfinite(r[col]) and r[col] != 0
    ]
    items.sort(key=lambda x: (-x[0], x[1]))  # strongest first, ties in row order
    got = [(e.get("data-src"), e.get("data-dst"), e.get("data-input"), float(e.get("data-value")))
           for e in root.iter() if e.get("class") in ("edge", "attn")]  # fmt: skip
    assert got == [(s, d, k, v) for *_, s, d, k, v in items[:max_edges]]
    assert drawn["edges_total"] == len(items) and drawn["edges"] == len(got)


def test_exports_leave_the_frames_as_they_were(circuit, tmp_path):
    before = [f.copy() for f in (circuit.nodes, circuit.edges, circuit.attention_edges)]
    circuit.to_eap_json(tmp_path / "a.json")
    circuit.to_neuronpedia(tmp_path / "b.json")
    circuit.to_dot()
    circuit.view().html()
    circuit.read_sites()
    circuit.prune(top_n=2)
    for a, b in zip(before, (circuit.nodes, circuit.edges, circuit.attention_edges)):
        pd.testing.assert_frame_equal(a, b)


# -- the pieces -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Real", MP, "TopK(2)", "MaxAbs", "LogAbs", "PathCount"])
def test_oplus_groups_equals_oplus_of_each_group(name):
    rng = np.random.default_rng(0)
    pool = np.array([0.5, -0.5, 2.0, -2.0, 0.0, np.nan, -np.inf, np.inf, 1e-3])
    values = np.where(rng.random(400) < 0.5, pool[rng.integers(0, len(pool), 400)],
                      rng.normal(size=400))  # fmt: skip
    groups = rng.integers(0, 30, 400)  # (some of the 33 groups hold nothing)
    if name in ("LogAbs", "PathCount"):
        values = np.where(np.isposinf(values), 1.0, values)
    got = sites.oplus_groups(name, values, groups, 33)
    for g in range(33):
        want = exports.oplus(name, [] if g >= 30 else values[groups == g].tolist())
        if name in ("Real", "LogAbs", "PathCount"):  # sums in another order
            assert got[g] == pytest.approx(want, rel=1e-12, abs=1e-12) or (
                math.isnan(got[g]) and math.isnan(want))  # fmt: skip
        else:
            assert got[g] == want or (math.isnan(got[g]) and math.isnan(want)), (g, got[g], want)
    # the oracle of ties: the first of largest size, signed
    if name == MP:
        assert sites.oplus_groups(name, [0.5, -0.5, np.nan, -0.5], [0, 0, 0, 1], 2).tolist() == [
            0.5, -0.5]  # fmt: skip
    with pytest.raises(InputError, match="no ⊕ of readouts"):
        sites.oplus_groups("Entropy", values, groups, 33)


def test_site_codes_name_sites_as_site_id():
    rng = np.random.default_rng(1)
    rows = [("embedding", -1, None, p) for p in range(5)] + [("target", 4, None, None)]
    rows += [("head", int(rng.integers(0, 40)), int(rng.integers(0, 30)), int(rng.integers(0, 600)))
             for _ in range(200)]  # fmt: skip
    rows += [(r, int(rng.integers(0, 40)), None, int(rng.integers(0, 600)))
             for r in ("mlp", "residual") for _ in range(50)]  # fmt: skip
    frame = pd.DataFrame(rows, columns=["role", "layer", "head_index", "position"])
    for c in ("layer", "head_index", "position"):
        frame[c] = frame[c].astype("Int64")
    codes = sites.node_codes(frame)
    assert [sites.name_of(c) for c in codes] == [exports.site_id(*r) for r in rows]
    assert len(set(codes.tolist())) == len(set(rows))
    found, at = sites.lookup(codes[::-1], codes)
    assert found.all() and (codes[at] == codes[::-1]).all()
    with pytest.raises(InputError, match="unknown site role 'attn'"):
        sites.site_codes(np.array(["attn"], dtype=object), [0], [0], [0])
    with pytest.raises(InputError, match="out of range"):
        sites.site_codes(np.array(["head"], dtype=object), [0], [-1], [0])


def test_chunks_cover_the_rows_once():
    for n, step in ((0, 4), (3, 4), (8, 4), (9, 4)):
        parts = list(sites.chunks(n, "test", step))
        assert [i for s in parts for i in range(n)[s]] == list(range(n))


def test_a_circuit_without_edges(tmp_path):
    c = hand_built(seed=8)
    c = Circuit(c.nodes, None, None, list(COLS), c.tokens)
    for circuit in (c, c.prune(top_n=3)):
        d = json.loads(json.dumps(circuit.to_eap_json(tmp_path / "e.json")))
        assert d == json.loads((tmp_path / "e.json").read_text())
        assert not any(e["in_graph"] for e in d["edges"].values())
        assert all(e["score"] == 0.0 for e in d["edges"].values())
        assert circuit.to_neuronpedia(tmp_path / "n.json")["links"] == []
        assert " -> " not in circuit.to_dot()
        assert circuit_svg(circuit)[1]["edges_total"] == 0
