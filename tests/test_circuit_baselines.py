"""A circuit's baseline given as the model's own inputs (``{"input_ids": corrupted}``):
the traced graph runs on them and the baseline is its value where the paths start. The
oracle is the baseline the user would compute by hand at the token embeddings
(``{place: embeddings(corrupted)}``): both give the same circuit, value for value."""

from __future__ import annotations

import functools

import pandas as pd
import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.errors import InputError

T = pytest.importorskip("transformers")

IDS = torch.tensor([[3, 7, 1, 9, 4]])
BASE_IDS = torch.tensor([[3, 5, 2, 9, 4]])  # positions 1 and 2 differ


@functools.cache
def bert():
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=16, max_position_embeddings=16)  # fmt: skip
    return T.BertForMaskedLM(cfg).double().eval(), "bert.embeddings.word_embeddings", 2


@functools.cache
def llama():
    torch.manual_seed(1)
    cfg = T.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=16)  # fmt: skip
    return T.LlamaForCausalLM(cfg).double().eval(), "model.embed_tokens", 4


def _margin(position):
    def out(o):
        logp = o.logits[0, position].log_softmax(-1)
        return logp[7] - logp[9]

    return out


def _circuit(which, baseline, **kw):
    model, _, position = which()
    return sbp.circuit(model, kwargs={"input_ids": IDS, "attention_mask": torch.ones_like(IDS)},
                       output=_margin(position), baseline=baseline, **kw)  # fmt: skip


def _by_hand(which):
    model, place, _ = which()
    with torch.no_grad():
        return {place: model.get_input_embeddings()(BASE_IDS)}


def _same(a, b):
    pd.testing.assert_frame_equal(a.nodes, b.nodes)
    pd.testing.assert_frame_equal(a.edges, b.edges)
    pd.testing.assert_frame_equal(a.attention_edges, b.attention_edges)


@pytest.mark.parametrize("which", [bert, llama], ids=["bert", "llama"])
def test_inputs_as_baseline_equal_the_embeddings_by_hand(which):
    by_inputs = _circuit(which, {"input_ids": BASE_IDS})
    _same(by_inputs, _circuit(which, _by_hand(which)))
    assert by_inputs.seed == "x - x'"
    # and the seed is x - x' indeed: not x (the circuit without a baseline differs)
    real = by_inputs.nodes["Real"].to_numpy()
    assert not (real == _circuit(which, None).nodes["Real"].to_numpy()).all()


def test_inputs_as_baseline_with_integrated_gradients():
    by_inputs = _circuit(llama, {"input_ids": BASE_IDS}, semirings=[sbp.Real()], ig_steps=3)
    _same(by_inputs, _circuit(llama, _by_hand(llama), semirings=[sbp.Real()], ig_steps=3))


def test_from_result_takes_inputs_as_baseline():
    model, _, position = llama()
    res = sbp.backprop(model, kwargs={"input_ids": IDS}, output=_margin(position),
                       semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip
    a = sbp.Circuit.from_result(res, baseline={"input_ids": BASE_IDS})
    b = sbp.Circuit.from_result(res, baseline=_by_hand(llama))
    _same(a, b)


@pytest.mark.parametrize(
    "baseline, said",
    [
        ({"input_ids": BASE_IDS[:, :3]}, "same shape"),
        ({"input_ids": BASE_IDS.float()}, "dtype"),
        ({"input_ids": [3, 5, 2, 9, 4]}, "as a tensor"),
        ({"input_ids": IDS.clone()}, "same values as the input"),
        ({"input_ids": BASE_IDS, "model.embed_tokens": torch.zeros(1, 5, 16)}, "mixes"),
    ],
)
def test_inputs_as_baseline_refusals(baseline, said):
    with pytest.raises(InputError, match=said):
        _circuit(llama, baseline)
