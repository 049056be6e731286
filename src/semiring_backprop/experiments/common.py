"""Shared pieces of the paper's experiments: models, training, results written as they come.

Every experiment writes into its own directory. A trained model is saved there with its
training history and reloaded on a rerun; per-example results go to JSON lines, one line
as soon as it is computed, and a rerun skips the lines already written.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch

from .._threads import TRAIN, threads
from ..errors import InputError


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
):
    """A BERT-style sequence classifier (Hugging Face ``BertForSequenceClassification``):
    embeddings, ``layers`` encoder layers, and the readout from position 0 through the
    pooler. No dropout: the synthetic tasks are noiseless."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=intermediate, num_labels=num_labels,
        max_position_embeddings=max(length, 8), type_vocab_size=1, pad_token_id=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
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
    directory) if an earlier run saved it there; saves after training."""
    path = Path(path)
    weights, hist = path / "model.pt", path / "history.json"
    if weights.exists() and hist.exists():
        model.load_state_dict(torch.load(weights, weights_only=True))
        return model.eval(), json.loads(hist.read_text())
    history = fit(model)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), weights)
    write_json(hist, history)
    return model.eval(), history


class Records:
    """Rows written as JSON lines the moment they are added; a rerun reads them back.

    >>> rec = Records(out / "values.jsonl")
    >>> if not rec.has(key): rec.add({"key": key, ...})
    """

    def __init__(self, path: Path, key: str = "key"):
        self.path, self.key = Path(path), key
        self.rows: list[dict] = []
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        for i, line in enumerate(lines, 1):
            try:
                self.rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines):
                    raise InputError(
                        f"{self.path}:{i} is not valid JSON; delete the file to start over"
                    ) from None
                # the last line was cut off by an interrupted run: drop it
        self._done = {r.get(key) for r in self.rows}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if len(self.rows) != len(lines):
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))

    def has(self, key) -> bool:
        return key in self._done

    def add(self, row: dict):
        with self.path.open("a") as f:
            f.write(json.dumps(_plain(row)) + "\n")
        self.rows.append(row)
        self._done.add(row.get(self.key))

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows)


def same_settings(out: Path, config, free=()) -> None:
    """Write ``config.json`` into ``out``; if an earlier run left one there whose settings
    differ (other than the ``free`` fields, which only choose what to compute or
    report), its records would be stale: raise instead of mixing them."""
    path = out / "config.json"
    now = json.loads(json.dumps(asdict(config)))  # tuples as JSON lists
    if path.exists():
        before = json.loads(path.read_text())
        changed = sorted(k for k in now if k not in free and before.get(k, now[k]) != now[k])
        if changed:
            raise InputError(
                f"{out} holds results of a run with other settings ({', '.join(changed)}); "
                "write into a new output directory, or delete this one to start over"
            )
    write_json(path, now)


def spearman(x, y) -> dict:
    """Spearman's ρ, its p-value and n; ρ is None when either side is constant or n < 3
    (scipy would warn and return NaN)."""
    from scipy.stats import spearmanr

    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return {"spearman_rho": None, "p": None, "n": len(x)}
    r = spearmanr(x, y)
    return {"spearman_rho": float(r.statistic), "p": float(r.pvalue), "n": len(x)}


def write_json(path: Path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(obj), indent=2) + "\n")
    return path


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
