"""The data-set runner: ``semiring-backprop run`` and ``semiring_backprop.runner.run``.

Tiny random models saved with ``save_pretrained`` beside tokenizers built from small
vocabularies (nothing is downloaded; the hub is offline for the module). Oracles are
independent of the code under test: the score is recomputed from the model's own
logits, the Real readout from ``torch.autograd`` through a hook, entropies are bounded
by ``log #paths``; files are read back with pandas. A model is traced once per run (a
few seconds), so the full run is made once (``serial``) and shared.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

from semiring_backprop import cli  # noqa: E402
from semiring_backprop.data import MASK  # noqa: E402
from semiring_backprop.errors import InputError, LoadError  # noqa: E402
from semiring_backprop.runner import driver, load_results, prepare, read_examples, run  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

WORDS = "the keys to cabinet is are on table a dog cat that works work with here".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
KEYS = ["example_id", "layer", "sublayer", "token", "branch", "semiring"]
#: the thread count of each Ray actor (a fair share of the cores), used by the one-process
#: run too, so that the two are comparable bit for bit
SHARE = max(1, (os.cpu_count() or 1) // 2)


def _jsonl(path: Path, lines) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# line numbers matter: the malformed rows are reported by them
DATA = [
    {"text": "the keys to the cabinet [MASK] on the table", "target": "are", "foil": "is",
     "positions": [1]},  # 1
    {"text": "the dog [MASK] on the table", "target": "is", "foil": "are"},  # 2
    "{not json",  # 3
    {"text": "the cat [MASK] on the table", "target": "is", "foil": "are"},  # 4
    {"text": "the dog [MASK] here", "target": "is"},  # 5: no foil
    "",  # 6: blank
    {"text": "a dog [MASK] on a table", "target": "is", "foil": "are"},  # 7
    {"text": "the cat [MASK] here", "target": "is", "foil": "are", "positions": [9]},  # 8
    {"text": "the keys [MASK] on the table", "target": "dogs", "foil": "is"},  # 9: 2 pieces
    {"text": "a cat [MASK] on the table", "target": "is", "foil": "are"},  # 10
    {"text": "the keys to a cabinet [MASK] on a table", "target": "are", "foil": "is"},  # 11
]  # fmt: skip
EXPLAINED = {"1", "2", "4", "7", "10", "11"}


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, _offline_quiet):
    d = tmp_path_factory.mktemp("bert")
    vocab = SPECIAL + WORDS + ["##s"]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(d / "vocab.txt")).save_pretrained(d)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return _jsonl(tmp_path_factory.mktemp("data") / "data.jsonl", DATA)


def _cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def _argv(model, data, out, *extra):
    return ["run", model, "--data", data, "--out", out, "--batch-size", 2,
            "--threads", SHARE, "--no-figures", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def serial(bert_dir, data_file, tmp_path_factory):
    """The CLI over the whole file, one process: (out dir, tables, stdout)."""
    out = tmp_path_factory.mktemp("serial")
    rc, stdout, err = _cli([*_argv(bert_dir, data_file, out)[:-1], "--top-path"])
    assert rc == 0, err
    return out, load_results(out), stdout


def _sorted(frame):
    keys = [k for k in KEYS if k in frame.columns]
    return frame.sort_values(keys).reset_index(drop=True)


# -- a whole run ---------------------------------------------------------------------------


def test_summary_counts_and_malformed_lines(serial, data_file):
    out, tables, stdout = serial
    s = json.loads((out / "summary.json").read_text())
    assert (s["examples"], s["explained"], s["skipped"], s["malformed"]) == (7, 6, 1, 3)
    where = {m["source"]: m["reason"] for m in s["malformed_rows"]}
    assert set(where) == {f"{data_file}:{n}" for n in (3, 5, 8)}
    assert "not valid JSON" in where[f"{data_file}:3"]
    assert "foil" in where[f"{data_file}:5"]
    assert "positions" in where[f"{data_file}:8"]
    assert list(s["skip_reasons"].values()) == [1] and "dogs" in next(iter(s["skip_reasons"]))
    assert "6 of 7 examples explained (1 skipped, 3 malformed rows)" in stdout
    assert set(tables["examples"]["example_id"]) == EXPLAINED
    assert s["files"] == ["summary.json", "branches.png", "winners.png"]
    for name in s["files"][1:]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_score_is_the_models_log_prob_difference(serial, bert_dir):
    _, tables, _ = serial
    model = transformers.BertForMaskedLM.from_pretrained(bert_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(bert_dir)
    for r in tables["examples"].itertuples():
        enc = tok(r.text, return_tensors="pt")
        pos = int((enc["input_ids"][0] == tok.mask_token_id).nonzero())
        with torch.no_grad():
            logp = model(**enc).logits[0, pos].log_softmax(-1)
        t, f = tok.convert_tokens_to_ids([r.target, r.foil])
        assert r.score == pytest.approx(float(logp[t] - logp[f]), abs=1e-5)
        assert r.position == pos


def test_tables_are_tidy_and_bounded(serial):
    _, tables, _ = serial
    b, t, e = tables["branches"], tables["tokens"], tables["examples"]
    assert not b.duplicated(KEYS).any()
    assert not t.duplicated(["example_id", "token"]).any()
    assert set(b["branch"]) == {"skip", "query", "key", "value", "mlp"}
    assert set(b["semiring"]) == {"MaxProduct(neuron)", "Entropy", "PathCount", "Real"}
    n_tokens = e.set_index("example_id")["tokens"]
    assert t.groupby("example_id").size().to_dict() == n_tokens.to_dict()
    # entropy of a distribution over paths: 0 <= H <= log #paths
    assert (t["entropy"] >= -1e-4).all() and (t["entropy"] <= t["log_paths"] + 1e-3).all()
    assert t["normalized_entropy"].between(-1e-5, 1 + 1e-5).all()
    # word positions of interest: "keys" (word 1) of example 1
    first = t[t["example_id"] == "1"]
    assert first.loc[first["group"] == "interest", "token_text"].tolist() == ["keys"]
    # the top path's value is the best max_hi of the example's tokens
    best = t.groupby("example_id")["max_hi"].max()
    for r in e.itertuples():
        assert r.top_path_value == pytest.approx(best[r.example_id], rel=1e-5)


def test_real_readouts_are_autograds_gradient(tmp_path):
    """A causal LM (GPT-2) given as a loaded model with examples in Python, extra
    columns copied: the Real readouts per token are autograd's gradient of the score at
    the word embeddings' output, summed over hidden units and its norm."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    inner = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]")
    cfg = transformers.GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=1, n_head=2,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    examples = [
        {"text": f"the keys to the cabinet {MASK} on the table", "target": "are",
         "foil": "is", "condition": "attractor"},
        {"text": "the dog that", "target": "works", "foil": "work", "condition": "plain"},
    ]  # fmt: skip
    r = run(model, examples=examples, out=tmp_path, tokenizer=tok, semirings=("real",),
            dtype="float64", progress=False, figures=False)  # fmt: skip
    assert r["explained"] == 2
    tables = load_results(tmp_path)
    assert tables["examples"]["condition"].tolist() == ["attractor", "plain"]
    for k, text in enumerate(["the keys to the cabinet", "the dog that"]):
        ids = tok(text, return_tensors="pt")["input_ids"]
        t, f = vocab[examples[k]["target"]], vocab[examples[k]["foil"]]
        seen = []
        hook = model.transformer.wte.register_forward_hook(
            lambda m, i, o, seen=seen: seen.append(o) or o.retain_grad()
        )
        logp = model(input_ids=ids).logits[0, -1].log_softmax(-1)
        hook.remove()
        score = logp[t] - logp[f]
        score.backward()
        grad = seen[0].grad[0]
        mine = tables["tokens"][tables["tokens"]["example_id"] == str(k)]
        for column, want in (("real", grad.sum(-1)), ("real_l2", grad.norm(dim=-1))):
            got = torch.tensor(mine[column].tolist(), dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
        assert grad.norm(dim=-1).min() > 1e-4  # (the sums are ~0: layer norms ignore shifts)
        assert tables["examples"]["score"][k] == pytest.approx(score.item(), 1e-5)


# -- resuming ------------------------------------------------------------------------------


class Killed(BaseException):
    """Stands for a kill: nothing in the runner catches it."""


def test_resume_after_a_kill_loses_and_duplicates_nothing(serial, bert_dir, data_file,
                                                          tmp_path, monkeypatch):  # fmt: skip
    """Killed after the second batch's shards were written but before its commit line:
    the rerun deletes those shards, explains what is left, and the tables equal the
    uninterrupted run's."""
    real, calls = driver._commit, []

    class Dying:
        def __init__(self, records):
            self.rows = records.rows

        def add(self, row):
            raise Killed

    def commit(out, records, group, tables):
        calls.append(len(group))
        real(out, Dying(records) if len(calls) == 2 else records, group, tables)

    monkeypatch.setattr(driver, "_commit", commit)
    argv = _argv(bert_dir, data_file, tmp_path, "--top-path")
    with pytest.raises(Killed):
        _cli(argv)
    assert len(list((tmp_path / "examples").glob("*.parquet"))) == 2  # one uncommitted
    monkeypatch.setattr(driver, "_commit", real)
    rc, stdout, err = _cli(argv)
    assert rc == 0, err
    assert "this run: 4 " in stdout  # 6 explained: 2 in the first batch, 4 now
    assert len(list((tmp_path / "examples").glob("*.parquet"))) == 3
    got, want = load_results(tmp_path), serial[1]
    for name in ("examples", "tokens", "branches"):
        a, b = _sorted(got[name]), _sorted(want[name])
        assert len(a) == len(b) and not a.duplicated([c for c in KEYS if c in a]).any()
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-5, atol=1e-7)


def test_rerun_with_other_settings_is_refused(serial, bert_dir, data_file):
    out = serial[0]
    rc, _, err = _cli(_argv(bert_dir, data_file, out, "--top-path", "--semiring", "max"))
    assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "other settings (semirings)" in err
    # a smaller limit is no other setting: nothing is left to do
    rc, stdout, err = _cli(_argv(bert_dir, data_file, out, "--top-path", "--limit", "3"))
    assert rc == 0, err
    assert "3 of 3 examples explained (0 skipped, 3 malformed rows)" in stdout


# -- readers -------------------------------------------------------------------------------


def test_blimp_file_with_a_multi_word_prefix(tmp_path, bert_dir):
    path = _jsonl(tmp_path / "blimp.jsonl", [
        {"sentence_good": "The dog is here.", "sentence_bad": "The dog are here.",
         "one_prefix_prefix": "The dog", "one_prefix_word_good": "is",
         "one_prefix_word_bad": "are", "subject": 1},
        {"sentence_good": "The keys to the cabinet that works with the dog are here.",
         "sentence_bad": "The keys to the cabinet that work with the dog are here.",
         "one_prefix_prefix": "The keys to the cabinet that",
         "one_prefix_word_good": "works with", "one_prefix_word_bad": "work with"},
        {"sentence_good": "The dog is here.", "sentence_bad": "A cat are here.",
         "one_prefix_prefix": "The dog", "one_prefix_word_good": "is",
         "one_prefix_word_bad": "are"},
    ])  # fmt: skip
    examples, bad = read_examples(path)
    assert [m.source for m in bad] == [f"{path}:3"]
    assert examples[0].positions == {"subject": (1,)}
    assert examples[0].text == f"The dog {MASK} here."
    two = examples[1]
    assert (two.target, two.foil) == ("works", "work")
    assert two.text == f"The keys to the cabinet that {MASK} with the dog are here."
    tok = transformers.AutoTokenizer.from_pretrained(bert_dir)
    cfg = transformers.AutoConfig.from_pretrained(bert_dir)
    masked = prepare(two, tok, cfg, "masked")
    assert tok.convert_ids_to_tokens(masked.ids)[masked.position] == "[MASK]"
    assert masked.position == 7  # [CLS] the keys to the cabinet that [MASK]
    causal = prepare(two, tok, cfg, "causal")
    assert tok.decode(causal.ids, skip_special_tokens=True) == "the keys to the cabinet that"


def test_csv_tsv_and_linzen_rows_report_their_lines(tmp_path):
    csv_file = tmp_path / "d.csv"
    csv_file.write_text(
        'sentence,good,bad,cond\n'
        'the dog [MASK] here,is,are,a\n'
        '"the keys\nto the cabinet [MASK] here",are,is,b\n'  # a quoted newline: lines 3-4
        'the cat [MASK] here,is\n'  # line 5: two columns short
        'the cat [MASK] here,is,are,c\n'
    )  # fmt: skip
    cols = {"text": "sentence", "target": "good", "foil": "bad", "extra": "cond"}
    examples, bad = read_examples(csv_file, columns=cols)
    assert [e.id for e in examples] == ["2", "3", "6"]
    assert [e.extra["cond"] for e in examples] == ["a", "b", "c"]
    assert [(m.source, "2 columns, the header has 4" in m.reason) for m in bad] == [
        (f"{csv_file}:5", True)
    ]
    with pytest.raises(InputError, match="no column 'text'"):
        read_examples(csv_file)
    tsv = tmp_path / "lgd.tsv"
    tsv.write_text(
        f"1\tthe keys to the cabinet are here\tthe keys to the cabinet {MASK} here\tare\tis\n"
        "2\tbroken line\n"
    )
    examples, bad = read_examples(tsv)
    assert [(e.target, e.foil, e.extra) for e in examples] == [("are", "is", {"attractors": 1})]
    assert [m.source for m in bad] == [f"{tsv}:2"]


def test_datasets_on_disk_and_offline_by_name(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"s": ["the dog [MASK] here", "the cat [MASK]"],
                                     "t": ["is", "is"], "f": ["are", ""]})  # fmt: skip
    ds.save_to_disk(str(tmp_path / "ds"))
    examples, bad = read_examples(tmp_path / "ds", columns={"text": "s", "target": "t",
                                                            "foil": "f"})  # fmt: skip
    assert [e.text for e in examples] == ["the dog [MASK] here"]
    assert [m.source for m in bad] == [f"{tmp_path / 'ds'}[1]"]
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(LoadError, match="save_to_disk"):
        read_examples("someone/no-such-data-set")


def test_cli_errors_are_one_line(tmp_path, bert_dir, data_file, monkeypatch):
    rc, _, err = _cli(_argv(bert_dir, tmp_path / "missing.jsonl", tmp_path / "o"))
    assert rc == 2 and err.count("\n") == 1 and "does not exist" in err
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    rc, _, err = _cli(_argv(bert_dir, data_file, tmp_path / "o", "--workers", 2))
    assert rc == 2 and 'pip install "semiring-backprop[ray]"' in err


# -- Ray -----------------------------------------------------------------------------------


def test_two_ray_workers_give_the_serial_results(serial, bert_dir, data_file, tmp_path):
    pytest.importorskip("ray")
    rc, stdout, err = _cli(_argv(bert_dir, data_file, tmp_path, "--top-path", "--workers", 2))
    assert rc == 0, err
    got, want = load_results(tmp_path), serial[1]
    for name in ("examples", "tokens", "branches"):
        a, b = _sorted(got[name]), _sorted(want[name])
        if name == "examples":
            a, b = a.drop(columns="source"), b.drop(columns="source")
        pd.testing.assert_frame_equal(a, b, check_exact=True)
