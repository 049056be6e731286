"""The nodes of a circuit (``circuits.nodes.circuit_nodes``) on tiny BERTs (one and two
layers) and a tiny GPT-2, float64, random weights.

Oracles:
- cut (Real, seed "x"): the token embeddings and each layer's residual stream are cuts
  of the graph, so their sites (one per position) sum to the target's value, the total
  flow alpha(output);
- direct: each head's score is the sum of ``res.marginal`` over that head's columns of
  the output projection's input, and each MLP's the sum over its output module's
  columns, read here by module path (not by the nodes the library finds);
- MaxProduct (seed "structural"): the best site of every cut has the value of the top
  path (the larger |product| of ``top_path`` with sign + and -), and every site the top
  path passes has that value too;
- a model without attention raises an InputError that says so.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop.circuits.nodes import circuit_nodes
from semiring_backprop.errors import InputError

T = pytest.importorskip("transformers")

F64 = torch.float64
V = 40
IDS = torch.tensor([[3, 7, 1, 9, 4]])
TOKENS = ["[CLS]", "the", "cat", "sat", "[SEP]"]
MP = sbp.MaxProduct()
SEMIRINGS = [sbp.Real(), MP, sbp.Entropy(), sbp.TopK(2)]


def _bert(layers):
    return T.BertForMaskedLM(T.BertConfig(
        vocab_size=V, hidden_size=8, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, attn_implementation="sdpa"))  # fmt: skip


def _gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=V, n_embd=8, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
        eos_token_id=0, attn_implementation="sdpa"))  # fmt: skip


def _mlm(out):
    logp = out.logits[0, 2].log_softmax(-1)
    return logp[7] - logp[9]


# name: (build, output, output projection's input per layer, MLP output per layer, layers)
MODELS = {
    "bert1": (lambda: _bert(1), _mlm, "bert.encoder.layer.{i}.attention.output.dense:input",
              "bert.encoder.layer.{i}.output.dense", 1),
    "bert2": (lambda: _bert(2), _mlm, "bert.encoder.layer.{i}.attention.output.dense:input",
              "bert.encoder.layer.{i}.output.dense", 2),
    "gpt2": (_gpt2, lambda out: out.logits[0, -1, 5] - out.logits[0, -2, 3],
             "transformer.h.{i}.attn.c_proj:input", "transformer.h.{i}.mlp", 2),
}  # fmt: skip


@functools.cache
def result(name):
    torch.manual_seed(0)
    build, output, *_ = MODELS[name]
    model = build().to(F64).eval()
    return sbp.backprop(model, kwargs={"input_ids": IDS}, output=output, semirings=SEMIRINGS)


@functools.cache
def table(name, seed):
    return circuit_nodes(result(name), seed=seed, tokens=TOKENS)


def _close(got, want, what):
    assert np.allclose(got, want, rtol=1e-9, atol=1e-15), f"{what}: {got} != {want}"


@pytest.mark.parametrize("name", list(MODELS))
def test_sites_and_columns(name):
    t = table(name, "x")
    layers = MODELS[name][-1]
    assert list(t.columns[:6]) == ["layer", "position", "token", "head_index", "role", "node"]
    assert [sr.name for sr in SEMIRINGS] == list(t.columns[6:])
    counts = t.role.value_counts().to_dict()
    assert counts == {"embedding": 5, "head": 2 * 5 * layers, "mlp": 5 * layers,
                      "residual": 5 * layers, "target": 1}  # fmt: skip
    assert list(t[t.role == "residual"].token[:5]) == TOKENS
    assert t[t.role != "head"]["head_index"].isna().all()
    assert t[t.role == "target"].position.isna().all()


@pytest.mark.parametrize("name", list(MODELS))
def test_real_cuts_sum_to_the_target(name):
    t = table(name, "x")
    total = t[t.role == "target"]["Real"].item()
    assert total != 0
    _close(t[t.role == "embedding"]["Real"].sum(), total, "embedding")
    for layer in range(MODELS[name][-1]):
        cut = t[(t.role == "residual") & (t.layer == layer)]
        _close(cut["Real"].sum(), total, f"residual stream of layer {layer}")


@pytest.mark.parametrize("name", list(MODELS))
def test_real_heads_and_mlps_from_marginals(name):
    res, t = result(name), table(name, "x")
    _, _, proj_in, mlp_out, layers = MODELS[name]
    real = sbp.Real()
    for i in range(layers):
        m = res.marginal(proj_in.format(i=i), real, seed="x")[0]  # (positions, heads * d)
        per_head = m.reshape(m.shape[0], 2, -1).sum(-1)
        for h in range(2):
            got = t[(t.role == "head") & (t.layer == i) & (t["head_index"] == h)]
            _close(got["Real"].to_numpy(), per_head[:, h].numpy(), f"layer {i} head {h}")
        mlp = res.marginal(mlp_out.format(i=i), real, seed="x")[0].sum(-1)
        _close(t[(t.role == "mlp") & (t.layer == i)]["Real"].to_numpy(), mlp.numpy(),
               f"layer {i} mlp")  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_maxproduct_heads_from_marginals(name):
    """The signed best over a head's columns: the largest |hi| or |lo| of the slice."""
    res, t = result(name), table(name, "structural")
    proj_in, layers = MODELS[name][2], MODELS[name][-1]
    for i in range(layers):
        m = res.marginal(proj_in.format(i=i), MP)
        hi = m.hi[0].reshape(5, 2, -1).amax(-1)
        lo = m.lo[0].reshape(5, 2, -1).amin(-1)
        best = torch.where(hi.abs() >= lo.abs(), hi, lo)
        for h in range(2):
            got = t[(t.role == "head") & (t.layer == i) & (t["head_index"] == h)][MP.name]
            _close(got.to_numpy(), best[:, h].numpy(), f"layer {i} head {h}")


def _top(res, t):
    src = t[t.role == "embedding"].node.iloc[0]
    paths = [res.top_path(src, MP, sign=s) for s in "+-"]
    return max(paths, key=lambda p: abs(p.value))


def _passes(res, path, row, positions):
    """Whether ``path`` passes an element of the site in ``row``."""
    if row.role == "target":
        return True
    for step in path.steps:
        if step.node != row.node or step.index is None:
            continue
        shape = res.values[res.node(step.node)].shape
        flat = int(np.ravel_multi_index(step.index, tuple(shape)))
        width = int(np.prod(shape)) // positions
        position, col = divmod(flat, width)
        if position != row.position:
            continue
        if pd_na(row["head_index"]) or col // (width // 2) == row["head_index"]:  # two heads
            return True
    return False


def pd_na(x) -> bool:
    import pandas as pd

    return x is pd.NA or pd.isna(x)


@pytest.mark.parametrize("name", list(MODELS))
def test_maxproduct_cuts_and_the_top_path(name):
    res, t = result(name), table(name, "structural")
    path = _top(res, t)
    col = MP.name
    cuts = [t[t.role == "embedding"], t[t.role == "target"]]
    cuts += [t[(t.role == "residual") & (t.layer == i)] for i in range(MODELS[name][-1])]
    for cut in cuts:
        best = cut[col].to_numpy()[np.abs(cut[col].to_numpy()).argmax()]
        _close(best, path.value, f"best site of the {cut.role.iloc[0]} cut")
    passed = [row for _, row in t.iterrows() if _passes(res, path, row, 5)]
    assert {r.role for r in passed} >= {"embedding", "residual", "target"}
    assert len(passed) >= 2 + MODELS[name][-1]
    for row in passed:
        _close(row[col], path.value, f"{row.role} {row.layer} {row.position} on the top path")


def test_no_attention_is_named():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).to(F64)
    x = torch.randn(1, 3, 4, dtype=F64)
    res = sbp.backprop(mlp, (x,), output=lambda y: y.sum(), semirings=[sbp.Real()])
    with pytest.raises(InputError, match="found no attention block"):
        circuit_nodes(res)
