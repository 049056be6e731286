"""Millions of Python objects made at once, for the exports of circuits of millions of
edges: text joined from pieces (no string per line), dicts made by one loop with their
keys written out, and the cyclic garbage collector paused while they are made.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import numpy as np


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector paused (then restored as it was): making millions of
    dicts otherwise starts collections that walk every dict made so far, a second or
    more in all; nothing made here is garbage until the caller drops it. What was made
    joins the oldest generation (``gc.freeze`` then ``gc.unfreeze``: two list splices),
    where the collector next looks at a full collection, rather than the youngest,
    whose next collection would walk all of it at once (half a second for millions);
    left to the youngest where objects are frozen already (a forking server's)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()
            gc.unfreeze()
        if was:
            gc.enable()


def factorize(values) -> tuple[np.ndarray, np.ndarray]:
    """``pandas.factorize`` of int ``values`` (codes, then the distinct values in the order
    first met), each run of equal neighbours hashed once: an edge's rows into one
    destination (its q, k and v) lie side by side."""
    import pandas as pd

    values = np.asarray(values)
    if len(values) < 2:
        return pd.factorize(values)
    first, run = runs(values)
    codes, uniques = pd.factorize(values[first])
    return codes[run], uniques


def runs(*columns) -> tuple[np.ndarray, np.ndarray]:
    """``(first, run)``: the first row of each run of neighbouring rows equal in every one
    of ``columns`` (arrays of one length), and each row's run. An edge's rows into one
    destination (its q, k and v) lie side by side: work done once a run is a third of
    that done once a row."""
    n = len(columns[0])
    new = np.zeros(n, dtype=bool)
    if n:
        new[0] = True
    for c in columns:
        new[1:] |= c[1:] != c[:-1]
    return np.flatnonzero(new), np.cumsum(new) - 1


def interleaved(*columns) -> list[str]:
    """The strings of ``columns`` taken row by row (each a list or object array of one
    length, or one string for every row), to be joined: the text of many lines without
    making each line's string."""
    n = max((len(c) for c in columns if not isinstance(c, str)), default=0)
    table = np.empty((n, len(columns)), dtype=object)
    for i, c in enumerate(columns):
        table[:, i] = c
    return table.ravel().tolist()


def store_records(targets: list, keys: list, fields: dict) -> None:
    """``targets[i][keys[i]] = {name: value}`` for every ``i``, with the fields in
    ``fields``' order (``name: list``, a value per row, or ``name: str``, one for all).
    As the plain loop does, but the dict written out as a display, which Python makes
    without a call (about half the time of ``dict(zip(names, row))``)."""
    names = tuple(fields)
    varying = tuple(not isinstance(v, str) for v in fields.values())
    loop = _record_loop(varying)
    loop(targets, keys, names, [v for v in fields.values() if isinstance(v, str)],
         *(v for v in fields.values() if not isinstance(v, str)))  # fmt: skip


@functools.cache
def _record_loop(varying: tuple[bool, ...]):
    """The loop of :func:`store_records` for fields varying (a list) or fixed (one
    value) as given. Only identifiers made here enter the code; names and values are
    its arguments."""
    n_fixed = varying.count(False)
    x = [f"x{i}" for i in range(len(varying))]
    fixed = iter(f"c{i}" for i in range(n_fixed))
    values = [xi if v else next(fixed) for xi, v in zip(x, varying)]
    display = ", ".join(f"n{i}: {v}" for i, v in enumerate(values))
    row = "".join(f", {xi}" for xi, v in zip(x, varying) if v)
    lines = [
        "def loop(targets, keys, names, fixed, *columns):",
        f"    ({''.join(f'n{i}, ' for i in range(len(varying)))}) = names",
        f"    ({''.join(f'c{i}, ' for i in range(n_fixed))}) = fixed",
        f"    for t, k{row} in zip(targets, keys, *columns):",
        f"        t[k] = {{{display}}}",
    ]
    scope: dict = {}
    exec("\n".join(lines), scope)  # noqa: S102 (generated from the shape above only)
    return scope["loop"]
