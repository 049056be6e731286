"""Nothing the library keeps holds a model alive once the caller lets it go.

A sweep over checkpoints in one process must not grow: after ``del model`` (and the
result) and ``gc.collect()``, a weak reference to the model and to one of its parameters
is dead, for every entry point that takes a loaded model (the traces kept for reuse
hold the model weakly). Models loaded with ``from_pretrained``, as a sweep loads them.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop.circuits.hf import circuit_of_text  # noqa: E402
from semiring_backprop.hf.explain import explain  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")

WORDS = "the keys to cabinet is are on table".split()
TEXT = "the keys to the cabinet"
IDS = {"input_ids": torch.tensor([[1, 2, 3, 1, 4]])}


def _gap(out):
    return out.logits[0, -1, 5] - out.logits[0, -1, 6]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, _offline_quiet):
    """A tiny GPT-2 and its word-level tokenizer, saved as a checkpoint directory."""
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    d = tmp_path_factory.mktemp("gpt2")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=2, n_head=2,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(d)
    return str(d)


def _backprop_paths(model, tok):
    res = sbp.backprop(model, kwargs=IDS, output=_gap, semirings=[sbp.Real(), sbp.MaxProduct()])
    return res, res.top_path("transformer.wte")


def _explainer(model, tok):
    bp = sbp.Backprop(model, _gap, [sbp.Real()])
    return bp, bp(kwargs=IDS)


def _failed(model, tok):
    with pytest.raises(sbp.InputError):
        sbp.backprop(model, kwargs=IDS, output=lambda out: out.logits[0])


CALLS = {
    "backprop": lambda m, tok: sbp.backprop(m, kwargs=IDS, output=_gap),
    "backprop-paths": _backprop_paths,
    "Backprop": _explainer,
    "circuit": lambda m, tok: sbp.circuit(m, kwargs=IDS, output=_gap),
    "explain": lambda m, tok: explain(m, TEXT, "is", "are", tokenizer=tok, semirings=("max",)),
    "circuit_of_text": lambda m, tok: circuit_of_text(m, TEXT, "is", "are", tokenizer=tok),
    "failed": _failed,
}


@pytest.mark.parametrize("call", list(CALLS))
def test_the_model_is_freed_after_the_call(checkpoint, call):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    alive = weakref.ref(model), weakref.ref(model.transformer.wte.weight)
    got = CALLS[call](model, tok)
    del model, got
    gc.collect()
    assert alive[0]() is None, f"{call}: the model is still held"
    assert alive[1]() is None, f"{call}: a parameter is still held"
