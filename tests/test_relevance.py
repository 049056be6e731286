"""Edge weights under ``weights="relevance"`` (DESIGN §3c, ``engine.relevance``).

Oracles: the Real semiring equals torch.autograd of a hand-written LRP model of the same
rules (detach tricks: the LN-rule ``d / sigma.detach()``, the identity rule
``x * (f(x)/x).detach()``, the half rule ``0.5*(a*b.detach()) + 0.5*(a.detach()*b)``,
CP attention ``probs.detach() @ v``); every semiring equals the brute-force enumerator
run on the hand-written model's gradient graph; conservation where the rules conserve.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from torch import nn
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama

import oracles
import semiring_backprop as sbp
from semiring_backprop.engine import relevance
from test_oracle import SEMIRINGS, assert_node_matches

F64 = torch.float64
ALL = SEMIRINGS  # (TopK(K) and TopK(1) among them)


# -- the rules, written by hand ------------------------------------------------------------


def ln_rule(x, weight=None, bias=None, eps=1e-5, center=True):
    """LN-rule (Ali et al. 2022): the normalization scale held constant."""
    d = x - x.mean(-1, keepdim=True) if center else x
    y = d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + eps).detach()
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def identity_rule(f, x):
    """The identity rule: one edge of weight f(x)/x."""
    return x * (f(x) / x).detach()


def half_rule(a, b):
    """AttnLRP's uniform rule for a product of two input-dependent factors."""
    return 0.5 * (a * b.detach()) + 0.5 * (a.detach() * b)


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """CP-LRP: the attention pattern held constant (probs.detach() @ v)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query @ key.transpose(-1, -2) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    probs = torch.softmax(scores, -1).detach()
    return (probs @ value).transpose(1, 2).contiguous(), probs


class LNRule(nn.Module):
    def __init__(self, ln):
        super().__init__()
        self.ln = ln

    def forward(self, x):
        return ln_rule(x, self.ln.weight, self.ln.bias, self.ln.eps)


class RMSRule(nn.Module):
    """LlamaRMSNorm with its rsqrt held constant (and its float32 cast, as the model)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.norm.variance_epsilon).detach()
        return self.norm.weight * h.to(dtype)


class IdentityRule(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        return identity_rule(self.act, x)


def _swiglu_rule(mlp):
    act = IdentityRule(mlp.act_fn)
    return lambda x: mlp.down_proj(half_rule(act(mlp.gate_proj(x)), mlp.up_proj(x)))


# -- models ------------------------------------------------------------------------------


def _mlp(bias=True):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8, bias=bias), nn.LayerNorm(8, bias=bias), nn.GELU(),
        nn.Linear(8, 3, bias=bias),
    ).to(F64).eval()  # fmt: skip


def _mlp_rule(m):
    def f(x):
        h = ln_rule(m[0](x), m[1].weight, m[1].bias, m[1].eps)
        return m[3](identity_rule(nn.functional.gelu, h))

    return f


def _gpt2(impl, bias=True):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
        eos_token_id=0, attn_implementation=impl,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).to(F64).eval()
    if not bias:  # every bias 0, and no position embeddings (a bias of each position)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "wpe" in name:
                    p.zero_()
    return model


def _gpt2_rule(model):
    lrp = copy.deepcopy(model)
    lrp.set_attn_implementation("eager")
    t = lrp.transformer
    for block in t.h:
        block.ln_1, block.ln_2 = LNRule(block.ln_1), LNRule(block.ln_2)
        block.mlp.act = IdentityRule(block.mlp.act)
    t.ln_f = LNRule(t.ln_f)
    return lrp, modeling_gpt2


def _llama(impl):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
        attn_implementation=impl,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(F64).eval()


def _llama_rule(model):
    lrp = copy.deepcopy(model)
    lrp.set_attn_implementation("eager")
    m = lrp.model
    for layer in m.layers:
        layer.input_layernorm = RMSRule(layer.input_layernorm)
        layer.post_attention_layernorm = RMSRule(layer.post_attention_layernorm)
        layer.mlp.forward = _swiglu_rule(layer.mlp)
    m.norm = RMSRule(m.norm)
    return lrp, modeling_llama


HF = {"gpt2": (_gpt2, _gpt2_rule), "llama": (_llama, _llama_rule)}


def _logit(out):
    return out.logits[0, -1, 5]


def _embeds(model):
    ids = torch.tensor([[3, 7, 1, 9, 4]])
    return model.get_input_embeddings()(ids).detach()


def _hf_rule_grad(model, rule, embeds, monkeypatch):
    lrp, module = rule(model)
    monkeypatch.setattr(module, "eager_attention_forward", cp_attention)
    e = embeds.clone().requires_grad_()
    out = _logit(lrp(inputs_embeds=e))
    (grad,) = torch.autograd.grad(out, e)
    return grad, out.detach()


# -- (a) Real = autograd of the hand-written LRP model -------------------------------------


def test_mlp_relevance_is_autograd_of_the_lrp_model():
    m = _mlp()
    torch.manual_seed(1)
    x = torch.randn(2, 5, dtype=F64)
    output = lambda y: y[1, 2]  # noqa: E731
    res = sbp.backprop(m, (x,), output=output, weights="relevance")
    xg = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(output(_mlp_rule(m)(xg)), xg)
    got = res.at(0, sbp.Real())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    grad = sbp.backprop(m, (x,), output=output).at(0, sbp.Real())
    assert (got - grad).abs().max() > 1e-3  # (the rules change the weights)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_relevance_is_autograd_of_the_lrp_model(name, impl, monkeypatch):
    make, rule = HF[name]
    model = make(impl)
    embeds = _embeds(model)
    res = sbp.backprop(model, kwargs={"inputs_embeds": embeds}, output=_logit,
                       weights="relevance")  # fmt: skip
    got = res.at("inputs_embeds", sbp.Real())
    want, _ = _hf_rule_grad(model, rule, embeds, monkeypatch)
    # Llama's RMSNorm runs in float32 (and its eager softmax): both round through it
    rtol = 1e-10 if name == "gpt2" else 1e-5
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def test_relevance_plan_finds_each_rule_once_per_place():
    """What the plan finds in each model, counted by rule."""

    def counts(model, kwargs, output):
        graph = sbp.Backprop(model, output=output, weights="relevance").graph(kwargs=kwargs)
        found: dict = {}
        for e in relevance.plan(graph).values():
            found[e.rule] = found.get(e.rule, 0) + 1
        return found

    gpt2, llama = _gpt2("sdpa"), _llama("sdpa")
    # GPT-2, 2 layers: 5 layer norms, 2 attentions, 2 GELUs (the product, and its tanh
    # piece, which no path reaches)
    assert counts(gpt2, {"inputs_embeds": _embeds(gpt2)}, _logit) == {
        "norm": 5, "attention": 2, "identity": 4,
    }  # fmt: skip
    # Llama, 2 layers: 5 RMS norms, 2 attentions, 2 SiLUs (the product, and its sigmoid
    # piece), 2 SwiGLU products
    assert counts(llama, {"inputs_embeds": _embeds(llama)}, _logit) == {
        "norm": 5, "attention": 2, "identity": 4, "half": 2,
    }  # fmt: skip


# -- (b) conservation ------------------------------------------------------------------------


def test_conservation_on_bias_free_models():
    """sum(x ⊙ R) = f(x) where every op is linear in x once the rules hold their
    constants (bias-free, no position embeddings)."""
    m = _mlp(bias=False)
    x = torch.randn(1, 5, dtype=F64)
    res = sbp.backprop(m, (x,), output=lambda y: y[0, 1], weights="relevance")
    torch.testing.assert_close((x * res.at(0, sbp.Real())).sum(), m(x)[0, 1], rtol=1e-12, atol=0)
    for model, rtol in ((_gpt2("sdpa", bias=False), 1e-10), (_llama("sdpa"), 1e-5)):
        embeds = _embeds(model)
        res = sbp.backprop(model, kwargs={"inputs_embeds": embeds}, output=_logit,
                           weights="relevance")  # fmt: skip
        total = (embeds * res.at("inputs_embeds", sbp.Real())).sum()
        torch.testing.assert_close(total, _logit(model(inputs_embeds=embeds)), rtol=rtol, atol=0)


def test_biases_break_conservation():
    model = _gpt2("sdpa")  # biases and position embeddings: not linear in the embeddings
    embeds = _embeds(model)
    res = sbp.backprop(model, kwargs={"inputs_embeds": embeds}, output=_logit,
                       weights="relevance")  # fmt: skip
    total = (embeds * res.at("inputs_embeds", sbp.Real())).sum()
    with torch.no_grad():
        assert abs(float(total - _logit(model(inputs_embeds=embeds)))) > 1e-3


# -- (c) every semiring against the enumerator on the hand-written model --------------------


def _block_weights():
    torch.manual_seed(2)
    return {k: torch.randn(2, 2, dtype=F64) for k in ("q", "k", "v", "o", "g", "u", "d")}


def _block(x, W, rule=False):
    """A pre-norm transformer block: RMS norm, causal attention, layer norm, SwiGLU."""
    rms = (lambda t: ln_rule(t, center=False, eps=1e-6)) if rule else (
        lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
    )  # fmt: skip
    h = rms(x)
    q, k, v = h @ W["q"], h @ W["k"], h @ W["v"]
    mask = torch.full((x.shape[0], x.shape[0]), -math.inf, dtype=x.dtype).triu(1)
    probs = torch.softmax(q @ k.T / math.sqrt(2) + mask, -1)
    r = x + ((probs.detach() if rule else probs) @ v) @ W["o"]
    h2 = ln_rule(r) if rule else nn.functional.layer_norm(r, (2,))
    z = h2 @ W["g"]
    act = identity_rule(nn.functional.silu, z) if rule else nn.functional.silu(z)
    up = h2 @ W["u"]
    gated = half_rule(act, up) if rule else act * up
    out = identity_rule(nn.functional.gelu, gated) if rule else nn.functional.gelu(gated)
    return (r + out @ W["d"])[-1].sum()


def test_every_semiring_matches_the_enumerator_on_the_lrp_graph():
    W = _block_weights()
    torch.manual_seed(3)
    x = torch.randn(3, 2, dtype=F64)
    res = sbp.backprop(lambda t: _block(t, W), (x,), semirings=ALL, weights="relevance")
    lrp = sbp.backprop(lambda t: _block(t, W, rule=True), (x,), semirings=[sbp.Real()])
    oracle = oracles.build(lrp)
    source = lrp.graph.user_inputs[0]

    class Relevance:  # res read at the hand-written graph's input
        def at(self, node, sr):
            assert node is source
            return res.at(0, sr)

    assert_node_matches(Relevance(), oracle, source)
    # PathCount: the gradient graph's paths less those through the removed edges
    grad = sbp.backprop(lambda t: _block(t, W), (x,), semirings=[sbp.PathCount()])
    full = oracles.build(grad).count(grad.graph.user_inputs[0])
    kept = oracle.count(source)
    assert (kept < full).all() and (kept > 0).all()


# -- the options -------------------------------------------------------------------------


def test_gradient_weights_are_the_default_bit_for_bit():
    m = _mlp()
    x = torch.randn(2, 5, dtype=F64)
    srs = [sbp.Real(), sbp.MaxProduct(), sbp.Entropy()]
    a = sbp.backprop(m, (x,), output=lambda y: y[0, 1], semirings=srs)
    b = sbp.backprop(m, (x,), output=lambda y: y[0, 1], semirings=srs, weights="gradient")
    assert torch.equal(a.at(0, srs[0]), b.at(0, srs[0]))
    assert torch.equal(a.at(0, srs[1]).hi, b.at(0, srs[1]).hi)
    assert torch.equal(a.at(0, srs[2]).entropy, b.at(0, srs[2]).entropy)


def test_bad_weights_are_refused():
    m, x = _mlp(), torch.randn(1, 5, dtype=F64)
    with pytest.raises(sbp.InputError, match="'gradient', 'relevance'"):
        sbp.backprop(m, (x,), output=lambda y: y[0, 1], weights="relevnce")
    with pytest.raises(sbp.InputError, match="paper"):
        sbp.Backprop(m, output=lambda y: y[0, 1], weights="relevance", paper=True)
    with pytest.raises(sbp.InputError, match="layer_norm"):
        sbp.backprop(m, (x,), output=lambda y: y[0, 1], weights="relevance",
                     whole=("layer_norm",))  # fmt: skip


def test_relevance_paths_and_keep():
    """The best path under relevance is read from its graph, and a pass that keeps only
    the input gives the same values (the ratio rules read their inputs)."""
    m = _mlp()
    x = torch.randn(1, 5, dtype=F64)
    out = lambda y: y[0, 1]  # noqa: E731
    full = sbp.backprop(m, (x,), output=out, semirings=[sbp.MaxProduct()], weights="relevance")
    kept = sbp.backprop(m, (x,), output=out, semirings=[sbp.MaxProduct()], weights="relevance",
                        keep=[0])  # fmt: skip
    torch.testing.assert_close(kept.at(0, sbp.MaxProduct()).hi, full.at(0, sbp.MaxProduct()).hi)
    hi = full.at(0, sbp.MaxProduct()).hi
    path = full.top_path((0, (0, 2)))
    assert math.isclose(path.value, hi[0, 2].item(), rel_tol=1e-12)
    # its steps are the relevance graph's: no step through the norm's scale or the gate
    assert not any("rsqrt" in str(s.op) or "erf" in str(s.op) for s in path.steps)


# -- circuit, explain and the CLI ------------------------------------------------------------


def test_circuit_under_relevance_reads_the_relevance_graph():
    """The circuit's target (Real, seed x) is sum(x ⊙ R) of the relevance pass: its
    forward (alpha) pass runs the same rules; on Llama (bias-free) that is the logit."""
    model = _llama("sdpa")
    embeds = _embeds(model)
    kwargs = {"inputs_embeds": embeds}
    c = sbp.circuit(model, kwargs=kwargs, output=_logit, weights="relevance")
    score = c.to_eap_json()["nodes"]["logits"]["score"]
    res = sbp.backprop(model, kwargs=kwargs, output=_logit, weights="relevance")
    want = float((embeds * res.at("inputs_embeds", sbp.Real())).sum())
    assert math.isclose(score, want, rel_tol=1e-9)
    with torch.no_grad():
        assert math.isclose(score, float(_logit(model(**kwargs))), rel_tol=1e-5)
    grad = sbp.circuit(model, kwargs=kwargs, output=_logit).to_eap_json()["nodes"]["logits"]
    assert abs(grad["score"] - score) > 1e-3
    with pytest.raises(sbp.InputError, match="relevnce"):
        sbp.circuit(model, kwargs=kwargs, output=_logit, weights="relevnce")


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = "the keys to cabinet is are on table a dog cat".split()
    where = tmp_path_factory.mktemp("gpt2")
    ids = {w: i for i, w in enumerate(["[UNK]", *words])}
    tok = tokenizers.Tokenizer(WordLevel(ids, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        where
    )
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(ids), n_embd=8, n_layer=1, n_head=2,
                                  n_positions=16, bos_token_id=0, eos_token_id=0)  # fmt: skip
    transformers.GPT2LMHeadModel(cfg).save_pretrained(where)
    return str(where)


def _cli(argv):
    import contextlib
    import io

    from semiring_backprop import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse's refusal
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.usefixtures("_offline_quiet")
def test_cli_and_explain_take_weights(saved_gpt2, tmp_path):
    scores = {}
    for weights in ("gradient", "relevance"):
        file = tmp_path / f"{weights}.json"
        rc, _, err = _cli(["circuit", saved_gpt2, "--text", "the keys to the cabinet",
                           "--target", "are", "--dtype", "float64", "--weights", weights,
                           "--json", str(file)])  # fmt: skip
        assert rc == 0, err
        import json

        scores[weights] = json.loads(file.read_text())["nodes"]["logits"]["score"]
    assert abs(scores["gradient"] - scores["relevance"]) > 1e-6
    rc, _, err = _cli(["circuit", saved_gpt2, "--text", "the keys", "--target", "are",
                       "--weights", "relevnce"])  # fmt: skip
    assert rc == 2 and "relevnce" in err and "relevance" in err
    rc, text, err = _cli(["explain", saved_gpt2, "--text", "the keys to the cabinet",
                          "--target", "are", "--weights", "relevance"])  # fmt: skip
    assert rc == 0, err
    from semiring_backprop.hf.explain import explain

    model = transformers.AutoModelForCausalLM.from_pretrained(saved_gpt2).to(F64).eval()
    tok = transformers.AutoTokenizer.from_pretrained(saved_gpt2)
    ex = explain(model, "the keys to the cabinet", "are", tokenizer=tok, semirings=["real"],
                 weights="relevance")  # fmt: skip
    assert ex.weights == "relevance" and ex.result.graph.weights == "relevance"
    with pytest.raises(sbp.InputError, match="paper"):
        explain(model, "the keys", "are", tokenizer=tok, weights="relevance", paper=True)
