"""The thread count of the library's own tiny models (experiments, demo, quickstart).

Their ops are small (a few thousand parameters, batches of a few hundred), so a second
thread saves nothing, and costs much on a busy machine: after every op, OpenMP threads
wait for each other, spinning; when another process holds a core, each op waits until
the scheduler gives the late thread its turn. One thread has no such wait.

Passes on a user's model (``backprop``, ``Backprop``) keep the caller's setting.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .errors import InputError

ENV = "SEMIRING_BACKPROP_THREADS"
#: threads of the library's tiny-model work, unless ``SEMIRING_BACKPROP_THREADS`` says
DEFAULT = 1
#: threads of the experiments' training, whatever the setting: a thread count changes
#: how sums are split, so the trained weights (and what a seed gives) would depend on it
TRAIN = 1


@contextlib.contextmanager
def threads(n: int | None = None) -> Iterator[int]:
    """Run with ``torch.set_num_threads(n)``, then restore the caller's count (also when
    an exception leaves the block). Usable as a decorator: ``@threads()``.

    ``n=None`` reads the ``SEMIRING_BACKPROP_THREADS`` environment variable, else 1 (the
    right count for the library's tiny models); ``0`` leaves torch's count as it is.
    Yields the count in effect.

    Examples:
        >>> before = torch.get_num_threads()
        >>> with sbp.threads(1) as n:
        ...     r = sbp.backprop(mlp, (x,), output=lambda y: y.sum())
        ...     print(n, torch.get_num_threads())
        1 1
        >>> torch.get_num_threads() == before
        True
    """
    n = _setting() if n is None else _count(n, "threads(n)")
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield n or before
    finally:
        if n:
            torch.set_num_threads(before)


def _setting() -> int:
    text = os.environ.get(ENV, "").strip()
    return DEFAULT if not text else _count(text, ENV)


def _count(value, name: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0 or isinstance(value, bool | float):
        raise InputError(
            f"{name}={value!r}: expected a whole number of threads (0 keeps torch's count)"
        )
    return n
