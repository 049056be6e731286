"""Tiny models and explanations shared by the view tests (test_views, test_browser and
the notebook): a random BERT masked LM with a tokenizer written from a small vocabulary."""

from __future__ import annotations

import copy

import pytest
import torch

WORDS = "the keys to cabinet is are on table a dog cat".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXT = "the keys to the cabinet [MASK] on the table"


def tiny_bert(directory, layers: int = 2, positions: int = 16):
    """``(model, tokenizer)``: a random ``BertForMaskedLM`` and a WordPiece tokenizer
    whose vocabulary file is written to ``directory``."""
    import transformers

    vocab = SPECIAL + WORDS
    path = f"{directory}/vocab.txt"
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizer(path)
    cfg = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=positions,
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).eval(), tok


@pytest.fixture(scope="session")
def views_bert(tmp_path_factory):
    """The tiny BERT and its tokenizer, made once for the view tests."""
    return tiny_bert(tmp_path_factory.mktemp("views_bert"))


@pytest.fixture(scope="session")
def views_ex(views_bert):
    """The explanation of a float64 copy of the tiny BERT, with every quantity's
    semiring (max, entropy, real, topk); ``result_model``, ``result_tokenizer`` attached."""
    from semiring_backprop.explain import explain

    model, tok = views_bert
    model = copy.deepcopy(model).double()
    out = explain(model, TEXT, "are", "is", tokenizer=tok,
                  semirings=("max", "entropy", "real", "topk"))  # fmt: skip
    out.result_model, out.result_tokenizer = model, tok
    return out
