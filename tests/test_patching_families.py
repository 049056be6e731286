"""Ablation on the traced graph (``analysis.patching.Patching``) on every family whose
circuits are tested: BERT (post-LN), GPT-2 (fused query/key/value), a Llama with
grouped-query attention (four query heads read two key/value heads),
``nn.TransformerEncoderLayer`` models (post-norm and pre-norm) and TransformerLens'
HookedTransformer (LayerNorm; rotary, RMSNorm and one K/V head for two query heads);
float64, small random configs, mode "corrupted".

Oracles, the model's own forward (hooks on its own modules, not the traced graph):
- every edge kept gives the clean output, none the corrupted input's output;
- ablating the embedding site at one position is the model run with that one token
  corrupted;
- ablating every edge into one destination input at one position (all the edges into
  a head's query, key or value input, an MLP's input or the target there) is the model
  with that input alone replaced there by the corrupted run's value: that head's
  columns of its projection's output (a forward hook on the projection), the MLP's or
  the output head's input (a pre-hook);
- grouped-query attention: a head's own keys and values are the shared K/V head of its
  group as repeated for that head (``repeat_kv``'s copy for it). Ablating every edge
  into ``h<k>`` at a position is the model where only head ``h``'s copy of the keys at
  that position comes from the corrupted run (``repeat_kv`` wrapped), the other heads
  of its group reading the clean keys; ablating the k edges of both heads of a group
  is the model with the shared K/V columns of ``k_proj`` replaced;
- the edges are ``Circuit.edges``' rows (the circuit's own analysis).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop.analysis.patching import EDGE_KEY, Patching

T = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")
# TransformerLens 3 deprecates HookedTransformer (tested here as test_transformer_lens.py does)
pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

F64 = torch.float64
MP = sbp.MaxProduct()
IDS = torch.tensor([[3, 7, 1, 9, 4]])
COR = torch.tensor([[3, 5, 1, 2, 4]])  # positions 1 and 3 differ
MHA_IDS, MHA_COR = torch.tensor([[1, 4, 2, 5]]), torch.tensor([[1, 6, 2, 0]])
# grouped-query Llama: 4 query heads of 4 columns, 2 key/value heads (heads 0, 1 read K/V
# head 0; heads 2, 3 read K/V head 1)
GQA_HEADS, GQA_KV, GQA_D = 4, 2, 4


def _causal(out):
    return out.logits[0, -1, 5] - out.logits[0, -2, 3]


def _mlm(out):
    return out.logits[0, 2, 7] - out.logits[0, 2, 9]


def _mha(y):
    return y[0, -1, 0] - y[0, 0, 1]


def _bert():
    return T.BertForMaskedLM(T.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, initializer_range=0.5,
        attn_implementation="sdpa"))  # fmt: skip


def _gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=20, n_embd=8, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
        eos_token_id=0, initializer_range=0.5, attn_implementation="sdpa"))  # fmt: skip


def _llama():
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=20, hidden_size=GQA_HEADS * GQA_D, intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=GQA_HEADS, num_key_value_heads=GQA_KV,
        max_position_embeddings=16, initializer_range=0.5,
        attn_implementation="sdpa"))  # fmt: skip


class Encoder(nn.Module):
    """An embedding, two ``TransformerEncoderLayer``s (batch first) and a readout."""

    def __init__(self, norm_first):
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(8, 2, 8, dropout=0.0, batch_first=True,
                                       norm_first=norm_first)
            for _ in range(2)
        )  # fmt: skip
        self.head = nn.Linear(8, 2)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _lens(name):
    """TransformerLens' HookedTransformer as test_transformer_lens.py builds it: LayerNorm
    and learned positions, or rotary, RMSNorm and one K/V head for two query heads."""
    pytest.importorskip("transformer_lens")
    import test_transformer_lens as ttl

    return ttl.model(name)


def _logits(y):
    return y[0, -1, 5] - y[0, -2, 3]


TL_IDS, TL_COR = torch.tensor([[3, 7, 1, 9, 4, 11]]), torch.tensor([[3, 7, 20, 9, 30, 11]])
# name: (build, metric, keyword of the ids or None (positional), clean ids, corrupted ids)
FAMILIES = {
    "bert": (_bert, _mlm, "input_ids", IDS, COR),
    "gpt2": (_gpt2, _causal, "input_ids", IDS, COR),
    "llama_gqa": (_llama, _causal, "input_ids", IDS, COR),
    "mha_post": (lambda: Encoder(False), _mha, None, MHA_IDS, MHA_COR),
    "mha_pre": (lambda: Encoder(True), _mha, None, MHA_IDS, MHA_COR),
    "lens_ln": (lambda: _lens("learned-ln"), _logits, None, TL_IDS, TL_COR),
    "lens_gqa": (lambda: _lens("rotary-rms-gqa"), _logits, None, TL_IDS, TL_COR),
}


@functools.cache
def built(name):
    """``(model, Patching)``: the traced pass (Real, MaxProduct) and its patching."""
    build, metric, key, ids, cor = FAMILIES[name]
    torch.manual_seed(0)
    model = build().to(F64).eval()
    if key is None:
        res = sbp.backprop(model, (ids,), output=metric, semirings=[sbp.Real(), MP])
        return model, Patching(res, (cor,))
    res = sbp.backprop(model, kwargs={key: ids}, output=metric, semirings=[sbp.Real(), MP])
    return model, Patching(res, {key: cor})


def forward(name, ids, hooks=()):
    """The metric of the model's own forward on ``ids``, with ``hooks`` (functions that
    register a hook and return its handle) in place. Gradients stay on: with them off
    ``nn.TransformerEncoderLayer`` takes its fused fast path, which calls no hook."""
    model, _ = built(name)
    _, metric, key, *_ = FAMILIES[name]
    handles = [h() for h in hooks]
    try:
        with torch.enable_grad():
            out = model(input_ids=ids) if key else model(ids)
            return float(metric(out).detach())
    finally:
        for h in handles:
            h.remove()


def _close(got, want, what):
    assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), f"{what}: {got} != {want}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_edge_kept_is_the_clean_output_and_none_the_corrupted(name):
    _, p = built(name)
    _, _, _, ids, cor = FAMILIES[name]
    clean, corrupted = forward(name, ids), forward(name, cor)
    assert abs(clean - corrupted) > 1e-2
    _close(p.clean, clean, "clean")
    _close(p.metric(p.edges()), clean, "every edge kept")
    _close(p.empty, corrupted, "no edge kept")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ablating_the_embedding_at_a_position_is_corrupting_that_token(name):
    _, p = built(name)
    _, _, _, ids, cor = FAMILIES[name]
    nodes = p.node_effects()
    emb = nodes[nodes.role == "embedding"].sort_values("position")
    assert len(emb) == ids.shape[1]
    clean = forward(name, ids)
    for pos in range(ids.shape[1]):
        one = ids.clone()
        one[0, pos] = cor[0, pos]
        _close(emb.effect.iloc[pos], clean - forward(name, one), f"embedding at {pos}")
    assert [abs(e) > 1e-9 for e in emb.effect] == (ids != cor)[0].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_edges_are_the_circuits(name):
    _, p = built(name)
    c = sbp.Circuit.from_result(p.res, [sbp.Real(), MP], seed="x")
    want = c.edges[list(EDGE_KEY)].reset_index(drop=True)
    pd.testing.assert_frame_equal(p.edges(), want)
    assert set(want.input) == {"q", "k", "v", "mlp", "target"}


# -- one destination's input --------------------------------------------------------


def ablated_into(p, dst, pos) -> float:
    """m with every edge into destination ``dst`` = (layer, role, head, input) at ``pos``
    ablated (``dst`` a list: into each of them), every other edge kept."""
    dsts = dst if isinstance(dst, list) else [dst]
    edges = p.edges()
    into = pd.Series(False, index=edges.index)
    for layer, role, head, inp in dsts:
        into |= ((edges.dst_layer == layer) & (edges.dst_role == role) & (edges.input == inp)
                 & (edges.position == pos)
                 & (edges.dst_head_index.isna() if head is None
                    else edges.dst_head_index == head))  # fmt: skip
    assert into.any(), (dst, pos)
    return p.metric(edges[~into])


def _capture(name, module, ids, what):
    """The input (``what="in"``) or output of ``module`` on ``ids``."""
    got = {}

    def hook():
        if what == "in":
            return module.register_forward_pre_hook(
                lambda mod, args: got.__setitem__("v", args[0].detach().clone()))  # fmt: skip
        return module.register_forward_hook(
            lambda mod, args, out: got.__setitem__("v", out.detach().clone()))  # fmt: skip

    forward(name, ids, [hook])
    return got["v"]


def replaced(name, module, what, pos, cols=slice(None)):
    """The metric with ``module``'s input or output (batch, positions, columns) at ``pos``,
    columns ``cols``, replaced by the corrupted run's."""
    _, _, _, ids, cor = FAMILIES[name]
    value = _capture(name, module, cor, what)

    def hook():
        if what == "in":

            def pre(mod, args):
                x = args[0].clone()
                x[:, pos, cols] = value[:, pos, cols]
                return (x, *args[1:])

            return module.register_forward_pre_hook(pre)

        def post(mod, args, out):
            out = out.clone()
            out[:, pos, cols] = value[:, pos, cols]
            return out

        return module.register_forward_hook(post)

    return forward(name, ids, [hook])


def _heads(i, h, d=4):
    return slice(i * d + h * d, i * d + (h + 1) * d)


def _hf_reference(name, dst, pos):
    """The model's own forward with destination ``dst``'s input at ``pos`` corrupted."""
    model, _ = built(name)
    if name.startswith("lens"):  # its hook points: q / k / v (batch, position, head, d)
        layer, role, head, inp = dst[0] if isinstance(dst, list) else dst
        if role == "target":
            return replaced(name, model.ln_final.hook_normalized, "out", pos)
        block = model.blocks[layer]
        if role == "mlp":
            return replaced(name, block.ln2.hook_normalized, "out", pos)
        hook = getattr(block.attn, f"hook_{inp}")
        return replaced(name, hook, "out", pos, 0 if isinstance(dst, list) else head)
    layer, role, head, inp = dst
    if name == "bert":
        block = model.bert.encoder.layer[layer] if role != "target" else None
        if role == "target":
            return replaced(name, model.cls, "in", pos)
        if role == "mlp":
            return replaced(name, block.intermediate, "in", pos)
        proj = {"q": "query", "k": "key", "v": "value"}[inp]
        return replaced(name, getattr(block.attention.self, proj), "out", pos, _heads(0, head))
    if name == "gpt2":
        if role == "target":
            return replaced(name, model.transformer.ln_f, "in", pos)
        block = model.transformer.h[layer]
        if role == "mlp":
            return replaced(name, block.mlp, "in", pos)
        return replaced(name, block.attn.c_attn, "out", pos, _heads("qkv".index(inp) * 2, head))
    if role == "target":
        return replaced(name, model.model.norm, "in", pos)
    block = model.model.layers[layer]
    if role == "mlp":
        return replaced(name, block.mlp, "in", pos)
    assert inp == "q"  # (keys and values: test_a_grouped_query_head_reads_its_own_copy)
    return replaced(name, block.self_attn.q_proj, "out", pos, _heads(0, head))


def _mha_reference(name, dst, pos, monkeypatch):
    """The same for ``nn.TransformerEncoderLayer``: its query / key / value are one packed
    projection inside ``F.multi_head_attention_forward`` (``_in_projection_packed``,
    sequence first), wrapped to replace one head's columns of one of them."""
    import torch.nn.functional as F

    model, _ = built(name)
    layer, role, head, inp = dst
    if role == "target":
        return replaced(name, model.head, "in", pos)
    block = model.layers[layer]
    if role == "mlp":
        return replaced(name, block.linear1, "in", pos)
    packed = F._in_projection_packed
    calls: list = []
    which = "qkv".index(inp)

    def capture(*args, **kw):
        out = packed(*args, **kw)
        calls.append([t.detach().clone() for t in out])
        return out

    monkeypatch.setattr(F, "_in_projection_packed", capture)
    _, _, _, ids, cor = FAMILIES[name]
    forward(name, cor)
    value = calls[layer][which]
    seen = []

    def patched(*args, **kw):
        out = list(packed(*args, **kw))
        if len(seen) == layer:
            out[which] = out[which].clone()
            out[which][pos, :, _heads(0, head)] = value[pos, :, _heads(0, head)]
        seen.append(1)
        return tuple(out)

    monkeypatch.setattr(F, "_in_projection_packed", patched)
    got = forward(name, ids)
    assert len(seen) == 2  # the wrapper ran (no fast path), once per layer
    return got


# name: [(destination (layer, role, head, input), position)]: one of each input
DESTINATIONS = {
    "bert": [((0, "head", 1, "q"), 1), ((0, "head", 0, "k"), 3), ((1, "head", 1, "v"), 2),
             ((0, "mlp", None, "mlp"), 1), ((1, "mlp", None, "mlp"), 2),
             ((2, "target", None, "target"), 2)],
    "gpt2": [((0, "head", 1, "q"), 3), ((1, "head", 0, "k"), 1), ((1, "head", 1, "v"), 3),
             ((0, "mlp", None, "mlp"), 3), ((2, "target", None, "target"), 4)],
    "llama_gqa": [((1, "head", 2, "q"), 4), ((0, "mlp", None, "mlp"), 3),
                  ((2, "target", None, "target"), 3)],
    "mha_post": [((0, "head", 0, "q"), 1), ((1, "head", 1, "k"), 1), ((0, "head", 1, "v"), 1),
                 ((1, "mlp", None, "mlp"), 3), ((2, "target", None, "target"), 0)],
    "lens_ln": [((1, "head", 0, "q"), 4), ((0, "head", 1, "k"), 2), ((1, "head", 1, "v"), 4),
                ((0, "mlp", None, "mlp"), 2), ((2, "target", None, "target"), 5)],
    # (one K/V head for both query heads: the k edges of both, as the hook on K sees them)
    "lens_gqa": [((1, "head", 1, "q"), 4), ([(0, "head", 0, "k"), (0, "head", 1, "k")], 2),
                 ((1, "mlp", None, "mlp"), 4), ((2, "target", None, "target"), 4)],
    "mha_pre": [((1, "head", 0, "q"), 3), ((0, "head", 1, "k"), 1), ((1, "head", 0, "v"), 2),
                ((0, "mlp", None, "mlp"), 1), ((2, "target", None, "target"), 3)],
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ablating_every_edge_into_a_destination_is_ablating_its_input(name, monkeypatch):
    _, p = built(name)
    moved = 0
    for dst, pos in DESTINATIONS[name]:
        got = ablated_into(p, dst, pos)
        if name.startswith("mha"):
            want = _mha_reference(name, dst, pos, monkeypatch)
            monkeypatch.undo()
        else:
            want = _hf_reference(name, dst, pos)
        _close(got, want, f"{dst} at {pos}")
        moved += abs(want - p.clean) > 1e-4
    assert moved == len(DESTINATIONS[name])


# -- grouped-query attention --------------------------------------------------------


def own_copy(monkeypatch, heads: dict, pos):
    """The Llama's forward where the heads ``heads`` = {(layer, "k" or "v"): [head]} read
    their copy of the keys / values at ``pos`` from the corrupted run: ``repeat_kv`` (the
    K/V heads repeated once per query head of their group) wrapped, called for the keys
    and then the values of each layer in turn (SDPA's own grouped-query path turned
    off, so that it is called)."""
    from transformers.integrations import sdpa_attention as sa

    repeat = sa.repeat_kv
    copies: list = []
    monkeypatch.setattr(sa, "use_gqa_in_sdpa", lambda *a, **k: False)
    monkeypatch.setattr(sa, "repeat_kv", lambda x, n: copies.append(repeat(x, n)) or copies[-1])
    forward("llama_gqa", COR)
    corrupted = list(copies)
    calls = []

    def patched(x, n):
        out = repeat(x, n)
        layer, kind = len(calls) // 2, "kv"[len(calls) % 2]
        calls.append(1)
        chosen = heads.get((layer, kind), [])
        if chosen:
            out = out.clone()
            out[:, chosen, pos] = corrupted[len(calls) - 1][:, chosen, pos]
        return out

    monkeypatch.setattr(sa, "repeat_kv", patched)
    got = forward("llama_gqa", IDS)
    monkeypatch.undo()
    assert len(calls) == 4  # keys and values, two layers
    return got


def test_a_grouped_query_head_reads_its_own_copy_of_the_keys_and_values(monkeypatch):
    model, p = built("llama_gqa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    cases = [((0, "head", 1, "k"), 3, {(0, "k"): [1]}),
             ((1, "head", 2, "k"), 1, {(1, "k"): [2]}),
             ((0, "head", 0, "v"), 1, {(0, "v"): [0]}),
             ((1, "head", 3, "v"), 3, {(1, "v"): [3]})]  # fmt: skip
    for dst, pos, heads in cases:
        got = ablated_into(p, dst, pos)
        want = own_copy(monkeypatch, heads, pos)
        _close(got, want, f"{dst} at {pos}")
        # the group's other head keeps the clean keys: reading the corrupted ones there
        # too is another model
        (key,) = heads
        group = heads[key][0] // 2 * 2
        both = own_copy(monkeypatch, {key: [group, group + 1]}, pos)
        assert abs(both - want) > 1e-4 and abs(want - p.clean) > 1e-4, (dst, pos)
    # both heads of a group: the shared K/V head's columns of k_proj corrupted
    layer, group, pos = 1, 1, 3
    dsts = [(layer, "head", h, "k") for h in (2 * group, 2 * group + 1)]
    proj = model.model.layers[layer].self_attn.k_proj
    _close(ablated_into(p, dsts, pos), replaced("llama_gqa", proj, "out", pos, _heads(0, group)),
           "both heads of a group")  # fmt: skip


def _sources(ids):
    """The Llama's sources as added to the residual stream, ``{(layer, role, head):
    (positions, hidden)}``: the token embedding, each head's slice times its columns of
    ``o_proj``'s weight, each MLP's output."""
    model, _ = built("llama_gqa")
    got, hooks = {}, []
    put = got.__setitem__
    hooks.append(lambda: model.model.embed_tokens.register_forward_hook(
        lambda mod, a, out: put((-1, "embedding", None), out[0].detach())))  # fmt: skip
    for i, block in enumerate(model.model.layers):

        def heads(mod, a, i=i):
            for h in range(GQA_HEADS):
                cols = _heads(0, h)
                put((i, "head", h), (a[0][0, :, cols] @ mod.weight[:, cols].T).detach())

        hooks.append(lambda o=block.self_attn.o_proj, f=heads: o.register_forward_pre_hook(f))
        hooks.append(lambda m=block.mlp, i=i: m.register_forward_hook(
            lambda mod, a, out: put((i, "mlp", None), out[0].detach())))  # fmt: skip
    forward("llama_gqa", ids, hooks)
    return got


def _own_gradient(monkeypatch, layer, head, inp):
    """The gradient of the metric at ``z`` (positions, hidden) added to block ``layer``'s
    residual stream where only head ``head``'s own query, key or value reads it: its
    query columns of ``q_proj`` (a forward hook), or its copy of the repeated K / V
    (``repeat_kv`` wrapped), computed again from ``input_layernorm(stream + z)`` by the
    model's own modules and rotary embedding."""
    from transformers.integrations import sdpa_attention as sa
    from transformers.models.llama import modeling_llama as ml

    model, _ = built("llama_gqa")
    block = model.model.layers[layer]
    attn = block.self_attn
    z = torch.zeros(IDS.shape[1], GQA_HEADS * GQA_D, dtype=F64, requires_grad=True)
    seen: dict = {}

    def own(proj):
        x = block.input_layernorm.forward(seen["stream"] + z)
        return getattr(attn, proj).forward(x)

    hooks = [lambda: block.input_layernorm.register_forward_pre_hook(
                 lambda mod, a: seen.__setitem__("stream", a[0])),
             lambda: model.model.rotary_emb.register_forward_hook(
                 lambda mod, a, out: seen.__setitem__("rope", out))]  # fmt: skip
    if inp == "q":
        cols = _heads(0, head)

        def q_hook(mod, a, out):
            out = out.clone()
            out[..., cols] = own("q_proj")[..., cols]
            return out

        hooks.append(lambda: attn.q_proj.register_forward_hook(q_hook))
    else:
        repeat, calls = sa.repeat_kv, []

        def patched(x, n):
            out = repeat(x, n)
            if len(calls) == 2 * layer + "kv".index(inp):
                mine = own(f"{inp}_proj").view(1, IDS.shape[1], GQA_KV, GQA_D).transpose(1, 2)
                if inp == "k":
                    mine = ml.apply_rotary_pos_emb(mine, mine, *seen["rope"])[1]
                out = out.clone()
                out[:, head] = mine[:, head // n]
            calls.append(1)
            return out

        monkeypatch.setattr(sa, "use_gqa_in_sdpa", lambda *a, **k: False)
        monkeypatch.setattr(sa, "repeat_kv", patched)
    _, metric, *_ = FAMILIES["llama_gqa"]
    handles = [h() for h in hooks]
    try:
        (g,) = torch.autograd.grad(metric(model(input_ids=IDS)), z)
    finally:
        for h in handles:
            h.remove()
        monkeypatch.undo()
    return g


def test_grouped_query_eap_reads_each_heads_own_copy(monkeypatch):
    """EAP on the grouped-query Llama: the score of an edge into a head's q / k / v input
    is (a - a') of its source at its position times the gradient at the stream where
    only that head's own query, key or value reads it (autograd through the model)."""
    _, p = built("llama_gqa")
    scores = p.eap()
    clean, corrupted = _sources(IDS), _sources(COR)
    checked = 0
    for layer, head, inp in [(0, 1, "k"), (1, 2, "k"), (1, 3, "v"), (1, 0, "q")]:
        g = _own_gradient(monkeypatch, layer, head, inp)
        rows = scores[(scores.dst_layer == layer) & (scores.dst_head_index == head)
                      & (scores.input == inp)]  # fmt: skip
        assert len(rows) > 0
        for row in rows.itertuples():
            hd = None if pd.isna(row.src_head_index) else int(row.src_head_index)
            src = (int(row.src_layer), row.src_role, hd)
            want = float((clean[src] - corrupted[src])[row.position] @ g[row.position])
            # (RMSNorm computes in float32 inside the float64 model, and its gradient
            # rounds differently in the two computations: 3e-6 relative seen)
            assert row.score == pytest.approx(want, rel=1e-4, abs=1e-9), (src, row)
            checked += abs(want) > 1e-6
    assert checked > 5
