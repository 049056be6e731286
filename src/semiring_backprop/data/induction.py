"""The induction task: predict the next token of a repeated run of random tokens.

Signatures::

    def induction(n=None, half=8, vocab_size=20, seed=0, *, sizes=None, min_half=None)
        -> InductionData                  # .train / .val / .test: Split(x, y), x and y (n, length)
    def pairs(n, half=8, vocab_size=20, seed=0, *, position=None, corrupt="permute")
        -> Pairs                          # clean / corrupted (n, length), position, answer, foil
    class LogitDiff(nn.Module)            # forward(input_ids, position, answer, foil) -> (batch,)

A sequence is ``BOS`` (token 0), filler, a run ``r`` of ``ell`` tokens and ``r`` again,
``length = 2 * half + 1`` tokens in all: ``2 * (half - ell)`` filler tokens first, ``ell``
uniform in ``min_half..half`` (default ``max(2, half // 2)``), every token other than
``BOS`` distinct within a sequence (drawn from ``1..vocab_size-1`` without
replacement), so that each token of the repeat has one earlier occurrence and the token
after it is the answer. ``y[i]`` is the token at ``i + 1`` where that is predictable (the
repeat's tokens after its first) and ``IGNORE`` (-100) elsewhere: the loss counts the
second copy only. The run's length varies so that no fixed offset finds the earlier
occurrence: with ``ell`` fixed, one head attending ``half - 1`` positions back solves the
task in one layer, which is not the induction circuit (a previous-token head in one layer,
an induction head reading its output through its keys in the next).

Examples:
    >>> data = induction(1000, half=4, vocab_size=12, seed=0)
    >>> data.train.x.shape, data.length
    (torch.Size([700, 9]), 9)
    >>> x, y = data.train.x[0], data.train.y[0]
    >>> bool((y[y != IGNORE] == x[1:][y[:-1] != IGNORE]).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..errors import InputError
from .synthetic import Split

BOS = 0
#: the ignored target (``torch.nn.functional.cross_entropy``'s ``ignore_index``)
IGNORE = -100
CORRUPTIONS = ("permute", "second_half")


@dataclass(frozen=True, eq=False)
class InductionData:
    """Three splits of the induction task; ``y`` holds the next token or ``IGNORE``."""

    name: str
    train: Split
    val: Split
    test: Split
    vocab_size: int
    length: int
    half: int
    seed: int


def induction(n: int | None = None, half: int = 8, vocab_size: int = 20, seed: int = 0, *,
              sizes: tuple[int, int, int] | None = None,
              min_half: int | None = None) -> InductionData:  # fmt: skip
    """``n`` sequences (default 10000) cut 70/10/20, or exactly ``sizes``; the same seed
    gives the same tensors."""
    lo = max(2, half // 2) if min_half is None else min_half
    _check(half, vocab_size, lo)
    counts = _sizes(n, sizes)
    rng = np.random.default_rng(seed)
    total = sum(counts)
    ells = rng.integers(lo, half + 1, size=total)
    x = np.zeros((total, 2 * half + 1), dtype=np.int64)
    y = np.full_like(x, IGNORE)
    for i, ell in enumerate(ells):
        x[i], y[i] = _sequence(rng, half, vocab_size, int(ell))
    splits, start = [], 0
    for c in counts:
        splits.append(Split(torch.from_numpy(x[start : start + c]),
                            torch.from_numpy(y[start : start + c])))  # fmt: skip
        start += c
    name = f"Induction(half={half}, min_half={lo})"
    return InductionData(name, *splits, vocab_size, 2 * half + 1, half, seed)


def _sequence(rng, half, vocab_size, ell):
    fill = 2 * (half - ell)
    toks = rng.choice(np.arange(1, vocab_size), size=fill + ell, replace=False)
    run = toks[fill:]
    x = np.concatenate([[BOS], toks[:fill], run, run])
    y = np.full_like(x, IGNORE)
    second = 1 + fill + ell  # the repeat's first position
    y[second:-1] = x[second + 1 :]
    return x, y


@dataclass(frozen=True, eq=False)
class Pairs:
    """Clean and corrupted sequences, row for row, and what is explained at each: the
    logit of ``answer`` minus that of ``foil`` at ``position``."""

    clean: torch.Tensor  #: (n, length) token ids
    corrupted: torch.Tensor  #: (n, length)
    position: torch.Tensor  #: (n,) where the next token is predicted
    answer: torch.Tensor  #: (n,) the clean run's next token there
    foil: torch.Tensor  #: (n,) the corrupted run's next token there
    corrupt: str

    def __len__(self) -> int:
        return len(self.clean)

    def kwargs(self, i: int, corrupted: bool = False) -> dict:
        """The inputs of :class:`LogitDiff` for pair ``i`` (a batch of one)."""
        ids = self.corrupted if corrupted else self.clean
        return {"input_ids": ids[i : i + 1], "position": self.position[i : i + 1],
                "answer": self.answer[i : i + 1], "foil": self.foil[i : i + 1]}  # fmt: skip


def pairs(n: int, half: int = 8, vocab_size: int = 20, seed: int = 0, *,
          position: int | None = None, corrupt: str = "permute") -> Pairs:  # fmt: skip
    """``n`` clean / corrupted pairs. A clean sequence is ``BOS``, a run ``r`` of ``half``
    distinct tokens and ``r`` again (the training data's sequence with no filler);
    ``position`` (default ``2 * half - 1``, the last that has a next token) is in the
    repeat, where the token ``r[j]`` stands and ``r[j + 1]`` (``answer``) comes next.

    ``corrupt`` says what the corrupted sequence is:

    - ``"permute"`` (default): the same tokens in another order, ``BOS r' r'`` with
      ``r'`` a permutation of ``r`` that puts another token at ``j`` and at ``j + 1``;
      ``foil = r'[j + 1]``. Every position differs, the first copy included, so each
      part of the induction circuit is seeded (x - x'): the previous-token head's
      reading of the first copy, which the induction head's keys read, as well as the
      query at ``position``. The context holds the same tokens, so what a head that
      copies every token of the context adds cancels in the logit difference.
    - ``"second_half"``: the first copy kept, the repeat up to ``position`` replaced by
      ``r'[:j + 1]`` (after it, kept); ``foil`` is the token after ``r'[j]`` in the first
      copy, the corrupted run's induction answer. Only the query side differs: the
      first copy, and with it every path through the previous-token head's output
      there, is the same in both: patched from this corruption, the K-composition
      edge at the key the induction head looks for changes nothing, so exact patching
      cannot find it (the faithfulness experiment uses ``"permute"``).
    """
    if corrupt not in CORRUPTIONS:
        raise InputError(f"pairs: corrupt must be one of {CORRUPTIONS}, got {corrupt!r}")
    _check(half, vocab_size, half)
    if half < 3:
        raise InputError(
            f"pairs: half must be >= 3 (a token and two others to permute), got {half}"
        )
    p = 2 * half - 1 if position is None else int(position)
    if not half + 1 <= p <= 2 * half - 1:
        raise InputError(
            f"pairs: position must be in the repeat and have a next token: "
            f"{half + 1}..{2 * half - 1} for half={half}, got {position}"
        )
    j = p - half - 1
    rng = np.random.default_rng(seed)
    clean, bad, foil = [], [], []
    for _ in range(n):
        run = rng.choice(np.arange(1, vocab_size), size=half, replace=False)
        while True:  # rejection: few permutations fail
            perm = run[rng.permutation(half)]
            if perm[j] != run[j] and perm[j + 1] != run[j + 1] and perm[j] != run[-1]:
                break
        clean.append(np.concatenate([[BOS], run, run]))
        if corrupt == "permute":
            bad.append(np.concatenate([[BOS], perm, perm]))
            foil.append(perm[j + 1])
        else:
            bad.append(np.concatenate([[BOS], run, perm[: j + 1], run[j + 1 :]]))
            foil.append(run[int(np.flatnonzero(run == perm[j])[0]) + 1])
    clean_t = torch.from_numpy(np.stack(clean))
    return Pairs(clean_t, torch.from_numpy(np.stack(bad)), torch.full((n,), p),
                 clean_t[:, p + 1].clone(), torch.as_tensor(np.array(foil), dtype=torch.long),
                 corrupt)  # fmt: skip


class LogitDiff(nn.Module):
    """``logits[position, answer] - logits[position, foil]`` of each row of a batch of a
    language model's logits (``model(input_ids)``, shaped (batch, positions, vocab)):
    the scalar explained. Position and tokens are tensor inputs, so one trace serves
    every pair.

    Examples:
        >>> m = LogitDiff(model)
        >>> c = sbp.circuit(m, kwargs=p.kwargs(0), output=lambda y: y[0],
        ...     baseline={"model.embed_tokens": model.embed_tokens(p.corrupted[:1])})
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position, answer, foil):
        logits = self.model(input_ids)
        b, _, v = logits.shape
        at = logits.gather(1, position.reshape(b, 1, 1).expand(b, 1, v))[:, 0]
        return at.gather(1, answer.reshape(b, 1))[:, 0] - at.gather(1, foil.reshape(b, 1))[:, 0]


def _check(half, vocab_size, lo):
    if not isinstance(half, int) or half < 2:
        raise InputError(f"induction: half must be an integer >= 2, got {half!r}")
    if not isinstance(lo, int) or not 2 <= lo <= half:
        raise InputError(f"induction: min_half must be an integer in 2..half={half}, got {lo!r}")
    need = 2 * half - lo + 1  # BOS and the distinct tokens of the longest filler + run
    if vocab_size < need:
        raise InputError(
            f"induction: vocab_size={vocab_size} is too small for half={half}, min_half={lo}: "
            f"a sequence holds up to {need - 1} distinct tokens besides BOS; use "
            f"vocab_size >= {need} or a larger min_half"
        )


def _sizes(n, sizes):
    if sizes is not None:
        if n is not None:
            raise InputError("induction: give n or sizes, not both")
        if len(sizes) != 3 or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise InputError(f"induction: sizes must be three positive integers, got {sizes!r}")
        return tuple(sizes)
    n = 10000 if n is None else n
    if not isinstance(n, int) or n < 10:
        raise InputError(f"induction: n must be an integer >= 10, got {n!r}")
    train, val = int(n * 0.7), int(n * 0.1)
    return train, val, n - train - val
