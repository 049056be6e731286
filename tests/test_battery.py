"""The battery of bad inputs and faults (tests/battery.py): every case must end the way
it declares, a clear error naming what was wrong or a result an oracle confirms; never a
raw traceback, a crash, or a silently wrong or lost result.

``python tests/battery.py`` prints the table of counts and every case that is not good.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")  # model directories and the command line
pytest.importorskip("pandas")  # branch tables
pytest.importorskip("tqdm")

import battery  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest


@pytest.fixture(scope="module")
def forkserver():
    """Command-line cases run in children of one server that imported torch once."""
    return battery._context()


@pytest.fixture(scope="module")
def env(tmp_path_factory, _offline_quiet, forkserver):
    """Shared tiny models and files; the command-line cases start at once, two at a
    time, while the library cases run here."""
    env = battery.Env(tmp_path_factory.mktemp("battery"))
    pool = battery.prefetch(battery.CASES, env, forkserver)
    yield env
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("case", battery.CASES, ids=lambda c: c.name)
def test_case_ends_as_declared(case, env, forkserver):
    outcome = battery.classify(case, env, forkserver)
    assert outcome.kind == case.expect, (
        f"{case.name}: {outcome.kind}, expected {case.expect} ({case.what})\n{outcome.detail}"
    )


def test_the_battery_is_large_and_covers_every_area():
    areas = {c.name.split(".")[0] for c in battery.CASES}
    # (reuse: what a kept trace may serve; targets: what is explained and loaded)
    assert areas == {"api", "result", "data", "runs", "cli", "reuse", "targets"}
    assert len(battery.CASES) >= 150
    assert len({c.name for c in battery.CASES}) == len(battery.CASES)
    assert all(c.expect in battery.GOOD for c in battery.CASES)
    # a clear case says what its message must name; a graceful case has an oracle
    assert all(c.names for c in battery.CASES if c.expect == "clear")
    assert all(c.check for c in battery.CASES if c.expect == "graceful")


def test_the_classifier_tells_the_classes_apart(env, forkserver):
    """The classifier itself, on cases whose class is known by construction."""
    from semiring_backprop import InputError

    def raise_(e):
        raise e

    known = {
        "clear": battery.Case("k.clear", "clear", lambda env: raise_(InputError("bad x")), "x"),
        "raw": battery.Case("k.raw", "clear", lambda env: raise_(KeyError("x")), "x"),
        "unnamed": battery.Case("k.unnamed", "clear", lambda env: raise_(InputError("?")), "x"),
        "silent": battery.Case("k.silent", "clear", lambda env: float("nan"), "x"),
        "wrong": battery.Case("k.wrong", "graceful", lambda env: 1, check=lambda v, e: "off"),
        "right": battery.Case("k.right", "graceful", lambda env: 1, check=lambda v, e: v == 1),
    }
    got = {k: battery.classify(c, env, forkserver).kind for k, c in known.items()}
    assert got == {"clear": "clear", "raw": "raw", "unnamed": "raw", "silent": "silent",
                   "wrong": "silent", "right": "graceful"}  # fmt: skip
    cli = battery.Case("k.cli", "clear", lambda env: None, r"--seed")
    ran = {
        "crash": battery.Ran(-11, "", ""),  # a segfault
        "raw": battery.Ran(1, "", "Traceback (most recent call last):\n  ...\nKeyError: 1"),
        "clear": battery.Ran(2, "", "usage: ...\nsemiring-backprop: error: --seed: bad"),
        "unnamed": battery.Ran(2, "", "error: something"),
        "silent": battery.Ran(0, "done", ""),  # a clear case that exited 0
    }
    got = {k: battery._classify_cli(cli, r, env).kind for k, r in ran.items()}
    assert got == {"crash": "crash", "raw": "raw", "clear": "clear", "unnamed": "raw",
                   "silent": "silent"}  # fmt: skip
    # a real child: the command line's own exit status and error line
    real = battery.Case("k.real", "clear", lambda env: battery.Cli(["bogus"]), r"'bogus'")
    assert battery.classify(real, env, forkserver).kind == "clear"
