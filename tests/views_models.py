"""Tiny models and explanations shared by the view tests (test_views, test_browser and
the notebook): a random BERT masked LM with a tokenizer written from a small vocabulary."""

from __future__ import annotations

import contextlib
import io
import types

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
def views_run(views_bert, tmp_path_factory):
    """``semiring-backprop explain DIR ... --dtype float64 --html FILE`` on the tiny BERT
    saved to DIR, with every quantity's semiring; the Explanation it made is kept (the
    CLI imports ``explain`` from its module at call time)."""
    import huggingface_hub.constants

    from semiring_backprop import cli
    from semiring_backprop.hf import explain as explain_mod

    model, tok = views_bert
    d = tmp_path_factory.mktemp("views_model")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    page = d / "out" / "report.html"
    argv = ["explain", str(d), "--text", TEXT, "--target", "are", "--foil", "is",
            "--dtype", "float64", "--semiring", "max", "entropy", "real", "topk",
            "--html", str(page)]  # fmt: skip
    made, real = [], explain_mod.explain
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(explain_mod, "explain", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    return types.SimpleNamespace(
        rc=rc, out=out.getvalue(), err=err.getvalue(), ex=made[0] if made else None,
        page=page, dir=d, argv=argv,
    )  # fmt: skip


@pytest.fixture(scope="session")
def views_ex(views_run):
    """The Explanation of :func:`views_run` (float64), with the model it explained loaded
    again (``result_model``) and its tokenizer (``result_tokenizer``)."""
    import transformers

    assert views_run.rc == 0, views_run.err
    ex = views_run.ex
    ex.result_model = transformers.AutoModelForMaskedLM.from_pretrained(
        views_run.dir, dtype=torch.float64
    ).eval()
    ex.result_tokenizer = transformers.AutoTokenizer.from_pretrained(views_run.dir)
    return ex


SIM_WORDS = "a man is playing guitar someone plays an instrument".split()
SIM_TEXT = "a man is playing a guitar"
SIM_PAIR = "someone plays an instrument"  # two tokens shorter: two [PAD] in the batch


def save_sentence_model(directory, layers: int = 2, seed: int = 0) -> str:
    """A tiny random BERT saved as a sentence-transformers directory (mean pooling,
    Normalize), as all-MiniLM-L6-v2 is laid out; with :data:`SIM_TEXT` and
    :data:`SIM_PAIR` the second text is padded by two positions. Returns the directory."""
    import json
    import os

    import transformers

    os.makedirs(directory, exist_ok=True)
    vocab = SPECIAL + SIM_WORDS
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    transformers.BertTokenizer(path).save_pretrained(directory)
    cfg = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(seed)
    transformers.BertModel(cfg).save_pretrained(directory)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 16, "pooling_mode_cls_token": False,
                   "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
                   "pooling_mode_mean_sqrt_len_tokens": False}, f)  # fmt: skip
    os.makedirs(os.path.join(directory, "2_Normalize"), exist_ok=True)
    return str(directory)
