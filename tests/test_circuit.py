"""Circuits (``semiring_backprop.circuits``): pruning, exports and the command line.

Hand-built frames (two layers, two heads, three positions, random signed values, some
MaxProduct sites of no path) check the semantics against independent oracles written
here: prune's three criteria by sorting, the kept edges by their ends; EAP-IG's graph
JSON read the way ``Graph.from_json`` of the EAP-IG package reads it (its complete
graph built here from its construction: every earlier node into each head's q, k, v,
each MLP and the logits; each score the ⊕ over positions); circuit-tracer's attribution
graph JSON validated by its pydantic models, restated here field by field; networkx's
node and edge sets equal to the frames'; DOT parsed back. A tiny BERT runs the whole
``sbp.circuit``, and ``semiring-backprop circuit`` runs on tiny saved BERT and GPT-2.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import numpy as np
import pytest
import torch

pd = pytest.importorskip("pandas")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import cli  # noqa: E402
from semiring_backprop.circuits import Circuit  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402

MP = "MaxProduct(neuron)"
TOKENS = ["the", "cat", "sat"]
L, H, P = 2, 2, 3


def _components(layers=L, heads=H):
    """EAP-IG's nodes in order: (role, layer, head)."""
    out = []
    for layer in range(layers):
        out += [("head", layer, h) for h in range(heads)] + [("mlp", layer, None)]
    return out


def hand_built(seed=0, mask=None):
    rng = np.random.default_rng(seed)
    rows = []

    def values():
        real = float(rng.normal())
        mp = float(rng.normal()) if rng.random() > 0.1 else -math.inf
        return {"Real": real, MP: mp}

    for p in range(P):
        rows.append(dict(layer=-1, position=p, token=TOKENS[p], head_index=None,
                         role="embedding", node="emb", **values()))  # fmt: skip
    for layer in range(L):
        for h in range(H):
            for p in range(P):
                rows.append(dict(layer=layer, position=p, token=TOKENS[p], head_index=h,
                                 role="head", node=f"h{layer}", **values()))  # fmt: skip
        for p in range(P):
            rows.append(dict(layer=layer, position=p, token=TOKENS[p], head_index=None,
                             role="mlp", node=f"m{layer}", **values()))  # fmt: skip
        for p in range(P):
            rows.append(dict(layer=layer, position=p, token=TOKENS[p], head_index=None,
                             role="residual", node=f"r{layer}", **values()))  # fmt: skip
    rows.append(dict(layer=L, position=None, token="", head_index=None, role="target",
                     node="out", Real=1.5, **{MP: 0.7}))  # fmt: skip
    nodes = pd.DataFrame(rows)
    for c in ("layer", "position", "head_index"):
        nodes[c] = nodes[c].astype("Int64")
    edges = []
    for p in range(P):
        stream = [("embedding", -1, None)]
        for layer in range(L):
            heads = [("head", layer, h) for h in range(H)]
            for src in stream:
                for dst in heads:
                    for q in "qkv":
                        edges.append((src, dst, q, p))
            stream += heads
            for src in stream:
                edges.append((src, ("mlp", layer, None), "mlp", p))
            stream.append(("mlp", layer, None))
        for src in stream:
            edges.append((src, ("target", L, None), "target", p))
    erows = [dict(src_layer=s[1], src_role=s[0], src_head_index=s[2], dst_layer=d[1],
                  dst_role=d[0], dst_head_index=d[2], input=q, position=p, token=TOKENS[p],
                  **values()) for s, d, q, p in edges]  # fmt: skip
    edges = pd.DataFrame(erows)
    for c in ("src_layer", "src_head_index", "dst_layer", "dst_head_index", "position"):
        edges[c] = edges[c].astype("Int64")
    att = [dict(layer=layer, head_index=h, src_position=s, dst_position=d,
                src_token=TOKENS[s], dst_token=TOKENS[d], **values())
           for layer in range(L) for h in range(H) for d in range(P)
           for s in range(d + 1)]  # fmt: skip
    attention = pd.DataFrame(att)
    return Circuit(nodes, edges, attention, ["Real", MP], TOKENS, what="a test", d_model=8,
                   mask=mask)  # fmt: skip


def _id(role, layer, head, p):
    name = {"embedding": "input", "target": "logits"}.get(role)
    if role == "head":
        name = f"a{int(layer)}.h{int(head)}"
    elif role == "mlp":
        name = f"m{int(layer)}"
    elif role == "residual":
        name = f"r{int(layer)}"
    return name if role == "target" else f"{name}@{int(p)}"


def _na(x):
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def _row_id(r):
    return _id(r["role"], r["layer"], None if _na(r["head_index"]) else r["head_index"],
               None if _na(r["position"]) else r["position"])  # fmt: skip


def _edge_ids(frame):
    return [
        (_id(r["src_role"], r["src_layer"], None if _na(r["src_head_index"]) else
             r["src_head_index"], r["position"]),
         _id(r["dst_role"], r["dst_layer"], None if _na(r["dst_head_index"]) else
             r["dst_head_index"], r["position"]), r["input"])
        for r in frame.to_dict("records")
    ]  # fmt: skip


def _kept_ids(c):
    return {_row_id(r) for r in c.nodes.to_dict("records") if r["role"] in ("head", "mlp")}


# -- prune ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hb():
    return hand_built()


def _sizes(c, col="Real"):
    comps = c.nodes[c.nodes.role.isin(["head", "mlp"])]
    out = {_row_id(r): abs(r[col]) for r in comps.to_dict("records") if math.isfinite(r[col])}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def test_prune_top_n(hb):
    sizes = _sizes(hb)
    for n in (0, 1, 5, len(sizes), len(sizes) + 3):
        assert _kept_ids(hb.prune(top_n=n)) == set(list(sizes)[:n])


def test_prune_threshold(hb):
    sizes = _sizes(hb)
    t = float(np.median(list(sizes.values())))
    assert _kept_ids(hb.prune(threshold=t)) == {k for k, v in sizes.items() if v >= t}


@pytest.mark.parametrize("share", [0.0, 0.3, 0.8, 1.0])
def test_prune_cumulative(hb, share):
    sizes = _sizes(hb)
    total, run, want = sum(sizes.values()), 0.0, set()
    for k, v in sizes.items():
        if run >= share * total * (1 - 1e-12):
            break
        want.add(k)
        run += v
    got = hb.prune(cumulative=share)
    assert _kept_ids(got) == want
    assert sum(sizes[k] for k in want) >= share * total * (1 - 1e-12)


def test_prune_by_maxproduct_never_keeps_no_path(hb):
    sizes = _sizes(hb, MP)
    got = hb.prune(top_n=1000, semiring=sbp.MaxProduct())
    assert _kept_ids(got) == set(sizes)
    assert len(sizes) < len(hb.components())  # some sites have no path


def test_prune_criteria_together(hb):
    sizes = _sizes(hb)
    t = list(sizes.values())[3]
    assert _kept_ids(hb.prune(top_n=2, threshold=t)) == set(list(sizes)[:2])


def test_pruned_keeps_ends_and_edges_between_kept(hb):
    small = hb.prune(top_n=4)
    kept = _kept_ids(small)
    roles = small.nodes.role.value_counts().to_dict()
    assert roles["embedding"] == P and roles["target"] == 1 and roles["residual"] == L * P
    # a head is kept where it writes and reads keys and values where its attention
    # reaches (tests/test_circuit_prune.py has the exact sets)
    att = {(f"a{r['layer']}.h{r['head_index']}@{r['src_position']}",
            f"a{r['layer']}.h{r['head_index']}@{r['dst_position']}")
           for r in small.attention_edges.to_dict("records")}  # fmt: skip
    assert all(d in kept for _, d in att)
    reads = {s for s, _ in att}
    for src, dst, entry in _edge_ids(small.edges):
        assert src.startswith("input") or src in kept
        assert dst == "logits" or dst in kept or (entry in "kv" and dst in reads)
    assert small.full is hb and small.prune(top_n=2).full is hb


def test_prune_refusals(hb):
    with pytest.raises(InputError, match="give top_n"):
        hb.prune()
    with pytest.raises(InputError, match="share from 0 to 1"):
        hb.prune(cumulative=1.5)
    with pytest.raises(InputError, match="not in this circuit"):
        hb.prune(top_n=1, semiring="Entropy")
    with pytest.raises(InputError, match="missing columns"):
        Circuit(hb.nodes.drop(columns="role"))


def test_padding_has_no_sites():
    c = hand_built(mask=[1, 1, 0])
    assert set(c.nodes.position.dropna()) == {0, 1}
    assert set(c.edges.position) == {0, 1}
    assert not (c.attention_edges[["src_position", "dst_position"]] == 2).any().any()


# -- EAP-IG ---------------------------------------------------------------------------


def _eap_complete(n_layers, n_heads):
    """EAP-IG's ``Graph.from_model`` for a sequential model: node and edge names."""
    nodes, edges, stream = ["input"], [], ["input"]
    for layer in range(n_layers):
        heads = [f"a{layer}.h{h}" for h in range(n_heads)]
        nodes += heads + [f"m{layer}"]
        for node in stream:
            for a in heads:
                edges += [f"{node}->{a}<{q}>" for q in "qkv"]
        stream = stream + heads
        edges += [f"{node}->m{layer}" for node in stream]
        stream.append(f"m{layer}")
    edges += [f"{node}->logits" for node in stream]
    return nodes + ["logits"], edges


def read_eap(text: str):
    """What EAP-IG's ``Graph.from_json`` needs of the file (a minimal restatement)."""
    d = json.loads(text)
    assert all(k in d for k in ("cfg", "nodes", "edges")), "Bad input JSON format"
    cfg = d["cfg"]
    for k in ("n_layers", "n_heads", "parallel_attn_mlp", "d_model"):
        assert k in cfg, k
    assert cfg["parallel_attn_mlp"] is False and isinstance(cfg["d_model"], int)
    names, edge_names = _eap_complete(cfg["n_layers"], cfg["n_heads"])
    for name, node in d["nodes"].items():
        if name == "logits":
            continue
        assert name in names, name
        assert isinstance(node["in_graph"], bool)
        if "score" in node:
            assert isinstance(node["score"], float)
    for name, info in d["edges"].items():
        assert name in edge_names, name
        assert isinstance(info["score"], float) and math.isfinite(info["score"])
        assert isinstance(info["in_graph"], bool)
    return d, names, edge_names


def _eap_name(role, layer, head):
    return {"embedding": "input", "target": "logits", "mlp": f"m{layer}"}.get(
        role, f"a{layer}.h{head}"
    )


def test_eap_json_schema_and_scores(hb, tmp_path):
    file = tmp_path / "graph.json"
    g = hb.to_eap_json(file)
    d, names, edge_names = read_eap(file.read_text())
    assert d == json.loads(json.dumps(g))
    assert list(d["nodes"]) == names and list(d["edges"]) == edge_names
    assert d["cfg"]["n_layers"] == L and d["cfg"]["n_heads"] == H and d["cfg"]["d_model"] == 8
    frame = hb.nodes[hb.nodes.role != "residual"]
    for (role, layer, head), part in frame.groupby(["role", "layer", "head_index"],
                                                    dropna=False):  # fmt: skip
        name = _eap_name(role, layer, None if _na(head) else head)
        assert np.isclose(d["nodes"][name]["score"], part["Real"].sum())
    sums = {}
    for r in hb.edges.to_dict("records"):
        name = (f"{_eap_name(r['src_role'], r['src_layer'], r['src_head_index'])}->"
                f"{_eap_name(r['dst_role'], r['dst_layer'], r['dst_head_index'])}")  # fmt: skip
        name += f"<{r['input']}>" if r["dst_role"] == "head" else ""
        sums[name] = sums.get(name, 0.0) + r["Real"]
    assert set(sums) == set(edge_names)
    for name, v in sums.items():
        assert np.isclose(d["edges"][name]["score"], v)
    assert all(e["in_graph"] for e in d["edges"].values())


def test_eap_json_maxproduct_and_pruned(hb):
    small = hb.prune(top_n=3)
    d, *_ = read_eap(json.dumps(small.to_eap_json(semiring=MP)))
    kept = {n.split("@")[0] for n in _kept_ids(small)}
    assert {n for n, v in d["nodes"].items() if v["in_graph"]} == kept | {"input", "logits"}
    heads = hb.nodes[(hb.nodes.role == "head") & (hb.nodes.layer == 1) & (hb.nodes.head_index == 0)]
    vals = [v for v in heads[MP] if math.isfinite(v)]
    want = max(vals, key=abs) if vals else 0.0
    assert d["nodes"]["a1.h0"]["score"] == pytest.approx(want)
    in_graph = {n for n, e in d["edges"].items() if e["in_graph"]}
    for n in in_graph:
        src, dst = n.split("<")[0].split("->")
        assert src in kept | {"input"} and dst in kept | {"logits"}
    # full scores stay: pruning marks, it does not zero
    full, *_ = read_eap(json.dumps(hb.to_eap_json(semiring=MP)))
    assert {n: e["score"] for n, e in full["edges"].items()} == {
        n: e["score"] for n, e in d["edges"].items()
    }


def test_entropy_has_no_export(hb):
    c = Circuit(hb.nodes.assign(Entropy=1.0), hb.edges.assign(Entropy=1.0),
                hb.attention_edges.assign(Entropy=1.0), ["Real", MP, "Entropy"])  # fmt: skip
    with pytest.raises(InputError, match="no ⊕ of readouts"):
        c.to_eap_json(semiring="Entropy")


# -- circuit-tracer / Neuronpedia -----------------------------------------------------


def _pydantic_models():
    """circuit-tracer's ``frontend/graph_models.py``, restated: what its server and
    Neuronpedia read."""
    pydantic = pytest.importorskip("pydantic")

    class Metadata(pydantic.BaseModel):
        slug: str
        scan: str
        transcoder_list: list[str]
        prompt_tokens: list[str]
        prompt: str
        node_threshold: float | None = None
        schema_version: int | None = 1

    class QParams(pydantic.BaseModel):
        pinnedIds: list[str]
        supernodes: list[list[str]]
        linkType: str
        clickedId: str
        sg_pos: str

    class Node(pydantic.BaseModel):
        node_id: str
        feature: int
        layer: str
        ctx_idx: int
        feature_type: str
        token_prob: float = 0.0
        is_target_logit: bool = False
        run_idx: int = 0
        reverse_ctx_idx: int = 0
        jsNodeId: str
        clerp: str = ""
        influence: float | None = None
        activation: float | None = None

    class Link(pydantic.BaseModel):
        source: str
        target: str
        weight: float

    class Model(pydantic.BaseModel):
        metadata: Metadata
        qParams: QParams
        nodes: list[Node]
        links: list[Link]

    return Model


def test_neuronpedia_schema(hb, tmp_path):
    Model = _pydantic_models()
    small = hb.prune(top_n=5)
    g = small.to_neuronpedia(tmp_path / "np", slug="test-graph", scan="tiny")
    file = tmp_path / "np" / "test-graph.json"
    text = file.read_text()
    model = Model.model_validate_json(text)
    assert json.loads(text) == json.loads(json.dumps(g))
    listed = json.loads((tmp_path / "np" / "graph-metadata.json").read_text())
    assert [m["slug"] for m in listed["graphs"]] == ["test-graph"]
    small.to_neuronpedia(tmp_path / "np", slug="test-graph")  # the same slug: replaced
    listed = json.loads((tmp_path / "np" / "graph-metadata.json").read_text())
    assert [m["slug"] for m in listed["graphs"]] == ["test-graph"]
    ids = [n.node_id for n in model.nodes]
    assert len(ids) == len(set(ids)) == len(set(n.jsNodeId for n in model.nodes))
    kinds = [n.feature_type for n in model.nodes]
    assert kinds.count("embedding") == P and kinds.count("logit") == 1
    reads = {r["id"] for r in small.read_sites()}  # where kept heads read, not kept
    assert kinds.count("attention head") + kinds.count("mlp") == 5 + len(reads)
    assert all(0 <= n.ctx_idx < len(model.metadata.prompt_tokens) for n in model.nodes)
    assert model.metadata.prompt_tokens == TOKENS
    assert all(link.source in ids and link.target in ids and link.source != link.target
               for link in model.links)  # fmt: skip
    target = next(n for n in model.nodes if n.is_target_logit)
    assert target.layer == str(L + 1) and target.influence == 1.5
    # a link per pair of kept sites an edge joins
    kept = _kept_ids(small) | reads | {f"input@{p}" for p in range(P)} | {"logits"}
    pairs = {(s, d) for s, d, _ in _edge_ids(small.edges) if s in kept and d in kept}
    pairs |= {(f"a{r['layer']}.h{r['head_index']}@{r['src_position']}",
               f"a{r['layer']}.h{r['head_index']}@{r['dst_position']}")
              for r in small.attention_edges.to_dict("records")
              if r["src_position"] != r["dst_position"]}  # fmt: skip
    assert len(model.links) == len(pairs)
    one = Model.model_validate(hb.to_neuronpedia(tmp_path / "one.json"))
    assert (tmp_path / "one.json").exists() and len(one.nodes) == P * (1 + L * (H + 1)) + 1


# -- networkx and DOT -----------------------------------------------------------------


def test_networkx_sets_equal_the_frames(hb):
    nx = pytest.importorskip("networkx")
    for c in (hb, hb.prune(top_n=6)):
        g = c.to_networkx()
        assert isinstance(g, nx.MultiDiGraph)
        reads = {r["id"] for r in c.read_sites()}  # where kept heads read, not kept
        assert set(g.nodes) == {_row_id(r) for r in c.nodes.to_dict("records")} | reads
        assert g.number_of_nodes() == len(c.nodes) + len(reads)
        want = sorted(_edge_ids(c.edges)) + sorted(
            (f"a{r['layer']}.h{r['head_index']}@{r['src_position']}",
             f"a{r['layer']}.h{r['head_index']}@{r['dst_position']}", "attention")
            for r in c.attention_edges.to_dict("records"))  # fmt: skip
        assert sorted(g.edges(keys=True)) == sorted(want)
        r = c.nodes.iloc[0]
        assert g.nodes[_row_id(r)]["Real"] == r["Real"]


def test_dot_parses(hb):
    small = hb.prune(top_n=6)
    dot = small.to_dot()
    assert dot.startswith("digraph circuit {") and dot.rstrip().endswith("}")
    nodes = set(re.findall(r'^  "([^"]+)" \[label=', dot, re.M))
    edges = re.findall(r'^  "([^"]+)" -> "([^"]+)" \[label="([^"]+)"', dot, re.M)
    reads = {r["id"] for r in small.read_sites()}  # where kept heads read, not kept
    assert nodes == {_row_id(r) for r in small.nodes.to_dict("records")
                     if r["role"] != "residual"} | reads  # fmt: skip
    assert len(edges) == len(small.edges) + len(small.attention_edges)
    assert {(s, d, k) for s, d, k in edges if k != "attention"} == set(_edge_ids(small.edges))
    assert dot.count("{") == dot.count("}")
    try:
        from networkx.drawing.nx_pydot import read_dot
    except ImportError:
        return
    try:
        import pydot  # noqa: F401
    except ImportError:
        return
    g = read_dot(io.StringIO(dot))
    assert {n.strip('"') for n in g.nodes} >= nodes


# -- on a model -----------------------------------------------------------------------


def _bert():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=16, max_position_embeddings=16,
                       attn_implementation="sdpa")  # fmt: skip
    return T.BertForMaskedLM(cfg).to(torch.float64).eval()


def _mlm(out):
    logp = out.logits[0, 2].log_softmax(-1)
    return logp[7] - logp[9]


@pytest.fixture(scope="module")
def bert_circuit():
    ids = torch.tensor([[3, 7, 1, 9, 4]])
    return sbp.circuit(_bert(), kwargs={"input_ids": ids}, output=_mlm,
                       tokens=["[CLS]", "the", "cat", "sat", "[SEP]"], what="a margin")  # fmt: skip


def test_circuit_on_bert(bert_circuit):
    c = bert_circuit
    assert c.names == ["Real", MP] and c.n_layers == 2 and c.n_heads == 2 and c.d_model == 8
    assert c.token_ids == [3, 7, 1, 9, 4]
    assert len(c.components()) == 2 * 5 * 3
    target = c.nodes[c.nodes.role == "target"]["Real"].item()
    assert np.isclose(c.nodes[c.nodes.role == "embedding"]["Real"].sum(), target)
    d, *_ = read_eap(json.dumps(c.to_eap_json()))
    assert np.isclose(d["nodes"]["logits"]["score"], target)
    small = c.prune(top_n=4)
    assert len(small.components()) == 4
    _pydantic_models().model_validate(small.to_neuronpedia())


def test_circuit_edges_on_bert(bert_circuit):
    c = bert_circuit
    assert len(c.edges) and list(c.edges.columns[:9]) == [
        "src_layer", "src_role", "src_head_index", "dst_layer", "dst_role", "dst_head_index",
        "input", "position", "token"]  # fmt: skip
    d, _, edge_names = read_eap(json.dumps(c.to_eap_json()))
    assert set(d["edges"]) == set(edge_names)
    nx = pytest.importorskip("networkx")
    g = c.prune(cumulative=0.9).to_networkx()
    assert isinstance(g, nx.MultiDiGraph) and g.number_of_edges() > 0


# -- the command line -----------------------------------------------------------------


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, _offline_quiet):
    T = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = "the keys to cabinet is are on table a dog cat".split()
    bert = tmp_path_factory.mktemp("bert")
    (bert / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                               *words]) + "\n")  # fmt: skip
    T.BertTokenizer(str(bert / "vocab.txt")).save_pretrained(bert)
    torch.manual_seed(0)
    T.BertForMaskedLM(T.BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=32,
                                   max_position_embeddings=16)).save_pretrained(bert)  # fmt: skip
    gpt2 = tmp_path_factory.mktemp("gpt2")
    vocab = {w: i for i, w in enumerate(["[UNK]", *words])}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(gpt2)
    T.GPT2LMHeadModel(T.GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=2, n_head=2,
                                   n_positions=16, bos_token_id=0,
                                   eos_token_id=0)).save_pretrained(gpt2)  # fmt: skip
    return {"bert": str(bert), "gpt2": str(gpt2)}


def test_cli_circuit_bert(saved_models, tmp_path):
    out = tmp_path / "out"
    rc, text, err = _run(["circuit", saved_models["bert"], "--text",
                          "the keys to the cabinet [MASK] on the table", "--target", "are",
                          "--foil", "is", "--baseline-text",
                          "the dog to the cabinet [MASK] on the table", "--top-n", "6",
                          "--json", str(out / "eap.json"), "--neuronpedia", str(out / "np"),
                          "--html", str(out / "circuit.html")])  # fmt: skip
    assert rc == 0, err
    assert "circuit of" in text and "6 of 66 head/MLP sites kept" in text
    d, *_ = read_eap((out / "eap.json").read_text())
    assert sum(v["in_graph"] for v in d["nodes"].values()) <= 6 + 2
    files = sorted(p.name for p in (out / "np").iterdir())
    assert "graph-metadata.json" in files and len(files) == 2
    slug = next(f for f in files if f != "graph-metadata.json")
    _pydantic_models().model_validate_json((out / "np" / slug).read_text())
    page = (out / "circuit.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert page.count('class="comp"') == 11 + 6 + 1  # tokens, kept sites, target


def test_cli_circuit_gpt2_and_errors(saved_models, tmp_path):
    rc, text, err = _run(["circuit", saved_models["gpt2"], "--text", "the keys to the",
                          "--target", "cabinet", "--foil", "table", "--json",
                          str(tmp_path / "g.json")])  # fmt: skip
    assert rc == 0, err
    read_eap((tmp_path / "g.json").read_text())
    rc, _, err = _run(["circuit", saved_models["gpt2"], "--text", "the keys to the",
                       "--target", "cabinet", "--baseline-text", "the keys"])  # fmt: skip
    assert rc == 2 and "baseline text has 2 tokens" in err
