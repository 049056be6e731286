"""Shared pieces of the paper's experiments: models, training, results written as they come.

Every experiment writes into its own directory. A trained model is saved there with its
training history and reloaded on a rerun; per-example results go to JSON lines, one line
as soon as it is computed, and a rerun skips the lines already written. Whole files
(models, histories, configs, tables) are written under a temporary name and renamed, so
a file that exists is complete (:func:`atomic_write`: the temporary file is made anew in a
private directory, never through a planted link); one run at a time holds a directory
(:func:`lock`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import torch

from .._files import atomic_write
from .._threads import TRAIN, threads
from ..errors import InputError

log = logging.getLogger(__name__)

#: files of an output directory that hold no results: the settings, the lock, and data
#: a run makes again from its settings before computing anything
NOT_RESULTS = frozenset({"config.json", ".lock", "synthetic.jsonl"})


def bert_classifier(
    vocab_size: int,
    num_labels: int,
    *,
    hidden: int,
    heads: int,
    intermediate: int,
    layers: int,
    length: int,
    seed: int = 0,
    max_positions: int | None = None,
    type_vocab_size: int = 1,
    dropout: float = 0.0,
):
    """A BERT-style sequence classifier (Hugging Face ``BertForSequenceClassification``):
    embeddings, ``layers`` encoder layers, and the readout from position 0 through the
    pooler. By default no dropout (the synthetic tasks are noiseless), position
    embeddings for ``max(length, 8)`` positions and one token type; ``max_positions``,
    ``type_vocab_size`` and ``dropout`` (hidden and attention) set them otherwise (the
    paper's §5.1 model: 512, 2 and 0.2)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=intermediate, num_labels=num_labels,
        max_position_embeddings=max_positions or max(length, 8),
        type_vocab_size=type_vocab_size, pad_token_id=0,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def logits(model, x: torch.Tensor) -> torch.Tensor:
    """Class scores for a batch of token ids (a Hugging Face classifier) or features."""
    out = model(input_ids=x) if x.dtype == torch.long else model(x)
    return out.logits if hasattr(out, "logits") else out


class GoldLogit(torch.nn.Module):
    """The gold-class logit of each example of a batch (a per-example scalar to explain:
    ``Backprop(GoldLogit(model), output=lambda y: y, per_example=True)``); the gold
    class is a tensor input, so one trace serves every batch."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, gold):
        return logits(self.model, x).gather(-1, gold[:, None])[:, 0]


@torch.no_grad()
def accuracy(model, split, batch_size: int = 1024) -> float:
    was = model.training
    model.eval()
    right = 0
    for i in range(0, len(split), batch_size):
        x, y = split.x[i : i + batch_size], split.y[i : i + batch_size]
        right += int((logits(model, x).argmax(-1) == y).sum())
    model.train(was)
    return right / max(len(split), 1)


@threads(TRAIN)
def train(
    model,
    train_split,
    val_split=None,
    *,
    epochs: int,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int = 0,
    stop_at: float | None = None,
    desc: str = "train",
    progress: bool = True,
) -> list[dict]:
    """Adam on cross-entropy. Returns the history, one dict per epoch (loss and, with a
    validation split, accuracy); stops early once validation accuracy reaches
    ``stop_at``. Leaves the model in eval mode.

    Trains on one thread whatever the caller's setting (``SEMIRING_BACKPROP_THREADS``
    included): another count splits sums otherwise, and one seed would train other
    weights on another machine."""
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    history = []
    bar = tqdm(range(epochs), desc=desc, disable=not progress, leave=False)
    for epoch in bar:
        model.train()
        total, n = 0.0, 0
        for x, y in train_split.loader(batch_size, shuffle=True, seed=seed + epoch):
            loss = torch.nn.functional.cross_entropy(logits(model, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(y), n + len(y)
        row = {"epoch": epoch + 1, "loss": total / max(n, 1)}
        if val_split is not None:
            row["val_accuracy"] = accuracy(model, val_split)
        history.append(row)
        bar.set_postfix({k: round(v, 4) for k, v in row.items() if k != "epoch"})
        if stop_at is not None and row.get("val_accuracy", 0.0) >= stop_at:
            break
    bar.close()
    model.eval()
    return history


def trained(model, path: Path, fit) -> tuple[torch.nn.Module, list[dict]]:
    """``model`` trained by ``fit(model) -> history``, or loaded from ``path`` (a
    directory) if an earlier run saved it there; saves after training. A saved model or
    history that cannot be read (cut off by an earlier version's interrupted write) is
    trained again."""
    path = Path(path)
    weights, hist = path / "model.pt", path / "history.json"
    if weights.exists() and hist.exists():
        try:
            state = torch.load(weights, weights_only=True)
            history = json.loads(hist.read_text())
            model.load_state_dict(state)
            return model.eval(), history
        except Exception as e:  # noqa: BLE001  (EOFError, pickle and zip errors, JSON)
            log.warning("%s cannot be read (%s: %s); training again", path, type(e).__name__, e)
    history = fit(model)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(weights, lambda tmp: torch.save(model.state_dict(), tmp))
    write_json(hist, history)
    return model.eval(), history


def write_csv(frame, path: Path) -> Path:
    return atomic_write(path, lambda tmp: frame.to_csv(tmp, index=False))


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

    def __init__(self, path: Path, key: str = "key"):
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
            f.write(json.dumps(_plain(row)) + "\n")
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


def spearman(x, y) -> dict:
    """Spearman's ρ, its p-value and n; ρ is None when either side is constant or n < 3
    (scipy would warn and return NaN)."""
    from scipy.stats import spearmanr

    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return {"spearman_rho": None, "p": None, "n": len(x)}
    r = spearmanr(x, y)
    return {"spearman_rho": float(r.statistic), "p": float(r.pvalue), "n": len(x)}


def write_json(path: Path, obj) -> Path:
    text = json.dumps(_plain(obj), indent=2) + "\n"
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def _plain(x):
    """JSON-safe: tensors and numpy scalars to Python numbers, non-finite floats to None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _plain(x.tolist())
    if hasattr(x, "item") and not isinstance(x, str):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
