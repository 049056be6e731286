"""Readers: a data file (or a Hugging Face data set) to :class:`Example` rows.

Every reader yields examples and :class:`Malformed` rows: a row that cannot be read is
reported with its file and line (or row number) and skipped; the rest of the file is
read. Formats:

- ``jsonl``: one JSON object per line with the text, target and foil (column names are
  options, ``columns={"text": "sentence", ...}``);
- ``csv`` / ``tsv``: a header row, then one example per row;
- ``blimp``: the official BLiMP JSON lines, read by
  :func:`~semiring_backprop.data.read_blimp` (``sentence_good`` / ``sentence_bad``:
  the differing word is target and foil, a verb phrase such as "works with" / "work
  with" included); the text is the good sentence with :data:`MASK` at that word;
- ``linzen``: the Linzen/Goldberg agreement TSV
  (:func:`~semiring_backprop.data.read_linzen`);
- ``datasets``: a Hugging Face data set saved with ``save_to_disk`` (a directory), or a
  name for ``datasets.load_dataset`` (which needs the hub or its cache).

A text may hold :data:`MASK` (``***mask***``) at the word to predict: a masked LM gets
its mask token there, a causal LM reads the words before it. Word positions of
interest (``positions``) are indices of whitespace-separated words of the text.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..data.agreement import MASK, Malformed
from ..data.agreement_files import read_blimp, read_linzen
from ..errors import InputError, LoadError

FORMATS = ("auto", "jsonl", "csv", "tsv", "blimp", "linzen", "datasets")
#: the columns an example is read from (``columns=`` renames them)
COLUMNS = {"text": "text", "target": "target", "foil": "foil", "id": "id",
           "positions": "positions"}  # fmt: skip


@dataclass(frozen=True)
class Example:
    """One explained item: ``log p(target) - log p(foil)`` after (or at the mask of) ``text``."""

    id: str  #: unique within the data; the key a rerun resumes by
    text: str  #: may hold MASK at the predicted word
    target: str
    foil: str
    positions: dict = field(default_factory=dict)  #: name -> word indices of interest
    extra: dict = field(default_factory=dict)  #: more columns, copied to the results
    source: str = ""  #: "file:line" (or "name[row]")


def read_examples(data, format: str = "auto", columns: dict | None = None,
                  split: str | None = None) -> tuple[list[Example], list[Malformed]]:  # fmt: skip
    """Every example of ``data`` and every malformed row (ids checked unique)."""
    if format not in FORMATS:
        raise InputError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    cols = dict(COLUMNS)
    for key, name in (columns or {}).items():
        if key not in COLUMNS and key != "extra":
            raise InputError(
                f"columns: unknown field {key!r}; name the column of one of "
                f"{', '.join(COLUMNS)} (or 'extra': comma-separated columns to copy)"
            )
        cols[key] = name
    extra = [c for c in str(cols.pop("extra", "")).split(",") if c]
    fmt = _guess(data, split) if format == "auto" else format
    rows = {
        "jsonl": lambda: _jsonl(data, cols, extra),
        "csv": lambda: _table(data, ",", cols, extra),
        "tsv": lambda: _table(data, "\t", cols, extra),
        "blimp": lambda: _agreement(data, read_blimp),
        "linzen": lambda: _agreement(data, read_linzen),
        "datasets": lambda: _datasets(data, split, cols, extra),
    }[fmt]()
    return split_rows(rows)


def split_rows(rows) -> tuple[list[Example], list[Malformed]]:
    """Examples and malformed rows apart; an id seen before is a malformed row."""
    examples, bad, seen = [], [], {}
    for row in rows:
        if isinstance(row, Malformed):
            bad.append(row)
        elif row.id in seen:
            bad.append(Malformed(row.source, f"id {row.id!r} again (first at {seen[row.id]})"))
        else:
            seen[row.id] = row.source
            examples.append(row)
    return examples, bad


def _guess(data, split) -> str:
    p = Path(str(data))
    if p.is_dir():
        return "datasets"
    if not p.exists():
        if str(data).startswith(("/", "./", "../", "~")) or p.suffix:
            raise InputError(f"data file {str(data)!r} does not exist")
        return "datasets"  # a data set name
    suffix = p.suffix.lower()
    if suffix in (".csv",):
        return "csv"
    if suffix in (".jsonl", ".json"):
        first = next((line for _, line in _lines(p) if not isinstance(line, Malformed)), "")
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            return "jsonl"
        return "blimp" if isinstance(row, dict) and "sentence_good" in row else "jsonl"
    if suffix in (".tsv", ".txt"):
        first = next((line for _, line in _lines(p) if not isinstance(line, Malformed)), "")
        cells = first.split("\t")
        return "linzen" if len(cells) == 5 and MASK in cells[2] else "tsv"
    raise InputError(
        f"cannot tell the format of {str(data)!r} from its extension {suffix!r}: pass "
        f"format= (--format) one of {', '.join(FORMATS[1:])}"
    )


# -- lines ------------------------------------------------------------------------------


def _lines(path) -> Iterator[tuple[str, str | Malformed]]:
    """("path:line", text or Malformed) for each non-blank line."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"data file {str(path)!r} does not exist or is not a file")
    with p.open("rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{p}:{number}"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield where, Malformed(where, f"not UTF-8 (byte {raw[e.start]:#04x})")
                continue
            if "\x00" in line:
                yield where, Malformed(where, "holds a NUL byte")
            elif line.strip():
                yield where, line


def _objects(path) -> Iterator[tuple[str, dict | Malformed]]:
    for where, line in _lines(path):
        if isinstance(line, Malformed):
            yield where, line
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield where, Malformed(where, f"not valid JSON ({e.msg}, column {e.colno})")
            continue
        except RecursionError:
            yield where, Malformed(where, "JSON nested too deeply")
            continue
        if not isinstance(row, dict):
            yield where, Malformed(where, f"expected a JSON object, found {type(row).__name__}")
        else:
            yield where, row


def _jsonl(path, cols, extra) -> Iterator[Example | Malformed]:
    for where, row in _objects(path):  # the default id: the line number
        line = int(where.rsplit(":", 1)[1])
        yield row if isinstance(row, Malformed) else _example(row, where, line, cols, extra)


def _table(path, sep, cols, extra) -> Iterator[Example | Malformed]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"data file {str(path)!r} does not exist or is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{p}: not UTF-8 text (at byte {e.start}); save it as UTF-8") from None
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as e:
        raise InputError(f"{p}:1: the header row cannot be read ({e})") from None
    need = [cols[k] for k in ("text", "target", "foil")]
    missing = [c for c in need + extra if c not in header]
    if missing:
        raise InputError(
            f"{p}:1: the header has no column {', '.join(map(repr, missing))} (it has "
            f"{', '.join(map(repr, header))}); name the columns with columns= (--column "
            "text=NAME target=NAME foil=NAME)"
        )
    while True:
        line = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            yield Malformed(f"{p}:{line}", f"cannot be parsed ({e})")
            continue
        if not any(c.strip() for c in cells):
            continue
        where = f"{p}:{line}"
        if len(cells) != len(header):
            yield Malformed(where, f"{len(cells)} columns, the header has {len(header)}")
            continue
        yield _example(dict(zip(header, cells)), where, line, cols, extra)


def _example(row: dict, where: str, number: int, cols, extra) -> Example | Malformed:
    values = {}
    for key in ("text", "target", "foil"):
        v = row.get(cols[key])
        if not isinstance(v, str) or not v.strip():
            return Malformed(where, f"column {cols[key]!r} ({key}) is missing or not a text")
        values[key] = v.strip()
    for key in ("target", "foil"):
        if len(values[key].split()) != 1:
            return Malformed(where, f"{key} {values[key]!r} must be one word")
    ident = row.get(cols["id"], number)
    if ident is None or isinstance(ident, dict | list) or str(ident).strip() == "":
        return Malformed(where, f"column {cols['id']!r} (id) is empty or not a value")
    words = values["text"].split()
    positions = row.get(cols["positions"])
    try:
        positions = _positions(positions, len(words))
    except ValueError as e:
        return Malformed(where, f"column {cols['positions']!r} (positions): {e}")
    missing = [c for c in extra if c not in row]
    if missing:
        return Malformed(where, f"no column {', '.join(map(repr, missing))} (asked for as extra)")
    more = {c: row[c] for c in extra}
    return Example(str(ident).strip(), values["text"], values["target"], values["foil"],
                   positions, more, where)  # fmt: skip


def _positions(value, n_words: int) -> dict:
    """``{name: (word indices)}`` from a list, a dict of lists, or a text "1 4" / "1,4"."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip()[:1] in "[{" else [
                int(t) for t in value.replace(",", " ").split()]  # fmt: skip
        except ValueError:
            raise ValueError(f"{value!r} is not word indices (e.g. '1 4' or [1, 4])") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, list):
        value = {"interest": value}
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is not word indices")
    out = {}
    for name, idx in value.items():
        idx = [idx] if isinstance(idx, int) and not isinstance(idx, bool) else idx
        if not isinstance(idx, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_words for i in idx
        ):
            raise ValueError(f"{name}: {idx!r} must be word indices in 0..{n_words - 1}")
        out[str(name)] = tuple(idx)
    return out


# -- BLiMP and Linzen/Goldberg: the agreement readers ---------------------------------


def _agreement(path, read) -> Iterator[Example | Malformed]:
    """The examples of :func:`~semiring_backprop.data.read_blimp` or ``read_linzen``
    (which skip malformed lines and list them), as runner examples (:func:`from_agreement`)."""
    data = read(path)
    rows = [*data, *data.skipped]
    rows.sort(key=lambda r: int(r.source.rsplit(":", 1)[1]))
    for row in rows:
        if isinstance(row, Malformed):
            yield row
            continue
        yield from_agreement(row)


def from_agreement(ex) -> Example:
    """A runner example of an :class:`~semiring_backprop.data.AgreementExample`: the text
    has MASK at the verb, the subject and attractors (where known) are positions of
    interest, the number of attractors an extra column; the id is the line number."""
    positions = {}
    if ex.subject is not None:
        positions["subject"] = (ex.subject,)
    if ex.attractor_positions is not None:
        positions["attractors"] = tuple(ex.attractor_positions)
    extra = {} if ex.attractors is None else {"attractors": ex.attractors}
    line = ex.source.rsplit(":", 1)[-1]
    return Example(line, " ".join(ex.words), ex.good, ex.bad, positions, extra, ex.source)


# -- Hugging Face datasets -------------------------------------------------------------


def _datasets(name, split, cols, extra) -> Iterator[Example | Malformed]:
    ds = load_dataset(name, split)
    for i, row in enumerate(ds):
        yield _example(row, f"{name}[{i}]", i, cols, extra)


def load_dataset(name, split: str | None = None):
    """A ``datasets.Dataset``: ``load_from_disk`` for a directory, else ``load_dataset``
    by name (the hub or its cache); a ``DatasetDict`` needs ``split``."""
    try:
        import datasets
    except ImportError:
        raise InputError(
            'reading a Hugging Face data set needs datasets: pip install "semiring-backprop[data]"'
        ) from None
    name = str(name)
    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001  (connection, not found, offline: many types)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise LoadError(
            f"could not load the data set {name!r}: {first}\n{name!r} is not a directory "
            "written by Dataset.save_to_disk, and it could not be loaded by name (no such "
            "data set, or the hub cannot be reached from here and it is not cached). On a "
            "machine with internet: datasets.load_dataset(NAME).save_to_disk(DIR), then "
            "pass DIR"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise InputError(
                f"the data set {name!r} has splits {', '.join(ds)}; choose one with "
                "split= (--split)"
            )
        ds = ds[split]
    return ds


def iter_examples(examples: Iterable) -> Iterator[Example | Malformed]:
    """Examples given in Python (``Example`` objects or dicts with the default columns)."""
    for i, ex in enumerate(examples):
        if isinstance(ex, Example | Malformed):
            yield ex
        elif isinstance(ex, dict):
            yield _example(ex, f"examples[{i}]", i, COLUMNS, [k for k in ex if k not in COLUMNS])
        else:
            yield Malformed(f"examples[{i}]", f"expected an Example or a dict, got {ex!r}")
