"""The edges of a circuit (``circuits.edges``) against brute force.

Oracles:
- enumeration: on tiny attention models (one layer, one layer with a pre-norm, two
  layers; float64, random weights, negative ones included), every whole path of the
  scalar gradient graph is listed (tests/oracles.py) with the component sites it passes
  (the embedding, each head's slice of the output projection's input, each MLP's
  output, read here by module tags) and the query / key / value projection it enters
  before each head. Each edge u -> v is the ⊕ over the listed paths in which v is the
  next component after u, and each attention edge the ⊕ over the paths entering the
  head's value projection at one position and leaving the head at another; both
  compared for Real, MaxProduct, Entropy, PathCount and TopK(2), row by row (no row
  missing, none extra);
- cut (Real, seed "x"): every path into an MLP's input or into the target has one last
  component, so the edges into it sum to the marginal of the MLP's input (by module
  path) and to the output's total, on the tiny models and on BERT, GPT-2 (fused
  query/key/value) and a grouped-query Llama; there the edges into the heads' q / k / v
  inputs also sum to the marginal of each projection's input;
- the attention edges of a head summed over both positions are the edges into its
  value input summed over their sources (Real).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

import oracles
import semiring_backprop as sbp
from semiring_backprop.circuits.attention_edges import attention_edges
from semiring_backprop.circuits.edges import circuit_edges

F64 = torch.float64
MP = sbp.MaxProduct()
SEMIRINGS = [sbp.Real(), MP, sbp.Entropy(), sbp.PathCount(), sbp.TopK(2)]
KEY = ["src_layer", "src_role", "src_head_index", "dst_layer", "dst_role", "dst_head_index",
       "input", "position"]  # fmt: skip


class Attention(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.num_heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, t, h = x.shape
        d = h // self.num_heads

        def split(y):
            return y.view(b, t, self.num_heads, d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        a = (q @ k.transpose(-1, -2) / math.sqrt(d)).softmax(-1)
        return self.out((a @ v).transpose(1, 2).reshape(b, t, h))


class Layer(nn.Module):
    def __init__(self, h, heads, f, norm):
        super().__init__()
        self.ln = nn.LayerNorm(h) if norm else nn.Identity()
        self.attention = Attention(h, heads)
        self.mlp = nn.Sequential(nn.Linear(h, f), nn.Tanh(), nn.Linear(f, h))

    def forward(self, x):
        x = x + self.attention(self.ln(x))
        return x + self.mlp(x)


class Tiny(nn.Module):
    def __init__(self, layers, h, f, norm=False):
        super().__init__()
        self.emb = nn.Embedding(7, h)
        self.layers = nn.ModuleList(Layer(h, 2, f, norm) for _ in range(layers))
        self.head = nn.Linear(h, 2)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# name: (layers, hidden, MLP width, pre-norm, positions)
TINY = {
    "one": (1, 4, 3, False, 3),
    "norm": (1, 2, 2, True, 3),
    "two": (2, 2, 2, False, 2),
}


@functools.cache
def tiny(name):
    layers, h, f, norm, t = TINY[name]
    torch.manual_seed(0)
    model = Tiny(layers, h, f, norm).to(F64).eval()
    ids = torch.tensor([[1, 4, 2][:t]])
    return sbp.backprop(model, (ids,), output=lambda y: y[0, -1, 0] - y[0, 0, 1],
                        semirings=SEMIRINGS)  # fmt: skip


@functools.cache
def tables(name, seed):
    res = tiny(name)
    return circuit_edges(res, seed=seed), attention_edges(res, seed=seed)


def _events(res, layers, h):
    """``event(node, flat)``: the component sites and projection entries, by module."""
    d = h // 2
    table: dict = {res.node("emb"): lambda f: ("embedding", -1, None, f // h)}
    for i in range(layers):
        table[res.node(f"layers.{i}.attention.out:input")] = (
            lambda f, i=i: ("head", i, (f % h) // d, f // h))  # fmt: skip
        table[res.node(f"layers.{i}.mlp")] = lambda f, i=i: ("mlp", i, None, f // h)
        for n in res.graph.nodes:
            module = res.graph.module_of(n) or ""
            role = module.rsplit(".", 1)[-1]
            if n.target is torch.ops.aten.addmm.default and module.startswith(
                f"layers.{i}.attention."
            ) and role in ("query", "key", "value"):  # fmt: skip
                table[n] = lambda f, i=i, role=role: ("in", i, role[0], f // h)

    def event(node, flat):
        fn = table.get(node)
        return None if fn is None else fn(flat)

    return event


@functools.cache
def brute(name, seed):
    """``(edges, attention)``: ``{key: products}`` of every whole path, classified."""
    res = tiny(name)
    layers, h, *_ = TINY[name]
    dag = oracles.scalar_dag(res)
    v = res.values
    seeds = {n: np.ones(v[n].numel()) if seed == "structural" else v[n].double().reshape(-1).numpy()
             for n in oracles.sources(res)}  # fmt: skip
    groups = oracles.grouped_paths(res, dag, seeds, _events(res, layers, h))
    edges: dict = {}
    attn: dict = {}
    for sig, products in groups.items():
        comps = [(k, e) for k, e in enumerate(sig) if e[0] != "in"]
        comps.append((len(sig), ("target", layers, None, None)))
        assert comps[0][1][0] == "embedding", sig
        for (a, u), (b, w) in zip(comps, comps[1:]):
            ins = [e for e in sig[a + 1 : b] if e[0] == "in"]
            if w[0] == "head":
                assert len(ins) == 1 and ins[0][1] == w[1], sig
                assert ins[0][3] == u[3], f"a residual path changed position: {sig}"
                inp = ins[0][2]
            else:
                assert not ins, sig
                inp = w[0]
            key = (u[1], u[0], u[2], w[1], w[0], w[2], inp, u[3])
            edges.setdefault(key, []).append(products)
        for e, w in zip(sig, sig[1:]):
            if e[0] == "in" and e[2] == "v" and w[0] == "head":
                attn.setdefault((w[1], w[2], e[3], w[3]), []).append(products)
    cat = {k: np.concatenate(p) for k, p in edges.items()}
    return cat, {k: np.concatenate(p) for k, p in attn.items()}


def _expected(products, sr):
    s = oracles.stats([products], (1,), 3)
    if isinstance(sr, sbp.Real):
        return s["real"][0]
    if isinstance(sr, sbp.MaxProduct):
        hi, lo = s["hi"][0], s["lo"][0]
        return hi if abs(hi) >= abs(lo) else lo
    if isinstance(sr, sbp.PathCount):
        return s["log_count"][0]
    if isinstance(sr, sbp.Entropy):
        return s["entropy"][0]
    return s["topk"][0][0]  # TopK's headline: the best of the k, signed


def _check(got, want, what):
    assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), f"{what}: {got} != {want}"


@pytest.mark.parametrize("seed", ["structural", "x"])
@pytest.mark.parametrize("name", list(TINY))
def test_edges_match_enumeration(name, seed):
    edges, _ = tables(name, seed)
    want, _ = brute(name, seed)
    got = {tuple(_plain(row[c]) for c in KEY): row for _, row in edges.iterrows()}
    assert set(got) == set(want), (sorted(set(want) - set(got), key=str)[:5],
                                   sorted(set(got) - set(want), key=str)[:5])  # fmt: skip
    inputs = {k[6] for k in want}
    assert {"q", "k", "v", "mlp", "target"} <= inputs
    for key, products in want.items():
        for sr in SEMIRINGS:
            _check(got[key][sr.name], _expected(products, sr), f"{name} {seed} {sr.name} {key}")


@pytest.mark.parametrize("name", list(TINY))
def test_edges_match_enumeration_with_one_component_per_source_pass(name, monkeypatch):
    """The components go forward together, their rows padded where fewer of them reach
    a node (the other tests: one pass for all); with a budget of held values that
    fits one component (``HELD_BUDGET`` 1), one pass per component."""
    from semiring_backprop.circuits import edge_sources

    monkeypatch.setattr(edge_sources, "HELD_BUDGET", 1)
    edges = circuit_edges(tiny(name), seed="x")
    want, _ = brute(name, "x")
    got = {tuple(_plain(row[c]) for c in KEY): row for _, row in edges.iterrows()}
    assert set(got) == set(want)
    for key, products in want.items():
        for sr in SEMIRINGS:
            _check(got[key][sr.name], _expected(products, sr), f"{name} {sr.name} {key}")


@pytest.mark.parametrize("name", list(TINY))
def test_attention_edges_match_enumeration(name):
    _, attn = tables(name, "structural")
    _, want = brute(name, "structural")
    layers, _, _, _, t = TINY[name]
    assert len(attn) == layers * 2 * t * t
    assert len(want) >= t * t  # (with one layer, the heads at unread positions reach nothing)
    names = ["layer", "head_index", "src_position", "dst_position", "src_token", "dst_token"]
    assert list(attn.columns) == names + [sr.name for sr in SEMIRINGS]
    for _, row in attn.iterrows():
        key = (int(row.layer), int(row.head_index), int(row.src_position), int(row.dst_position))
        if key not in want:  # the output reads not every position: no path, the zeros
            assert row["Real"] == 0 and row[MP.name] == -math.inf, key
            assert row["PathCount"] == -math.inf, key
            continue
        for sr in SEMIRINGS:
            _check(row[sr.name], _expected(want[key], sr), f"{name} {sr.name} {key}")


def _plain(x):
    import pandas as pd

    if x is None or x is pd.NA:
        return None
    return x if isinstance(x, str) else int(x)


def _close(got, want, what):
    assert np.allclose(got, want, rtol=1e-9, atol=1e-13), f"{what}: {got} != {want}"


def _cuts(res, edges, layers, mlp_input):
    """Real, seed "x": the edges into the target and into each MLP sum to the marginal
    there."""
    real = sbp.Real()
    total = float(res.marginal(res.graph.output_node, real, seed="x"))
    assert total != 0
    into = edges[edges.dst_role == "target"]
    assert set(into.src_role) == {"embedding", "head", "mlp"}
    _close(into["Real"].sum(), total, "edges into the target")
    for i in range(layers):
        want = float(res.marginal(mlp_input.format(i=i), real, seed="x").sum())
        got = edges[(edges.dst_role == "mlp") & (edges.dst_layer == i)]["Real"].sum()
        _close(got, want, f"edges into the MLP of layer {i}")


@pytest.mark.parametrize("name", list(TINY))
def test_real_edges_into_an_input_sum_to_its_marginal(name):
    edges, attn = tables(name, "x")
    res = tiny(name)
    _cuts(res, edges, TINY[name][0], "layers.{i}.mlp:input")
    for (layer, head), rows in attn.groupby(["layer", "head_index"]):
        into = edges[(edges.dst_role == "head") & (edges.dst_layer == layer)
                     & (edges.dst_head_index == head) & (edges.input == "v")]  # fmt: skip
        _close(rows["Real"].sum(), into["Real"].sum(), f"value input of {layer}.{head}")


# name: (MLP input, {inputs: projection input}, layers, rtol); Llama's RMSNorm computes in
# float32 inside the float64 model: alpha and D round differently there (6e-5 seen on
# the smallest sums, 1e-8)
HF = {
    "bert1": ("bert.encoder.layer.{i}.intermediate:input",
              {"q": "bert.encoder.layer.{i}.attention.self.query:input",
               "k": "bert.encoder.layer.{i}.attention.self.key:input",
               "v": "bert.encoder.layer.{i}.attention.self.value:input"}, 1, 1e-9),
    "gpt2": ("transformer.h.{i}.mlp:input", {"qkv": "transformer.h.{i}.attn.c_attn:input"},
             2, 1e-9),
    "llama_gqa": ("model.layers.{i}.mlp:input",
                  {"q": "model.layers.{i}.self_attn.q_proj:input",
                   "k": "model.layers.{i}.self_attn.k_proj:input",
                   "v": "model.layers.{i}.self_attn.v_proj:input"}, 1, 1e-3),
}  # fmt: skip


@functools.cache
def hf_result(name):
    import test_circuit_nodes as tcn

    if name != "llama_gqa":
        return tcn.result(name)
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=40, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        attn_implementation="sdpa")).to(F64).eval()  # fmt: skip
    return sbp.backprop(model, kwargs={"input_ids": tcn.IDS}, semirings=[sbp.Real(), MP],
                        output=lambda out: out.logits[0, -1, 5] - out.logits[0, -2, 3])  # fmt: skip


@pytest.mark.parametrize("name", list(HF))
def test_real_cuts_on_hugging_face_models(name):
    """Every path into a projection's input or an MLP's input, or to the output, has one
    last component: the edges into it sum to its marginal (read by module path). Under
    grouped-query attention the K/V heads are shared: the edges into each query head's
    k / v input still sum, over the heads, to the marginal of the key / value input."""
    pytest.importorskip("transformers")
    import test_circuit_nodes as tcn

    res = hf_result(name)
    mlp_input, projections, layers, rtol = HF[name]
    edges = circuit_edges(res, semirings=[sbp.Real(), MP], seed="x", tokens=tcn.TOKENS)
    real = sbp.Real()
    total = float(res.marginal(res.graph.output_node, real, seed="x"))
    assert total != 0
    heads = edges[edges.dst_role == "head"]
    checks = [(edges[edges.dst_role == "target"]["Real"].sum(), total, "target")]
    for i in range(layers):
        mlp = edges[(edges.dst_role == "mlp") & (edges.dst_layer == i)]["Real"].sum()
        checks.append((mlp, float(res.marginal(mlp_input.format(i=i), real, seed="x").sum()),
                       f"mlp {i}"))  # fmt: skip
        for inputs, where in projections.items():
            got = heads[(heads.dst_layer == i) & heads.input.isin(list(inputs))]["Real"].sum()
            want = float(res.marginal(where.format(i=i), real, seed="x").sum())
            checks.append((got, want, f"{inputs} of layer {i}"))
    for got, want, what in checks:
        assert want != 0, what
        assert np.isclose(got, want, rtol=rtol, atol=0), f"{name} {what}: {got} != {want}"
    assert set(edges.input) == {"q", "k", "v", "mlp", "target"}
    assert set(heads.dst_head_index) == {0, 1}
    assert np.isfinite(edges[MP.name]).all()
    assert list(edges.columns[:9]) == ["src_layer", "src_role", "src_head_index", "dst_layer",
                                       "dst_role", "dst_head_index", "input", "position",
                                       "token"]  # fmt: skip
    assert edges[edges.src_role != "head"].src_head_index.isna().all()


@pytest.mark.parametrize("name", ["one", "two", "bert2", "gpt2", "llama_gqa"])
def test_attention_edges_by_the_matmul_equal_a_pass_from_each_position(name):
    """The attention edges read at the ``A @ V`` matmul (its edge marginals: alpha at V,
    the weights A, D at its output) equal those of a pass back from the head's slice at
    each position (the definition, run generically), under every semiring; and the
    matmul is found (GPT-2's fused q/k/v and Llama's shared K/V heads included)."""
    from semiring_backprop.circuits import attention_edges as ae
    from semiring_backprop.circuits import layout as cl

    res = tiny(name) if name in TINY else hf_result(name)
    srs = list(res.semirings)
    lay = cl.layout(res)
    al = cl.circuit_alphas(res, srs, "x", None, lay)
    for layer in range(lay.layers):
        for comp in lay.heads[layer]:
            plan = cl.head_plan(res, lay, srs, layer, comp.head, roles=("value",))
            fast = ae._attention_by_contraction(res, lay, srs, plan, al)
            assert fast is not None, f"no A @ V found in layer {layer}"
            slow = ae._attention_by_positions(res, lay, srs, plan, al)
            for sr, x, y in zip(srs, fast, slow):
                got, want = ae.readout(sr, x), ae.readout(sr, y)
                assert torch.allclose(got, want, rtol=1e-9, atol=1e-14, equal_nan=True), (
                    f"{sr} in layer {layer}, head {comp.head}: {got} != {want}"
                )


@pytest.mark.parametrize("name", ["two", "bert2", "gpt2", "llama_gqa"])
def test_a_later_call_reads_each_heads_columns_where_the_heads_are_apart(name):
    """The first call of a trace passes back from each head's slice and finds out
    whether the heads of each block are apart (each with projection columns of its own,
    through which only its paths leave); a later call then reads the reverse pass's D on
    those columns. Both calls give the same edges, which on the tiny model are the
    enumerated ones; under grouped-query attention (K/V columns shared by two query
    heads) the heads are not apart and every call passes back."""
    res = tiny(name) if name in TINY else hf_result(name)
    res.graph.__dict__.pop("_heads_apart", None)
    first = circuit_edges(res, seed="structural")
    verdicts = list(res.graph.__dict__["_heads_apart"].values())
    if name == "llama_gqa":
        assert verdicts == [None]
    else:
        assert verdicts and all(isinstance(v, dict) for v in verdicts)
    later = circuit_edges(res, seed="structural")
    pd = pytest.importorskip("pandas")
    pd.testing.assert_frame_equal(first, later, rtol=1e-12, atol=0)
    if name in TINY:
        want, _ = brute(name, "structural")
        got = {tuple(_plain(row[c]) for c in KEY): row for _, row in later.iterrows()}
        assert set(got) == set(want)
        for key, products in want.items():
            for sr in SEMIRINGS:
                _check(got[key][sr.name], _expected(products, sr), f"later call {sr.name} {key}")
