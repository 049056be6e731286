"""Whole files written safely: under a private temporary name, then renamed; and what
JSON cannot hold, replaced (one policy for every JSON file the package writes).

A reader sees the old file or the whole new one, never half of it. The temporary file
lives in a directory made for it alone (``tempfile.mkdtemp`` beside the target: a new,
randomly named directory only this user can write into), so no name of it can be
planted in advance, as a symbolic link or otherwise, and nothing is written through a
link: the rename replaces a link at the target itself, not the file it points to.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch


def atomic_write(path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` into a new temporary file of the same name as ``path``, in a
    private directory beside it, then rename it to ``path`` (atomic on POSIX and
    Windows). The temporary directory is removed whatever happens; an error of
    ``write`` (a full disk: ``OSError`` 28) leaves ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the name keeps its suffix (pandas, matplotlib and torch read the format from it)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent))
    try:
        tmp = scratch / path.name
        write(tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def write_user_file(path, write: Callable[[Path], object], example: str = "out.json") -> Path:
    """:func:`atomic_write` for a file the user named: a directory, a place that cannot
    be written (read-only, no such drive) or a full disk is an
    :class:`~semiring_backprop.errors.InputError` naming the file, not an ``OSError``
    from deep inside. ``example``: a file name to suggest."""
    from .errors import InputError

    p = Path(path)
    if p.is_dir():
        raise InputError(f"{str(path)!r} is a directory; give a file name such as {example}")
    try:
        return atomic_write(p, write)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise InputError(
            f"cannot write {str(path)!r} ({why}): give a file in a directory you can write "
            "to, on a disk with room"
        ) from None


def json_safe(x, nonfinite: str = "null", plain: bool = True):
    """``x`` (dicts, lists and tuples of them) as JSON can hold it. A non-finite float
    becomes ``None`` (``nonfinite="null"``: JSON's null) or its name (``"name"``:
    ``"inf"``, ``"-inf"``, ``"nan"``, as an explanation's and a top path's JSON say it).
    With ``plain``, tensors and numpy scalars become Python numbers and dict keys
    strings (what records and settings files hold); without it, other values are kept
    as they are."""
    if isinstance(x, dict):
        return {(str(k) if plain else k): json_safe(v, nonfinite, plain) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v, nonfinite, plain) for v in x]
    if plain and isinstance(x, torch.Tensor):
        return json_safe(x.tolist(), nonfinite, plain)
    if plain and hasattr(x, "item") and not isinstance(x, str):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None if nonfinite == "null" else str(x)
    return x
