"""Results written as they come, and the settings they were computed under.

Per-example results go to JSON lines, one line as soon as it is computed, and a rerun
skips the lines already written (:class:`Records`). Whole files (configs, tables) are
written under a temporary name and renamed, so a file that exists is complete
(:func:`~semiring_backprop._files.atomic_write`); one run at a time holds a directory
(:func:`lock`); a rerun under other settings is refused (:func:`same_settings`). Both
the data-set runner and the paper's experiments write through here.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import MISSING, asdict, fields
from pathlib import Path

from .._files import atomic_write, json_safe
from ..errors import InputError

__all__ = ["NOT_RESULTS", "Records", "atomic_write", "lock", "same_settings", "write_json"]

#: files of an output directory that hold no results: the settings, the lock, and data
#: a run makes again from its settings before computing anything
NOT_RESULTS = frozenset({"config.json", ".lock", "synthetic.jsonl"})


@contextlib.contextmanager
def lock(out: Path) -> Iterator[None]:
    """Hold ``out`` for this run: a second run into the same directory (another process)
    is refused, naming the process that holds it, rather than mixing rows."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = os.fdopen(_open_own(out / ".lock", os.O_RDWR), "r+")
    except OSError as e:
        raise InputError(f"cannot write into output directory {str(out)!r}: {e.strerror}") from None
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        fcntl = None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                raise InputError(
                    f"{out} is in use by another run (process {holder}); wait for it to "
                    "finish, or write into another output directory"
                ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        f.close()  # releases the lock


def _open_own(path: Path, flags: int) -> int:
    """``os.open`` of a file of this package's own, created if missing; a symbolic link
    there (planted: none of ours is one) is refused, never written through."""
    try:
        return os.open(path, flags | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError:
        if os.path.islink(path):
            raise InputError(
                f"{path} is a symbolic link, not a file this package wrote; it is not written "
                "through: remove the link (or write into another output directory)"
            ) from None
        raise


class Records:
    """Rows written as JSON lines the moment they are added; a rerun reads them back.

    For example::

        rec = Records(out / "values.jsonl")
        if not rec.has(key):
            rec.add({"key": key, "value": value})
    """

    def __init__(self, path: Path, key: str = "key", fields: tuple = ()):
        """``fields``: what every record holds (besides ``key``): a record without one
        (another version wrote it, or it was edited) is refused, naming its line."""
        self.path, self.key = Path(path), key
        self.rows: list[dict] = []
        try:
            text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        except UnicodeDecodeError as e:
            raise InputError(
                f"{self.path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                f"{e.start}): not a file of records this package wrote; delete it to start over"
            ) from None
        lines = text.splitlines()
        seen: dict = {}  # key -> row, to find rows written twice
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i < len(lines):
                    raise InputError(
                        f"{self.path}:{i} is not valid JSON; delete the file to start over"
                    ) from None
                continue  # the last line was cut off by an interrupted run: drop it
            if not isinstance(row, dict):
                raise InputError(
                    f"{self.path}:{i} holds a JSON {type(row).__name__}, not a record (an "
                    "object); delete the file to start over"
                )
            missing = [f for f in (key, *fields) if f not in row]
            if missing:
                raise InputError(
                    f"{self.path}:{i} is a record without {', '.join(missing)} (another "
                    "version of this package wrote it, or it was edited): delete that line "
                    "to compute it again, or the file to start over"
                )
            k = row.get(key)
            if k is not None and k in seen:
                if seen[k] != row:
                    raise InputError(
                        f"{self.path}:{i} is a second, different record for {key} {k!r}: "
                        "which one holds is unknown; delete the file to start over"
                    )
                continue  # the same record written twice: read once
            seen.setdefault(k, row)
            self.rows.append(row)
        self._done = {r.get(key) for r in self.rows}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if len(self.rows) != len(lines) or not text.endswith("\n") and lines:  # cut off
            clean = "".join(json.dumps(r) + "\n" for r in self.rows)
            atomic_write(self.path, lambda tmp: tmp.write_text(clean))

    def has(self, key) -> bool:
        return key in self._done

    def add(self, row: dict):
        with os.fdopen(_open_own(self.path, os.O_WRONLY | os.O_APPEND), "a") as f:
            f.write(json.dumps(json_safe(row)) + "\n")
        self.rows.append(row)
        self._done.add(row.get(self.key))

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows)


def same_settings(out: Path, config, free=()) -> None:
    """Write ``config.json`` into ``out``; if an earlier run left one there whose settings
    differ (other than the ``free`` fields, which only choose what to compute or
    report), its records would be stale: raise instead of mixing them. Files in ``out``
    without a ``config.json`` (deleted, or another program's) are refused too: their
    settings are unknown. Hidden files (``.lock``, ``.DS_Store``) are no results."""
    path = out / "config.json"
    now = json.loads(json.dumps(asdict(config)))  # tuples as JSON lists
    # settings count only where a run left results under them (a run that failed
    # before computing anything does not block a corrected one)
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    results = [n for n in held if n not in NOT_RESULTS and not n.startswith(".")]
    if results and not path.exists():
        shown = ", ".join(results[:5]) + (", ..." if len(results) > 5 else "")
        raise InputError(
            f"{out} holds files ({shown}) but no config.json, so the settings of any results "
            "among them are unknown, and a run now would mix its results with them; write "
            "into a new (or empty) output directory, or delete these files to start over"
        )
    if path.exists() and results:
        try:
            before = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InputError(
                f"{path} is not valid JSON, so the settings of the results beside it are "
                "unknown; delete the directory to start over, or write into a new one"
            ) from None
        if not isinstance(before, dict):
            raise InputError(
                f"{path} holds a JSON {type(before).__name__}, not the settings of the results "
                "beside it; delete the directory to start over, or write into a new one"
            )
        # a setting added since that run: the run computed what its default computes
        was = {**_defaults(config), **before}
        changed = sorted(k for k in now if k not in free and was.get(k, now[k]) != now[k])
        if changed:
            raise InputError(
                f"{out} holds results of a run with other settings ({', '.join(changed)}); "
                "write into a new output directory, or delete this one to start over"
            )
    write_json(path, now)


def _defaults(config) -> dict:
    """The settings' default values, as ``config.json`` holds them."""
    out = {}
    for f in fields(config):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return json.loads(json.dumps(out, default=str))


def write_json(path: Path, obj) -> Path:
    text = json.dumps(json_safe(obj), indent=2) + "\n"
    return atomic_write(path, lambda tmp: tmp.write_text(text))
