"""malloc tuning: set by the first Backprop call (glibc only), off by the environment."""

import ctypes
import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch, semiring_backprop as sbp
from semiring_backprop.engine import allocator
assert allocator._state["result"] is None  # importing changes nothing
lin = torch.nn.Linear(3, 2).eval()
sbp.Backprop(lin, lambda y: y.sum())(torch.randn(1, 3))
print(allocator._state["result"])
"""


def _glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    return True


def _run(env_value):
    env = {k: v for k, v in os.environ.items() if k != "SEMIRING_BACKPROP_TUNE_MALLOC"}
    if env_value is not None:
        env["SEMIRING_BACKPROP_TUNE_MALLOC"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not _glibc(), reason="malloc is tuned on glibc only")
def test_first_backprop_call_tunes_malloc():
    assert _run(None) == "True"


def test_environment_leaves_malloc_alone():
    assert _run("0") == "None"


@pytest.mark.skipif(not _glibc(), reason="malloc is tuned on glibc only")
def test_tune_sets_the_glibc_thresholds():
    from semiring_backprop.engine import allocator

    assert allocator.tune() is True
    assert allocator.tune() is True  # once per process; later calls report it
