"""The circuit's drawing (``views/circuit.py``): the SVG read back as XML (every kept
component drawn once, with the sign of its value in its colour, its glyph and its data;
a slot per component of the whole circuit; a column per token and none for padding; a
hollow box where a kept head reads keys and values without being kept; every non-zero
edge of the frames drawn between drawn boxes, its sign in its colour, at most
``max_edges``), and the page in headless Chromium (no console message, no script, the
tokens in the DOM, a screenshot)."""

from __future__ import annotations

import math
import os
import shutil
import xml.etree.ElementTree as ET

import pytest

from semiring_backprop.views.circuit import circuit_svg
from semiring_backprop.views.colors import rgb
from test_circuit import MP, TOKENS, _kept_ids, hand_built

NS = "{http://www.w3.org/2000/svg}"


def _parse(svg: str):
    root = ET.fromstring(svg)
    comps = [e for e in root.iter(f"{NS}rect") if e.get("class") == "comp"]
    slots = [e for e in root.iter(f"{NS}rect") if e.get("class") == "slot"]
    tokens = ["".join(e.itertext()).replace("".join(e.find(f"{NS}title").itertext()), "")
              for e in root.iter(f"{NS}text") if e.get("class") == "token"]  # fmt: skip
    edges = [e for e in root.iter() if e.get("class") in ("edge", "attn")]
    return comps, slots, tokens, edges


def _reads(root_svg: str):
    root = ET.fromstring(root_svg)
    return [e for e in root.iter(f"{NS}rect") if e.get("class") == "read"]


def _read_oracle(c):
    """Heads at the positions their kept attention edges read from, not kept there."""
    kept = _kept_ids(c)
    return {f"a{r['layer']}.h{r['head_index']}@{r['src_position']}"
            for r in c.attention_edges.to_dict("records")} - kept  # fmt: skip


@pytest.mark.parametrize("col", ["Real", MP])
def test_every_kept_component_once_with_its_sign(col):
    whole = hand_built(seed=3)
    c = whole.prune(top_n=7, semiring=col)
    svg, drawn = circuit_svg(c, col, max_edges=25)
    comps, slots, tokens, edges = _parse(svg)
    ids = [e.get("data-id") for e in comps]
    assert len(ids) == len(set(ids)) == drawn["components"]
    want = _kept_ids(c) | {f"input@{p}" for p in range(3)} | {"logits"}
    assert set(ids) == want
    assert len(slots) == len(whole.components())
    assert tokens == TOKENS
    frame = {}
    for r in c.nodes[c.nodes.role != "residual"].to_dict("records"):
        key = "logits" if r["role"] == "target" else None
        frame[key or _site(r)] = r[col]
    for e in comps:
        v = float(e.get("data-value"))
        assert v == frame[e.get("data-id")]
        if not math.isfinite(v) or e.get("data-role") == "target":
            continue
        sign = e.get("data-sign")
        assert sign == ("+" if v > 0 else "-" if v < 0 else "0")
        r, _, b = rgb(e.get("fill"))
        if abs(v) > 1e-3:
            assert (r > b) == (v > 0), (e.get("data-id"), v, e.get("fill"))
    assert 0 < len(edges) <= 25 and drawn["edges_total"] >= len(edges)
    reads = _read_oracle(c)
    assert {e.get("data-id") for e in _reads(svg)} == reads and drawn["reads"] == len(reads)
    for e in edges:
        assert e.get("data-src") in want | reads and e.get("data-dst") in want | reads
    signs = {e.get("data-id"): "".join(e.itertext())
             for e in ET.fromstring(svg).iter(f"{NS}text") if e.get("class") == "sign"}  # fmt: skip
    for i, v in frame.items():
        if math.isfinite(v) and v != 0:
            assert signs[i] == ("+" if v > 0 else "−"), i


def _edge_frame(c, col):
    """(src, dst, input) -> value of every edge and attention edge of the frames."""
    out = {}
    for r in c.edges.to_dict("records"):
        src = "input" if r["src_role"] == "embedding" else (
            f"a{r['src_layer']}.h{r['src_head_index']}" if r["src_role"] == "head"
            else f"m{r['src_layer']}")  # fmt: skip
        src = f"{src}@{r['position']}"
        if r["dst_role"] == "target":
            dst = "logits"
        elif r["dst_role"] == "head":
            dst = f"a{r['dst_layer']}.h{r['dst_head_index']}@{r['position']}"
        else:
            dst = f"m{r['dst_layer']}@{r['position']}"
        out[(src, dst, r["input"])] = r[col]
    for r in c.attention_edges.to_dict("records"):
        if r["src_position"] != r["dst_position"]:
            head = f"a{r['layer']}.h{r['head_index']}"
            out[(f"{head}@{r['src_position']}", f"{head}@{r['dst_position']}",
                 "attention")] = r[col]  # fmt: skip
    return out


@pytest.mark.parametrize("col", ["Real", MP])
def test_kept_reads_and_attention_drawn_with_signs(col):
    whole = hand_built(seed=5)
    heads = whole.components()
    row = heads[(heads.role == "head") & (heads.layer == 1) & (heads.head_index == 0)
                & (heads.position == 2)]  # fmt: skip
    c = whole.prune(top_n=1, semiring=col)
    for small in (c, whole._keeping(row)):
        svg, drawn = circuit_svg(small, col, max_edges=10_000)
        _, _, _, edges = _parse(svg)
        got = {(e.get("data-src"), e.get("data-dst"), e.get("data-input")): e for e in edges}
        want = {k: v for k, v in _edge_frame(small, col).items() if math.isfinite(v) and v != 0}
        assert set(got) == set(want) and drawn["edges_total"] == len(want)
        for k, e in got.items():
            v = want[k]
            assert float(e.get("data-value")) == v
            assert e.get("data-sign") == ("+" if v > 0 else "-")
            assert e.get("stroke") == ("#B2182B" if v > 0 else "#2166AC")
    # the head kept at 2 alone: its key and value edges at 0 and 1 end in read boxes
    alone = whole._keeping(row)
    assert str(alone.view()).endswith("read without being kept there: a1.h0@0 (for 2); "
                                      "a1.h0@1 (for 2)")  # fmt: skip
    svg, _ = circuit_svg(alone, "Real")
    assert {e.get("data-id") for e in _reads(svg)} == {"a1.h0@0", "a1.h0@1"}
    _, _, _, edges = _parse(svg)
    into = {(e.get("data-dst"), e.get("data-input")) for e in edges}
    assert {("a1.h0@0", "k"), ("a1.h0@0", "v"), ("a1.h0@1", "k"), ("a1.h0@1", "v")} <= into
    assert {("a1.h0@2", "attention")} <= into


def _site(r):
    p = int(r["position"])
    if r["role"] == "embedding":
        return f"input@{p}"
    if r["role"] == "head":
        return f"a{int(r['layer'])}.h{int(r['head_index'])}@{p}"
    return f"m{int(r['layer'])}@{p}"


def test_padding_never_drawn_and_caption():
    c = hand_built(mask=[1, 0, 1])
    svg, _ = circuit_svg(c)
    comps, _, tokens, _ = _parse(svg)
    assert tokens == ["the", "sat"]
    assert not any(e.get("data-id").endswith("@1") for e in comps)
    small = c.prune(top_n=3)
    svg, _ = circuit_svg(small)
    comps, _, _, edges = _parse(svg)
    drawn = [e.get("data-id") for e in comps + _reads(svg)]
    drawn += [e.get(k) for e in edges for k in ("data-src", "data-dst")]
    assert drawn and not any(d.endswith("@1") for d in drawn)
    page = c.view(MP).html()
    assert "Circuit of “the sat”" in page and f"values under {MP}" in page
    assert "<script" not in page and "http://" not in page.replace(NS[1:-1], "")
    assert "a test" in page  # what is explained
    text = str(c.view())
    assert text.startswith("circuit of 'the sat'") and "values under Real" in text


def test_repr_html_and_file(tmp_path):
    c = hand_built().prune(cumulative=0.5)
    assert c._repr_html_().startswith("<style>")
    file = c.to_html(tmp_path / "c.html")
    with open(file, encoding="utf-8") as f:
        assert f.read().startswith("<!DOCTYPE html>")


def test_circuit_in_chromium(tmp_path):
    import semiring_backprop as sbp
    from test_browser import _run, console_messages, png_size
    from test_circuit import _bert, _mlm

    torch = pytest.importorskip("torch")
    tokens = ["[CLS]", "the", "cat", "sat", "[SEP]"]
    c = sbp.circuit(_bert(), kwargs={"input_ids": torch.tensor([[3, 7, 1, 9, 4]])},
                    output=_mlm, tokens=tokens, what="log p(7) - log p(9)")  # fmt: skip
    page = tmp_path / "circuit.html"
    c.prune(top_n=8).to_html(page)
    run = _run("--dump-dom", page.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    assert console_messages(run.stderr) == []
    dom = run.stdout
    assert "<script" not in dom and dom.count('class="comp"') == 5 + 8 + 1
    for t in tokens:
        assert f">{t}</text>" in dom.replace("&lt;", "<").replace("&gt;", ">") or t in dom
    shot = tmp_path / "circuit.png"
    run = _run("--window-size=1000,700", f"--screenshot={shot}", page.as_uri())
    assert run.returncode == 0 and console_messages(run.stderr) == []
    assert png_size(shot) == (1000, 700) and shot.stat().st_size > 10_000
    keep = os.environ.get("SEMIRING_BACKPROP_SCREENSHOTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(shot, os.path.join(keep, "circuit.png"))
