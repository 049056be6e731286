"""Tokens as people read them (``semiring_backprop.tokens``) and everywhere they are shown.

Tokenizers are built here (nothing is downloaded): a byte-level BPE (GPT-2's scheme),
a SentencePiece-style BPE (Metaspace, byte fallback) and a WordPiece vocabulary. The
oracles are the tokenizers' own: a byte-level token reads as its decoding
(``tokenizer.decode([id])``, newline and tab shown as ↵ and ⇥), the byte table is the
one ``tokenizers`` builds its byte-level alphabet from, and a WordPiece token is left as
it is. A tiny GPT-2 with the byte-level tokenizer then runs ``explain``, a circuit and a
data-set run: every view, table, figure and export shows `` Mary``, and the raw
``ĠMary`` stays where a program reads it (``raw_tokens``, ``token_raw``, vocabulary ids).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pd = pytest.importorskip("pandas")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import tokens as T  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

CORPUS = [
    "When Mary and John went to the store, John gave a drink to Mary",
    "When Mary and John went to the park, Mary gave a book to John",
    "the café was naïve\tand\nold",
] * 20
TEXT = "When Mary and John went to the store, John gave a drink to"


def byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    inner.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner,
                                                eos_token="<|endoftext|>")  # fmt: skip


def sentencepiece():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    inner = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace()
    inner.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    fallback = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *fallback])
    inner.train_from_iterator([c.replace("\n", " ").replace("\t", " ") for c in CORPUS], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>")


def wordpiece(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "play", "##ing", "the", "keys"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return transformers.BertTokenizer(str(tmp_path / "vocab.txt"))


def _raw(tok, text):
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def _shown(text: str) -> str:
    return text.replace("\n", "↵").replace("\t", "⇥")


# -- the function --------------------------------------------------------------------


def test_the_byte_table_is_the_byte_level_alphabet():
    from tokenizers import pre_tokenizers

    table = T.byte_table()
    assert sorted(table) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))
    assert (table["Ġ"], table["Ċ"], table["ĉ"], table["A"]) == (32, 10, 9, 65)


def test_byte_level_tokens_read_as_their_decoding():
    tok = byte_level()
    assert T.scheme(tok) == "byte-level"
    text = "When Mary went to the café,\tnaïve\nold"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    raw = tok.convert_ids_to_tokens(ids)
    assert "ĠMary" in raw and any("Ã" in t for t in raw) and "Ċ" in "".join(raw)
    shown = T.readable_tokens(raw, tok)
    for i, t in zip(ids, shown):
        decoded = tok.decode([i])
        if "\ufffd" not in decoded:  # a whole character (not a piece of é)
            assert t == _shown(decoded), (tok.convert_ids_to_tokens(i), t, decoded)
        else:  # a piece of a character shows as its bytes
            assert re.fullmatch(r"[^\\]*(\\x[0-9a-f]{2})+[^\\]*", t), t
    assert " Mary" in shown and "é" in "".join(shown)
    assert T.guess(raw) == "byte-level" and T.readable_tokens(raw) == shown
    assert T.readable("ĠMary", tok) == " Mary" and T.readable("ĠMary") == " Mary"
    # already readable: left as it is
    assert T.readable_tokens(shown) == shown and T.guess(shown) == "plain"


def test_sentencepiece_tokens_read_with_spaces():
    tok = sentencepiece()
    assert T.scheme(tok) == "sentencepiece"
    raw = _raw(tok, "When Mary went\nto")
    assert "▁Mary" in raw and "<0x0A>" in raw
    shown = T.readable_tokens(raw, tok)
    assert " Mary" in shown and "↵" in shown
    assert all("▁" not in t for t in shown)
    assert "".join(shown) == " When Mary went↵to"
    assert T.guess(raw) == "sentencepiece" and T.readable_tokens(raw) == shown


def test_wordpiece_tokens_stay(tmp_path):
    tok = wordpiece(tmp_path)
    assert T.scheme(tok) == "plain"
    raw = tok.convert_ids_to_tokens(tok("the playing keys")["input_ids"])
    assert raw == ["[CLS]", "the", "play", "##ing", "keys", "[SEP]"]
    assert T.readable_tokens(raw, tok) == raw and T.readable_tokens(raw) == raw
    # no tokenizer known: a list of text with such characters is not taken for bytes
    # unless it reads as UTF-8 (ł alone is no whole character)
    assert T.guess(["ł", "ódź"]) == "plain" and T.readable_tokens(["Ġa", "é"]) == ["Ġa", "é"]


def test_control_characters_and_errors():
    assert T.readable("Ċ", "byte-level") == "↵" and T.readable("ĉ", "byte-level") == "⇥"
    assert T.readable("čĊ", "byte-level") == "␍↵"
    assert T.readable("Ã", "byte-level") == "\\xc3"  # half of é: its byte
    assert T.readable("ĠMary", "plain") == "ĠMary"
    with pytest.raises(InputError, match="token scheme 'bytes'"):
        T.readable("ĠMary", "bytes")
    assert T.text_of([" When", " Mary"]) == "When Mary" and T.text_of(["a", "b"]) == "a b"
    assert T.token_line(["When", " Mary"]) == "When| Mary"


# -- where tokens are shown -----------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    tok = byte_level()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=2, n_head=2,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval(), tok


def _no_raw(text: str):
    assert "ĠMary" not in text and "Ġ" not in text, re.findall(r".{20}Ġ.{20}", text)[:3]


def test_explanation_shows_readable_tokens_and_keeps_raw(gpt2, tmp_path):
    from semiring_backprop.hf.explain import explain

    model, tok = gpt2
    ex = explain(model, TEXT, "Mary", "John", tokenizer=tok, semirings=["max", "entropy"])
    assert " Mary" in ex.tokens and "ĠMary" in ex.raw_tokens[0]
    assert ex.raw_tokens[0] == _raw(tok, TEXT)
    view = ex.view()
    for text in (str(view), view.html(), ex.report()):
        _no_raw(text)
    assert "<b> Mary</b>" in view.html()  # a strip token, its space kept (white-space: pre)
    assert "' Mary'" in str(ex.view("top_path")) or " Mary " in str(ex.view("top_path"))
    assert "When| Mary| and" in ex.report()
    ex.write(tmp_path, format="svg")
    saved = json.loads((tmp_path / "explanation.json").read_text())
    assert " Mary" in saved["tokens"] and "ĠMary" in saved["raw_tokens"][0]
    assert " Mary" in set(pd.read_csv(tmp_path / "layers.csv", keep_default_na=False).token_text)
    for svg in tmp_path.glob("*.svg"):
        _no_raw(svg.read_text())
    from semiring_backprop import plots

    fig = plots.token_heatmap(ex.layers, semiring="MaxProduct(neuron)")
    assert " Mary" in [t.get_text() for t in fig.axes[0].get_xticklabels()]


def test_views_of_raw_tokens_guess(gpt2):
    model, tok = gpt2
    enc = tok(TEXT, return_tensors="pt")
    raw = tok.convert_ids_to_tokens(enc["input_ids"][0])
    res = sbp.backprop(model, kwargs=dict(enc), output=lambda o: o.logits[0, -1, 5],
                       semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip
    view = sbp.views.tokens(res, "top_path", tokens=raw)
    _no_raw(view.html())
    _no_raw(str(view))
    assert "<b> Mary</b>" in view.html() and " Mary " in str(view)
    table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=raw)
    assert " Mary" in set(table.token_text) and "ĠMary" not in set(table.token_text)
    heat = sbp.views.branches(table)
    _no_raw(heat.html())
    assert 'xml:space="preserve"> Mary' in heat.html().replace(
        "<title>&#x27; Mary&#x27; (position 1)</title>", ""
    )


def test_circuit_views_and_exports(gpt2, tmp_path):
    model, tok = gpt2
    enc = tok(TEXT, return_tensors="pt")
    raw = tok.convert_ids_to_tokens(enc["input_ids"][0])
    mary, john = tok.convert_tokens_to_ids(["ĠMary", "ĠJohn"])
    n = len(raw)
    target = sbp.WordChoice(((0, n - 1, mary, 1), (0, n - 1, john, -1)))
    c = sbp.circuit(model, kwargs=dict(enc), output=target, tokens=raw)
    small = c.prune(top_n=4)
    for circuit in (c, small):
        view = circuit.view()
        _no_raw(view.html())
        _no_raw(str(view))
        assert "> Mary</text>" in view.html() and "' Mary'" in view.html().replace("&#x27;", "'")
        _no_raw(circuit.to_dot())
        assert "@1\\n Mary" in circuit.to_dot()
    g = small.to_neuronpedia(tmp_path / "np.json")
    assert g["metadata"]["prompt_tokens"][1] == " Mary" and g["metadata"]["prompt"] == TEXT
    _no_raw((tmp_path / "np.json").read_text())
    emb = [nd for nd in g["nodes"] if nd["feature_type"] == "embedding"]
    ids = tok.convert_tokens_to_ids(raw)  # the node ids keep the vocabulary ids
    assert {nd["node_id"] for nd in emb} == {f"E_{i}_{p}" for p, i in enumerate(ids)}
    best = c.top_paths()[0]  # the sites a path passes, their tokens as people read them
    assert all("Ġ" not in str(s.token) for s in best.steps) and "Ġ" not in repr(best)
    nxg = pytest.importorskip("networkx") and small.to_networkx()
    node = nxg.nodes["input@1"]
    assert (node["token"], node["token_raw"]) == (" Mary", "ĠMary")
    assert nxg.graph["tokens"][1] == " Mary" and nxg.graph["tokens_raw"][1] == "ĠMary"


def test_circuit_from_a_tokenizer_is_readable(gpt2):
    from semiring_backprop.circuits.hf import circuit_of_text

    model, tok = gpt2
    c = circuit_of_text(model, TEXT, "Mary", "John", tokenizer=tok)
    assert c.tokens[1] == " Mary" and c.prompt == TEXT
    assert tok.convert_ids_to_tokens(c.token_ids)[1] == "ĠMary"


def test_run_tables_readable_with_raw_column(gpt2, tmp_path):
    pytest.importorskip("pyarrow")
    from semiring_backprop.runner import load_results, run

    model, tok = gpt2
    run(model, examples=[{"text": TEXT, "target": "Mary", "foil": "John"}], out=tmp_path,
        tokenizer=tok, semirings=("max",), progress=False, figures=False)  # fmt: skip
    tables = load_results(tmp_path)
    for name in ("tokens", "branches"):
        frame = tables[name]
        assert " Mary" in set(frame.token_text) and "ĠMary" not in set(frame.token_text)
        assert "ĠMary" in set(frame.token_raw)
        assert (frame.token_text == [T.readable(t, tok) for t in frame.token_raw]).all()
