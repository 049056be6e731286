"""Host memory: let freed memory be reused instead of handed back to the system.

A pass keeps every node's value (``keep=None``), so its memory grows through the pass
and what it frees comes in large blocks. glibc's malloc serves blocks above a threshold
(128 KiB, rising with what is freed) with fresh ``mmap`` pages and returns them on
``free``; every fresh page costs a fault and a zeroing on first touch. On a 2-core CPU
that was 0.2-0.4 s of a 0.6-1.0 s pass for BERT at 128 tokens (900 MB of faults), and
autograd, which frees as it goes, pays almost none of it.

:func:`tune` raises the threshold to glibc's maximum (32 MiB) and keeps up to 2 GiB of
freed memory for reuse. It changes no value, only speed, and applies to the whole
process (which then keeps its high-water memory). :class:`~semiring_backprop.Backprop`
calls it on its first call; ``SEMIRING_BACKPROP_TUNE_MALLOC=0`` in the environment (or
``tune(False)`` before) leaves malloc as it is. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 * 2**20  # glibc's upper limit for the threshold on 64-bit
_TRIM = 2**31 - 1

_state = {"result": None, "enabled": os.environ.get("SEMIRING_BACKPROP_TUNE_MALLOC", "1") != "0"}


def tune(enabled: bool = True) -> bool:
    """Set glibc malloc for reuse (see the module docstring), once per process.

    ``tune(False)`` before the first call of a ``Backprop`` keeps the defaults. Returns
    whether the settings are in effect (False where the C library is not glibc).
    """
    if not enabled:
        _state["enabled"] = False
        return False
    if _state["result"] is None:
        _state["result"] = _mallopt()
    return _state["result"]


def _mallopt() -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
        gnu = ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError):
        log.info("not glibc: malloc left as it is")
        return False
    gnu.restype = ctypes.c_char_p
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM) == 1
    log.info("glibc %s malloc tuned for reuse: %s", gnu().decode(), ok)
    return ok


def auto() -> None:
    """What ``Backprop`` calls: :func:`tune` unless it was turned off."""
    if _state["enabled"] and _state["result"] is None:
        tune()
