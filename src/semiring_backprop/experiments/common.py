"""Shared pieces of the paper's experiments: models, training, statistics.

Every experiment writes into its own directory. A trained model is saved there with its
training history and reloaded on a rerun; per-example results and settings are written
through :mod:`semiring_backprop.runner.records` (as they come, resumable, one run at a
time per directory), and whole files through
:func:`~semiring_backprop._files.atomic_write`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .._files import atomic_write
from .._threads import TRAIN, threads
from ..runner.records import write_json

log = logging.getLogger(__name__)


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


def spearman(x, y) -> dict:
    """Spearman's ρ, its p-value and n; ρ is None when either side is constant or n < 3
    (scipy would warn and return NaN)."""
    from scipy.stats import spearmanr

    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return {"spearman_rho": None, "p": None, "n": len(x)}
    r = spearmanr(x, y)
    return {"spearman_rho": float(r.statistic), "p": float(r.pvalue), "n": len(x)}
