"""Relevance weights with exact queries and keys (``ablation/relevance_qk.py``:
``pattern_adjoints``, ``relp_sites``, ``Patching.relevance_qk``); float64, fixed seeds, a
saturated pattern.

Oracles:
- under gradient weights a pattern's adjoint is torch.autograd's ``∂m/∂A`` (small Llama
  with grouped-query attention, GPT-2);
- on one attention layer followed by a LayerNorm and the unembedding, everything is
  written out by hand (tensors, torch.autograd, no hook of the library): relevance's
  LN-rule is the norm's scale detached, its CP-LRP the pattern detached; the pattern's
  relevance adjoint, each site's RelP score ``(a - a') . r`` plus every head's exact
  pattern change under it, and each query and key edge's QK-fixed score are computed
  from that forward and compared.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop.ablation import Patching, qk
from semiring_backprop.ablation import relevance_qk as rq
from semiring_backprop.experiments.models import attention_only

T = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")

F64 = torch.float64
IDS, COR = torch.tensor([[0, 3, 4, 5, 3, 4, 5]]), torch.tensor([[0, 3, 4, 5, 6, 7, 8]])
HIDDEN, HEADS = 8, 2
D = HIDDEN // HEADS
POS = IDS.shape[1]


def metric(y):
    return y[0, -1, 5] - y[0, -2, 6] + y[0, 3, 1]


@functools.cache
def model():
    """One attention layer without its input norm, then a LayerNorm: the pattern is
    the only nonlinearity before the norm; saturated."""
    m = attention_only(12, hidden=HIDDEN, heads=HEADS, layers=1, length=POS, seed=0).to(F64)
    m.layers[0].input_layernorm = nn.Identity()
    attn = m.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(8)
        attn.k_proj.weight.mul_(8)
    return m.eval()


def _split(y):
    return y.view(1, POS, HEADS, D).transpose(1, 2)


def embeddings(ids):
    m = model()
    return m.embed_tokens(ids) + m.embed_positions(torch.arange(POS))


def hand(x, *, pattern=None, hold=False, q_from=None, k_from=None, rows=()):
    """``(m, pattern, head outputs)`` written out: ``pattern`` replaces the softmax's
    output; ``hold``: the pattern detached (CP-LRP); the norm's scale always detached
    (the LN-rule); ``q_from`` / ``k_from``: an input whose query (key) replaces the clean
    one at each ``(head, position)`` of ``rows``."""
    m = model()
    attn = m.layers[0].self_attn
    q, k, v = _split(attn.q_proj(x)), _split(attn.k_proj(x)), _split(attn.v_proj(x))
    for h, p in rows:
        if q_from is not None:
            q = q.clone()
            q[0, h, p] = _split(attn.q_proj(q_from))[0, h, p]
        if k_from is not None:
            k = k.clone()
            k[0, h, p] = _split(attn.k_proj(k_from))[0, h, p]
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    future = torch.ones(POS, POS, dtype=torch.bool).triu(1)
    a = s.masked_fill(future, -math.inf).softmax(-1)
    used = pattern if pattern is not None else (a.detach() if hold else a)
    heads = used @ v  # (1, heads, positions, D): each head's output, before o_proj
    y = x + attn.o_proj(heads.transpose(1, 2).reshape(1, POS, HIDDEN))
    z = y - y.mean(-1, keepdim=True)
    sigma = (z.pow(2).mean(-1, keepdim=True) + m.norm.eps).sqrt()
    out = m.lm_head(z / sigma.detach() * m.norm.weight + m.norm.bias)
    return metric(out), a, heads


@functools.cache
def runs():
    kw, cor = {"input_ids": IDS}, {"input_ids": COR}
    res = sbp.backprop(model(), kwargs=kw, output=metric, semirings=[sbp.Real()])
    c = sbp.circuit(model(), kwargs=kw, output=metric, baseline=cor, semirings=[sbp.Real()],
                    weights="relevance")  # fmt: skip
    return Patching(res, cor), c


def relevance_adjoint():
    """``∂m/∂A`` of the hand-written forward (the norm's scale detached)."""
    x = embeddings(IDS).detach()
    _, a, _ = hand(x)
    leaf = a.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(hand(x, pattern=leaf)[0], leaf)
    return a.detach(), g


def test_the_pattern_adjoint_of_a_gradient_pass_is_autograds():
    for net, ids, cor in _small_models():
        res = sbp.backprop(net, kwargs={"input_ids": ids}, output=lambda o: o.logits[0, -1, 3]
                           - o.logits[0, -1, 4], semirings=[sbp.Real()])  # fmt: skip
        p = Patching(res, {"input_ids": cor})
        heads = qk.attention_heads(p)
        got, want = rq.pattern_adjoints(p, heads), qk._pattern_gradients(p, heads)
        assert len(got) == len({h.pattern for h in heads}) >= 2
        for node, g in got.items():
            assert float(want[node].abs().max()) > 1e-6
            # (Llama's eager attention takes its softmax in float32, in a float64 model)
            tight = g.dtype == F64
            torch.testing.assert_close(g, want[node], rtol=1e-9 if tight else 1e-5,
                                       atol=1e-12 if tight else 1e-8)  # fmt: skip


def _small_models():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                        attn_implementation="eager")  # fmt: skip
    llama = T.LlamaForCausalLM(cfg).to(F64).eval()
    torch.manual_seed(1)
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=20, n_embd=16, n_layer=2, n_head=2,
                                          n_positions=16, attn_implementation="eager")
                             ).to(F64).eval()  # fmt: skip
    ids, cor = torch.tensor([[1, 5, 7, 2, 5, 7]]), torch.tensor([[1, 5, 9, 2, 5, 11]])
    return [(llama, ids, cor), (gpt2, ids, cor)]


def test_the_relevance_adjoint_holds_the_norms_scale():
    p, c = runs()
    heads = qk.attention_heads(p)
    (got,) = rq.pattern_adjoints(p, heads, c.result).values()
    a, want = relevance_adjoint()
    assert float(a.amax(-1).max()) > 1 - 1e-9  # saturated rows
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    (grad,) = qk._pattern_gradients(p, heads).values()
    assert float((grad - want).abs().max()) > 1e-3  # the LN-rule changes it here


def _pattern_change(x, x_cor, g, h, pos, which=("q", "k")):
    """``Σ (A - A') G`` with head ``h``'s query and/or key at ``pos`` from ``x_cor``."""
    with torch.no_grad():
        _, a, _ = hand(x)
        kw = {f"{w}_from": x_cor for w in which}
        _, a2, _ = hand(x, rows=[(h, pos)], **kw)
        return float(((a - a2) * g).sum())


def test_relp_sites_are_the_relevance_of_the_activation_difference():
    p, c = runs()
    x, x_cor = embeddings(IDS).detach(), embeddings(COR).detach()
    _, g = relevance_adjoint()
    sites = rq.relp_sites(p, c.result)
    plain = rq.relp_sites(p, c.result, exact_qk=False)
    # the embeddings: (x - x') . r, r through the value path with the pattern held, plus
    # each head's exact pattern change (query and key at the site's position from x')
    xl = x.clone().requires_grad_()
    (r,) = torch.autograd.grad(hand(xl, hold=True)[0], xl)
    first = ((x - x_cor) * r).sum(-1)[0]
    emb = sites[sites.role == "embedding"].set_index("position").score
    emb_plain = plain[plain.role == "embedding"].set_index("position").score
    for pos in range(POS):
        qk_terms = sum(_pattern_change(x, x_cor, g, h, pos) for h in range(HEADS))
        assert emb[pos] == pytest.approx(float(first[pos]) + qk_terms, abs=1e-9)
        assert emb_plain[pos] == pytest.approx(float(first[pos]), abs=1e-9)
    assert max(abs(emb[q] - emb_plain[q]) for q in range(POS)) > 1e-3
    # a head's site: (o - o') . r, o' the corrupted run's output of the head
    _, _, o = hand(x)
    _, _, o_cor = hand(x_cor)
    leaf = o.detach().clone().requires_grad_()
    m = model()
    y = x + m.layers[0].self_attn.o_proj(leaf.transpose(1, 2).reshape(1, POS, HIDDEN))
    z = y - y.mean(-1, keepdim=True)
    sigma = (z.pow(2).mean(-1, keepdim=True) + m.norm.eps).sqrt()
    (r_head,) = torch.autograd.grad(metric(m.lm_head(z / sigma.detach() * m.norm.weight
                                                     + m.norm.bias)), leaf)  # fmt: skip
    want = ((o - o_cor) * r_head).sum(-1)[0].detach()  # (heads, positions)
    got = sites[sites.role == "head"]
    assert len(got) == HEADS * POS
    for row in got.itertuples():
        assert row.score == pytest.approx(float(want[row.head_index, row.position]), abs=1e-9)
    assert float(want.abs().max()) > 1e-3


def test_relevance_qk_fixes_query_and_key_edges_under_the_relevance_adjoint():
    p, c = runs()
    x, x_cor = embeddings(IDS).detach(), embeddings(COR).detach()
    _, g = relevance_adjoint()
    edges, sites = p.relevance_qk(c)
    assert len(edges) == len(p.edges()) and len(sites) == len(p.node_effects())
    qk_rows = edges[edges.input.isin(["q", "k"])]
    assert len(qk_rows) >= 10 and set(qk_rows.src_role) == {"embedding"}
    for row in qk_rows.itertuples():
        h = int(row.dst_head_index)
        want = _pattern_change(x, x_cor, g, h, row.position, (row.input,))
        assert row.score == pytest.approx(want, abs=1e-9), row
    assert float(qk_rows.score.abs().max()) > 1e-3
    # value and target edges keep the circuit's relevance flow (0: no path, not listed)
    rest = edges[~edges.input.isin(["q", "k"])].merge(
        c.edges[[*rq.EDGE_KEY, "Real"]], on=list(rq.EDGE_KEY), how="left"
    )
    assert rest.Real.notna().sum() >= 10
    assert rest.score.tolist() == rest.Real.fillna(0.0).tolist()
    # the embeddings' sites: the circuit's (x - x') . r plus the exact pattern changes,
    # as relp_sites (whose activation difference there is x - x' too)
    relp = rq.relp_sites(p, c.result)
    mine = sites[sites.role == "embedding"].score.to_numpy()
    theirs = relp[relp.role == "embedding"].score.to_numpy()
    assert abs(mine - theirs).max() < 1e-9


def test_relevance_qk_says_what_it_needs():
    p, c = runs()
    plain = sbp.circuit(model(), kwargs={"input_ids": IDS}, output=metric,
                        baseline={"input_ids": COR}, semirings=[sbp.Real()])  # fmt: skip
    with pytest.raises(sbp.InputError, match="weights='relevance'"):
        p.relevance_qk(plain)
    other = Patching(c.result, {"input_ids": COR})
    with pytest.raises(sbp.InputError, match="gradient weights"):
        other.relevance_qk(c)
    with pytest.raises(sbp.InputError, match="Real semiring"):
        mp = sbp.backprop(model(), kwargs={"input_ids": IDS}, output=metric,
                          semirings=[sbp.MaxProduct()])  # fmt: skip
        rq.pattern_adjoints(p, qk.attention_heads(p), mp)
