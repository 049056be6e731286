"""Battery cases: the data-set runner's directory on disk (issue 29). A rerun into the
same output directory after the data changed (rows inserted, a text fixed, a row
deleted), after ``done.jsonl`` was edited, ``config.json`` deleted or a committed shard
deleted, cut off or replaced; a full disk; links planted where temporary files, the lock
and HTML pages are written.

Oracles: the saved model's own logits for the text the data file holds *now* under each
id (``battery._cli_score``), the data file itself, the Parquet files read back with
pyarrow, and a planted link's target read back byte for byte.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from pathlib import Path
from unittest import mock

import semiring_backprop as sbp
from battery import Cli, _cli_score, case, clear, graceful

ROWS = [
    {"id": "a", "text": "the dog [MASK] on the table", "target": "is", "foil": "are"},
    {"id": "b", "text": "the keys [MASK] on the table", "target": "are", "foil": "is"},
    {"id": "c", "text": "a cat [MASK] on a table", "target": "is", "foil": "are"},
]
TABLES = ("examples", "tokens", "branches")


def _data(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@contextlib.contextmanager
def _quiet():
    """The runner's warnings (what it explains again) are the point, not noise here."""
    logger = logging.getLogger("semiring_backprop.runner")
    was = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(was)


def _run(env, data, out, **kw):
    kw = {"semirings": ("real",), "batch_size": 1, "threads": 1, "progress": False,
          "figures": False, **kw}  # fmt: skip
    with _quiet():
        return sbp.run(str(env.model_dirs()["bert"]), data, out, **kw)


def _rows_now(data: Path) -> dict:
    rows = [json.loads(x) for x in data.read_text().splitlines() if x.strip()]
    return {str(r.get("id", n)): r for n, r in enumerate(rows, 1)}


def _agrees(out: Path, data: Path, env):
    """Each example of the data once, under its id, with its text and the model's own
    score for it; tokens and branches of those examples only."""
    want = _rows_now(data)
    tables = sbp.load_results(out)
    ex = tables["examples"]
    if sorted(ex["example_id"]) != sorted(want):
        return f"examples {sorted(ex['example_id'])}, the data has {sorted(want)}"
    for r in ex.itertuples():
        row = want[r.example_id]
        if r.text != row["text"]:
            return f"id {r.example_id}: the table explains {r.text!r}, the data {row['text']!r}"
        what = (row["text"], row["target"], row["foil"])
        score = env.memo(("score", *what), lambda what=what: _cli_score(env, *what))
        if abs(r.score - score) > 1e-4:
            return f"id {r.example_id}: score {r.score}, the model gives {score}"
    for name in ("tokens", "branches"):
        if set(tables[name]["example_id"]) != set(want):
            return f"{name}: examples {sorted(set(tables[name]['example_id']))}"
    n_tokens = ex.set_index("example_id")["tokens"].to_dict()
    if tables["tokens"].groupby("example_id").size().to_dict() != n_tokens:
        return "tokens: not one row per token of each example"
    return True


def _rerun_agrees(value, env):
    out, data = value
    return _agrees(out, data, env)


def _twice(env, name, first, change, **kw):
    """Run over ``first`` rows, let ``change(data, out)`` edit the files, run again."""
    d = env.tmp("runner/" + name)
    data, out = _data(d / "d.jsonl", first), d / "out"
    _run(env, data, out, **kw)
    change(data, out)
    _run(env, data, out, **kw)
    return out, data


# -- the data changed -----------------------------------------------------------------------


@graceful("runs.runner-rows-inserted-above", _rerun_agrees)
def _(env):
    """ids are line numbers: a row inserted on top shifts every id"""
    plain = [{k: v for k, v in r.items() if k != "id"} for r in ROWS]
    return _twice(env, "inserted", plain[:2], lambda d, o: _data(d, [plain[2], *plain[:2]]))


@graceful("runs.runner-text-fixed", _rerun_agrees)
def _(env):
    """a typo fixed in one row, then the same run again"""
    fixed = [ROWS[0], {**ROWS[1], "text": "the keys to the cabinet [MASK] here"}, ROWS[2]]
    return _twice(env, "fixed", ROWS, lambda d, o: _data(d, fixed))


@graceful("runs.runner-row-deleted", _rerun_agrees)
def _(env):
    return _twice(env, "deleted", ROWS, lambda d, o: _data(d, ROWS[1:]))


@graceful("runs.runner-done-jsonl-id-removed", _rerun_agrees)
def _(env):
    """an id taken off its line of done.jsonl by hand (its shard still holds its rows)"""

    def edit(data, out):
        lines = [json.loads(x) for x in (out / "done.jsonl").read_text().splitlines()]
        next(r for r in lines if r["shard"])["ids"].clear()
        (out / "done.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    return _twice(env, "edited", ROWS[:2], edit)


@clear("runs.runner-config-json-deleted", r"no config\.json.*settings.*unknown")
def _(env):
    """config.json deleted, then a rerun with other semirings (would mix two settings)"""
    d = env.tmp("runner/noconfig")
    data, out = _data(d / "d.jsonl", ROWS[:1]), d / "out"
    _run(env, data, out)
    (out / "config.json").unlink()
    return _run(env, data, out, semirings=("max",))


# -- a committed shard damaged --------------------------------------------------------------


def _shard(out: Path, table: str, k: int) -> Path:
    names = [json.loads(x)["shard"] for x in (out / "done.jsonl").read_text().splitlines()]
    return out / table / f"{[n for n in names if n][k]}.parquet"


DAMAGE = {
    "deleted": ("tokens", lambda p, out: p.unlink()),
    "truncated": ("branches", lambda p, out: p.write_bytes(p.read_bytes()[:100])),
    "replaced": ("examples", lambda p, out: p.write_bytes(_shard(out, "examples", 2).read_bytes())),
}


def _damaged(env, how):
    table, spoil = DAMAGE[how]
    return lambda data, out: spoil(_shard(out, table, 1), out)


def _recomputed(value, env):
    import pandas as pd
    import pyarrow.parquet as pq

    out, data = value
    ok = _agrees(out, data, env)
    if ok is not True:
        return ok
    for t in TABLES:  # what is left on disk reads, each example once
        frame = pd.concat([pq.read_table(f).to_pandas() for f in sorted((out / t).iterdir())])
        if t == "examples" and sorted(frame["example_id"]) != sorted(_rows_now(data)):
            return f"{t} files hold {sorted(frame['example_id'])}"
    return True


def _base(env, name):
    """A copy of one run over ROWS (made once): ``(out, data)``."""
    import shutil

    def make():
        d = env.tmp("runner/base")
        data = _data(d / "d.jsonl", ROWS)
        _run(env, data, d / "out")
        return d / "out", data

    out, data = env.memo("runner-base", make)
    copy = env.tmp("runner/" + name) / "out"
    shutil.copytree(out, copy, dirs_exist_ok=True)
    return copy, data


def _load_damaged(env, how):
    """load_results on the damaged directory, before any rerun"""
    out, data = _base(env, f"load-{how}")
    _damaged(env, how)(data, out)
    return sbp.load_results(out)


def _rerun_damaged(env, how):
    out, data = _base(env, f"shard-{how}")
    _damaged(env, how)(data, out)
    _run(env, data, out)
    return out, data


for _how in DAMAGE:
    graceful(f"runs.runner-shard-{_how}-rerun", _recomputed)(
        lambda env, how=_how: _rerun_damaged(env, how)
    )
    clear(f"runs.runner-shard-{_how}-load", r"\.parquet.*rerun the same")(
        lambda env, how=_how: _load_damaged(env, how)
    )


# -- a full disk ----------------------------------------------------------------------------


def _full_on(n):
    """``DataFrame.to_parquet`` that writes half a file on its ``n``-th call, then fails
    as a full disk does."""
    import pandas as pd

    real, calls = pd.DataFrame.to_parquet, []

    def to_parquet(frame, path, *a, **kw):
        calls.append(1)
        if len(calls) == n:
            Path(path).write_bytes(b"PAR1" + b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(frame, path, *a, **kw)

    return mock.patch.object(pd.DataFrame, "to_parquet", to_parquet)


@clear("runs.runner-disk-full", r"disk is full.*1 of the 3 examples.*kept.*run the same command")
def _(env):
    d = env.tmp("runner/full")
    with _full_on(5):  # the second example's tokens
        return _run(env, _data(d / "d.jsonl", ROWS), d / "out")


@graceful("runs.runner-disk-full-then-resumed", _rerun_agrees)
def _(env):
    d = env.tmp("runner/full-resumed")
    data, out = _data(d / "d.jsonl", ROWS), d / "out"
    with _full_on(5), contextlib.suppress(sbp.InputError):
        _run(env, data, out)
    _run(env, data, out)
    return out, data


@case("cli.run-results-without-config-json", "clear", names=r"no config\.json")
def _(env):
    """semiring-backprop run into a directory of results whose config.json was deleted"""
    d = env.tmp("runner/cli-noconfig")
    data, out = _data(d / "d.jsonl", ROWS[:1]), d / "out"
    _run(env, data, out)
    (out / "config.json").unlink()
    return Cli(["run", str(env.model_dirs()["bert"]), "--data", str(data), "--out", str(out),
                "--semiring", "max", "--no-figures"])  # fmt: skip


# -- links planted where files are written --------------------------------------------------


def _victim(env, name) -> Path:
    d = env.tmp(f"links/{name}")
    v = d / "victim.txt"
    v.write_text("precious\n")
    return v


def _intact(value, env):
    victim, target, want = value
    if victim.read_text() != "precious\n":
        return f"the link's target was overwritten: {victim.read_text()[:60]!r}"
    if target.is_symlink() or target.read_text() != want:
        return f"{target} does not hold what was written"
    left = sorted(p.name for p in target.parent.iterdir() if not p.is_symlink())
    return left == sorted({target.name, "victim.txt"}) or f"files left: {left}"


@graceful("runs.runner-atomic-write-planted-tmp-link", _intact)
def _(env):
    """links planted at the temporary names atomic_write used to use"""
    from semiring_backprop.runner import records

    victim = _victim(env, "tmp")
    target = victim.parent / "summary.json"
    for name in (f".{target.name}.{os.getpid()}.tmp", f"{target.name}.part"):
        (target.parent / name).symlink_to(victim)
    records.write_json(target, {"a": 1})
    return victim, target, '{\n  "a": 1\n}\n'


@graceful("runs.runner-atomic-write-target-a-link", _intact)
def _(env):
    """the file written is itself a link: the link is replaced, its target untouched"""
    from semiring_backprop.runner import records

    victim = _victim(env, "target")
    target = victim.parent / "summary.json"
    target.symlink_to(victim)
    records.write_json(target, {"a": 1})
    return victim, target, '{\n  "a": 1\n}\n'


@clear("runs.runner-lock-a-link", r"\.lock is a symbolic link")
def _(env):
    from semiring_backprop.runner import records

    victim = _victim(env, "lock")
    out = victim.parent / "out"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    with records.lock(out):  # held without an error: counted silent
        pass


@graceful("runs.runner-html-page-part-a-link", _intact)
def _(env):
    """report.html.part planted as a link (views.html.write_document)"""
    from semiring_backprop.views import html

    victim = _victim(env, "html")
    page = victim.parent / "report.html"
    Path(f"{page}.part").symlink_to(victim)
    html.write_document(page, "<p>page</p>")
    return victim, page, "<p>page</p>"
