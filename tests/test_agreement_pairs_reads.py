"""The generated agreement pairs (counts, numbers, the pair's equal lengths) and the last
query's key/value edges (:mod:`semiring_backprop.ablation.reads`).

Oracles: the generator's words read back by the BLiMP reader; for the reads, the
model's own forward (nothing replaced: the same logits) and a brute-force one, the
whole sequence run again with layer L's attention output at the last position computed
by a hand-written attention in which the source's key (or value) is replaced."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from semiring_backprop.ablation.reads import LastQueryReads, Variant  # noqa: E402
from semiring_backprop.data import read_blimp  # noqa: E402
from semiring_backprop.data.agreement_pairs import (  # noqa: E402
    NOUNS,
    agreement_pairs,
    counterpart,
    is_plural,
    other_number,
    write_agreement_pairs,
)
from semiring_backprop.errors import InputError  # noqa: E402

# -- the generator ------------------------------------------------------------------------


def _read(tmp_path, n=60, **kw):
    path = write_agreement_pairs(tmp_path / "pairs.jsonl", n, seed=3, **kw)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return lines, read_blimp(path)


def test_pairs_cycle_through_the_attractor_counts_and_are_deterministic(tmp_path):
    lines, data = _read(tmp_path)
    assert [len(x["attractors"]) for x in lines] == [i % 5 for i in range(60)]
    assert [ex.attractors for ex in data] == [i % 5 for i in range(60)]
    assert not data.skipped
    assert agreement_pairs(60, seed=3) == lines  # the same seed, the same lines
    assert agreement_pairs(60, seed=4) != lines
    one = agreement_pairs(20, seed=0, attractors=(1, 2, 3, 4))
    assert sorted({len(x["attractors"]) for x in one}) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="attractors"):
        agreement_pairs(3, attractors=(5,))


def test_pairs_numbers_subject_attractors_and_verbs(tmp_path):
    lines, data = _read(tmp_path)
    verbs = {("is", "are"), ("was", "were"), ("has", "have"), ("does", "do")}
    for line, ex in zip(lines, data):
        words = ex.words
        plural = line["plural"]
        assert is_plural(words[ex.subject]) is plural
        good, bad = (ex.bad, ex.good) if plural else (ex.good, ex.bad)
        assert (good, bad) in verbs  # the singular form first
        between = [
            i for i in range(ex.subject + 1, ex.mask_index) if is_plural(words[i]) is not None
        ]
        others = [i for i in between if is_plural(words[i]) is not plural]
        assert list(ex.attractor_positions) == others  # every noun of the other number
        assert len(between) <= 4 and words[0] == "The"


def test_long_pairs_reach_their_lengths_before_the_subject(tmp_path):
    lines, data = _read(tmp_path, n=30, words=(20, 40), attractors=(1, 2))
    for ex in data:
        assert 20 <= ex.mask_index + 1 <= 40 + 12  # a preamble may overshoot by one clause
        assert all(i > ex.subject for i in ex.attractor_positions)
        assert ex.words[0][0].isupper() and "the" in ex.words[ex.subject - 2 : ex.subject]


def test_counterpart_flips_the_subject_and_swaps_the_verbs(tmp_path):
    _, data = _read(tmp_path, n=10)
    for ex in data:
        twin = counterpart(ex)
        assert len(twin.words) == len(ex.words)  # the pair: as many words
        assert twin.words[ex.subject] == other_number(ex.words[ex.subject])
        assert [w for i, w in enumerate(twin.words) if i != ex.subject] == [
            w for i, w in enumerate(ex.words) if i != ex.subject
        ]
        assert (twin.good, twin.bad) == (ex.bad, ex.good)
    assert other_number("Keys") == "Key" and other_number("children") == "child"
    assert other_number("banana") is None and len({p for _, p in NOUNS}) == len(NOUNS)


# -- the last query's reads -------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=24, intermediate_size=48,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().double()


IDS = torch.tensor([3, 7, 11, 5, 19, 2, 8, 30])
OTHER = torch.tensor([3, 7, 12, 5, 19, 2, 8, 30])


def _by_hand(model, ids, layer, source, branch, vector):
    """The whole sequence again; at ``layer``, the attention output at the last position
    computed by hand (repeat the key/value heads, scaled dot products, softmax over the
    positions), with the source's key (rotated at its position) or value replaced."""
    import transformers.models.llama.modeling_llama as llama_code

    attn = model.model.layers[layer].self_attn
    h, kv, d = model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim

    def hook(module, args, kwargs, out):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        n = x.shape[1]
        q = module.q_proj(x).view(1, n, h, d).transpose(1, 2)
        k_pre = module.k_proj(x).view(1, n, kv, d)
        v = module.v_proj(x).view(1, n, kv, d)
        if branch == "key":
            k_pre = k_pre.clone()
            k_pre[0, source] = vector.view(kv, d)
        else:
            v = v.clone()
            v[0, source] = vector.view(kv, d)
        q, k = llama_code.apply_rotary_pos_emb(q, k_pre.transpose(1, 2), cos, sin)
        k, v = k.repeat_interleave(h // kv, 1), v.transpose(1, 2).repeat_interleave(h // kv, 1)
        scores = (q[:, :, -1:] @ k.transpose(-1, -2)) * d**-0.5  # the last query sees all
        mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 1, h * d)
        last = module.o_proj(mixed)
        y = out[0].clone()
        y[:, -1:] = last
        return (y, *out[1:])

    handle = attn.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            return model(ids[None]).logits[0, -1]
    finally:
        handle.remove()


def test_states_are_the_projections_outputs_at_the_source(llama):
    reads = LastQueryReads(llama)
    seen = {}
    attn = llama.model.layers[1].self_attn
    hooks = [attn.k_proj.register_forward_hook(lambda m, a, o: seen.update(key=o)),
             attn.v_proj.register_forward_hook(lambda m, a, o: seen.update(value=o))]  # fmt: skip
    with torch.no_grad():
        llama(IDS[None])
    for h in hooks:
        h.remove()
    for source in (0, 3, len(IDS) - 1):
        got = reads.states(IDS, source)
        for b in ("key", "value"):
            assert torch.allclose(got[b][1], seen[b][0, source], rtol=0, atol=1e-12)


def test_nothing_replaced_gives_the_models_own_logits(llama):
    reads = LastQueryReads(llama)
    own = reads.states(IDS, 2)
    got = reads.logits(IDS, 2, [Variant(), Variant(1, "key", own["key"][1]),
                                Variant(2, "value", own["value"][2])])  # fmt: skip
    with torch.no_grad():
        full = llama(IDS[None]).logits[0, -1]
    assert torch.allclose(got[0], full, rtol=0, atol=1e-12)
    # its own key rotated again, its own value: bit for bit the unreplaced row
    assert torch.equal(got[1], got[0]) and torch.equal(got[2], got[0])


@pytest.mark.parametrize("source", [2, len(IDS) - 1])  # an earlier token; the query's own
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("branch", ["key", "value"])
def test_replacing_the_sources_key_or_value_for_the_last_query_matches_by_hand(
    llama, layer, branch, source
):
    reads = LastQueryReads(llama)
    other = reads.states(OTHER, source)[branch][layer]
    mean = torch.randn_like(other)
    got = reads.logits(IDS, source, [Variant(layer, branch, other),
                                     Variant(layer, branch, mean), Variant()])  # fmt: skip
    for row, vector in zip(got, (other, mean)):
        want = _by_hand(llama, IDS, layer, source, branch, vector)
        assert torch.allclose(row, want, rtol=0, atol=1e-10)
    with torch.no_grad():
        assert not torch.allclose(got[1], llama(IDS[None]).logits[0, -1], atol=1e-6)


def test_reads_refuse_what_they_cannot_cut(llama):
    reads = LastQueryReads(llama)
    with pytest.raises(InputError, match="source position in it"):
        reads.logits(IDS, len(IDS), [Variant()])
    with pytest.raises(InputError, match="at least two"):
        reads.states(IDS[:1], 0)
    with pytest.raises(InputError, match="layer in 0..2"):
        reads.logits(IDS, 1, [Variant(3, "key", torch.zeros(12))])
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))
    with pytest.raises(InputError, match="k_proj and v_proj"):
        LastQueryReads(gpt2)
