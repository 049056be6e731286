"""The model matrix: one tiny random config per Hugging Face family, as a new user meets it.

For each family (float64, eval mode, nothing downloaded): ``Real`` equals
torch.autograd at the model's input, the top gradient path's product equals the
``MaxProduct`` readout it starts from (both signs), the path entropy is finite, and
``layer_table`` finds every attention block with its skip / query / key / value and
MLP branches. One line per family in ``FAMILIES``; docs/models.md's table lists the same.

Tolerances: families that run part of the model in float32 even in a float64 model
(rotary embeddings, RMSNorm, routers, softmax; as autograd does) agree to float32
rounding, the others to float64 rounding.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass, field

import pytest
import torch

import semiring_backprop as sbp

T = pytest.importorskip("transformers")

F64 = torch.float64
V = 64  # vocabulary
SEMIRINGS = [sbp.Real(), sbp.MaxProduct(), sbp.Entropy()]
ROLES = {"skip", "query", "key", "value", "mlp"}
IDS = [[3, 7, 1, 9, 4, 11]]


def _small(**kw):
    """The shared tiny sizes, under each family's own names."""
    return kw


@dataclass(frozen=True)
class Family:
    cls: str
    config: object  # () -> config
    kind: str = "lm"  # lm: inputs_embeds -> logits; seq2seq; vision; audio; encoder
    rtol: float = 1e-10  # 1e-6 where the family computes in float32 in places
    roles: frozenset = frozenset(ROLES)
    extra: dict = field(default_factory=dict)  # config attributes set after construction
    #: () -> the refusal's pattern where the installed transformers' code of the family
    #: cannot be traced, else None
    refused: object = None


def _lm(name, **kw):
    return getattr(T, name)(vocab_size=V, **kw)


def _funnel_refusal():
    """transformers before 5.24 (5.17 does) computes Funnel's relative positions from
    tensors, ``torch.arange`` between tensor bounds: a size that depends on tensor values,
    which torch.export cannot trace. Refused, naming that and the place; later releases
    compute them from Python ints (``relative_pos`` takes a device) and trace."""
    from transformers.models.funnel import modeling_funnel

    structure = modeling_funnel.FunnelAttentionStructure
    if "device" in inspect.signature(structure.relative_pos).parameters:
        return None
    return (
        r"a data-dependent shape: a size computed from it\)\. "
        r"It failed at .*modeling_funnel\.py, line \d+"
    )


FAMILIES = {
    "bert": Family("BertForMaskedLM", lambda: _lm(
        "BertConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32)),
    "distilbert": Family("DistilBertForMaskedLM", lambda: _lm(
        "DistilBertConfig", dim=16, n_layers=2, n_heads=2, hidden_dim=32,
        max_position_embeddings=32)),
    "roberta": Family("RobertaForMaskedLM", lambda: _lm(
        "RobertaConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=40, pad_token_id=1)),
    "albert": Family("AlbertForMaskedLM", lambda: _lm(
        "AlbertConfig", embedding_size=8, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)),
    "electra": Family("ElectraForMaskedLM", lambda: _lm(
        "ElectraConfig", embedding_size=8, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)),
    "deberta-v2": Family("DebertaV2ForMaskedLM", lambda: _lm(
        "DebertaV2Config", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, relative_attention=True,
        pos_att_type=["p2c", "c2p"], max_relative_positions=16, position_buckets=8)),
    "bart": Family("BartForConditionalGeneration", lambda: _lm(
        "BartConfig", d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32), kind="seq2seq"),
    "t5": Family("T5ForConditionalGeneration", lambda: _lm(
        "T5Config", d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0), kind="seq2seq"),
    "t5-encoder": Family("T5EncoderModel", lambda: _lm(
        "T5Config", d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16),
        kind="encoder"),
    "gpt2": Family("GPT2LMHeadModel", lambda: _lm(
        "GPT2Config", n_embd=16, n_layer=2, n_head=2, n_positions=32)),
    "llama": Family("LlamaForCausalLM", lambda: _lm(
        "LlamaConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32), rtol=1e-6),
    "mistral": Family("MistralForCausalLM", lambda: _lm(
        "MistralConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
        head_dim=8), rtol=1e-6),
    "qwen2": Family("Qwen2ForCausalLM", lambda: _lm(
        "Qwen2Config", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32), rtol=1e-6),
    "gemma": Family("GemmaForCausalLM", lambda: _lm(
        "GemmaConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, head_dim=8,
        max_position_embeddings=32), rtol=1e-6),
    "gemma2": Family("Gemma2ForCausalLM", lambda: _lm(
        "Gemma2Config", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, head_dim=8, max_position_embeddings=32,
        sliding_window=4), rtol=1e-6),
    "phi": Family("PhiForCausalLM", lambda: _lm(
        "PhiConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32), rtol=1e-6),
    "phi3": Family("Phi3ForCausalLM", lambda: _lm(
        "Phi3Config", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
        pad_token_id=0, eos_token_id=1, bos_token_id=2), rtol=1e-6),
    "gpt-neox": Family("GPTNeoXForCausalLM", lambda: _lm(
        "GPTNeoXConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32), rtol=1e-6),
    "falcon": Family("FalconForCausalLM", lambda: _lm(
        "FalconConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2),
        rtol=1e-6),  # (its attention softmax runs in float32 in transformers 5.25)
    "opt": Family("OPTForCausalLM", lambda: _lm(
        "OPTConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
        max_position_embeddings=32, word_embed_proj_dim=16), rtol=1e-6),
    "bloom": Family("BloomForCausalLM", lambda: _lm(
        "BloomConfig", hidden_size=16, n_layer=2, n_head=2), rtol=1e-6),
    "gpt-j": Family("GPTJForCausalLM", lambda: _lm(
        "GPTJConfig", n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=32,
        bos_token_id=0, eos_token_id=0), rtol=1e-6),
    "clip-text": Family("CLIPTextModel", lambda: _lm(
        "CLIPTextConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, bos_token_id=0, eos_token_id=2),
        kind="ids", rtol=1e-6),
    "mixtral": Family("MixtralForCausalLM", lambda: _lm(
        "MixtralConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32), rtol=1e-6,
        # torch's grouped matmul has no float64 CPU kernel (the model itself fails)
        extra={"_experts_implementation": "batched_mm"}),
    "qwen2-moe": Family("Qwen2MoeForCausalLM", lambda: _lm(
        "Qwen2MoeConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32), rtol=1e-6,
        extra={"_experts_implementation": "batched_mm"}),
    "granite-moe": Family("GraniteMoeForCausalLM", lambda: _lm(
        "GraniteMoeConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32), rtol=1e-6,  # its experts: block_sparse_moe
        extra={"_experts_implementation": "batched_mm"}),
    "qwen3-moe": Family("Qwen3MoeForCausalLM", lambda: _lm(
        "Qwen3MoeConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, moe_intermediate_size=8, num_experts=4,
        num_experts_per_tok=2, head_dim=8, max_position_embeddings=32), rtol=1e-6,
        extra={"_experts_implementation": "batched_mm"}),
    "gpt-oss": Family("GptOssForCausalLM", lambda: _lm(
        "GptOssConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=16, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=32,
        layer_types=["sliding_attention", "full_attention"]), rtol=1e-6,
        extra={"_experts_implementation": "batched_mm"}),
    "phimoe": Family("PhimoeForCausalLM", lambda: _lm(
        "PhimoeConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32), rtol=1e-6,
        extra={"_experts_implementation": "batched_mm"}),
    "gpt-bigcode": Family("GPTBigCodeForCausalLM", lambda: _lm(
        "GPTBigCodeConfig", n_embd=16, n_layer=2, n_head=2, n_positions=32,
        multi_query=True), rtol=1e-6),  # one key / value head: c_attn split unequally
    "flan-t5": Family("T5ForConditionalGeneration", lambda: _lm(
        "T5Config", d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, feed_forward_proj="gated-gelu"), kind="seq2seq"),
    # Mamba layers (a selective scan, here torch's reference loop), attention every
    # other layer, experts every other layer
    "jamba": Family("JambaForCausalLM", lambda: _lm(
        "JambaConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
        attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2,
        max_position_embeddings=32, use_mamba_kernels=False), rtol=1e-6,
        extra={"_experts_implementation": "batched_mm"}),
    "xlnet": Family("XLNetLMHeadModel", lambda: _lm(
        "XLNetConfig", d_model=16, n_layer=2, n_head=2, d_inner=32)),  # weights q, k, v
    "funnel": Family("FunnelForMaskedLM", lambda: _lm(
        "FunnelConfig", d_model=16, n_head=2, d_head=8, d_inner=32, block_sizes=[1, 1],
        num_decoder_layers=1), refused=_funnel_refusal),
    "mpnet": Family("MPNetForMaskedLM", lambda: _lm(
        "MPNetConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32)),
    "modernbert": Family("ModernBertForMaskedLM", lambda: _lm(
        "ModernBertConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, global_attn_every_n_layers=2, local_attention=4,
        max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        sep_token_id=2, cls_token_id=1), rtol=1e-6),
    "qwen3": Family("Qwen3ForCausalLM", lambda: _lm(
        "Qwen3Config", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, head_dim=8,
        max_position_embeddings=32), rtol=1e-6),
    "gemma3": Family("Gemma3ForCausalLM", lambda: _lm(
        "Gemma3TextConfig", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, head_dim=8, sliding_window=4,
        max_position_embeddings=32), rtol=1e-6),
    "olmo2": Family("Olmo2ForCausalLM", lambda: _lm(
        "Olmo2Config", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32), rtol=1e-6),
    "smollm3": Family("SmolLM3ForCausalLM", lambda: _lm(
        "SmolLM3Config", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2), rtol=1e-6),
    "vit": Family("ViTForImageClassification", lambda: T.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, num_labels=3), kind="vision", rtol=1e-6),
    "deit": Family("DeiTForImageClassification", lambda: T.DeiTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, num_labels=3), kind="vision", rtol=1e-6),
    # windows rolled and partitioned by views; its pooler restates a layout (as_strided)
    "swin": Family("SwinForImageClassification", lambda: T.SwinConfig(
        image_size=8, patch_size=2, num_channels=3, embed_dim=8, depths=[2], num_heads=[2],
        window_size=2, num_labels=3), kind="vision", rtol=1e-6),
    "beit": Family("BeitForImageClassification", lambda: T.BeitConfig(
        image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=3, use_relative_position_bias=True),
        kind="vision", rtol=1e-6),
    "dinov2": Family("Dinov2Model", lambda: T.Dinov2Config(
        image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        mlp_ratio=2), kind="vision-pooled", rtol=1e-6),
    # its patch embedding is a convolution with padding="valid"
    "siglip-vision": Family("SiglipVisionModel", lambda: T.SiglipVisionConfig(
        image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32), kind="vision-pooled", rtol=1e-6),
    "hubert": Family("HubertForSequenceClassification", lambda: T.HubertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(2, 2), conv_kernel=(2, 2), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, num_labels=3, vocab_size=8), kind="wave", rtol=1e-6),
    "ast": Family("ASTForAudioClassification", lambda: T.ASTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        patch_size=4, frequency_stride=4, time_stride=4, max_length=16, num_mel_bins=8,
        num_labels=3), kind="spectrogram", rtol=1e-6),
    "whisper-encoder": Family("WhisperForAudioClassification", lambda: T.WhisperConfig(
        vocab_size=V, num_mel_bins=4, d_model=16, encoder_layers=2, encoder_attention_heads=2,
        decoder_layers=1, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_source_positions=8, num_labels=3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1), kind="audio"),
}  # fmt: skip


@functools.cache
def _model(name):
    fam = FAMILIES[name]
    config = fam.config()
    config._attn_implementation = "eager"
    for key, value in fam.extra.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        # transformers before 5.24 decorates helpers of some families (DeBERTa-v2,
        # GPTBigCode) with torch.jit.script at import, which torch 2.11 deprecates
        warnings.filterwarnings(
            "ignore", message=".*torch.jit.script.*", category=DeprecationWarning
        )
        cls = getattr(T, fam.cls)
    return cls(config).to(F64).eval()


def _inputs(name, model):
    """``(kwargs, key of the explained input, output function)``."""
    kind = FAMILIES[name].kind
    gen = torch.Generator().manual_seed(1)
    if kind in ("vision", "vision-pooled"):  # a classifier, or an image embedding
        x = torch.randn(1, 3, 8, 8, generator=gen, dtype=F64)
        field = "logits" if kind == "vision" else "pooler_output"
        return {"pixel_values": x}, "pixel_values", lambda out: getattr(out, field)[0, 1]
    if kind == "wave":  # raw audio samples (1-D convolutions first)
        x = torch.randn(1, 64, generator=gen, dtype=F64)
        return {"input_values": x}, "input_values", lambda out: out.logits[0, 1]
    if kind == "spectrogram":  # (time, mel bins), cut into patches
        x = torch.randn(1, 16, 8, generator=gen, dtype=F64)
        return {"input_values": x}, "input_values", lambda out: out.logits[0, 1]
    if kind == "audio":
        x = torch.randn(1, 4, 16, generator=gen, dtype=F64)
        return {"input_features": x}, "input_features", lambda out: out.logits[0, 1]
    if kind == "ids":  # the model takes token ids only: explained from its embeddings
        emb = model.get_input_embeddings()
        key = next(n for n, m in model.named_modules() if m is emb)
        return {"input_ids": torch.tensor(IDS)}, key, lambda out: out.pooler_output[0, 3]
    embeds = model.get_input_embeddings()(torch.tensor(IDS)).detach()
    kwargs = {"inputs_embeds": embeds}
    if kind == "encoder":
        return kwargs, "inputs_embeds", lambda out: out.last_hidden_state[0, -1, 3]
    if kind == "seq2seq":
        kwargs["decoder_input_ids"] = torch.tensor([[0, 5, 6]])
    return kwargs, "inputs_embeds", lambda out: out.logits[0, -1, 5]


def _run(name):
    model = _model(name)
    kwargs, key, output = _inputs(name, model)
    res = sbp.backprop(model, kwargs=kwargs, output=output, semirings=SEMIRINGS)
    return model, kwargs, key, output, res


def _autograd(model, kwargs, key, output):
    """Autograd's gradient at input ``key``, or at the output of module ``key``."""
    kwargs = dict(kwargs)
    if key in kwargs:
        leaf = kwargs[key] = kwargs[key].clone().requires_grad_()
        (g,) = torch.autograd.grad(output(model(**kwargs)), leaf)
        return g
    return _autograd_module(model, key, lambda: output(model(**kwargs)))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family(name):
    fam = FAMILIES[name]
    refusal = fam.refused() if fam.refused is not None else None
    if refusal is not None:  # this transformers' code of the family cannot be traced
        with pytest.raises(sbp.TracingError, match=refusal):
            _run(name)
        return
    model, kwargs, key, output, res = _run(name)
    want = _autograd(model, kwargs, key, output)
    got = res.at(key, sbp.Real())
    scale = float(want.abs().max())
    assert scale > 0, "the output must depend on the input for the check to mean anything"
    torch.testing.assert_close(got, want, rtol=fam.rtol, atol=fam.rtol * scale)

    ent = res.at(key, sbp.Entropy())
    assert bool(torch.isfinite(ent.entropy).all()) and bool(torch.isfinite(ent.log_z).all())
    assert float(ent.entropy.max()) > 0  # many paths: a real distribution, not a stub

    # the top path from the first token (first channel for images and audio) and from
    # the best element of the whole input: its product is the MaxProduct readout
    mp = res.at(key, sbp.MaxProduct())
    agg = res.aggregate(key, sbp.MaxProduct(), dims=tuple(range(2, mp.hi.dim())))
    rel = max(fam.rtol, 1e-9) * 10
    for source, hi, lo in [((key, (0, 0)), agg.hi[0, 0], agg.lo[0, 0]),
                           (key, mp.hi.max(), mp.lo.min())]:  # fmt: skip
        for sign, want_value in (("+", hi), ("-", lo)):
            path = res.top_path(source, sign=sign)
            assert math.isclose(path.value, float(want_value), rel_tol=rel), (source, sign)
            assert len(path.steps) > 5  # through the model, not a stub

    table = res.layer_table()
    assert fam.roles <= set(table["branch"]), sorted(set(table["branch"]))
    attention = table[table["sublayer"] == "attention"]
    assert {"query", "key", "value"} <= set(attention["branch"])


# -- vision and sentence embeddings without Hugging Face heads ---------------------------


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1),
            torch.nn.BatchNorm2d(4),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2),
            torch.nn.GroupNorm(2, 6),
            torch.nn.GELU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def _check_vision(model, x, rtol=1e-10):
    model = model.to(F64).eval()
    output = lambda out: out[0, 1]  # noqa: E731
    res = sbp.backprop(model, (x,), output=output, semirings=SEMIRINGS)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(output(model(leaf)), leaf)
    torch.testing.assert_close(res.at(0, sbp.Real()), want, rtol=rtol, atol=rtol)
    assert bool(torch.isfinite(res.at(0, sbp.Entropy()).entropy).all())
    mp = res.at(0, sbp.MaxProduct())
    for sign, want_value in (("+", mp.hi.max()), ("-", mp.lo.min())):
        path = res.top_path(0, sign=sign)
        assert math.isclose(path.value, float(want_value), rel_tol=1e-9)
    return res


def test_small_cnn_with_batch_norm_and_max_pool():
    torch.manual_seed(0)
    model = SmallCNN()
    bn = model.features[1]
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 2.0)  # eval-mode statistics that are not the identity
    res = _check_vision(model, torch.randn(2, 3, 8, 8, dtype=F64))
    path = res.top_path(0)
    assert {"features.0", "features.4", "head"} <= set(path.modules)


def test_torchvision_resnet18():
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = models.resnet18(num_classes=3)
    for m in model.modules():  # running statistics other than (0, 1)
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    _check_vision(model, torch.randn(1, 3, 32, 32, dtype=F64), rtol=1e-9)


class _Logits(torch.nn.Module):
    """A Hugging Face image classifier as a function of the pixels alone."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def test_hf_convnext_and_mobilevit():
    """No attention blocks (ConvNeXt: depthwise convolutions, layer norm over channels;
    MobileViT: convolutions around transformers, upsampled by bilinear interpolation)."""
    torch.manual_seed(0)
    convnext = T.ConvNextForImageClassification(T.ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3,
        image_size=8))  # fmt: skip
    _check_vision(_Logits(convnext), torch.randn(1, 3, 8, 8, dtype=F64), rtol=1e-9)
    mobilevit = T.MobileViTForImageClassification(T.MobileViTConfig(
        image_size=16, num_channels=3, hidden_sizes=[16, 16, 16],
        neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16], num_labels=3))  # fmt: skip
    _check_vision(_Logits(mobilevit), torch.randn(1, 3, 16, 16, dtype=F64), rtol=1e-6)


class _PoolTransposed(torch.nn.Module):
    """Swin's pooler: a 1-D average pool over the tokens of a transposed sequence (export
    restates eager's strides there with an ``as_strided``)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.pool = torch.nn.AdaptiveAvgPool1d(1)

    def forward(self, x):
        return self.pool(self.proj(x).transpose(1, 2)).flatten(1)


def test_as_strided_that_restates_a_layout_is_the_identity_and_others_are_refused():
    torch.manual_seed(0)
    model, x = _PoolTransposed().to(F64).eval(), torch.randn(2, 5, 4, dtype=F64)
    output = lambda y: (y * y).sum()  # noqa: E731
    res = sbp.backprop(model, (x,), output=output, semirings=SEMIRINGS)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(output(model(leaf)), leaf)
    torch.testing.assert_close(res.at(0, sbp.Real()), want, rtol=1e-12, atol=1e-12)
    assert math.isclose(res.top_path(0).value, float(res.at(0, sbp.MaxProduct()).hi.max()))

    def windows(x):  # overlapping windows of one row: reads memory, not a layout
        return x.as_strided((3, 2), (1, 1)).sum()

    with pytest.raises(sbp.UnsupportedOpError, match="as_strided"):
        sbp.backprop(windows, (torch.randn(4, dtype=F64),))


def test_a_view_to_the_shape_it_has_is_the_identity():
    """transformers 5.24's SDPA attention reshapes its output to the shape it has (5.17's
    does not): the graph leaves such a view out, so its nodes and paths do not depend on
    it. A view that changes the shape stays."""
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(4, 4).to(F64).eval(), torch.randn(2, 5, 4, dtype=F64)
    plain = lambda x: torch.tanh(lin(x)).sum()  # noqa: E731
    same = lambda x: torch.tanh(lin(x).view(2, 5, 4)).sum()  # noqa: E731
    flat = lambda x: torch.tanh(lin(x).view(10, 4)).sum()  # noqa: E731
    res = {f: sbp.backprop(f, (x,), semirings=SEMIRINGS) for f in (plain, same, flat)}
    views = {f: [n for n in r.graph.nodes if n.target is torch.ops.aten.view.default]
             for f, r in res.items()}  # fmt: skip
    assert len(views[same]) == len(views[plain]) and len(views[flat]) == len(views[plain]) + 1
    assert len(res[same].graph.nodes) == len(res[plain].graph.nodes)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(plain(leaf), leaf)
    for r in res.values():
        torch.testing.assert_close(r.at(0, sbp.Real()), want, rtol=1e-12, atol=1e-12)
    assert len(res[same].top_path(0).steps) == len(res[plain].top_path(0).steps)
    assert len(res[flat].top_path(0).steps) == len(res[plain].top_path(0).steps) + 1


def test_sentence_embedding_similarity():
    """A sentence-transformers model, unmodified: mean pooling over the attention mask,
    normalized embeddings, their cosine similarity explained for both sentences."""
    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=32)  # fmt: skip
    bert = T.BertModel(config, add_pooling_layer=False).to(F64).eval()

    class Similarity(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask[..., None].to(hidden.dtype)
            pooled = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
            return torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=0)

    model = Similarity().eval()
    ids = torch.tensor([[3, 7, 1, 9, 4], [5, 2, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    where = "bert.embeddings.word_embeddings"
    res = sbp.backprop(model, (ids, mask), semirings=SEMIRINGS)
    got = res.at(where, sbp.Real())
    want = _autograd_module(model, where, lambda: model(ids, mask))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert not got[1, 3:].any()  # padding: no path
    assert bool(torch.isfinite(res.at(where, sbp.Entropy()).entropy).all())


def _autograd_module(model, name, run):
    kept = []
    hook = dict(model.named_modules())[name].register_forward_hook(
        lambda mod, args, out: kept.append(out) or out.retain_grad()
    )
    try:
        run().backward()
    finally:
        hook.remove()
    return kept[0].grad


def test_plain_module_that_casts_halfway():
    """A float64 model that runs a block in float32 and casts back: the pass follows."""

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4).double()
            self.b = torch.nn.Linear(4, 4).float()

        def forward(self, x):
            h = self.b(torch.tanh(self.a(x)).float()).softmax(-1)
            return h.to(torch.float64) * x + x.float().exp()  # f64 * f64 + f32 -> f64

    torch.manual_seed(0)
    model = Mixed().eval()
    x = torch.randn(2, 4, dtype=F64)
    output = lambda y: y[0, 1] - y[1, 2]  # noqa: E731
    res = sbp.backprop(model, (x,), output=output, semirings=SEMIRINGS)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(output(model(leaf)), leaf)
    torch.testing.assert_close(res.at(0, sbp.Real()), want, rtol=1e-6, atol=1e-7)
    assert res.at("b", sbp.Real()).dtype == torch.float32  # the island keeps its dtype


def test_t5_one_trace_serves_every_length():
    """Traced with symbolic sizes, T5's positions come from the input's length: values
    computed from a size are no function of the input's values (and its log(0) in the
    buckets is masked away), so the finite check and the pass leave them out."""
    model = _model("t5-encoder")
    output = lambda out: out.last_hidden_state[0, -1, 3]  # noqa: E731
    bp = sbp.Backprop(model, output, [sbp.Real(), sbp.Entropy()], dynamic=True)
    for n in (6, 9):
        embeds = model.get_input_embeddings()(torch.arange(n)[None] % V).detach()
        res = bp(kwargs={"inputs_embeds": embeds})
        want = _autograd(model, {"inputs_embeds": embeds}, "inputs_embeds", output)
        torch.testing.assert_close(res.at("inputs_embeds", sbp.Real()), want)
        assert bool(torch.isfinite(res.at("inputs_embeds", sbp.Entropy()).entropy).all())
    assert bp.traces == 1


def test_a_failed_trace_suggests_other_experts_only_to_a_mixture_of_experts():
    """transformers marks every model's config experts_implementation='eager': the hint
    to load the experts otherwise must go to models that have experts, and only them."""
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    config = T.MixtralConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=32)  # fmt: skip
    config._experts_implementation = "eager"  # a Python loop over the experts hit
    moe = T.MixtralForCausalLM(config).eval()
    with pytest.raises(sbp.TracingError, match="experts_implementation='grouped_mm'"):
        sbp.backprop(moe, kwargs={"input_ids": ids}, output=lambda o: o.logits[0, -1, 0])
    config = T.LongformerConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=32, attention_window=4,
                                max_position_embeddings=40, pad_token_id=1)  # fmt: skip
    dense = T.LongformerModel(config).eval()  # data-dependent attention windows
    assert dense.config._experts_implementation == "eager"
    with pytest.raises(sbp.TracingError) as e:
        sbp.backprop(dense, kwargs={"input_ids": ids},
                     output=lambda o: o.last_hidden_state[0, 0, 0])  # fmt: skip
    assert "expert" not in str(e.value) and "Things to try" in str(e.value)


def _tower(**kw):
    return dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, **kw)  # fmt: skip


def test_vision_language_models_from_the_pixels():
    """CLIP's image-text logit, LLaVA's and PaliGemma's next-token logit, explained at the
    pixels: the image features replace the image tokens by masked_scatter (a selection,
    no rule of its own: decomposed)."""
    torch.manual_seed(0)
    vision = _tower(image_size=8, patch_size=4)
    clip = T.CLIPModel(T.CLIPConfig(text_config=_tower(vocab_size=V, max_position_embeddings=16),
                                    vision_config=vision, projection_dim=8))  # fmt: skip
    llava = T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(**vision),
        text_config=T.LlamaConfig(**_tower(vocab_size=80, max_position_embeddings=16)),
        image_token_index=70, projector_hidden_act="gelu", vision_feature_layer=-1))  # fmt: skip
    paligemma_config = T.PaliGemmaConfig(
        vision_config=T.SiglipVisionConfig(**vision),
        text_config=T.GemmaConfig(**_tower(vocab_size=80, num_key_value_heads=1, head_dim=8,
                                           max_position_embeddings=16)),
        image_token_index=70, projection_dim=16)  # fmt: skip
    # (under SDPA, transformers' PaliGemma attends both ways when run and causally while
    # traced: the trace check refuses that; eager attention is the same either way)
    paligemma_config._attn_implementation = "eager"
    paligemma = T.PaliGemmaForConditionalGeneration(paligemma_config)
    px = torch.randn(1, 3, 8, 8, dtype=F64)
    cases = [
        (clip, {"input_ids": torch.tensor([[0, 5, 6, 7, 2], [0, 8, 9, 2, 1]]),
                "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])},
         lambda o: o.logits_per_image[0, 1], 4),
        (llava, {"input_ids": torch.tensor([[1, 70, 70, 70, 70, 5, 6, 7]])},
         lambda o: o.logits[0, -1, 5], 4),
        (paligemma, {"input_ids": torch.tensor([[70, 70, 70, 70, 1, 5, 6, 7]])},
         lambda o: o.logits[0, -1, 5], 4),
    ]  # fmt: skip
    for model, kwargs, output, layers in cases:
        model = model.to(F64).eval()
        kwargs = {**kwargs, "pixel_values": px}
        res = sbp.backprop(model, kwargs=kwargs, output=output, semirings=SEMIRINGS)
        want = _autograd(model, kwargs, "pixel_values", output)
        torch.testing.assert_close(res.at("pixel_values", sbp.Real()), want, rtol=1e-6,
                                   atol=1e-6 * float(want.abs().max()))  # fmt: skip
        best = float(res.at("pixel_values", sbp.MaxProduct()).hi.max())
        assert math.isclose(res.top_path("pixel_values").value, best, rel_tol=1e-9)
        table = res.layer_table()
        assert table["layer"].nunique() == layers  # both towers' blocks
        assert {"skip", "query", "key", "value", "mlp"} <= set(table["branch"])
    # LLaVA's check that its image tokens match the image features stays in the graph
    # (torch 2.11 writes it through a cast the trace unwraps): on the traced graph, three
    # image tokens for four features fail as the model's own forward does
    bp = sbp.Backprop(llava, lambda o: o.logits[0, -1, 5], [sbp.Real()])
    bp(kwargs={"input_ids": torch.tensor([[1, 70, 70, 70, 70, 5, 6, 7]]), "pixel_values": px})
    with pytest.raises(sbp.SemiringBackpropError, match="own forward fails the same way"):
        bp(kwargs={"input_ids": torch.tensor([[1, 70, 70, 70, 5, 5, 6, 7]]), "pixel_values": px})
    assert bp.traces == 1  # the same graph ran both


class _OtherPathWhenExported(torch.nn.Module):
    """Computes one thing when run and another while torch.export traces it, as a library
    that skips work outside tracing may (PaliGemma under SDPA attends both ways when run,
    causally in the trace)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.proj(x)
        if torch.compiler.is_exporting():
            h = h.tril()
        return self.head(h)


def test_a_trace_that_computes_something_else_than_the_model_is_refused():
    torch.manual_seed(0)
    model, x = _OtherPathWhenExported().to(F64).eval(), torch.randn(4, 4, dtype=F64)
    with pytest.raises(sbp.TracingError, match="'head' differs from the model's own"):
        sbp.backprop(model, (x,), output=lambda y: y[0, 1])
    with pytest.raises(sbp.TracingError, match="something else"):  # keep=: the same check
        sbp.backprop(model, (x,), output=lambda y: y[0, 1], keep=(0,))  # (head's value held)
    # float32 rounding between eager kernels and the decomposition is not a difference
    bert = T.BertForMaskedLM(FAMILIES["bert"].config()).eval()
    ids = torch.tensor(IDS)
    res = sbp.backprop(bert, kwargs={"input_ids": ids}, output=lambda o: o.logits[0, -1, 5])
    assert res.graph.eager_checked


def test_state_space_layers_are_not_read_as_attention():
    """Mamba's mixer projects its input with ``in_proj`` into z / x / dt: not a fused
    query / key / value. Jamba's table has its attention layer only; Mamba2 (running sums
    over chunks: cumsum) is exact, and its table says there is no attention block."""
    model, kwargs, key, output, res = _run("jamba")
    table = res.layer_table()
    qkv = table[table["branch"].isin(["query", "key", "value"])]
    assert set(qkv["consumer"]) == {f"model.layers.1.self_attn.{p}_proj" for p in "qkv"}
    torch.manual_seed(0)
    config = T.Mamba2Config(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=2,
                            expand=2, conv_kernel=2, n_groups=1, num_heads=4, head_dim=8,
                            chunk_size=4)  # fmt: skip
    mamba2 = T.Mamba2ForCausalLM(config).to(F64).eval()
    embeds = mamba2.get_input_embeddings()(torch.tensor(IDS)).detach()
    output = lambda out: out.logits[0, -1, 5]  # noqa: E731
    res = sbp.backprop(mamba2, kwargs={"inputs_embeds": embeds}, output=output,
                       semirings=SEMIRINGS)  # fmt: skip
    want = _autograd(mamba2, {"inputs_embeds": embeds}, "inputs_embeds", output)
    torch.testing.assert_close(res.at("inputs_embeds", sbp.Real()), want, rtol=1e-6,
                               atol=1e-6 * float(want.abs().max()))  # fmt: skip
    best = float(res.at("inputs_embeds", sbp.MaxProduct()).hi.max())
    assert math.isclose(res.top_path("inputs_embeds").value, best, rel_tol=1e-9)
    with pytest.raises(sbp.NotFoundError, match="no attention block"):
        res.layer_table()
