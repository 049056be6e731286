"""The faithfulness experiment's benchmarks (:mod:`.faithfulness`): each a small model
trained here, its clean / corrupted pairs, the scalar it explains and the inputs mean
ablation averages over.

- ``first-token`` and ``first-token-paper``: the §5.1 classifier of
  FirstTokenRepeatedOnce (:mod:`.first_token`), trained as the demo and as the paper
  did; a pair is a positive validation sequence and the same sequence with its repeat
  replaced by a token absent from it.
- ``induction``: a two-layer attention-only transformer (:mod:`.models`) on repeated
  runs of random tokens; a pair is a clean run and its corruption, and
  :func:`induction_heads` names its previous-token and induction heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError

__all__ = ["Bench", "bench", "first_token_bench", "induction_bench", "induction_heads"]


@dataclass
class Bench:
    """One trained model and its pairs: ``model`` (float64, eval), ``pairs`` (a list of
    (clean kwargs, corrupted kwargs)), ``output`` (the explained scalar of the model's
    output), ``place`` (the token embedding, where the baseline goes), ``embed`` (ids to
    embeddings), ``reference`` (inputs averaged for mean ablation), ``trained`` (the
    last history row)."""

    name: str
    seed: int
    model: object
    pairs: list
    output: object
    place: str
    embed: object
    reference: list
    trained: dict
    heads: dict | None = None  #: induction: :func:`induction_heads` over the clean inputs


def _logit_difference(out):
    return out.logits[0, 1] - out.logits[0, 0]


def _first_element(y):
    return y[0]


def first_token_bench(config, seed: int, where: Path, paper: bool, progress=True):
    from ..data import make_task
    from . import first_token as ft
    from .common import train, trained

    setting = ft.Config(paper_training=paper)
    how = ft.training(setting)
    epochs = config.ft_epochs or how["epochs"]
    task = make_task("FirstTokenRepeatedOnce", config.ft_n, length=setting.length,
                     vocab_size=setting.vocab_size, seed=config.seed)  # fmt: skip
    net, history = trained(ft.model(setting, seed), where / "model", lambda m: train(
        m, task.train, task.val, epochs=epochs, lr=how["lr"], batch_size=how["batch_size"],
        seed=seed, stop_at=1.0 if how["stop_early"] else None, progress=progress,
        desc=f"train ({'paper' if paper else 'demo'}, seed {seed})"))  # fmt: skip
    net = net.double().eval()
    x, y = task.val.x, task.val.y
    positives = x[y == 1]
    if len(positives) < config.pairs:
        raise InputError(f"faithfulness: {config.pairs} pairs asked, but the validation split "
                         f"holds {len(positives)} positives; raise ft_n")  # fmt: skip
    pairs = []
    for i in range(config.pairs):
        clean = positives[i : i + 1]
        ids = clean[0].tolist()
        at = next(t for t in range(1, len(ids)) if ids[t] == ids[0])
        absent = [t for t in range(1, setting.vocab_size) if t not in ids]
        g = torch.Generator().manual_seed(config.seed * 100_003 + i)
        bad = clean.clone()
        bad[0, at] = absent[int(torch.randint(len(absent), (1,), generator=g))]
        pairs.append(({"input_ids": clean}, {"input_ids": bad}))
    reference = [{"input_ids": x[i : i + 1]} for i in range(min(config.reference, len(x)))]
    emb = net.bert.embeddings.word_embeddings
    return Bench("first-token-paper" if paper else "first-token", seed, net, pairs,
                 _logit_difference, "bert.embeddings.word_embeddings", emb, reference,
                 history[-1])  # fmt: skip


def induction_bench(config, seed: int, where: Path, progress=True):
    from ..data.induction import LogitDiff, induction, pairs
    from .common import trained
    from .models import attention_only, train_induction

    data = induction(config.ind_n, half=config.ind_half, vocab_size=config.ind_vocab,
                     seed=config.seed)  # fmt: skip
    model = attention_only(config.ind_vocab, hidden=config.ind_hidden, heads=config.ind_heads,
                           layers=2, length=data.length, seed=seed)  # fmt: skip
    model, history = trained(model, where / "model", lambda m: train_induction(
        m, data, steps=config.ind_steps, seed=seed, progress=progress)[1])  # fmt: skip
    model = model.double().eval()
    p = pairs(config.pairs, half=config.ind_half, vocab_size=config.ind_vocab, seed=config.seed,
              corrupt=config.ind_corrupt)  # fmt: skip
    both = [(p.kwargs(i), p.kwargs(i, corrupted=True)) for i in range(config.pairs)]
    reference = [p.kwargs(i, corrupted=True) for i in range(config.pairs)]
    return Bench("induction", seed, LogitDiff(model).eval(), both, _first_element,
                 "model.embed_tokens", model.embed_tokens, reference, history[-1],
                 induction_heads(model, p.clean))  # fmt: skip


def bench(name: str, config, seed: int, where: Path, progress=True) -> Bench:
    """The benchmark ``name`` with ``config`` (:class:`.faithfulness.Config`) for model
    ``seed``, trained under ``where`` (or reloaded from there)."""
    if name == "induction":
        return induction_bench(config, seed, where, progress)
    return first_token_bench(config, seed, where, name == "first-token-paper", progress)


def induction_heads(model, ids) -> dict:
    """The model's previous-token head (layer 0, most attention from each position to
    the one before) and induction head (layer 1, most attention from each position of
    the repeat to the token after that token's first occurrence), by its own attention
    averaged over the clean inputs ``ids`` (one model, one answer for all its pairs);
    every head's score is kept, to show whether one head holds each role."""
    a0, a1 = model.patterns(ids)
    t, half = ids.shape[1], (ids.shape[1] - 1) // 2
    prev = torch.stack([a0[:, :, i, i - 1] for i in range(1, t)], -1).mean((0, -1))
    ind = torch.stack([a1[:, :, i, i - half + 1] for i in range(half + 1, t)], -1).mean((0, -1))
    return {"previous_head": int(prev.argmax()), "induction_head": int(ind.argmax()),
            "previous_scores": [round(float(v), 4) for v in prev],
            "induction_scores": [round(float(v), 4) for v in ind]}  # fmt: skip
