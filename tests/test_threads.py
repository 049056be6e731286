"""``sbp.threads``: sets a count and restores the caller's (also after an exception), reads
``SEMIRING_BACKPROP_THREADS``, refuses bad counts; passes on a user's model keep the
caller's count."""

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop import InputError

pytestmark = pytest.mark.usefixtures("no_thread_setting")


# -- the context manager -----------------------------------------------------------------


def test_threads_sets_and_restores(caller_threads):
    with sbp.threads(2) as n:
        assert n == 2 and torch.get_num_threads() == 2
        with sbp.threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == caller_threads


def test_threads_restores_after_an_exception(caller_threads):
    with pytest.raises(KeyError):
        with sbp.threads(1):
            raise KeyError("inside")
    assert torch.get_num_threads() == caller_threads


def test_threads_as_a_decorator(caller_threads):
    @sbp.threads()
    def inside(fail=False):
        if fail:
            raise ValueError("inside")
        return torch.get_num_threads()

    assert inside() == 1 and torch.get_num_threads() == caller_threads
    with pytest.raises(ValueError):
        inside(fail=True)
    assert torch.get_num_threads() == caller_threads


def test_setting_from_the_environment(caller_threads, monkeypatch):
    monkeypatch.setenv("SEMIRING_BACKPROP_THREADS", "2")
    with sbp.threads() as n:
        assert n == torch.get_num_threads() == 2
    with sbp.threads(1):  # an explicit count wins
        assert torch.get_num_threads() == 1
    monkeypatch.setenv("SEMIRING_BACKPROP_THREADS", "0")  # torch's count, untouched
    with sbp.threads() as n:
        assert n == torch.get_num_threads() == caller_threads
    assert torch.get_num_threads() == caller_threads


@pytest.mark.parametrize("bad", ["two", "-1", "1.5", ""])
def test_bad_settings_name_the_variable(bad, monkeypatch):
    monkeypatch.setenv("SEMIRING_BACKPROP_THREADS", bad)
    if not bad:  # empty: as if unset
        with sbp.threads() as n:
            assert n == 1
        return
    with pytest.raises(InputError, match="SEMIRING_BACKPROP_THREADS"):
        with sbp.threads():
            pass


@pytest.mark.parametrize("bad", [-1, 1.5, True, "x"])
def test_bad_counts(bad):
    with pytest.raises(InputError, match=r"threads\(n\)"):
        with sbp.threads(bad):
            pass


def test_user_passes_keep_the_callers_threads(caller_threads):
    seen = []

    def output(y):  # runs while the model is traced
        seen.append(torch.get_num_threads())
        return y.sum()

    res = sbp.backprop(torch.nn.Linear(3, 1).eval(), (torch.randn(2, 3),), output=output)
    assert seen and set(seen) == {caller_threads}
    assert torch.get_num_threads() == caller_threads and res.graph is not None
