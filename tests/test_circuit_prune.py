"""What a pruned circuit keeps (``Circuit.prune``): a head is kept at the position where
it writes and reads keys and values where its attention reaches, so the edges into its
key and value inputs at the positions it reads, and its attention edges to where it is
kept, stay with it.

The oracles are written here, from the frames and from the models' structure, not from
the code under test: the kept sites by sorting; the kept edges by the rule restated row
by row; on a causal GPT-2 and on a BERT with padding, the positions a head reads from the
attention mask alone (q <= p; every unpadded position), with every pair carrying a value
under ``seed="x"``; the exports' node and edge sets and EAP-IG's ``in_graph`` flags from
those sets.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pd = pytest.importorskip("pandas")

import semiring_backprop as sbp  # noqa: E402
from test_circuit import MP, _edge_ids, _kept_ids, _sizes, hand_built, read_eap  # noqa: E402

COLS = ("Real", MP)


def _att_ids(frame):
    return {(int(r["layer"]), int(r["head_index"]), int(r["src_position"]),
             int(r["dst_position"])) for r in frame.to_dict("records")}  # fmt: skip


def _carries(row):
    return any(math.isfinite(row[c]) and row[c] != 0 for c in COLS if c in row)


def _expected(whole, kept: set):
    """The rule, restated: (attention edges, residual edges, read sites) of the circuit
    that keeps the site ids ``kept``."""
    att = {(int(r["layer"]), int(r["head_index"]), int(r["src_position"]),
            int(r["dst_position"]))
           for r in whole.attention_edges.to_dict("records")
           if f"a{r['layer']}.h{r['head_index']}@{r['dst_position']}" in kept
           and (r["src_position"] == r["dst_position"] or _carries(r))}  # fmt: skip
    reads = {f"a{layer}.h{h}@{q}" for layer, h, q, _ in att} | {k for k in kept if k[0] == "a"}
    edges = []
    for src, dst, entry in _edge_ids(whole.edges):
        if not (src.startswith("input@") or src in kept):
            continue
        if dst == "logits" or (entry in "kv" and dst in reads) or dst in kept:
            edges.append((src, dst, entry))
    read_sites = {f"a{layer}.h{h}@{q}" for layer, h, q, _ in att} - kept
    return att, sorted(edges), read_sites


@pytest.fixture(scope="module")
def hb():
    return hand_built(seed=5)


@pytest.mark.parametrize("how", [{"top_n": 1}, {"top_n": 4}, {"top_n": 9},
                                 {"cumulative": 0.6}, {"threshold": 0.8},
                                 {"top_n": 5, "semiring": MP}])  # fmt: skip
def test_kept_edges_follow_what_kept_heads_read(hb, how):
    col = how.get("semiring", "Real")
    sizes = _sizes(hb, col)
    small = hb.prune(**how)
    if "top_n" in how:
        assert _kept_ids(small) == set(list(sizes)[: how["top_n"]])
    kept = _kept_ids(small)
    att, edges, reads = _expected(hb, kept)
    assert _att_ids(small.attention_edges) == att
    assert sorted(_edge_ids(small.edges)) == edges
    assert {s["id"] for s in small.read_sites()} == reads
    for s in small.read_sites():
        assert s["read_by"] == sorted(
            p
            for layer, h, q, p in att
            if (layer, h, q) == (s["layer"], s["head_index"], s["position"])
        )


def test_a_head_kept_where_it_writes_keeps_what_it_reads(hb):
    """The case in words: one head kept at its last position; its key and value edges at
    every earlier position stay, its query edges only at the position kept."""
    heads = hb.components()
    heads = heads[(heads.role == "head") & (heads.layer == 1) & (heads.head_index == 0)]
    row = heads[heads.position == 2]
    small = hb._keeping(row)  # the sites are chosen here, not by a criterion
    into = [e for e in _edge_ids(small.edges) if e[1].startswith("a1.h0@")]
    assert {(e[1], e[2]) for e in into if e[2] == "q"} == {("a1.h0@2", "q")}
    assert {int(e[1].split("@")[1]) for e in into if e[2] in "kv"} == {0, 1, 2}
    # the sources: the embeddings at every position; no head or MLP (none kept)
    assert {e[0].split("@")[0] for e in into} == {"input"}
    assert _att_ids(small.attention_edges) == {(1, 0, q, 2) for q in range(3)}
    assert [s["id"] for s in small.read_sites()] == ["a1.h0@0", "a1.h0@1"]
    assert not hb.read_sites()  # a whole circuit reads only where it writes


def test_pair_of_no_value_not_read():
    c = hand_built(seed=5)
    a = c.attention_edges.copy()
    hit = (a.layer == 1) & (a.head_index == 0) & (a.src_position == 0) & (a.dst_position == 2)
    a.loc[hit, "Real"], a.loc[hit, MP] = 0.0, -math.inf  # masked: the semirings' zeros
    c = sbp.Circuit(c.nodes, c.edges, a, ["Real", MP], c.tokens)
    heads = c.components()
    row = heads[(heads.role == "head") & (heads.layer == 1) & (heads.head_index == 0)
                & (heads.position == 2)]  # fmt: skip
    small = c._keeping(row)
    assert _att_ids(small.attention_edges) == {(1, 0, 1, 2), (1, 0, 2, 2)}
    assert not any(e[1] == "a1.h0@0" for e in _edge_ids(small.edges))


def test_exports_of_a_pruned_circuit_agree(hb):
    nx = pytest.importorskip("networkx")
    small = hb.prune(top_n=4)
    kept = _kept_ids(small)
    att, edges, reads = _expected(hb, kept)
    # EAP-IG: every in_graph edge joins in_graph nodes; in_graph edges = the kept edges
    d, *_ = read_eap(json.dumps(small.to_eap_json()))
    on = {n for n, v in d["nodes"].items() if v["in_graph"]}
    names = set()
    for src, dst, entry in edges:
        s, t = src.split("@")[0], dst.split("@")[0]
        names.add(f"{s}->{t}<{entry}>" if t.startswith("a") else f"{s}->{t}")
    assert {n for n, e in d["edges"].items() if e["in_graph"]} == names
    for n in names:
        s, t = n.split("<")[0].split("->")
        assert s in on and t in on
    # networkx: kept rows and read sites are the nodes; every edge has both ends
    g = small.to_networkx()
    read_nodes = {n for n, a in g.nodes(data=True) if a["read"]}
    assert read_nodes == reads
    assert all(math.isnan(g.nodes[n]["Real"]) for n in read_nodes)
    assert g.number_of_nodes() == len(small.nodes) + len(reads)
    want = sorted(edges + [(f"a{layer}.h{h}@{q}", f"a{layer}.h{h}@{p}", "attention")
                           for layer, h, q, p in att])  # fmt: skip
    assert sorted(g.edges(keys=True)) == want
    assert isinstance(g, nx.MultiDiGraph)
    # Neuronpedia: a node per kept site and read site; every link between two of them
    np_graph = small.to_neuronpedia()
    heads = [n for n in np_graph["nodes"] if n["feature_type"] == "attention head"]
    assert len(heads) == sum(k.startswith("a") for k in kept) + len(reads)
    no_value = [n for n in heads if n["influence"] is None and "reading position" in n["clerp"]]
    assert len(no_value) == len(reads)
    ids = {n["node_id"] for n in np_graph["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in np_graph["links"])
    pairs = {(s, t) for s, t, _ in edges} | {
        (f"a{layer}.h{h}@{q}", f"a{layer}.h{h}@{p}") for layer, h, q, p in att if q != p
    }
    assert len(np_graph["links"]) == len(pairs)
    # DOT: read sites dashed, unfilled
    dot = small.to_dot()
    for r in reads:
        line = next(x for x in dot.splitlines() if x.startswith(f'  "{r}" [label='))
        assert "style=dashed" in line and "fillcolor" not in line


# -- on models: which positions a head reads is the attention mask's -------------------


def _gpt2():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=30, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return T.GPT2LMHeadModel(cfg).to(torch.float64).eval()


@pytest.fixture(scope="module")
def gpt2_circuit():
    ids = torch.tensor([[3, 7, 1, 9, 4, 12]])
    return sbp.circuit(_gpt2(), kwargs={"input_ids": ids},
                       output=lambda o: o.logits[0, -1, 5] - o.logits[0, -1, 6],
                       tokens=[f"w{i}" for i in ids[0].tolist()])  # fmt: skip


def test_causal_heads_read_every_earlier_position(gpt2_circuit):
    for top_n in (1, 3, 8):
        _check_causal(gpt2_circuit, top_n)


def _check_causal(c, top_n):
    small = c.prune(top_n=top_n)
    writes: dict = {}
    for r in small.components().to_dict("records"):
        if r["role"] == "head":
            writes.setdefault((int(r["layer"]), int(r["head_index"])), set()).add(
                int(r["position"])
            )
    assert writes or top_n < 8
    # causal: a head kept at p reads every q <= p (each pair carries under seed="x")
    att = {(layer, h, q, p) for (layer, h), ps in writes.items() for p in ps
           for q in range(p + 1)}  # fmt: skip
    assert _att_ids(small.attention_edges) == att
    into = [e for e in _edge_ids(small.edges) if e[2] in "kv" and e[1].startswith("a")]
    got = {}
    for _, dst, _ in into:
        name, q = dst.split("@")
        got.setdefault(name, set()).add(int(q))
    want = {f"a{layer}.h{h}": set(range(max(ps) + 1)) for (layer, h), ps in writes.items()}
    assert got == want
    kept = _kept_ids(small)
    assert all(e[0].startswith("input@") or e[0] in kept for e in _edge_ids(small.edges))
    # the last position's head, kept, has a value edge from every earlier embedding
    if (0, 0) in writes or (0, 1) in writes:
        h = 0 if (0, 0) in writes else 1
        top = max(writes[(0, h)])
        vs = {
            int(e[1].split("@")[1])
            for e in into
            if e[0].startswith("input@") and e[1].startswith(f"a0.h{h}@") and e[2] == "v"
        }
        assert vs == set(range(top + 1))


def test_padding_is_never_read():
    T = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = T.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=16, max_position_embeddings=16,
                       attn_implementation="sdpa")  # fmt: skip
    model = T.BertForMaskedLM(cfg).to(torch.float64).eval()
    ids = torch.tensor([[3, 7, 1, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    c = sbp.circuit(model, kwargs={"input_ids": ids, "attention_mask": mask},
                    output=lambda o: o.logits[0, 2, 7] - o.logits[0, 2, 9],
                    tokens=["[CLS]", "a", "[MASK]", "b", "[PAD]", "[PAD]"])  # fmt: skip
    small = c.prune(top_n=2)
    heads = small.components()
    heads = heads[heads.role == "head"]
    assert len(heads)
    att = _att_ids(small.attention_edges)
    # bidirectional, padding masked: a head kept at p reads exactly positions 0..3
    want = {(int(r["layer"]), int(r["head_index"]), q, int(r["position"]))
            for r in heads.to_dict("records") for q in range(4)}  # fmt: skip
    assert att == want
    positions = {int(e[1].split("@")[1]) for e in _edge_ids(small.edges) if e[1] != "logits"}
    assert positions <= {0, 1, 2, 3}
    assert all(s["position"] < 4 for s in small.read_sites())
    np.testing.assert_equal(sorted(small.attention_edges.src_position.unique()), [0, 1, 2, 3])
