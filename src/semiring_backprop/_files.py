"""Whole files written safely: under a private temporary name, then renamed.

A reader sees the old file or the whole new one, never half of it. The temporary file
lives in a directory made for it alone (``tempfile.mkdtemp`` beside the target: a new,
randomly named directory only this user can write into), so no name of it can be
planted in advance, as a symbolic link or otherwise, and nothing is written through a
link: the rename replaces a link at the target itself, not the file it points to.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


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
