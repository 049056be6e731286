"""The synthetic tasks of the paper's Appendix C, seeded and reproducible.

>>> data = make_task("BinCountOnes", 1000, length=12, vocab_size=20, k=4, seed=0)
>>> data.name, len(data.train), len(data.val), len(data.test)
('BinCountOnes(k=4)', 700, 100, 200)
>>> xb, yb = next(iter(data.train.loader(32, shuffle=True)))
>>> tuple(xb.shape), tuple(yb.shape)
((32, 12), (32,))

Token 0 is padding and never generated; tokens come from 1..V-1. A binary task has
half positives (label 1) and half negatives, BinCountOnes k equal classes. Each
generator in ``TASKS`` returns its points grouped by class; ``make_task`` shuffles them
and cuts train/val/test, 70/10/20 unless ``sizes`` are given. The same seed gives the
same tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ..errors import InputError


@dataclass(frozen=True, eq=False)
class Split:
    """One split of a task: inputs ``x`` and labels ``y``, row for row.

    Examples:
        >>> train = sbp.data.make_task("FirstTokenRepeatedOnce", 100).train
        >>> len(train), train.x.shape
        (70, torch.Size([70, 10]))
        >>> xb, yb = next(iter(train.loader(8, shuffle=True, seed=0)))
        >>> xb.shape, yb.shape
        (torch.Size([8, 10]), torch.Size([8]))
    """

    x: torch.Tensor  #: (n, L) int64 token ids, or (n, F) float32 features
    y: torch.Tensor  #: (n,) int64 labels

    def __len__(self) -> int:
        return len(self.y)

    def loader(self, batch_size: int, shuffle: bool = False, seed: int = 0) -> DataLoader:
        """Batches of ``(x, y)``; with ``shuffle``, the same ``seed`` gives the same order."""
        if not _is_int(batch_size) or batch_size < 1:
            raise InputError(f"loader: batch_size must be a positive integer, got {batch_size!r}")
        generator = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(
            TensorDataset(self.x, self.y),
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
        )


@dataclass(frozen=True, eq=False)
class TaskData:
    """A task's three splits and what made them.

    Examples:
        >>> task = sbp.data.make_task("BinCountOnes", 120, length=12, k=3, seed=0)
        >>> task.name, task.num_classes, (len(task.train), len(task.val), len(task.test))
        ('BinCountOnes(k=3)', 3, (84, 12, 24))
    """

    name: str  #: e.g. ``"BinCountOnes(k=4)"``
    train: Split
    val: Split
    test: Split
    num_classes: int
    vocab_size: int | None  #: None for the feature data set
    length: int | None  #: sequence length L; None for the feature data set
    seed: int


# ---------------------------------------------------------------------------------------
# Generators: (rng, n, length, vocab_size, **params) -> (x, y), grouped by class.


def first_token_repeated_once(rng, n, length, vocab_size):
    """Label 1 iff the first token occurs exactly once more.

    A positive repeats the first token at one uniformly chosen later position; a
    negative never repeats it. Every other token is uniform over 1..V-1 without the
    first token.
    """
    _check(length, vocab_size, min_length=2, min_vocab=3, task="FirstTokenRepeatedOnce")
    half = _per_class(n, 2)
    x = _uniform(rng, n, length, vocab_size)
    x[:, 1:] = _uniform_except(rng, x[:, 0], length - 1, vocab_size)
    rows = np.arange(half)
    x[rows, rng.integers(1, length, size=half)] = x[:half, 0]
    return x, _labels(half, 2)


def first_token_repeated_immediately(rng, n, length, vocab_size):
    """Label 1 iff the second token equals the first.

    A positive has the first token at position 1 and nowhere after; a negative has
    another token at position 1 and uniform tokens after it (which may repeat the first).
    """
    _check(length, vocab_size, min_length=2, min_vocab=3, task="FirstTokenRepeatedImmediately")
    half = _per_class(n, 2)
    x = _uniform(rng, n, length, vocab_size)
    first = x[:, 0]
    x[:half, 1] = first[:half]
    x[:half, 2:] = _uniform_except(rng, first[:half], length - 2, vocab_size)
    x[half:, 1] = _uniform_except(rng, first[half:], 1, vocab_size)[:, 0]
    return x, _labels(half, 2)


def first_token_repeated_last(rng, n, length, vocab_size):
    """Label 1 iff the last token equals the first.

    The last token is the first one (positive) or uniform over the others (negative);
    the tokens in between are uniform over 1..V-1.
    """
    _check(length, vocab_size, min_length=2, min_vocab=3, task="FirstTokenRepeatedLast")
    half = _per_class(n, 2)
    x = _uniform(rng, n, length, vocab_size)
    first = x[:, 0]
    x[:half, -1] = first[:half]
    x[half:, -1] = _uniform_except(rng, first[half:], 1, vocab_size)[:, 0]
    return x, _labels(half, 2)


def adjacent_duplicate(rng, n, length, vocab_size):
    """Label 1 iff some two adjacent tokens are equal.

    A positive copies the token at a uniformly chosen position i in 0..L-2 to i+1, the
    rest uniform (other duplicates allowed); a negative is uniform over the sequences
    with no adjacent duplicate (each token uniform over 1..V-1 without its predecessor).
    """
    _check(length, vocab_size, min_length=2, min_vocab=3, task="AdjacentDuplicate")
    half = _per_class(n, 2)
    x = _uniform(rng, n, length, vocab_size)
    where = rng.integers(0, length - 1, size=half)
    rows = np.arange(half)
    x[rows, where + 1] = x[rows, where]
    for j in range(1, length):
        x[half:, j] = _uniform_except(rng, x[half:, j - 1], 1, vocab_size)[:, 0]
    return x, _labels(half, 2)


def contains_1(rng, n, length, vocab_size):
    """Label 1 iff token 1 occurs.

    A positive has token 1 at a uniformly chosen position and uniform tokens over 1..V-1
    elsewhere; a negative draws every token from 2..V-1.
    """
    _check(length, vocab_size, min_length=1, min_vocab=3, task="Contains1")
    half = _per_class(n, 2)
    x = _uniform(rng, n, length, vocab_size)
    x[half:] = rng.integers(2, vocab_size, size=(n - half, length))
    x[np.arange(half), rng.integers(0, length, size=half)] = 1
    return x, _labels(half, 2)


def contains_token_set(rng, n, length, vocab_size, *, tokens=(1, 2, 3)):
    """Label 1 iff every token of ``tokens`` (S) occurs.

    A positive puts the tokens of S at distinct uniformly chosen positions and uniform
    tokens over 1..V-1 elsewhere; a negative is uniform over the sequences that miss at
    least one token of S (uniform sequences, rejected while they contain all of S).
    """
    task = "ContainsTokenSet"
    _check(length, vocab_size, min_length=1, min_vocab=2, task=task)
    s = _token_set(tokens, length, vocab_size)
    half = _per_class(n, 2)
    x = _uniform(rng, n, length, vocab_size)
    places = rng.random((half, length)).argsort(axis=1)[:, : len(s)]
    x[np.arange(half)[:, None], places] = s

    def lacks_one(cand):
        return ~np.all([(cand == t).any(axis=1) for t in s], axis=0)

    x[half:] = _rejection(lambda m: _uniform(rng, m, length, vocab_size), lacks_one, n - half, task)
    return x, _labels(half, 2)


def bin_count_ones(rng, n, length, vocab_size, *, k=2):
    """Label c in 0..k-1 iff the number of ones is in c·L/k+1 .. (c+1)·L/k.

    Classes are balanced; in class c the number of ones is uniform over that range, at
    uniformly chosen positions; the other tokens are uniform over 2..V-1.
    """
    task = "BinCountOnes"
    if not _is_int(k) or k < 2:
        raise InputError(f"{task}: k (the number of classes) must be an integer >= 2, got {k!r}")
    _check(length, vocab_size, min_length=k, min_vocab=3, task=task)
    if length % k:
        raise InputError(
            f"{task}: k={k} must divide the length L={length}; choose a length that is a "
            f"multiple of {k} (e.g. {length + k - length % k})"
        )
    width = length // k
    y = _labels(_per_class(n, k), k)
    ones = rng.integers(y * width + 1, (y + 1) * width + 1)
    x = rng.integers(2, vocab_size, size=(n, length))
    ranks = rng.random((n, length)).argsort(axis=1).argsort(axis=1)  # a random permutation
    x[ranks < ones[:, None]] = 1
    return x, y


TASKS: dict[str, Callable] = {
    "FirstTokenRepeatedOnce": first_token_repeated_once,
    "FirstTokenRepeatedImmediately": first_token_repeated_immediately,
    "FirstTokenRepeatedLast": first_token_repeated_last,
    "AdjacentDuplicate": adjacent_duplicate,
    "Contains1": contains_1,
    "ContainsTokenSet": contains_token_set,
    "BinCountOnes": bin_count_ones,
}


def make_task(
    name: str,
    n: int | None = None,
    *,
    sizes: tuple[int, int, int] | None = None,
    length: int = 10,
    vocab_size: int = 20,
    seed: int = 0,
    **params,
) -> TaskData:
    """Generate task ``name`` (a key of ``TASKS``): ``n`` points (default 1000) cut
    70/10/20, or exactly ``sizes=(train, val, test)``.

    ``params``: ``tokens`` for ContainsTokenSet (default ``(1, 2, 3)``), ``k`` for
    BinCountOnes (default 2).

    Examples:
        FirstTokenRepeatedOnce: label 1 where the first token occurs exactly once more.

        >>> task = sbp.data.make_task("FirstTokenRepeatedOnce", 100, length=10, vocab_size=20)
        >>> x, y = task.train.x, task.train.y
        >>> bool(((x[:, 1:] == x[:, :1]).sum(1) == 1).long().eq(y).all())
        True
        >>> sbp.data.make_task("ContainsTokenSet", sizes=(36, 4, 4), length=12, vocab_size=30,
        ...                    tokens=range(1, 6), seed=1).name
        'ContainsTokenSet(tokens={1, 2, 3, 4, 5})'
    """
    if name not in TASKS:
        raise InputError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    generator = TASKS[name]
    options = {  # the task's parameters and their defaults
        p.name: p.default
        for p in inspect.signature(generator).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    }
    unknown = sorted(set(params) - set(options))
    if unknown:
        takes = ", ".join(options) or "no parameters"
        raise InputError(f"{name} does not take {', '.join(unknown)}; it takes: {takes}")
    counts = _split_sizes(n, sizes)
    rng = _rng(seed)
    x, y = generator(rng, sum(counts), length, vocab_size, **params)
    label = _task_name(name, {**options, **params})
    classes = int(y.max()) + 1
    return _finish(label, x, y, counts, rng, classes, vocab_size, length, seed)


def first_feature(
    n: int | None = None,
    *,
    sizes: tuple[int, int, int] | None = None,
    seed: int = 0,
    features: int = 4,
) -> TaskData:
    """The MLP sanity check: x uniform on [0, 1]^features (float32), label 1 iff x[0] > 0.5.

    ``n`` points (default 1000) cut 70/10/20, or exactly ``sizes``; half positives (first
    feature uniform in (0.5, 1)), half negatives (uniform in [0, 0.5)), shuffled.

    Examples:
        >>> task = sbp.data.first_feature(100, seed=0)
        >>> x, y = task.train.x, task.train.y
        >>> x.shape, bool(((x[:, 0] > 0.5).long() == y).all())
        (torch.Size([70, 4]), True)
    """
    if not _is_int(features) or features < 1:
        raise InputError(f"first_feature: features must be a positive integer, got {features!r}")
    counts = _split_sizes(n, sizes)
    rng = _rng(seed)
    half = _per_class(sum(counts), 2)
    y = _labels(half, 2)
    x = rng.random((len(y), features), dtype=np.float32)
    first = (0.5 * rng.random(len(y)) + 0.5 * y).astype(np.float32)
    # float32 rounding may bring 0.5 + tiny down to 0.5, which is not > 0.5
    above = np.nextafter(np.float32(0.5), np.float32(1))
    x[:, 0] = np.where(y == 1, np.maximum(first, above), first)
    name = f"FirstFeature(features={features})"
    return _finish(name, x, y, counts, rng, 2, None, None, seed)


# ---------------------------------------------------------------------------------------
# Helpers


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _rng(seed) -> np.random.Generator:
    if not _is_int(seed) or seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed!r}")
    return np.random.default_rng(seed)


def _check(length, vocab_size, *, min_length, min_vocab, task):
    """Length and vocabulary big enough for the task to have both classes."""
    if not _is_int(length) or length < min_length:
        raise InputError(f"{task}: length must be an integer >= {min_length}, got {length!r}")
    if not _is_int(vocab_size) or vocab_size < min_vocab:
        raise InputError(
            f"{task}: vocab_size must be an integer >= {min_vocab} (token 0 is padding and "
            f"every class must be possible), got {vocab_size!r}"
        )


def _token_set(tokens, length, vocab_size) -> np.ndarray:
    """ContainsTokenSet's S as a sorted array, checked against the vocabulary and length."""
    try:
        items = list(tokens)
    except TypeError:
        raise InputError(
            f"ContainsTokenSet: tokens must be a collection of ints, got {tokens!r}"
        ) from None
    if not items or not all(_is_int(t) for t in items):
        raise InputError(
            f"ContainsTokenSet: tokens must be a non-empty set of ints, got {tokens!r}"
        )
    if len(set(items)) != len(items):
        raise InputError(f"ContainsTokenSet: tokens must not repeat, got {tokens!r}")
    bad = sorted(t for t in items if not 1 <= t < vocab_size)
    if bad:
        raise InputError(
            f"ContainsTokenSet: tokens {bad} are outside 1..{vocab_size - 1} (0 is padding; "
            f"vocab_size={vocab_size}); use tokens in that range or a larger vocab_size"
        )
    if len(items) > length:
        raise InputError(
            f"ContainsTokenSet: {len(items)} tokens do not fit in length {length}; "
            "use fewer tokens or a longer length"
        )
    return np.array(sorted(items), dtype=np.int64)


def _per_class(n, classes) -> int:
    """Points per class; n must split evenly so the classes are balanced."""
    if n < classes or n % classes:
        up = max(classes, n + classes - n % classes)
        raise InputError(
            f"n={n} points cannot be split into {classes} equal classes; use a multiple "
            f"of {classes} (e.g. {up})"
        )
    return n // classes


def _labels(per_class, classes) -> np.ndarray:
    """Labels grouped by class: binary tasks put the positives (1) first."""
    order = [1, 0] if classes == 2 else range(classes)
    return np.repeat(np.array(order, dtype=np.int64), per_class)


def _uniform(rng, n, length, vocab_size) -> np.ndarray:
    return rng.integers(1, vocab_size, size=(n, length))


def _uniform_except(rng, avoid, length, vocab_size) -> np.ndarray:
    """(len(avoid), length) tokens uniform over 1..V-1 without avoid[i] in row i."""
    r = rng.integers(1, vocab_size - 1, size=(len(avoid), length))
    return r + (r >= avoid[:, None])  # skip over the avoided token


def _rejection(draw, keep, n, task) -> np.ndarray:
    """n rows of ``draw(m)`` for which ``keep`` holds, by rejection sampling."""
    kept, got, tried = [], 0, 0
    while got < n:
        m = min(1 << 18, max(1024, int(1.2 * (n - got) * (tried + 1) / (got + 1))))
        cand = draw(m)
        ok = cand[keep(cand)]
        kept.append(ok)
        got, tried = got + len(ok), tried + m
        if tried >= 1 << 16 and got * 1000 < tried:
            raise InputError(
                f"{task}: only {got} of {tried} random sequences are negatives; they are too "
                "rare. Use a shorter length, a larger vocab_size or more tokens"
            )
    return np.concatenate(kept)[:n]


def _split_sizes(n, sizes) -> tuple[int, int, int]:
    """(train, val, test): exactly ``sizes``, or ``n`` (default 1000) cut 70/10/20."""
    if sizes is not None:
        if (
            not isinstance(sizes, (tuple, list))
            or len(sizes) != 3
            or not all(_is_int(s) and s >= 0 for s in sizes)
        ):
            raise InputError(
                f"sizes must be 3 non-negative integers (train, val, test), got {sizes!r}"
            )
        if n is not None and n != sum(sizes):
            raise InputError(f"n={n} but sizes={tuple(sizes)} add up to {sum(sizes)}; give one")
        return tuple(int(s) for s in sizes)
    n = 1000 if n is None else n
    if not _is_int(n) or n < 1:
        raise InputError(f"n must be a positive integer, got {n!r}")
    val, test = (n + 5) // 10, (2 * n + 5) // 10  # rounded, half up
    return n - val - test, val, test


def _task_name(name, params) -> str:
    """``BinCountOnes(k=4)``, ``ContainsTokenSet(tokens={1, 2, 3})``."""

    def show(v):
        if isinstance(v, (set, frozenset, list, tuple, range)):
            return "{" + ", ".join(str(t) for t in sorted(v)) + "}"
        return repr(v)

    inner = ", ".join(f"{k}={show(v)}" for k, v in params.items())
    return f"{name}({inner})" if inner else name


def _finish(name, x, y, counts, rng, num_classes, vocab_size, length, seed) -> TaskData:
    """Shuffle the points and cut them into train/val/test."""
    order = rng.permutation(len(y))
    x, y = torch.from_numpy(x[order]), torch.from_numpy(y[order])
    a, b = counts[0], counts[0] + counts[1]
    train, val, test = (Split(x[i:j], y[i:j]) for i, j in ((0, a), (a, b), (b, len(y))))
    return TaskData(name, train, val, test, num_classes, vocab_size, length, seed)
