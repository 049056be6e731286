"""The data-set runner's directory on disk, tried as a careless or unlucky user would.

A rerun into the same ``--out`` after the data changed, ``done.jsonl`` edited,
``config.json`` deleted, a committed shard deleted, cut off or replaced, a full disk;
and links planted where files are written. Oracles are independent of the code under
test: each example's score is recomputed from the model's own logits for the text the
data file *now* holds under that id, tables are read back with pyarrow, and a planted
link's target is read back byte for byte.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")
pq = pytest.importorskip("pyarrow.parquet")

from semiring_backprop.errors import InputError  # noqa: E402
from semiring_backprop.runner import (  # noqa: E402
    load_results,
    prepare,
    records,  # noqa: E402
    run,
    skipped_examples,
)

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

WORDS = "the keys to cabinet is are on table a dog cat here".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROWS = [
    {"text": "the dog [MASK] here", "target": "is", "foil": "are"},
    {"text": "the keys [MASK] on the table", "target": "are", "foil": "is"},
    {"text": "a cat [MASK] on a table", "target": "is", "foil": "are"},
    {"text": "the keys to the cabinet [MASK] here", "target": "are", "foil": "is"},
]
TABLES = ("examples", "tokens", "branches")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, _offline_quiet):
    d = tmp_path_factory.mktemp("bert")
    vocab = SPECIAL + WORDS
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(d / "vocab.txt")).save_pretrained(d)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=16,
                                  max_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def oracle(bert_dir):
    """``score(text, target, foil)``: log p(target) - log p(foil) at [MASK], from the
    saved model's own logits."""
    model = transformers.BertForMaskedLM.from_pretrained(bert_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(bert_dir)

    def score(text, target, foil):
        enc = tok(text, return_tensors="pt")
        pos = int((enc["input_ids"][0] == tok.mask_token_id).nonzero())
        with torch.no_grad():
            logp = model(**enc).logits[0, pos].log_softmax(-1)
        t, f = tok.convert_tokens_to_ids([target, foil])
        return float(logp[t] - logp[f])

    return score


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(model, data, out, **kw):
    kw = {"semirings": ("max", "real"), "batch_size": 1, "threads": 1, "progress": False,
          "figures": False, **kw}  # fmt: skip
    return run(model, data, out, **kw)


def _ids_in_data(data: Path) -> dict:
    """``{id: row}`` as the data file holds it now (ids default to line numbers)."""
    rows = [json.loads(x) for x in data.read_text().splitlines() if x.strip()]
    return {str(r.get("id", n)): r for n, r in enumerate(rows, 1)}


def _pyarrow_tables(out: Path) -> dict:
    """Every Parquet file of the directory read back with pyarrow alone."""
    return {t: pd.concat([pq.read_table(f).to_pandas() for f in sorted((out / t).iterdir())])
            for t in TABLES}  # fmt: skip


def _agrees_with_the_data(out: Path, data: Path, oracle) -> None:
    """Every example of the data is in the tables once, under its id, with its text and
    the model's score for that text; tokens and branches hold no other examples."""
    want = _ids_in_data(data)
    tables = load_results(out)
    ex = tables["examples"]
    assert sorted(ex["example_id"]) == sorted(want), "examples lost, added or duplicated"
    for r in ex.itertuples():
        row = want[r.example_id]
        assert r.text == row["text"], f"id {r.example_id}: the table explains another text"
        assert r.score == pytest.approx(oracle(row["text"], row["target"], row["foil"]),
                                        abs=1e-5)  # fmt: skip
    n_tokens = ex.set_index("example_id")["tokens"].to_dict()
    assert tables["tokens"].groupby("example_id").size().to_dict() == n_tokens
    assert set(tables["branches"]["example_id"]) == set(want)
    keys = ["example_id", "layer", "sublayer", "token", "branch", "semiring", "aggregation"]
    assert not tables["branches"].duplicated(keys).any()


# -- 1. a rerun follows the data's content ------------------------------------------------


def test_rows_inserted_above_are_not_read_as_the_old_ids(bert_dir, tmp_path, oracle):
    """ids are line numbers: a row inserted on top shifts every id; the rerun explains
    the shifted rows again (their ids now name other texts)."""
    data = _write(tmp_path / "d.jsonl", ROWS[:3])
    _run(bert_dir, data, tmp_path / "out")
    _write(data, [ROWS[3], *ROWS[:3]])
    _run(bert_dir, data, tmp_path / "out")
    _agrees_with_the_data(tmp_path / "out", data, oracle)


def test_a_fixed_text_is_explained_again_and_only_it(bert_dir, tmp_path, oracle):
    rows = [{**r, "id": name} for name, r in zip("abc", ROWS)]
    data = _write(tmp_path / "d.jsonl", rows)
    _run(bert_dir, data, tmp_path / "out")
    rows[1] = {**rows[1], "text": "the keys [MASK] here"}  # a typo fixed
    _write(data, rows)
    again = _run(bert_dir, data, tmp_path / "out")
    assert again["summary"]["this_run"]["explained"] == 1
    _agrees_with_the_data(tmp_path / "out", data, oracle)
    rows.pop(0)  # a row deleted: its results leave the tables
    _write(data, rows)
    assert _run(bert_dir, data, tmp_path / "out")["summary"]["this_run"]["explained"] == 0
    _agrees_with_the_data(tmp_path / "out", data, oracle)


def test_a_skipped_example_fixed_is_no_longer_counted_skipped(bert_dir, tmp_path, oracle):
    rows = [{**r, "id": name} for name, r in zip("ab", ROWS)]
    rows[1] = {**rows[1], "foil": "zebra"}  # not in the vocabulary: skipped
    data = _write(tmp_path / "d.jsonl", rows)
    assert _run(bert_dir, data, tmp_path / "out")["skipped"] == 1
    seen = []  # a rerun of the same data prepares nothing again: the skip is kept

    def counting(ex, *a):
        seen.append(ex.id)
        return prepare(ex, *a)

    assert _run(bert_dir, data, tmp_path / "out", prepare=counting)["skipped"] == 1
    assert seen == []
    rows[1] = {**rows[1], "foil": "is"}
    _write(data, rows)
    r = _run(bert_dir, data, tmp_path / "out")
    assert (r["explained"], r["skipped"]) == (2, 0)
    assert skipped_examples(tmp_path / "out") == {}
    _agrees_with_the_data(tmp_path / "out", data, oracle)


def test_done_jsonl_edited_duplicates_nothing(bert_dir, tmp_path, oracle):
    """An id taken off its line (then explained again) and an id moved onto another
    line's shard (which holds no rows for it): each example once, with its score."""
    texts = ("the dog [MASK] here", "the cat [MASK] here", "a dog [MASK] here",
             "a cat [MASK] here")  # of one length: batches of 2  # fmt: skip
    rows = [
        {"id": name, "text": t, "target": "is", "foil": "are"} for name, t in zip("abcd", texts)
    ]
    data = _write(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    _run(bert_dir, data, out, batch_size=2)

    def edit(change):
        lines = [json.loads(x) for x in (out / "done.jsonl").read_text().splitlines()]
        change([r for r in lines if r["shard"]])
        (out / "done.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    edit(lambda shards: shards[0]["ids"].pop())  # its shard still holds its rows
    assert _run(bert_dir, data, out, batch_size=2)["summary"]["this_run"]["explained"] == 1
    _agrees_with_the_data(out, data, oracle)
    # an id moved from one line onto another, whose shard holds no rows for it
    edit(lambda shards: shards[1]["ids"].append(shards[0]["ids"].pop()))
    _run(bert_dir, data, out, batch_size=2)
    _agrees_with_the_data(out, data, oracle)
    # the same line pasted twice is read once
    text = (out / "done.jsonl").read_text()
    (out / "done.jsonl").write_text(text + text.splitlines()[0] + "\n")
    _agrees_with_the_data(out, data, oracle)


def test_a_directory_of_results_without_config_json_is_refused(bert_dir, tmp_path):
    data = _write(tmp_path / "d.jsonl", ROWS[:2])
    _run(bert_dir, data, tmp_path / "out")
    (tmp_path / "out" / "config.json").unlink()
    with pytest.raises(InputError, match=r"no config\.json.*settings.*unknown"):
        _run(bert_dir, data, tmp_path / "out", semirings=("real",))  # another setting
    # the results are as they were: the refused run added nothing
    assert len(load_results(tmp_path / "out")["examples"]) == 2
    assert not (tmp_path / "out" / "config.json").exists()


# -- 3. damaged shards, a full disk --------------------------------------------------------


def _shard(out: Path, table: str, k: int) -> Path:
    names = [json.loads(x)["shard"] for x in (out / "done.jsonl").read_text().splitlines()]
    return out / table / f"{[n for n in names if n][k]}.parquet"


@pytest.mark.parametrize("damage", ["deleted", "truncated", "replaced"])
def test_a_damaged_shard_is_named_then_explained_again(bert_dir, tmp_path, oracle, damage,
                                                       caplog):  # fmt: skip
    rows = [{**r, "id": name} for name, r in zip("abc", ROWS)]
    data = _write(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    _run(bert_dir, data, out)
    victim = _shard(out, {"deleted": "tokens", "truncated": "branches",
                          "replaced": "examples"}[damage], 1)  # fmt: skip
    if damage == "deleted":
        victim.unlink()
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:100])
    else:  # another shard's (valid) file copied over it
        victim.write_bytes(_shard(out, "examples", 2).read_bytes())
    with pytest.raises(InputError, match=rf"{victim.name}.*rerun the same"):
        load_results(out)
    with caplog.at_level(logging.WARNING, logger="semiring_backprop.runner"):
        r = _run(bert_dir, data, out)
    assert victim.name in caplog.text and "explained again" in caplog.text
    assert r["summary"]["this_run"]["explained"] == 1  # that shard's one example
    _agrees_with_the_data(out, data, oracle)
    got = _pyarrow_tables(out)  # what is left on disk reads, each example once
    for table in TABLES:
        assert set(got[table]["example_id"]) == set("abc")
    assert sorted(got["examples"]["example_id"]) == list("abc")


class _Full:
    """``DataFrame.to_parquet`` that writes half a file on its ``n``-th call, then fails
    as a full disk does."""

    def __init__(self, n):
        self.n, self.calls = n, 0
        self.real = pd.DataFrame.to_parquet

    def method(self):
        def to_parquet(frame, path, *a, **kw):
            self.calls += 1
            if self.calls == self.n:
                Path(path).write_bytes(b"PAR1" + b"\0" * 64)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.real(frame, path, *a, **kw)

        return to_parquet


def test_a_full_disk_is_one_clear_error_and_the_rerun_resumes(bert_dir, tmp_path, oracle,
                                                              monkeypatch):  # fmt: skip
    rows = [{**r, "id": name} for name, r in zip("abcd", ROWS)]
    data = _write(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    monkeypatch.setattr(pd.DataFrame, "to_parquet", _Full(5).method())  # the second batch's tokens
    with pytest.raises(InputError) as got:
        _run(bert_dir, data, out)
    message = str(got.value)
    assert "disk is full" in message and "1 of the 4 examples are committed" in message
    assert "run the same command again" in message
    leftovers = [p for t in TABLES if (out / t).is_dir() for p in (out / t).iterdir()]
    assert sorted(p.suffix for p in leftovers) == [".parquet"] * 4  # one shard + one table
    monkeypatch.undo()
    r = _run(bert_dir, data, out)
    assert r["summary"]["this_run"]["explained"] == 3
    _agrees_with_the_data(out, data, oracle)


def test_a_full_disk_at_the_commit_line(bert_dir, tmp_path, oracle, monkeypatch):
    """The append to done.jsonl fails half-way: that batch is not committed."""
    rows = [{**r, "id": name} for name, r in zip("ab", ROWS)]
    data = _write(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    real = records.Records.add

    def add(self, row):
        if row.get("shard") and len([r for r in self.rows if r.get("shard")]) == 1:
            with open(self.path, "a") as f:
                f.write(json.dumps(row)[:30])  # half a line
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, row)

    monkeypatch.setattr(records.Records, "add", add)
    with pytest.raises(InputError, match=r"disk is full.*1 of the 2 examples"):
        _run(bert_dir, data, out)
    monkeypatch.undo()
    assert _run(bert_dir, data, out)["summary"]["this_run"]["explained"] == 1
    _agrees_with_the_data(out, data, oracle)


def test_a_full_disk_from_the_command_line_is_one_line(bert_dir, tmp_path, monkeypatch,
                                                       capsys):  # fmt: skip
    from semiring_backprop import cli

    data = _write(tmp_path / "d.jsonl", ROWS[:2])
    monkeypatch.setattr(pd.DataFrame, "to_parquet", _Full(1).method())
    rc = cli.main(["run", bert_dir, "--data", str(data), "--out", str(tmp_path / "out"),
                   "--semiring", "real", "--no-figures", "--threads", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the disk is full") and "0 of the 2 examples" in last


# -- 2. links planted where files are written ---------------------------------------------


def _victim(tmp_path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text("precious\n")
    return v


def test_atomic_write_never_writes_through_a_planted_link(tmp_path):
    victim = _victim(tmp_path)
    target = tmp_path / "out" / "summary.json"
    target.parent.mkdir()
    # the temporary names of the earlier scheme, planted in advance
    for name in (f".{target.name}.{os.getpid()}.tmp", f"{target.name}.part"):
        (target.parent / name).symlink_to(victim)
    records.write_json(target, {"a": 1})
    assert victim.read_text() == "precious\n"
    assert json.loads(target.read_text()) == {"a": 1}
    target.unlink()
    target.symlink_to(victim)  # the file itself a link: replaced, not written through
    records.write_json(target, {"b": 2})
    assert victim.read_text() == "precious\n" and not target.is_symlink()
    assert json.loads(target.read_text()) == {"b": 2}
    left = sorted(p.name for p in target.parent.iterdir() if not p.is_symlink())
    assert left == ["summary.json"]  # no temporary file or folder left


def test_the_lock_and_done_jsonl_are_not_written_through_links(tmp_path):
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    with pytest.raises(InputError, match=r"\.lock is a symbolic link"), records.lock(out):
        pass
    assert victim.read_text() == "precious\n"
    rec = records.Records(out / "done.jsonl")
    (out / "done.jsonl").symlink_to(victim)  # planted after the run read it
    with pytest.raises(InputError, match=r"done\.jsonl is a symbolic link"):
        rec.add({"key": 1})
    assert victim.read_text() == "precious\n"


def test_html_pages_are_not_written_through_links(tmp_path):
    from semiring_backprop.views import html

    victim = _victim(tmp_path)
    page = tmp_path / "report.html"
    Path(f"{page}.part").symlink_to(victim)
    assert html.write_document(page, "<p>page</p>") == str(page)
    assert victim.read_text() == "precious\n" and page.read_text() == "<p>page</p>"
    with pytest.raises(InputError, match="is a directory"):
        html.write_document(tmp_path, "x")


def test_view_to_html_is_not_written_through_a_link(tmp_path):
    from semiring_backprop.views import View

    victim = _victim(tmp_path)
    page = tmp_path / "report.html"
    Path(f"{page}.part").symlink_to(victim)
    View("<p>page</p>", lambda color: "page", "t").to_html(page)
    assert victim.read_text() == "precious\n"
    assert "<p>page</p>" in page.read_text()
