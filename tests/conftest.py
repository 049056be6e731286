from pathlib import Path

import pytest
import torch

from views_models import views_bert, views_ex, views_run  # noqa: F401 (view tests' fixtures)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same torch random state."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def _offline_quiet():
    """No network (fail fast on hub ids) and no progress bars on stderr (modules that
    load models: ``pytestmark = pytest.mark.usefixtures("_offline_quiet")``)."""
    import huggingface_hub.constants
    import transformers

    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        # huggingface_hub reads the variable at import: patch the constant too
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield
    if was_enabled:
        transformers.utils.logging.enable_progress_bar()


@pytest.fixture
def caller_threads():
    """The caller runs with 3 threads (a count nothing in the library would choose by
    itself); the test's own count comes back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(before)


@pytest.fixture
def torch_kernels(monkeypatch):
    """The native kernels off (``SEMIRING_BACKPROP_NATIVE=0``): the torch kernels, eager
    and compiled, run, for tests of those; back on after."""
    from semiring_backprop.kernels import native

    monkeypatch.setenv("SEMIRING_BACKPROP_NATIVE", "0")
    native.library.cache_clear()
    yield
    monkeypatch.undo()
    native.library.cache_clear()


@pytest.fixture
def no_thread_setting(monkeypatch):
    """``SEMIRING_BACKPROP_THREADS`` unset (the library's default thread count)."""
    monkeypatch.delenv("SEMIRING_BACKPROP_THREADS", raising=False)


#: the slow tier (tests/slow.txt): node ids and files, marked ``slow``; the default run
#: leaves them out (pyproject's ``-m "not slow"``), CI runs them after it (``-m slow``)
SLOW = [
    line.strip()
    for line in (Path(__file__).parent / "slow.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    files = {s for s in SLOW if "::" not in s}
    ids = set(SLOW) - files
    for item in items:
        if item.nodeid in ids or item.nodeid.split("::")[0] in files:
            item.add_marker(pytest.mark.slow)
