"""A run directory on disk: what is done, keyed by content, and checked before a resume.

``done.jsonl`` holds one line per commit. A batch's line names its shard (one Parquet
file in each of ``examples/``, ``tokens/`` and ``branches/``), the ids it explained and
those it skipped, each id's **content key** (a hash of everything that defines the
example: id, text, target, foil, positions and the extra columns) and each file's size
and SHA-256. A line ``{"retracted": [ids]}`` withdraws earlier results. What a run
directory holds is the last word on each id, read in order (:func:`current`).

Before a resume, :func:`check` compares the directory with the data and with itself:

- an example whose content changed since it was explained (a text fixed; rows inserted
  above it while ids are line numbers), and one no longer in the data, is retracted:
  the rerun explains the changed ones again, and no table shows a result under an id
  whose example is now another;
- a committed shard that is missing, cut off, changed or holds no rows for its ids is
  retracted with a warning naming the file: its examples are explained again;
- files no line holds (written by a run killed before it committed them, or holding
  only retracted results) are deleted.

:func:`read_shard` checks a file's size and SHA-256 before :func:`load_results` reads it,
so a damaged file is an error that names it, not a raw Parquet error.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

log = logging.getLogger(__name__)

TABLES = ("examples", "tokens", "branches")
#: how this package names shards: commit number and a random suffix
SHARD = re.compile(r"\d{6}-[0-9a-f]{8}")
SHOWN = 8  # ids listed in a message


def content_key(ex) -> str:
    """A hash of what defines example ``ex`` (not where it was read: ``source``)."""
    what = {"id": ex.id, "text": ex.text, "target": ex.target, "foil": ex.foil,
            "positions": {k: list(v) for k, v in sorted(ex.positions.items())},
            "extra": ex.extra}  # fmt: skip
    text = json.dumps(what, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def file_record(path: Path) -> dict:
    """What :func:`read_shard` checks a file against: its size and SHA-256."""
    data = Path(path).read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@dataclass(frozen=True)
class Done:
    """The last word on one example id: explained into ``shard``, or ``skipped``."""

    shard: str | None
    key: str | None  #: its content key (None: written by a version that kept none)
    skipped: str | None = None  #: the reason, where it was skipped


def current(rows: list[dict], where: Path) -> dict[str, Done]:
    """``{id: Done}`` from the lines of ``done.jsonl`` (``where``), read in order."""
    now: dict[str, Done] = {}
    for row in rows:
        _valid(row, where)
        keys = row.get("keys") or {}
        for i in row.get("ids") or ():
            now[i] = Done(row.get("shard"), keys.get(i))
        for i, why in (row.get("skipped") or {}).items():
            now[i] = Done(None, keys.get(i), why)
        for i in row.get("retracted") or ():
            now.pop(i, None)
    return now


def _valid(row: dict, where: Path) -> None:
    shard, ids = row.get("shard"), row.get("ids") or []
    ok = (
        (shard is None or isinstance(shard, str) and SHARD.fullmatch(shard))
        and isinstance(ids, list)
        and all(isinstance(i, str) for i in ids)
        and isinstance(row.get("skipped") or {}, dict)
        and isinstance(row.get("keys") or {}, dict)
        and isinstance(row.get("files") or {}, dict)
        and isinstance(row.get("retracted") or [], list)
        and (shard is not None or not ids)
    )
    if not ok:
        raise InputError(
            f"{where} holds a line this package did not write ({json.dumps(row)[:120]}); "
            "which results it commits is unknown: delete the output directory to start over"
        )


def live(rows: list[dict], now: dict[str, Done]) -> list[tuple[str, dict, set]]:
    """``(shard, its line, the ids it is the last word on)`` in commit order."""
    owned: dict[str, set] = {}
    for i, d in now.items():
        if d.shard is not None:
            owned.setdefault(d.shard, set()).add(i)
    return [(r["shard"], r, owned[r["shard"]]) for r in rows if r.get("shard") in owned]


def check(out: Path, records, every: list) -> dict[str, Done]:
    """Bring ``out`` in line with the data ``every`` (all its examples) before a resume;
    returns what stays done (see the module's docstring)."""
    where = records.path
    now = current(records.rows, where)
    broken = {}
    for shard, row, ids in live(records.rows, now):
        problem = _damage(out, shard, row, ids)
        if problem:
            broken[shard] = ids
            log.warning("%s; its %d examples (%s) are explained again", problem, len(ids),
                        _ids(ids))  # fmt: skip
    keys = {ex.id: content_key(ex) for ex in every}
    changed = sorted(i for i, d in now.items() if i in keys and d.key != keys[i])
    gone = sorted(i for i in now if i not in keys)
    if changed:
        log.warning("%d examples of %s are not what they were when explained (their text, "
                    "target, foil, positions or columns changed; or rows moved while ids are "
                    "line numbers): explained again (%s)", len(changed), out,
                    _ids(changed))  # fmt: skip
    if gone:
        log.warning("%d examples of %s are no longer in the data: their results are dropped "
                    "(%s)", len(gone), out, _ids(gone))  # fmt: skip
    retract = sorted({*changed, *gone, *(i for ids in broken.values() for i in ids)})
    if retract:
        records.add({"shard": None, "ids": [], "skipped": {}, "retracted": retract})
        now = current(records.rows, where)
    _drop_unheld(out, records.rows, now)
    return now


def _damage(out: Path, shard: str, row: dict, ids: set) -> str | None:
    """What is wrong with a committed shard, or None."""
    files = row.get("files") or {}
    for table in TABLES:
        path = out / table / f"{shard}.parquet"
        if path.is_symlink() or not path.is_file():
            return f"{path} is missing" + (" (a link stands there)" if path.is_symlink() else "")
        want = files.get(table)
        if want is None:  # written before sizes and hashes were kept: it must read
            problem = _unreadable(path)
        else:
            problem = _changed(path, path.read_bytes(), want)
        if problem:
            return problem
    found = set(_read(out / "examples" / f"{shard}.parquet", ["example_id"])["example_id"])
    if not ids <= found:
        return (f"{out / 'examples' / f'{shard}.parquet'} holds no rows for ids "
                f"{_ids(ids - found)} that done.jsonl commits to it")  # fmt: skip
    return None


def _changed(path: Path, data: bytes, want: dict) -> str | None:
    if len(data) != want.get("bytes"):
        return (f"{path} is {len(data)} bytes, and was written with {want.get('bytes')}: cut "
                "off or replaced")  # fmt: skip
    if hashlib.sha256(data).hexdigest() != want.get("sha256"):
        return f"{path} changed since it was written (its SHA-256 differs)"
    return None


def _unreadable(path: Path) -> str | None:
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except Exception as e:  # noqa: BLE001  (ArrowInvalid, OSError: a cut-off or foreign file)
        return f"{path} cannot be read as Parquet ({type(e).__name__}: {str(e)[:120]})"
    return None


def _read(source, columns):
    import pandas as pd

    return pd.read_parquet(source, columns=columns)


def _drop_unheld(out: Path, rows: list[dict], now: dict[str, Done]) -> None:
    """Delete shards no line holds any more, and temporary files of killed runs."""
    held = {s for s, _, _ in live(rows, now)}
    committed = {r.get("shard") for r in rows}
    for table in TABLES:
        folder = out / table
        if not folder.is_dir():
            continue
        for f in sorted(folder.iterdir()):
            if f.name.startswith(".") and f.name.endswith(".tmp"):  # atomic_write's, left
                _remove(f)
            elif f.suffix == ".parquet" and f.stem not in held:
                if f.stem not in committed:
                    log.warning("%s was written by a run that stopped before committing it; "
                                "deleting it (its examples are explained again)", f)  # fmt: skip
                _remove(f)


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def read_shard(out: Path, table: str, shard: str, row: dict, ids: set, columns=None):
    """One committed shard's rows of the ids it is the last word on, its file checked
    against the size and SHA-256 its line recorded."""
    path = out / table / f"{shard}.parquet"
    rerun = (f": rerun the same `semiring-backprop run` (or `run()`) into {out}, which "
             f"explains its {len(ids)} examples ({_ids(ids)}) again")  # fmt: skip
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path} cannot be read ({e.strerror or e}){rerun}") from None
    want = (row.get("files") or {}).get(table)
    problem = _changed(path, data, want) if want is not None else None
    if problem:
        raise InputError(problem + rerun)
    cols = None if columns is None else list(dict.fromkeys([*columns, "example_id"]))
    try:
        frame = _read(io.BytesIO(data), cols)
    except Exception as e:  # noqa: BLE001  (a file of an older run, not checked by hash)
        raise InputError(
            f"{path} cannot be read as Parquet ({type(e).__name__}: {str(e)[:120]}){rerun}"
        ) from None
    if len(frame) and not frame["example_id"].isin(ids).all():  # some explained again since
        frame = frame[frame["example_id"].isin(ids)]
    return frame if columns is None or "example_id" in columns else frame.drop(
        columns="example_id")  # fmt: skip


def _ids(ids) -> str:
    ids = sorted(ids, key=lambda i: (len(i), i))
    return ", ".join(ids[:SHOWN]) + (f", ... ({len(ids)} in all)" if len(ids) > SHOWN else "")


def full(e: OSError) -> bool:
    """Whether ``e`` says the disk (or the user's quota) is full."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
        "No space left" in str(e) or "Errno 28" in str(e))  # fmt: skip
