"""Circuits of models built from ``torch.nn.TransformerEncoderLayer``
(``nn.MultiheadAttention``: one fused input projection, the output projection called
as ``F.linear`` inside ``F.multi_head_attention_forward``, the sequence first inside).

Oracles:
- enumeration (one layer, d_model 2, two heads, post-norm and pre-norm; float64): every
  whole path of the scalar gradient graph is listed (tests/oracles.py) with the
  components it passes, found here from the parameters each op reads (the embedding;
  each head's columns of the output projection's input; the second MLP linear's
  output) and the query / key / value columns of the fused input projection it enters.
  Each site is the ⊕ over the paths through it, each edge u -> v the ⊕ over the paths
  in which v is the next component after u, compared for Real and MaxProduct, row by
  row (no row missing, none extra);
- cuts (two layers, d_model 8, post-norm and pre-norm, Real, seed "x"): the target's
  value is the embeddings' gradient × input summed (torch.autograd); each layer's
  residual sites sum to it; the edges into the target sum to it; the edges into each
  MLP sum to the marginal of its first linear's input; the edges into each head's
  q / k / v input at each position sum to the marginal of that head's columns of the
  fused projection's output there (``res.marginal``).
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

pytest.importorskip("pandas")

F64 = torch.float64
MP = sbp.MaxProduct()
SEMIRINGS = [sbp.Real(), MP]
KEY = ["src_layer", "src_role", "src_head_index", "dst_layer", "dst_role", "dst_head_index",
       "input", "position"]  # fmt: skip
HEADS = 2


class Encoder(nn.Module):
    """An embedding, ``TransformerEncoderLayer``s (batch first) and a linear readout."""

    def __init__(self, layers, d, ff, norm_first):
        super().__init__()
        self.emb = nn.Embedding(7, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, HEADS, ff, dropout=0.0, batch_first=True,
                                       norm_first=norm_first)
            for _ in range(layers)
        )  # fmt: skip
        self.head = nn.Linear(d, 2)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _output(y):
    return y[0, -1, 0] - y[0, 0, 1]


# name: (layers, d_model, feed-forward width, norm_first, positions)
MODELS = {
    "post1": (1, 2, 2, False, 3),
    "pre1": (1, 2, 2, True, 3),
    "post2": (2, 8, 8, False, 3),
    "pre2": (2, 8, 8, True, 3),
}


@functools.cache
def model(name):
    layers, d, ff, norm_first, t = MODELS[name]
    torch.manual_seed(0)
    m = Encoder(layers, d, ff, norm_first).to(F64).eval()
    return m, torch.tensor([[1, 4, 2, 5][:t]])


@functools.cache
def built(name, seed):
    """The circuit (``sbp.circuit``, seed "x"; another seed read from the same pass)."""
    if seed != "x":
        res = built(name, "x")[1]
        return sbp.Circuit.from_result(res, SEMIRINGS, seed=seed), res
    m, ids = model(name)
    c = sbp.circuit(m, (ids,), output=_output, semirings=SEMIRINGS, seed=seed)
    return c, c.result


def _reads(node, what: str) -> bool:
    """Whether ``node`` reads a parameter whose name contains ``what``."""
    return any(what in a.name for a in node.all_input_nodes)


def _linear(res, module: str, param: str):
    """The addmm of ``module`` that reads ``param``'s bias (in_proj, out_proj, ...)."""
    found = [n for n in res.graph.nodes if n.target is torch.ops.aten.addmm.default
             and (res.graph.module_of(n) or "") == module and _reads(n, param)]  # fmt: skip
    assert len(found) == 1, (module, param, found)
    return found[0]


def _events(res, layers, d):
    """``event(node, flat)``: the component sites and projection entries, found from the
    parameters the ops read, not from the code under test."""
    hd = d // HEADS
    table: dict = {res.node("emb"): lambda f: ("embedding", -1, None, f // d)}
    for i in range(layers):
        attn = f"layers.{i}.self_attn"
        out_proj = _linear(res, attn, "out_proj_bias")
        head_in = next(a for a in out_proj.all_input_nodes if a in res.needed)
        table[head_in] = lambda f, i=i: ("head", i, (f % d) // hd, f // d)
        in_proj = _linear(res, attn, "in_proj_bias")
        # (positions, 3 d): query, key and value columns, heads in order within each
        table[in_proj] = lambda f, i=i: ("in", i, "qkv"[(f % (3 * d)) // d], f // (3 * d),
                                         ((f % d) // hd))  # fmt: skip
        table[_linear(res, f"layers.{i}.linear2", "linear2_bias")] = (
            lambda f, i=i: ("mlp", i, None, f // d))  # fmt: skip

    def event(node, flat):
        fn = table.get(node)
        return None if fn is None else fn(flat)

    return event


@functools.cache
def brute(name, seed):
    """``(sites, edges)``: ``{key: products}`` of every whole path, classified."""
    c, res = built(name, seed)
    layers, d = MODELS[name][:2]
    dag = oracles.scalar_dag(res)
    seeds = {n: np.ones(res.values[n].numel()) if seed == "structural"
             else res.values[n].double().reshape(-1).numpy()
             for n in oracles.sources(res)}  # fmt: skip
    groups = oracles.grouped_paths(res, dag, seeds, _events(res, layers, d))
    sites: dict = {}
    edges: dict = {}
    for sig, products in groups.items():
        comps = [(k, e) for k, e in enumerate(sig) if e[0] != "in"]
        for _, e in comps:
            sites.setdefault(e, []).append(products)
        sites.setdefault(("target",), []).append(products)
        comps.append((len(sig), ("target", layers, None, None)))
        assert comps[0][1][0] == "embedding", sig
        for (a, u), (b, w) in zip(comps, comps[1:]):
            ins = [e for e in sig[a + 1 : b] if e[0] == "in"]
            if w[0] == "head":
                # a head's output depends on its own q / k / v columns only
                assert len(ins) == 1 and ins[0][1] == w[1] and ins[0][4] == w[2], sig
                assert ins[0][3] == u[3], f"a residual path changed position: {sig}"
                inp = ins[0][2]
            else:
                assert not ins, sig
                inp = w[0]
            key = (u[1], u[0], u[2], w[1], w[0], w[2], inp, u[3])
            edges.setdefault(key, []).append(products)
    join = {k: np.concatenate(p) for k, p in sites.items()}
    return join, {k: np.concatenate(p) for k, p in edges.items()}


def _expected(products, sr):
    s = oracles.stats([products], (1,), 1)
    if isinstance(sr, sbp.Real):
        return s["real"][0]
    hi, lo = s["hi"][0], s["lo"][0]
    return hi if abs(hi) >= abs(lo) else lo


def _check(got, want, what):
    assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), f"{what}: {got} != {want}"


def _plain(x):
    import pandas as pd

    if x is None or x is pd.NA:
        return None
    return x if isinstance(x, str) else int(x)


@pytest.mark.parametrize("seed", ["structural", "x"])
@pytest.mark.parametrize("name", ["post1", "pre1"])
def test_sites_match_enumeration(name, seed):
    c, _ = built(name, seed)
    want, _ = brute(name, seed)
    layers, d, _, _, t = MODELS[name]
    nodes = c.nodes
    assert c.n_layers == layers and c.n_heads == HEADS and c.d_model == d
    counts = nodes.role.value_counts().to_dict()
    assert counts == {"embedding": t, "head": layers * HEADS * t, "mlp": layers * t,
                      "residual": layers * t, "target": 1}  # fmt: skip
    for row in nodes.to_dict("records"):
        if row["role"] == "residual":
            continue
        if row["role"] == "target":
            key = ("target",)
        else:
            key = (row["role"], _plain(row["layer"]), _plain(row["head_index"]),
                   _plain(row["position"]))  # fmt: skip
        for sr in SEMIRINGS:
            if key not in want:  # no path passes the site
                assert row["Real"] == 0 and row[MP.name] == -math.inf, key
                continue
            _check(row[sr.name], _expected(want[key], sr), f"{name} {seed} {sr.name} {key}")


@pytest.mark.parametrize("seed", ["structural", "x"])
@pytest.mark.parametrize("name", ["post1", "pre1"])
def test_edges_match_enumeration(name, seed):
    c, _ = built(name, seed)
    _, want = brute(name, seed)
    got = {tuple(_plain(row[k]) for k in KEY): row for row in c.edges.to_dict("records")}
    assert set(got) == set(want), (sorted(set(want) - set(got), key=str)[:5],
                                   sorted(set(got) - set(want), key=str)[:5])  # fmt: skip
    assert {"q", "k", "v", "mlp", "target"} <= {k[6] for k in want}
    for key, products in want.items():
        for sr in SEMIRINGS:
            _check(got[key][sr.name], _expected(products, sr), f"{name} {seed} {sr.name} {key}")


def _close(got, want, what, rtol=1e-9):
    assert np.allclose(got, want, rtol=rtol, atol=1e-12), f"{what}: {got} != {want}"


def _grad_times_input(name) -> float:
    """The target's value under Real with seed "x", by torch.autograd: the embeddings'
    gradient × input, summed."""
    m, ids = model(name)
    emb = m.emb(ids).detach().requires_grad_(True)
    x = emb
    for layer in m.layers:
        x = layer(x)
    (g,) = torch.autograd.grad(_output(m.head(x)), emb)
    return float((g * emb).sum().detach())


@pytest.mark.parametrize("name", ["post2", "pre2"])
def test_real_cuts_on_two_layers(name):
    c, res = built(name, "x")
    layers, d, _, _, t = MODELS[name]
    real = sbp.Real()
    nodes, edges = c.nodes, c.edges
    total = _grad_times_input(name)
    assert abs(total) > 1e-6
    _close(nodes[nodes.role == "target"]["Real"].item(), total, "the target")
    _close(nodes[nodes.role == "embedding"]["Real"].sum(), total, "the embeddings")
    for i in range(layers):
        cut = nodes[(nodes.role == "residual") & (nodes.layer == i)]
        assert len(cut) == t
        _close(cut["Real"].sum(), total, f"the residual stream of layer {i}")
    _close(edges[edges.dst_role == "target"]["Real"].sum(), total, "edges into the target")
    hd = d // HEADS
    for i in range(layers):
        want = float(res.marginal(f"layers.{i}.linear1:input", real, seed="x").sum())
        got = edges[(edges.dst_role == "mlp") & (edges.dst_layer == i)]["Real"].sum()
        _close(got, want, f"edges into the MLP of layer {i}")
        in_proj = _linear(res, f"layers.{i}.self_attn", "in_proj_bias")
        flow = res.marginal(in_proj.name, real, seed="x").reshape(t, 3 * d)
        for r, inp in enumerate("qkv"):
            for h in range(HEADS):
                cols = slice(r * d + h * hd, r * d + (h + 1) * hd)
                into = edges[(edges.dst_role == "head") & (edges.dst_layer == i)
                             & (edges.dst_head_index == h) & (edges.input == inp)]  # fmt: skip
                by_pos = into.groupby("position")["Real"].sum()
                for p in range(t):
                    _close(by_pos.get(p, 0.0), float(flow[p, cols].sum()),
                           f"edges into {inp} of head {i}.{h} at {p}")  # fmt: skip


@pytest.mark.parametrize("name", ["post2", "pre2"])
def test_maxproduct_sites_on_two_layers(name):
    """Under MaxProduct the target's value is the best path's product, which passes one
    embedding, one residual site per layer: each of those kinds' ⊕ (the value of
    largest size) is the target's."""
    c, _ = built(name, "x")
    nodes = c.nodes
    target = nodes[nodes.role == "target"][MP.name].item()
    assert math.isfinite(target) and target != 0
    for role, layer in [("embedding", -1)] + [("residual", i) for i in range(MODELS[name][0])]:
        part = nodes[(nodes.role == role) & (nodes.layer == layer)][MP.name]
        best = max(part, key=abs)
        _check(best, target, f"{role} {layer}")
