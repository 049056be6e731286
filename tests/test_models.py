"""Whole models: Real equals torch.autograd, every semiring runs, module lookup works.

Models are built from tiny random configs in float64 (nothing is downloaded). Gradients
at intermediate modules are read from autograd with forward hooks that retain the grad of
the module's first float input / output, exactly the tensors ``Result.at`` names.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import oracles
import semiring_backprop as sbp

transformers = pytest.importorskip("transformers")

ALL = oracles.all_semirings()
F64 = torch.float64


def assert_grad_close(got, want, rtol=1e-10):
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale)


def _first_float(items):
    return next((x for x in items if isinstance(x, torch.Tensor) and x.is_floating_point()), None)


class Probe:
    """Autograd gradients at module outputs (``"path"``) and inputs (``"path:input"``)."""

    def __init__(self, model: nn.Module, places):
        self.model, self.places, self.tensors, self.handles = model, places, {}, []
        modules = dict(model.named_modules())
        for place in places:
            name, _, kind = place.partition(":")
            mod = modules[name]
            if kind == "input":
                self.handles.append(
                    mod.register_forward_pre_hook(self._pre(place), with_kwargs=True)
                )
            else:
                self.handles.append(mod.register_forward_hook(self._post(place)))

    def _keep(self, place, t):
        if t is not None and place not in self.tensors:
            t.retain_grad()
            self.tensors[place] = t

    def _pre(self, place):
        # "m:input" is the value where the module reads its input: the paths through the
        # module only (the same tensor may also feed a residual branch). So the module
        # gets its own copy, as it gets its own ``mark`` node in the traced graph.
        def hook(mod, args, kwargs):
            t = _first_float(args)
            if t is None:
                t = _first_float(kwargs.values())
            if t is None or place in self.tensors:
                return None
            copy = t.view_as(t)
            self._keep(place, copy)
            args = tuple(copy if a is t else a for a in args)
            return args, {k: (copy if v is t else v) for k, v in kwargs.items()}

        return hook

    def _post(self, place):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor):
                self._keep(place, out)
            elif isinstance(out, tuple | list):
                self._keep(place, _first_float(out))
            elif isinstance(out, dict):
                self._keep(place, _first_float(out.values()))

        return hook

    def grads(self, args, kwargs, output, wrt=()):
        """Gradients at every probed place and at the given leaf inputs."""
        try:
            with torch.enable_grad():
                y = output(self.model(*args, **kwargs))
                y.backward()
        finally:
            for h in self.handles:
                h.remove()
        out = {place: t.grad for place, t in self.tensors.items()}
        out.update({k: t.grad for k, t in wrt})
        return out


def autograd_wrt(model, args, kwargs, output, key):
    """Autograd gradient of ``output(model(...))`` w.r.t. ``args[key]`` / ``kwargs[key]``."""
    args, kwargs = list(args), dict(kwargs)
    place = args if isinstance(key, int) else kwargs
    leaf = place[key] = place[key].clone().requires_grad_()
    (g,) = torch.autograd.grad(output(model(*args, **kwargs)), leaf)
    return g


def check_semirings(res, where, tol=1e-9):
    """Every semiring ran without NaN, and the cheap identities between them hold."""
    for sr in res.semirings:
        for f in res.value(where, sr):
            assert not torch.isnan(f).any(), f"NaN under {sr.name} at {where!r}"
    real = res.at(where, sbp.Real())
    mx, la = res.at(where, sbp.MaxAbs()), res.at(where, sbp.LogAbs())
    count, ent = res.at(where, sbp.PathCount()), res.at(where, sbp.Entropy())
    mp, top = res.at(where, sbp.MaxProduct()), res.at(where, sbp.TopK(3))
    live = torch.isfinite(la.log)
    # |Σ paths| <= Σ |paths| <= #paths · max |path|;  max |path| <= Σ |paths|
    assert bool((real.abs().log()[live] <= la.log[live] + tol).all())
    assert bool((mx.log[live] <= la.log[live] + tol).all())
    assert bool((la.log[live] <= count.log_count[live] + mx.log[live] + tol).all())
    # 0 <= H <= log #paths; log Z of Entropy is LogAbs
    assert bool((ent.entropy >= -tol).all())
    assert bool((ent.entropy[live] <= count.log_count[live] + tol).all())
    torch.testing.assert_close(ent.log_z, la.log, rtol=tol, atol=tol)
    # the top path of TopK is the MaxAbs path, and one of MaxProduct's hi / lo
    torch.testing.assert_close(top.log_abs[..., 0], mx.log, rtol=tol, atol=tol)
    big = torch.maximum(mp.hi.abs(), mp.lo.abs())
    torch.testing.assert_close(big[live], mx.value[live], rtol=tol, atol=1e-300)


# -- plain PyTorch ---------------------------------------------------------------------


def test_mlp_matches_autograd_and_looks_up_modules():
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(5, 8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.LeakyReLU(0.1),
        nn.Dropout(0.3),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Sigmoid(),
        nn.Linear(8, 8),
        nn.GELU(),
        nn.LayerNorm(8),
        nn.Linear(8, 3),
        nn.Softmax(-1),
    )
    mlp = mlp.to(F64).eval()
    x = torch.randn(4, 5, dtype=F64)
    output = lambda y: y[1, 2]  # noqa: E731
    res = sbp.backprop(mlp, args=(x,), output=output, semirings=ALL)
    assert_grad_close(res.at(0, sbp.Real()), autograd_wrt(mlp, (x,), {}, output, 0))
    check_semirings(res, 0)

    places = ["5", "11:input", "11"]
    want = Probe(mlp, places).grads((x.clone().requires_grad_(),), {}, output)
    for place in places:
        assert_grad_close(res.at(place, sbp.Real()), want[place])
    # examples in the paper aggregate over hidden units (Eq. 3)
    assert_grad_close(res.aggregate("5", sbp.Real(), dims=(-1,)), want["5"].sum(-1))


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_transformer_encoder_layer(batch_first, norm_first):
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(
        16, 2, 32, dropout=0.1, batch_first=batch_first, norm_first=norm_first
    )
    layer = layer.to(F64).eval()
    x = torch.randn(2, 5, 16, dtype=F64)  # (batch, seq, hidden)
    x = x if batch_first else x.transpose(0, 1).contiguous()
    pad = torch.zeros(2, 5, dtype=torch.bool)  # (batch, seq) in both layouts
    pad[1, -2:] = True
    output = lambda y: y[1, 1, 3] - y[0, 1, 0]  # noqa: E731
    kwargs = {"src_key_padding_mask": pad}
    res = sbp.backprop(layer, args=(x,), kwargs=kwargs, output=output, semirings=ALL)
    assert_grad_close(res.at(0, sbp.Real()), autograd_wrt(layer, (x,), kwargs, output, 0))
    check_semirings(res, 0)

    # post-norm: linear1's input also feeds the residual; ":input" is linear1's branch
    places = ["self_attn", "linear1:input", "norm2"]
    want = Probe(layer, places).grads((x.clone().requires_grad_(),), kwargs, output)
    for place in places:
        assert_grad_close(res.at(place, sbp.Real()), want[place])


class _ViewAfterFusedAttention(nn.Module):
    """Self-attention as torch 2.11's ``multi_head_attention_forward`` wrote it: the
    fused kernel's output, permuted, ``.contiguous().view(...)``. Export sees the fused
    kernel's layout, for which ``.contiguous()`` copies nothing, and keeps a bare
    ``view`` that is invalid for any other layout of the same values."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x):  # x: (seq, batch, hidden)
        L, B, E = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k, v = (t.reshape(L, B * 2, 8).transpose(0, 1).view(B, 2, L, 8) for t in (q, k, v))
        o = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(o.permute(2, 0, 1, 3).contiguous().view(B * L, E))


def test_a_view_valid_only_for_the_fused_attention_kernels_layout():
    torch.manual_seed(4)
    model = _ViewAfterFusedAttention().to(F64).eval()
    x = torch.randn(5, 2, 16, dtype=F64)
    output = lambda y: y[3, 1] - y[7, 4]  # noqa: E731
    res = sbp.backprop(model, args=(x,), output=output, semirings=ALL)
    assert_grad_close(res.at(0, sbp.Real()), autograd_wrt(model, (x,), {}, output, 0))
    check_semirings(res, 0)


def test_multihead_self_attention_with_one_tensor_as_query_key_value():
    """``mha(x, x, x)``: export reads one placeholder; all three args get the full value."""
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).to(F64).eval()
    x = torch.randn(2, 5, 16, dtype=F64)
    output = lambda y: y[0][1, 2, 3] + y[1][0, 1, 2]  # noqa: E731
    res = sbp.backprop(mha, args=(x, x, x), output=output, semirings=ALL)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(output(mha(leaf, leaf, leaf)), leaf)
    for k in (0, 1, 2):
        assert_grad_close(res.at(k, sbp.Real()), want)
    check_semirings(res, 0)


def test_multihead_cross_attention_with_padding():
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(16, 2, kdim=8, vdim=6).to(F64).eval()
    q = torch.randn(5, 2, 16, dtype=F64)
    k, v = torch.randn(4, 2, 8, dtype=F64), torch.randn(4, 2, 6, dtype=F64)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[0, -1] = True
    kwargs = {"key_padding_mask": pad}
    output = lambda y: y[0][1, 0, 3] + y[1][1, 2, 3]  # noqa: E731
    res = sbp.backprop(mha, args=(q, k, v), kwargs=kwargs, output=output, semirings=ALL)
    for i in range(3):
        want = autograd_wrt(mha, (q, k, v), kwargs, output, i)
        assert_grad_close(res.at(i, sbp.Real()), want)
        check_semirings(res, i)


# -- Hugging Face ------------------------------------------------------------------------

VOCAB = 50
IMPLS = ["sdpa", "eager"]


def _bert_config(impl):
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        attn_implementation=impl,
    )


def _gpt2_config(impl):
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=impl,
    )


def _llama_config(impl):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # grouped-query attention
        intermediate_size=32,
        max_position_embeddings=32,
        attn_implementation=impl,
    )


def _mlm_output(out):
    logp = out.logits[0, 2].log_softmax(-1)
    return logp[7] - logp[9]


# name -> (model class name, config, output fn, module places to probe)
HF = {
    "bert-cls": (
        "BertForSequenceClassification",
        _bert_config,
        lambda out: out.logits[0, 1],
        [
            "bert.embeddings",
            "bert.encoder.layer.0.attention",
            "bert.encoder.layer.0.attention:input",
        ],
    ),
    "bert-mlm": (
        "BertForMaskedLM",
        _bert_config,
        _mlm_output,
        ["bert.embeddings", "bert.encoder.layer.1.output", "bert.encoder.layer.1:input"],
    ),
    "gpt2": (
        "GPT2LMHeadModel",
        _gpt2_config,
        lambda out: out.logits[0, -1, 5],
        ["transformer.h.0.attn", "transformer.h.1.mlp:input", "transformer.ln_f"],
    ),
    "llama": (
        "LlamaForCausalLM",
        _llama_config,
        lambda out: out.logits[0, -1, 5],
        ["model.layers.0.self_attn", "model.layers.1.mlp:input", "model.norm"],
    ),
}
HF_PARAMS = [pytest.param(name, impl, id=f"{name}-{impl}") for name in HF for impl in IMPLS]


def _rtol(name, impl):
    # Llama's eager attention runs its softmax in float32 (autograd rounds through it)
    return 1e-6 if (name, impl) == ("llama", "eager") else 1e-10


@functools.cache
def hf_model(name, impl):
    cls_name, config, *_ = HF[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config(impl))
    return model.to(F64).eval()


def _ids():
    ids = torch.tensor([[3, 7, 1, 9, 4, 11], [5, 2, 8, 13, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])  # right padding
    return ids, mask


def _embedding_name(model):
    emb = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is emb)


@pytest.mark.parametrize(("name", "impl"), HF_PARAMS)
def test_hf_inputs_embeds_all_semirings(name, impl):
    model, output = hf_model(name, impl), HF[name][2]
    ids, _ = _ids()
    embeds = model.get_input_embeddings()(ids[:1]).detach()
    kwargs = {"inputs_embeds": embeds}
    res = sbp.backprop(model, kwargs=kwargs, output=output, semirings=ALL)
    want = autograd_wrt(model, (), kwargs, output, "inputs_embeds")
    assert_grad_close(res.at("inputs_embeds", sbp.Real()), want, rtol=_rtol(name, impl))
    # float32 islands (Llama's RMSNorm) round each semiring's values differently
    check_semirings(res, "inputs_embeds", tol=1e-5 if name == "llama" else 1e-9)
    # token attributions: ⊕ over the hidden units of each token (Eq. 3)
    agg = res.aggregate("inputs_embeds", sbp.MaxProduct(), dims=(-1,))
    assert agg.hi.shape == embeds.shape[:-1]
    assert bool((agg.hi >= agg.lo).all())


@pytest.mark.parametrize(("name", "impl"), HF_PARAMS)
def test_hf_input_ids_module_lookup(name, impl):
    model, output, places = hf_model(name, impl), HF[name][2], HF[name][3]
    ids, mask = _ids()
    kwargs = {"input_ids": ids, "attention_mask": mask}
    res = sbp.backprop(model, kwargs=kwargs, output=output)
    emb = _embedding_name(model)
    want = Probe(model, [emb, *places]).grads((), kwargs, output)
    rtol = _rtol(name, impl)
    assert_grad_close(res.at(emb, sbp.Real()), want[emb], rtol=rtol)
    for place in places:
        assert_grad_close(res.at(place, sbp.Real()), want[place], rtol=rtol)
        # a unique suffix of the path names the same module
        short = place.split(".", 1)[1]
        torch.testing.assert_close(res.at(short, sbp.Real()), res.at(place, sbp.Real()))
    # the second example does not interact with the first: its tokens get exactly zero
    assert not res.at(emb, sbp.Real())[1].any()


def test_hf_aggregate_by_token_matches_the_paper_reading():
    """⊕ of hidden units = per-token sum of the gradient under Real (Eq. 3)."""
    model, output = hf_model("bert-cls", "eager"), HF["bert-cls"][2]
    ids, mask = _ids()
    kwargs = {"input_ids": ids[:1], "attention_mask": mask[:1]}
    res = sbp.backprop(model, kwargs=kwargs, output=output, semirings=[sbp.Real(), sbp.MaxAbs()])
    emb = _embedding_name(model)
    g = res.at(emb, sbp.Real())
    assert_grad_close(res.aggregate(emb, sbp.Real()), g.sum(-1))
    torch.testing.assert_close(
        res.aggregate(emb, sbp.MaxAbs()).log, res.at(emb, sbp.MaxAbs()).log.amax(-1)
    )
    assert math.isfinite(float(res.aggregate(emb, sbp.MaxAbs()).log.max()))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_left_padding_sdpa(name):
    """A left-padded query may attend to nothing: torch's safe softmax gives it zeros,
    and so must the decomposed SDPA (not NaN)."""
    model, output = hf_model(name, "sdpa"), HF[name][2]
    ids = torch.tensor([[3, 7, 1, 9, 4, 11], [5, 5, 5, 2, 8, 13]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    kwargs = {"input_ids": ids, "attention_mask": mask}
    lead = lambda out: output(out) + out.logits[1, -1, 2]  # noqa: E731
    res = sbp.backprop(model, kwargs=kwargs, output=lead, semirings=[sbp.Real(), sbp.Entropy()])
    emb = _embedding_name(model)
    want = Probe(model, [emb]).grads((), kwargs, lead)[emb]
    assert_grad_close(res.at(emb, sbp.Real()), want, rtol=_rtol(name, "sdpa"))
    assert not torch.isnan(res.at(emb, sbp.Entropy()).entropy).any()
