"""Causal masking reads as "no path", the same under every attention implementation.

A causal language model (GPT-2, grouped-query Llama; tiny, random, float64) explained at
an early position. What the causal mask keeps from that position has no path under every
semiring (``engine.structure``: a masked probability is a structural zero, no edge):

- oracle: the structure itself, counted here without the library: which positions reach
  which under the causal mask, layer by layer, gives the circuit's edges (source, entry,
  position) and its attention edges (head, source, destination position), compared as
  sets with the library's rows, under every semiring whose readout tells a path from
  none; every other row reads as the semiring's zero;
- eager and SDPA attention: the same rows and the same values (the same function);
- torch.autograd: Real is the gradient, 0 where no path;
- zeros of the values are not structure: a ReLU's zeros, an exp that underflows on its
  own, stay edges of weight 0 (a path of product 0 under MaxProduct, a path counted).
"""

from __future__ import annotations

import functools
import math

import pandas as pd
import pytest
import torch
import transformers

import oracles
import semiring_backprop as sbp
from semiring_backprop.circuits.nodes import readout

pytestmark = pytest.mark.usefixtures("_offline_quiet")

F64 = torch.float64
ALL = oracles.all_semirings()
IMPLS = ["eager", "sdpa"]  # what the library traces (flex and flash attention: not on a CPU)
FAMILIES = ["gpt2", "llama"]
LAYERS, HEADS, LENGTH = 2, 2, 3
IDS = torch.tensor([[1, 2, 3]])
#: semirings whose readout of "no path" is no value a path can have
TELLING = ("MaxProduct(neuron)", "MaxProduct(tensor)", "LogAbs", "PathCount")
EDGE_KEY = ["src_layer", "src_role", "src_head_index", "dst_layer", "dst_role",
            "dst_head_index", "input", "position"]  # fmt: skip
PAIR_KEY = ["layer", "head_index", "src_position", "dst_position"]


@functools.cache
def _model(family, impl):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=16, n_embd=8, n_layer=LAYERS, n_head=HEADS, n_positions=8,
            bos_token_id=0, eos_token_id=0, attn_implementation=impl,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=16, hidden_size=8, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=1, intermediate_size=16, max_position_embeddings=8,
            attn_implementation=impl,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    return model.to(F64).eval()


def _gap(position):
    """The logit gap of two tokens at ``position``."""
    return lambda out: out.logits[0, position, 3] - out.logits[0, position, 4]


@functools.cache
def _result(family, impl, position, whole=()):
    return sbp.backprop(_model(family, impl), kwargs={"input_ids": IDS},
                        output=_gap(position), semirings=ALL, whole=whole)  # fmt: skip


@functools.cache
def _circuit(family, impl, position, whole=()):
    return sbp.Circuit.from_result(_result(family, impl, position, whole), seed="structural")


def _embedding(family):
    return "transformer.wte" if family == "gpt2" else "model.embed_tokens"


def _nothing(sr, value):
    """Where ``value`` (a pass's, per element) is the semiring's zero: its first field
    (MaxProduct: hi and lo both) equal to the zero's (pointers of no path mean nothing)."""
    zero = sr.zero(value[0].shape, value[0])
    fields = 2 if isinstance(sr, sbp.MaxProduct) else 1
    out = value[0] == zero[0]
    for f, z in zip(value[1:fields], zero[1:fields]):
        out &= f == z
    return out


def _no_path(sr):
    """What a table shows for an element without a path under ``sr``."""
    zero = sr.zero((), torch.zeros((), dtype=F64))
    return float(readout(sr, zero))


# -- the structure, counted without the library ------------------------------------------


def _reach(position):
    """``(mid, out)``: per layer, whether the residual stream after the layer's attention
    (``mid``) and after the whole layer (``out``) at each position reaches the output at
    ``position``. Attention moves a position ``p`` to the queries ``q >= p`` only."""
    out = {LAYERS - 1: [p == position for p in range(LENGTH)]}
    mid = {}
    for layer in reversed(range(LAYERS)):
        mid[layer] = out[layer]  # the MLP reads and writes one position
        enters = [any(mid[layer][q] for q in range(p, LENGTH)) for p in range(LENGTH)]
        out[layer - 1] = [a or b for a, b in zip(mid[layer], enters)]
    return mid, out


def _entries(position):
    """``{(component, entry): positions where a path enters it and goes on to the
    output}``; components are ``(role, layer, head)``."""
    mid, out = _reach(position)
    entries = {}
    for layer in range(LAYERS):
        for head in range(HEADS):
            comp = ("head", layer, head)
            entries[comp, "q"] = [p for p in range(LENGTH) if mid[layer][p]]
            for e in "kv":  # a key or value at p is read by the queries q >= p
                entries[comp, e] = [p for p in range(LENGTH)
                                    if any(mid[layer][q] for q in range(p, LENGTH))]  # fmt: skip
        entries[("mlp", layer, None), "mlp"] = [p for p in range(LENGTH) if out[layer][p]]
    entries[("target", LAYERS, None), "target"] = [position]
    return entries


def _sources(comp):
    """The components whose paths can enter ``comp`` through the residual stream."""
    role, layer, _ = comp
    srcs = [("embedding", -1, None)]
    for lay in range(min(layer + (role != "head"), LAYERS)):
        srcs += [("head", lay, h) for h in range(HEADS)]
        if lay < layer:
            srcs.append(("mlp", lay, None))
    return srcs


def structural_edges(position) -> set:
    """Every (source, entry, position) of the circuit that a path takes: a source reaches
    every position at and after its own, so its alpha is never "no path"."""
    out = set()
    for (comp, entry), positions in _entries(position).items():
        for src in _sources(comp):
            for p in positions:
                out.add((src[1], src[0], src[2], comp[1], comp[0], comp[2], entry, p))
    return out


def structural_pairs(position) -> set:
    """Every (layer, head, source, destination) of a head's value paths that goes on
    to the output: a destination the output reads, a source not after it."""
    mid, _ = _reach(position)
    return {(layer, h, s, d) for layer in range(LAYERS) for h in range(HEADS)
            for d in range(LENGTH) if mid[layer][d] for s in range(d + 1)}  # fmt: skip


def test_the_count_by_hand():
    # 2 layers of 2 heads: at the explained position 6 + 3 + 4*6 + 6 + 7 = 46 edges; at
    # position 0 before it, the layer-0 heads' q, k, v (6), the MLP 0 (3) and the layer-1
    # heads' k and v (2 * 2 * 4 = 16): 25
    assert len(structural_edges(0)) == 46
    assert len(structural_edges(1)) == 46 + 25
    assert len(structural_pairs(0)) == 2 * 2
    assert len(structural_pairs(1)) == 2 * 3 + 2 * 2


def _keys(frame, key):
    def value(v):
        return None if v is pd.NA else v if isinstance(v, str) else int(v)

    return {tuple(value(v) for v in row) for row in frame[key].itertuples(index=False)}


# -- the pass: no path where the mask keeps a position out -------------------------------


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_later_tokens_have_no_path_under_every_semiring(family, impl, position):
    res = _result(family, impl, position)
    place = _embedding(family)
    for sr in ALL:
        nothing = _nothing(sr, res.value(place, sr))[0]  # (positions, hidden units)
        assert bool(nothing[position + 1 :].all()), f"{sr.name}: a later token has a path"
        assert not bool(nothing[: position + 1].all(-1).any()), sr.name  # (each has one)
    # Real is the gradient: 0 after the position
    model = _model(family, impl)
    kept = {}
    hook = model.get_input_embeddings().register_forward_hook(
        lambda m, a, out: kept.setdefault("e", out.detach().requires_grad_())
    )
    try:
        (grad,) = torch.autograd.grad(_gap(position)(model(input_ids=IDS)), kept["e"])
    finally:
        hook.remove()
    # (Llama's eager attention runs its softmax in float32: autograd rounds through it)
    rtol = 1e-6 if (family, impl) == ("llama", "eager") else 1e-10
    torch.testing.assert_close(res.at(place, sbp.Real()), grad, rtol=rtol, atol=rtol * 1e-2)
    assert not grad[0, position + 1 :].any()


# -- the circuit: edges, attention edges and sites as the structure says ------------------


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_circuit_edges_are_those_the_mask_allows(family, impl, position):
    c = _circuit(family, impl, position)
    want = structural_edges(position)
    assert _keys(c.edges, EDGE_KEY) == want
    for name in TELLING:  # each semiring alone finds the same edges
        sr = next(s for s in ALL if s.name == name)
        found = c.edges[c.edges[name] != _no_path(sr)]
        assert _keys(found, EDGE_KEY) == want, name

    pairs = c.attention_edges
    assert len(pairs) == LAYERS * HEADS * LENGTH**2  # every pair is a row
    for sr in ALL:
        nothing = pairs[sr.name] == _no_path(sr)
        masked = pairs["src_position"] > pairs["dst_position"]
        assert bool(nothing[masked].all()), f"{sr.name}: a masked pair holds a path"
        if sr.name in TELLING:
            assert _keys(pairs[~nothing], PAIR_KEY) == structural_pairs(position), sr.name

    nodes = c.nodes
    later = nodes[nodes["position"] > position]
    assert len(later)
    for sr in ALL:
        assert bool((later[sr.name] == _no_path(sr)).all()), f"{sr.name}: a later site"
    first = nodes[(nodes["role"] == "embedding") & (nodes["position"] <= position)]
    assert bool(first["MaxProduct(neuron)"].map(math.isfinite).all())


def _same_frames(a, b, key):
    a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a[key], b[key])
    for sr in ALL:
        torch.testing.assert_close(
            torch.tensor(a[sr.name].to_numpy(dtype=float)),
            torch.tensor(b[sr.name].to_numpy(dtype=float)),
            rtol=1e-5, atol=1e-9,  # (Llama's eager softmax runs in float32)
        )  # fmt: skip


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_eager_and_sdpa_give_the_same_circuit(family, position):
    eager, sdpa = (_circuit(family, impl, position) for impl in IMPLS)
    _same_frames(eager.edges, sdpa.edges, EDGE_KEY)
    _same_frames(eager.attention_edges, sdpa.attention_edges, PAIR_KEY)
    key = ["layer", "position", "role", "head_index"]
    _same_frames(eager.nodes, sdpa.nodes, key)


def test_a_softmax_kept_whole_drops_the_masked_edges_too():
    c = _circuit("gpt2", "eager", 0, whole=("softmax",))
    assert _keys(c.edges, EDGE_KEY) == structural_edges(0)
    pairs = c.attention_edges
    mp = pairs["MaxProduct(neuron)"] != -math.inf
    assert _keys(pairs[mp], PAIR_KEY) == structural_pairs(0)


@pytest.mark.parametrize("impl", IMPLS)
def test_left_padding_is_no_path(impl):
    """A padded position (attention mask 0, made from the integer input) is read by no
    query: no path from it, eager and SDPA alike."""
    model = _model("gpt2", impl)
    kwargs = {"input_ids": IDS, "attention_mask": torch.tensor([[0, 1, 1]])}
    res = sbp.backprop(model, kwargs=kwargs, output=_gap(2),
                       semirings=[sbp.Real(), sbp.MaxProduct(), sbp.PathCount()])  # fmt: skip
    place = _embedding("gpt2")
    assert bool((res.at(place, sbp.MaxProduct()).hi[0, 0] == -math.inf).all())
    assert bool((res.at(place, sbp.PathCount()).log_count[0, 0] == -math.inf).all())
    assert bool(res.at(place, sbp.MaxProduct()).hi[0, 1:].isfinite().all())
    assert not res.at(place, sbp.Real())[0, 0].any()


# -- what is not structure ----------------------------------------------------------------


def test_zeros_of_the_values_stay_edges_of_weight_0():
    """A ReLU's zeros, an exp that underflows on its own and a weight of 0 are edges of
    weight 0: under MaxProduct a path of product 0, under PathCount a path."""
    x = torch.tensor([[-1.0, 2.0, -1000.0]], dtype=F64)
    w = torch.tensor([[1.0], [0.0], [1.0]], dtype=F64)

    def f(v):
        return torch.relu(v[:, :2]).sum() + torch.exp(v[:, 2]).sum() + (v @ w).sum()

    res = sbp.backprop(f, (x,), semirings=[sbp.MaxProduct(), sbp.PathCount()])
    mp, count = res.at(0, sbp.MaxProduct()), res.at(0, sbp.PathCount())
    # relu'(-1) = 0 and exp(-1000) = 0 beside a matmul edge of weight 1; x[1]: relu' 1,
    # and a matmul edge of weight 0
    torch.testing.assert_close(mp.hi, torch.tensor([[1.0, 1.0, 1.0]], dtype=F64))
    torch.testing.assert_close(mp.lo, torch.tensor([[0.0, 0.0, 0.0]], dtype=F64))
    torch.testing.assert_close(count.log_count.exp(), torch.full((1, 3), 2.0, dtype=F64))


def _attend(s, v, masked):
    return (masked.softmax(-1) @ v).sum() + 0 * s.sum()


S = torch.tensor([[0.5, -2.0, 1.0]], dtype=F64)
V = torch.tensor([[1.0], [2.0], [3.0]], dtype=F64)


def test_a_mask_made_from_the_values_is_no_structure():
    """A ``where`` whose condition is computed from the values explained picks a -inf
    that is data: the probability's 0 there is an edge of weight 0 to ``v`` (as DESIGN
    §1 says), a path of product 0 under MaxProduct, a path counted."""

    def f(s, v):
        return _attend(s, v, torch.where(s < 0, torch.tensor(-math.inf, dtype=F64), s))

    res = sbp.backprop(f, (S, V), semirings=[sbp.MaxProduct(), sbp.PathCount()])
    assert float(res.at(1, sbp.MaxProduct()).hi[1, 0]) == 0.0
    assert float(res.at(1, sbp.PathCount()).log_count[1, 0]) == 0.0  # one path


def test_a_mask_made_from_positions_is_structure():
    """The same function with the mask made from an integer input: ``v`` at the masked
    position has no path, under every semiring; Real is still autograd's gradient."""

    def f(s, v, keep):
        return _attend(s, v, s.masked_fill(keep == 0, -math.inf))

    keep = torch.tensor([[1, 0, 1]])
    res = sbp.backprop(f, (S, V, keep), semirings=ALL)
    for sr in ALL:
        nothing = _nothing(sr, res.value(1, sr))[:, 0]
        assert nothing.tolist() == [False, True, False], sr.name
    vg = V.clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(S, vg, keep), vg)
    torch.testing.assert_close(res.at(1, sbp.Real()), grad)
    assert float(grad[1, 0]) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_top_paths_agree_and_a_later_token_has_none(family):
    place = _embedding(family)
    got = [_result(family, impl, 1).top_path((place, (0, 0))).value for impl in IMPLS]
    assert got[0] == pytest.approx(got[1], rel=1e-6)
    for impl in IMPLS:
        with pytest.raises(sbp.NotFoundError, match="no path"):
            _result(family, impl, 1).top_path((place, (0, 2)))


# -- the semirings' operations without the edges that are not there ---------------------


def _values(sr, shape, generator):
    """A value of ``sr``: random path products, the zero (no path) at a third of them."""
    x = torch.randn(shape, dtype=F64, generator=generator)
    value = sr.times(sr.one(shape, x), x)
    return sr.without(value, torch.rand(shape, generator=generator) < 1 / 3)


@pytest.mark.parametrize("sr", ALL, ids=lambda s: s.name)
def test_matmul_without_is_the_sum_over_the_edges_there(sr):
    """``matmul_without(a, w, absent)[i, k]`` is the ⊕ over the ``j`` whose edge is there
    of ``a[i, j] ⊗ lift(w[j, k])`` (no path where there is none); at tensor granularity
    the real sums of the edges there."""
    g = torch.Generator().manual_seed(0)
    a = _values(sr, (2, 3, 4), g)
    w = torch.randn(2, 4, 5, dtype=F64, generator=g)
    absent = torch.rand(2, 4, 5, generator=g) < 0.5
    absent[0, :, 0] = True  # a column without any edge
    got = sr.matmul_without(a, w, absent)
    if sr == sbp.MaxProduct("tensor"):  # real sums of hi and lo, then swapped where lo > hi
        keep = (a[0] != -math.inf)[..., None] & ~absent[:, None]  # (batch, i, j, k)
        hi, lo = (torch.where(keep, f[..., None] * w[:, None], 0.0).sum(-2) for f in a[:2])
        reached = keep.any(-2)
        want = (torch.where(reached, torch.maximum(hi, lo), -math.inf),
                torch.where(reached, torch.minimum(hi, lo), math.inf))  # fmt: skip
    else:
        terms = []
        for j in range(4):  # one term per j: its edges there, the zero elsewhere
            edge = sr.times(tuple(f[..., j : j + 1] for f in a), w[:, j : j + 1, :])
            terms.append(sr.without(edge, absent[:, j : j + 1, :]))
        want = sr.sum(tuple(torch.stack(fs) for fs in zip(*terms)), (0,))
    fields = 2 if isinstance(sr, sbp.MaxProduct) else 1  # (values; not the pointers)
    for x, y in zip(got[:fields], want[:fields]):
        torch.testing.assert_close(x, y)
    assert bool(_nothing(sr, got)[0, :, 0].all())
