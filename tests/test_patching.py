"""Ablation on the traced graph (``analysis.patching.Patching``), float64, random weights.

Oracles:
- the model's own forward: m(M) is the clean output and m(∅) (every edge ablated, mode
  "corrupted") the corrupted input's output; ablating the embedding site at one position
  is the model run with only that token corrupted (mode "mean": with that position's
  embedding replaced by the references' mean, through a hook); ablating a head's site is
  the model with that head's columns of its output projection's input replaced by their
  corrupted values (hooks); ablating the query / value / MLP branch at one position is
  the model whose query / value projection or MLP reads its corrupted input there;
- on a linear model (attention with a fixed pattern, no norm, linear MLPs), the exact
  effects of sites and edges are the flows through them: the Real max-marginals of
  ``sbp.circuit`` seeded with ``x - x'`` (a different computation: semiring passes);
- the edges are those of ``Circuit.edges`` (the circuit's own analysis), row by row.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop.analysis.patching import EDGE_KEY, NODE_KEY, Patching
from semiring_backprop.errors import InputError

pd = pytest.importorskip("pandas")

F64 = torch.float64
IDS = torch.tensor([[1, 4, 2, 3]])
COR = torch.tensor([[1, 5, 6, 3]])  # positions 1 and 2 differ
REF = [torch.tensor([[2, 5, 6, 0]]), torch.tensor([[6, 0, 1, 4]])]


class Attention(nn.Module):
    def __init__(self, h, heads, linear):
        super().__init__()
        self.num_heads, self.linear = heads, linear
        self.query, self.key, self.value, self.out = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, t, h = x.shape
        d = h // self.num_heads

        def split(y):
            return y.view(b, t, self.num_heads, d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if self.linear:  # a fixed pattern: the model is linear in its embeddings
            scores = scores * 0.0
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h))


class Layer(nn.Module):
    def __init__(self, h, linear):
        super().__init__()
        self.ln1, self.ln2 = (nn.Identity() if linear else nn.LayerNorm(h) for _ in range(2))
        self.attention = Attention(h, 2, linear)
        act = nn.Identity() if linear else nn.Tanh()
        self.mlp = nn.Sequential(nn.Linear(h, 3), act, nn.Linear(3, h))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Tiny(nn.Module):
    def __init__(self, linear=False):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.layers = nn.ModuleList(Layer(4, linear) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def metric(y):
    return y[0, -1, 0] - y[0, 1, 1]


@functools.cache
def tiny(linear=False):
    torch.manual_seed(1)
    return Tiny(linear).to(F64).eval()


@functools.cache
def tiny_patching(linear=False, mode="corrupted"):
    res = sbp.backprop(tiny(linear), (IDS,), output=metric, semirings=[sbp.Real()])
    if mode == "mean":
        return Patching(res, mode="mean", reference=[(r,) for r in REF])
    if mode == "zero":
        return Patching(res, mode="zero")
    return Patching(res, (COR,))


def run(model, ids, hooks=()):
    handles = [h() for h in hooks]
    try:
        with torch.no_grad():
            return float(metric(model(ids)))
    finally:
        for h in handles:
            h.remove()


def test_nothing_ablated_is_the_clean_output_and_everything_the_corrupted():
    p = tiny_patching()
    model = tiny()
    clean, corrupted = run(model, IDS), run(model, COR)
    assert clean != pytest.approx(corrupted)
    assert math.isclose(p.clean, clean, rel_tol=1e-12)  # (the last bit may differ on other CPUs)
    assert math.isclose(p.metric(p.edges()), clean, rel_tol=1e-12)
    assert math.isclose(p.empty, corrupted, rel_tol=1e-12)
    assert math.isclose(p.faithfulness(p.edges()), 1, rel_tol=1e-12)
    assert p.faithfulness([]) == 0
    before = p.evaluations
    p.metric(p.edges().iloc[:5])
    assert p.evaluations == before + 1


def test_ablating_the_embedding_at_a_position_is_corrupting_that_token():
    p = tiny_patching()
    model = tiny()
    nodes = p.node_effects()
    assert list(nodes.columns) == [*NODE_KEY, "effect"]
    assert len(nodes) == 4 * (1 + 2 * (2 + 1))  # positions x (embedding + layers x (heads + MLP))
    clean = run(model, IDS)
    emb = nodes[nodes.role == "embedding"].sort_values("position")
    for pos in range(4):
        ids = IDS.clone()
        ids[0, pos] = COR[0, pos]
        want = clean - run(model, ids)
        assert math.isclose(emb.effect.iloc[pos], want, rel_tol=1e-10, abs_tol=1e-14), pos
    assert (emb.effect.abs() > 1e-6).tolist() == [False, True, True, False]


@pytest.mark.parametrize("mode", ["mean", "zero"])
def test_mean_or_zero_ablation_of_the_embedding_replaces_it_by_the_mean_or_zeros(mode):
    p = tiny_patching(mode=mode)
    model = tiny()
    with torch.no_grad():
        mean = torch.stack([model.emb(r) for r in REF]).mean(0)
    value = mean if mode == "mean" else torch.zeros_like(mean)
    nodes = p.node_effects()
    emb = nodes[nodes.role == "embedding"].sort_values("position")
    clean = run(model, IDS)
    for pos in range(4):

        def hook(pos=pos):
            def replace(module, args, out):
                out = out.clone()
                out[:, pos] = value[:, pos]
                return out

            return model.emb.register_forward_hook(replace)

        assert math.isclose(emb.effect.iloc[pos], clean - run(model, IDS, [hook]), rel_tol=1e-10)


def _captured(model, module, ids, what="input"):
    got = {}

    def keep(mod, args, out=None):
        got["v"] = (args[0] if what == "input" else out).detach().clone()

    h = (module.register_forward_pre_hook(keep) if what == "input"
         else module.register_forward_hook(keep))  # fmt: skip
    with torch.no_grad():
        model(ids)
    h.remove()
    return got["v"]


def _input_replaced(module, value, pos, cols=slice(None)):
    def hook():
        def pre(mod, args):
            x = args[0].clone()
            x[:, pos, cols] = value[:, pos, cols]
            return (x, *args[1:])

        return module.register_forward_pre_hook(pre)

    return hook


def test_ablating_a_head_or_a_branch_is_the_model_with_that_input_corrupted():
    p = tiny_patching()
    model = tiny()
    clean = run(model, IDS)
    nodes = p.node_effects().set_index(["layer", "position", "head_index", "role"])
    for layer in range(2):
        attn = model.layers[layer].attention
        out_in = _captured(model, attn.out, COR)
        for head in range(2):
            for pos in range(4):
                hook = _input_replaced(attn.out, out_in, pos, slice(2 * head, 2 * head + 2))
                want = clean - run(model, IDS, [hook])
                got = nodes.loc[(layer, pos, head, "head"), "effect"]
                assert math.isclose(got, want, rel_tol=1e-10, abs_tol=1e-14)
    # branches: what the query / value projection or the MLP reads, corrupted at one position
    for layer, branch, module in [(0, "query", "attention.query"), (1, "value", "attention.value"),
                                  (1, "mlp", "mlp")]:  # fmt: skip
        mod = model.layers[layer].get_submodule(module)
        x = _captured(model, mod, COR)
        for pos in (1, 2, 3):
            want = clean - run(model, IDS, [_input_replaced(mod, x, pos)])
            got = p.branch_effect(layer, branch, pos)
            assert math.isclose(got, want, rel_tol=1e-10, abs_tol=1e-14), (layer, branch, pos)


@functools.cache
def linear_circuit():
    model = tiny(linear=True)
    with torch.no_grad():
        base = {"emb": model.emb(COR)}
    return sbp.circuit(model, (IDS,), output=metric, baseline=base)


def test_on_a_linear_model_effects_are_the_flows_through_sites_and_edges():
    c = linear_circuit()
    p = tiny_patching(linear=True)
    nodes = p.node_effects()
    real = c.nodes[c.nodes.role.isin(["embedding", "head", "mlp"])][[*NODE_KEY, "Real"]]
    both = nodes.merge(real, on=list(NODE_KEY), how="outer", validate="one_to_one")
    assert len(both) == len(nodes) == len(real)
    assert np.allclose(both.effect, both.Real, rtol=1e-9, atol=1e-13)
    assert both.effect.abs().max() > 1e-3
    edges = p.edge_effects()
    assert list(edges.columns) == [*EDGE_KEY, "effect"]
    both = edges.merge(c.edges[[*EDGE_KEY, "Real"]], on=list(EDGE_KEY), validate="one_to_one")
    assert len(both) == len(edges) == len(c.edges)
    assert np.allclose(both.effect, both.Real, rtol=1e-9, atol=1e-13)
    assert (both.effect.abs() > 1e-6).sum() > 20
    # first order is exact on a linear model: EAP gives the effects too
    scores = p.eap()
    assert np.allclose(scores.score, edges.effect, rtol=1e-9, atol=1e-13)


def test_the_edges_are_the_circuits():
    p = tiny_patching()
    c = sbp.circuit(tiny(), (IDS,), output=metric)
    want = c.edges[list(EDGE_KEY)].reset_index(drop=True)
    pd.testing.assert_frame_equal(p.edges(), want)
    assert set(want.input) == {"q", "k", "v", "mlp", "target"}
    # given as tuples, or a frame with more columns, the same edges
    keys = list(want.iloc[:7].itertuples(index=False, name=None))
    assert p.edge_index(keys) == p.edge_index(c.edges.iloc[:7])
    by_tuples = p.edge_effects(keys)
    pd.testing.assert_frame_equal(by_tuples, p.edge_effects(c.edges.iloc[:7]))
    assert list(by_tuples.columns) == [*EDGE_KEY, "effect"]


def test_clear_errors():
    model = tiny()
    res = sbp.backprop(model, (IDS,), output=metric, semirings=[sbp.Real()])
    with pytest.raises(InputError, match="same shape"):
        Patching(res, (COR[:, :3],))
    with pytest.raises(InputError, match="mode="):
        Patching(res, (COR,), mode="resample")
    with pytest.raises(InputError, match="reference="):
        Patching(res, mode="mean")
    with pytest.raises(InputError, match="corrupted="):
        Patching(res)
    with pytest.raises(InputError, match="not inputs"):
        Patching(res, {"input_ids": COR})
    two = sbp.backprop(model, (torch.cat([IDS, COR]),), output=metric)
    with pytest.raises(InputError, match="batch of one"):
        Patching(two, (torch.cat([COR, IDS]),))
    rows = sbp.backprop(model, (torch.cat([IDS, COR]),), output=lambda y: y[:, -1, 0],
                        per_example=True)  # fmt: skip
    with pytest.raises(InputError, match="scalar output"):
        Patching(rows, (torch.cat([COR, IDS]),))
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).to(F64).eval()
    x = torch.randn(1, 3, 4, dtype=F64)
    with pytest.raises(InputError, match="attention block"):
        Patching(sbp.backprop(mlp, (x,), output=lambda y: y.sum()), (x + 1,))
    p = tiny_patching()
    with pytest.raises(InputError, match="no such source"):
        p.metric([(-1, "embedding", None, 9, "mlp", None, "mlp", 0)])
    with pytest.raises(InputError, match="branch="):
        p.branch_effect(0, "output", 1)
    with pytest.raises(InputError, match="position="):
        p.branch_effect(0, "query", 4)


def test_an_attention_only_model():
    """No MLP: heads and the embedding are the only sources (the induction model)."""
    from semiring_backprop.experiments.models import attention_only

    model = attention_only(12, hidden=8, heads=2, layers=2, length=7, seed=0).to(F64).eval()
    ids, cor = torch.tensor([[0, 3, 4, 5, 3, 4, 5]]), torch.tensor([[0, 3, 4, 5, 6, 7, 8]])

    def margin(y):
        return y[0, -2, 5] - y[0, -2, 6]

    res = sbp.backprop(model, (ids,), output=margin, semirings=[sbp.Real(), sbp.MaxProduct()])
    p = Patching(res, (cor,))
    with torch.no_grad():
        clean, corrupted = float(margin(model(ids))), float(margin(model(cor)))
    assert p.clean == pytest.approx(clean, rel=1e-12)
    assert p.empty == pytest.approx(corrupted, rel=1e-12) and clean != pytest.approx(corrupted)
    edges = p.edges()
    assert "mlp" not in set(edges.input) and "mlp" not in set(edges.src_role)
    assert p.metric(edges) == pytest.approx(clean, rel=1e-12)
    from semiring_backprop.circuits.edges import circuit_edges  # Circuit.edges' rows

    want = circuit_edges(res, seed="x")[list(EDGE_KEY)]
    pd.testing.assert_frame_equal(edges, want)
