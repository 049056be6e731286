"""AtP*'s QK fix (``Patching.eap_qk``, ``Patching.node_scores_qk``, ``ablation/qk.py``):
a query or key edge's score recomputes the head's attention pattern exactly and
linearizes only what follows it; float64, fixed seeds, saturated patterns (query and key
weights scaled up).

Oracles:
- where only the pattern is nonlinear (one attention-only layer without norms, then the
  unembedding: the output is linear in each head's pattern, its values fixed), a query
  or key edge's score is its exact effect: ``Patching.edge_effects`` and the model's own
  forward with that head's columns of ``q_proj`` (``k_proj``) at that position computed
  from the corrupted run's input (a forward hook); EAP is far from it there;
- a site's score is EAP over its value and target inputs plus, per head, the exact change
  of the output when that head's query and key at the site's position are both patched
  (hooks), on the same model; a head's site (read by the target alone) is its effect;
- on small Llama and GPT-2 models the value, MLP and target edges' scores are EAP's, and
  the query and key edges' scores are closer to exact patching than EAP's;
- grouped-query attention (a one-layer Llama whose output is linear in the pattern:
  no final norm, no MLP): a key edge into one query head is exact against
  ``Patching.edge_effects``, whose key is that head's own copy of the shared K head.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop.ablation import Patching
from semiring_backprop.experiments.models import attention_only

T = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")

F64 = torch.float64
IDS, COR = torch.tensor([[0, 3, 4, 5, 3, 4, 5]]), torch.tensor([[0, 3, 4, 5, 6, 7, 8]])
HIDDEN, HEADS = 8, 2
D = HIDDEN // HEADS


def metric(y):
    return y[0, -1, 5] - y[0, -2, 6] + y[0, 3, 1]


def _hf_metric(out):
    return metric(out.logits)


@functools.cache
def linear_after_pattern():
    """One attention layer, no norms: the output is linear in the pattern; saturated."""
    m = attention_only(12, hidden=HIDDEN, heads=HEADS, layers=1, length=7, seed=0).to(F64)
    m.layers[0].input_layernorm = nn.Identity()
    m.norm = nn.Identity()
    attn = m.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(8)
        attn.k_proj.weight.mul_(8)
    return m.eval()


def _clean():
    with torch.no_grad():
        return float(metric(linear_after_pattern()(IDS)))


@functools.cache
def linear_patching():
    res = sbp.backprop(linear_after_pattern(), (IDS,), output=metric, semirings=[sbp.Real()])
    return Patching(res, (COR,))


def _patched_output(patch):
    """The model's output with ``{"q" | "k": [(head, position)]}`` of ``patch`` computed
    from the corrupted run's input to that projection (forward hooks)."""
    model = linear_after_pattern()
    attn = model.layers[0].self_attn
    seen = {}
    hook = attn.q_proj.register_forward_pre_hook(lambda mod, a: seen.__setitem__("x", a[0]))
    with torch.no_grad():
        model(COR)
    hook.remove()
    x_cor = seen["x"]

    def replace(which):
        def fn(mod, a, out):
            alt = torch.nn.functional.linear(x_cor, mod.weight, mod.bias)
            out = out.clone()
            for h, pos in patch.get(which, ()):
                out[0, pos, h * D : (h + 1) * D] = alt[0, pos, h * D : (h + 1) * D]
            return out

        return fn

    hooks = [attn.q_proj.register_forward_hook(replace("q")),
             attn.k_proj.register_forward_hook(replace("k"))]  # fmt: skip
    try:
        with torch.no_grad():
            return float(metric(model(IDS)))
    finally:
        for h in hooks:
            h.remove()


def test_the_qk_fix_is_exact_where_only_the_pattern_is_nonlinear():
    p = linear_patching()
    patterns = linear_after_pattern().patterns(IDS)[0]
    assert float(patterns.amax(-1).max()) > 1 - 1e-9  # saturated rows
    fixed, eap, exact = p.eap_qk(), p.eap(), p.edge_effects()
    qk = fixed.input.isin(["q", "k"])
    assert qk.sum() >= 10 and set(fixed[qk].src_role) == {"embedding"}
    clean = _clean()
    for row in fixed[qk].itertuples():
        hooked = clean - _patched_output({row.input: [(int(row.dst_head_index), row.position)]})
        assert row.score == pytest.approx(hooked, abs=1e-9), row
    err = (fixed.score - exact.effect)[qk].abs()
    eap_err = (eap.score - exact.effect)[qk].abs()
    assert float(err.max()) < 1e-9
    assert float(eap_err.max()) > 0.1  # the saturated softmax hides these effects from EAP
    assert fixed.score[~qk].tolist() == eap.score[~qk].tolist()  # value, target: EAP's


def test_a_sites_score_takes_each_heads_pattern_exactly():
    p = linear_patching()
    nodes, eap = p.node_scores_qk(), p.eap()
    effects = p.node_effects()
    assert nodes[list(effects.columns[:4])].equals(effects[list(effects.columns[:4])])
    clean = _clean()
    heads = nodes.role == "head"  # read by the target alone: linear, the score is the effect
    assert (nodes.score - effects.effect)[heads].abs().max() < 1e-9
    assert effects.effect[heads].abs().max() > 1e-3
    emb = eap[(eap.src_role == "embedding") & eap.input.isin(["v", "target"])]
    first = emb.groupby("position").score.sum()
    for row in nodes[nodes.role == "embedding"].itertuples():
        want = first.get(row.position, 0.0)
        for h in range(HEADS):
            want += clean - _patched_output({"q": [(h, row.position)], "k": [(h, row.position)]})
        assert row.score == pytest.approx(want, abs=1e-9), row


def _llama(kv=None, layers=2):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=12, hidden_size=HIDDEN, intermediate_size=16,
                        num_hidden_layers=layers, num_attention_heads=HEADS,
                        num_key_value_heads=kv or HEADS, max_position_embeddings=16,
                        initializer_range=0.5, attn_implementation="sdpa")  # fmt: skip
    model = T.LlamaForCausalLM(cfg).to(F64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3)
            layer.self_attn.k_proj.weight.mul_(3)
    return model.eval()


def _gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=12, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=16,
                       bos_token_id=0, eos_token_id=0, initializer_range=0.5,
                       attn_implementation="sdpa")  # fmt: skip
    model = T.GPT2LMHeadModel(cfg).to(F64)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, : 2 * HIDDEN] *= 3
    return model.eval()


def _compare(model):
    res = sbp.backprop(model, kwargs={"input_ids": IDS}, output=_hf_metric,
                       semirings=[sbp.Real()])  # fmt: skip
    p = Patching(res, {"input_ids": COR})
    start, passes = time.perf_counter(), p.evaluations
    fixed = p.eap_qk()
    cost = (time.perf_counter() - start, p.evaluations - passes)
    eap = p.eap()
    qk = fixed.input.isin(["q", "k"])
    assert fixed.score[~qk].tolist() == eap.score[~qk].tolist()
    exact = p.edge_effects(fixed[qk]).effect.to_numpy()
    err = float(abs(fixed.score[qk].to_numpy() - exact).sum())
    eap_err = float(abs(eap.score[qk].to_numpy() - exact).sum())
    return p, err, eap_err, float(abs(exact).sum()), cost


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_query_and_key_edges_are_closer_to_patching_than_eap(name):
    model = _llama() if name == "llama" else _gpt2()
    p, err, eap_err, total, (seconds, passes) = _compare(model)
    print(f"{name}: q/k edges, Σ|score - effect| QK fix {err:.4g}, EAP {eap_err:.4g} "
          f"(Σ|effect| {total:.4g}); eap_qk {seconds:.2f} s, {passes} passes")  # fmt: skip
    assert err < 0.5 * eap_err
    nodes, effects = p.node_scores_qk(), p.node_effects()
    atp: dict = {}  # AtP of a site: the sum of EAP over its edges
    for row in p.eap().itertuples():
        key = (row.src_layer, row.src_role, _plain(row.src_head_index), row.position)
        atp[key] = atp.get(key, 0.0) + row.score
    keys = zip(nodes.layer, nodes.role, [_plain(h) for h in nodes.head_index], nodes.position)
    first = [atp.get(k, 0.0) for k in keys]
    node_err = float(abs(nodes.score - effects.effect).sum())
    atp_err = float(abs(pd.Series(first) - effects.effect).sum())
    print(f"{name}: sites, Σ|score - effect| QK fix {node_err:.4g}, AtP {atp_err:.4g} "
          f"(Σ|effect| {float(abs(effects.effect).sum()):.4g})")  # fmt: skip
    assert node_err < atp_err


def test_grouped_query_key_edges_patch_the_heads_own_copy():
    model = _llama(kv=1, layers=1)  # two query heads share one K/V head
    model.model.norm = nn.Identity()
    model.model.layers[0].mlp = _Zero()
    model.eval()
    res = sbp.backprop(model, kwargs={"input_ids": IDS}, output=_hf_metric,
                       semirings=[sbp.Real()])  # fmt: skip
    p = Patching(res, {"input_ids": COR})
    assert p.projection_reads(p.dest_index[(0, "head", 0, "k")])  # heads share columns
    fixed, eap = p.eap_qk(), p.eap()
    qk = fixed.input.isin(["q", "k"])
    exact = p.edge_effects(fixed[qk]).effect.to_numpy()
    err = abs(fixed.score[qk].to_numpy() - exact)
    assert float(err.max()) < 1e-9
    assert float(abs(eap.score[qk].to_numpy() - exact).max()) > 1e-2
    k = fixed[fixed.input == "k"]
    assert set(k.dst_head_index) == {0, 1} and float(k.score.abs().max()) > 1e-3


def _plain(v):
    return None if pd.isna(v) else int(v)


class _Zero(nn.Module):
    """An MLP that adds nothing: the output stays linear in the last pattern."""

    def forward(self, x):
        return x * 0.0
