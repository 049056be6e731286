"""Faithfulness metrics (analysis/faithfulness.py) against numbers computed by hand:
tiny curves whose trapezoids are a few lines of arithmetic, correlations of four
points worked out from their definitions, and circuit sizes counted from the
fractions."""

from __future__ import annotations

import doctest
import math

import pandas as pd
import pytest

import semiring_backprop.analysis.faithfulness as faith
from semiring_backprop.analysis.faithfulness import (
    FRACTIONS,
    agreement,
    cmd,
    cpr,
    curve,
    edges_needed,
    normalized,
)
from semiring_backprop.errors import InputError


def test_the_modules_examples_run():
    result = doctest.testmod(faith, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 6 and result.failed == 0


# -- normalized -------------------------------------------------------------------------


@pytest.mark.parametrize(("m_c", "m_full", "m_empty", "want"), [
    (2.0, 3.0, 1.0, 0.5),
    (3.0, 3.0, 1.0, 1.0),     # the circuit does all the model does
    (1.0, 3.0, 1.0, 0.0),     # ... or what nothing does
    (-1.0, 3.0, 1.0, -1.0),   # worse than nothing
    (0.0, -2.0, 2.0, 0.5),    # the model's value below the ablated one
])  # fmt: skip
def test_normalized(m_c, m_full, m_empty, want):
    assert normalized(m_c, m_full, m_empty) == pytest.approx(want, abs=1e-15)


def test_normalized_refuses_nothing_to_explain():
    with pytest.raises(InputError, match="nothing to explain"):
        normalized(1.0, 2.5, 2.5)
    with pytest.raises(InputError, match="not finite"):
        normalized(float("nan"), 2.0, 1.0)


# -- curve ------------------------------------------------------------------------------


def test_curve_keeps_mibs_counts_with_at_least_one_edge():
    scores = pd.Series(range(1000, 0, -1), dtype=float)
    sizes = []
    c = curve(scores, lambda kept: sizes.append(len(kept)) or len(kept) / 1000)
    # floor(fraction * 1000): 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000
    assert list(c.n_edges) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert list(c.fraction) == list(FRACTIONS)
    assert sizes == list(c.n_edges)
    # 7 edges: 0.001 .. 0.1 of them is under one edge: one edge each, evaluated once
    calls = []
    small = curve(pd.Series([1.0] * 7), lambda kept: calls.append(len(kept)) or 0.0)
    assert list(small.n_edges) == [1, 1, 1, 1, 1, 1, 1, 1, 3, 7]
    assert calls == [1, 3, 7]


def test_curve_ranks_by_magnitude_ties_in_order_non_finite_last():
    scores = pd.Series([0.5, -3.0, float("-inf"), 3.0, float("nan"), 0.0],
                       index=list("abcdef"))  # fmt: skip
    seen = {}
    curve(scores, lambda kept: seen.setdefault(len(kept), kept) and 0.0,
          fractions=[i / 6 for i in range(1, 7)])  # fmt: skip
    # |-3| ties |3|: b before d (their order); then 0.5, 0; the non-finite last
    assert seen[6] == ["b", "d", "a", "f", "c", "e"]
    assert seen[2] == ["b", "d"]


def test_curve_passes_the_kept_rows_of_a_frame():
    edges = pd.DataFrame({"src": ["x", "y", "z"], "dst": ["t", "t", "u"],
                          "score": [0.1, -2.0, 1.0]})  # fmt: skip
    got = []
    c = curve(edges, lambda kept: got.append(kept) or len(kept), fractions=(0.5, 1.0))
    assert list(got[0].columns) == ["src", "dst"]
    assert got[0].to_dict("records") == [{"src": "y", "dst": "t"}]
    assert list(got[1].src) == ["y", "z", "x"]
    assert list(c.f) == [1.0, 3.0]


@pytest.mark.parametrize("fractions", [(), (0.0, 1.0), (0.5, 1.5), (0.5, 0.2)])
def test_curve_refuses_bad_fractions(fractions):
    with pytest.raises(InputError, match="fraction"):
        curve(pd.Series([1.0, 2.0]), lambda kept: 0.0, fractions=fractions)


# -- areas ------------------------------------------------------------------------------


def _curve(fractions, f):
    return pd.DataFrame({"fraction": fractions, "n_edges": range(1, len(f) + 1), "f": f})


def test_cpr_and_cmd_by_hand():
    c = _curve([0.25, 0.5, 1.0], [0.25, 0.5, 1.0])
    # trapezoids: 0.25 * (0.25 + 0.5) / 2 + 0.5 * (0.5 + 1) / 2 = 0.09375 + 0.375
    assert cpr(c) == pytest.approx(0.46875, abs=1e-15)
    # |1 - f| = 0.75, 0.5, 0: 0.25 * 1.25 / 2 + 0.5 * 0.5 / 2 = 0.15625 + 0.125
    assert cmd(c) == pytest.approx(0.28125, abs=1e-15)
    # on log(fraction) each step is log 2 wide: log 2 * (0.375 + 0.75), log 2 * (0.625 + 0.25)
    assert cpr(c, log_scale=True) == pytest.approx(1.125 * math.log(2), abs=1e-15)
    assert cmd(c, log_scale=True) == pytest.approx(0.875 * math.log(2), abs=1e-15)


def test_cpr_and_cmd_on_mibs_fractions():
    ones = _curve(FRACTIONS, [1.0] * 10)
    assert cpr(ones) == pytest.approx(0.999, abs=1e-15)  # 1 - 0.001: not normalized
    assert cmd(ones) == 0.0
    zeros = _curve(FRACTIONS, [0.0] * 10)
    assert (cpr(zeros), cmd(zeros)) == (0.0, pytest.approx(0.999, abs=1e-15))
    # f crossing 1: CMD takes |1 - f| at the points (0.5 and 0.5 here), as MIB does
    over = _curve([0.5, 1.0], [1.5, 0.5])
    assert cpr(over) == pytest.approx(0.5, abs=1e-15)
    assert cmd(over) == pytest.approx(0.25, abs=1e-15)


def test_areas_need_two_points():
    with pytest.raises(InputError, match="two fractions"):
        cpr(_curve([1.0], [1.0]))


def test_edges_needed():
    c = pd.DataFrame({"fraction": [0.1, 0.5, 1.0], "n_edges": [2, 10, 20],
                      "f": [0.3, 0.85, 0.79]})  # fmt: skip
    assert edges_needed(c) == 10
    assert edges_needed(c, level=0.3) == 2
    assert edges_needed(c, level=0.9) is None


# -- agreement --------------------------------------------------------------------------


def test_agreement_by_hand():
    # |s| = 3, 2, 1, 0.5 and |e| = 30, 10, 20, 0: deviations (1.375, .375, -.625,
    # -1.125) and (15, -5, 5, -15); r = 32.5 / sqrt(3.6875 * 500). Kendall: of the 6
    # pairs only (2, 3) is discordant: tau = (5 - 1) / 6.
    a = agreement([3.0, -2.0, 1.0, 0.5], [30.0, 10.0, -20.0, 0.0], top_n=2)
    assert a["pearson"] == pytest.approx(32.5 / math.sqrt(3.6875 * 500), abs=1e-12)
    assert a["kendall"] == pytest.approx(4 / 6, abs=1e-12)
    assert a["top_n_overlap"] == 0.5  # {0, 1} against {0, 2}
    assert (a["n"], a["top_n"]) == (4, 2)


def test_agreement_merges_frames_on_their_key():
    scores = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1],
                           "score": [3.0, -2.0, 1.0, 0.5]})  # fmt: skip
    effects = pd.DataFrame({"layer": [1, 1, 0, 0], "head": [1, 0, 1, 0],
                            "effect": [0.0, -20.0, 10.0, 30.0]})  # fmt: skip
    a = agreement(scores, effects, top_n=2)
    assert a["pearson"] == pytest.approx(32.5 / math.sqrt(3.6875 * 500), abs=1e-12)
    with pytest.raises(InputError, match="one score per effect"):
        agreement(scores.iloc[:3], effects)


def test_agreement_constant_and_no_path():
    a = agreement([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])
    assert a["pearson"] is None and a["kendall"] is None
    assert a["top_n_overlap"] == 1.0  # top 3 of 3
    # no path (-inf) counts as a score of 0
    b = agreement([float("-inf"), 1.0, 2.0], [0.0, 1.0, 2.0])
    assert b["pearson"] == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(InputError, match="2 effects"):
        agreement([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(InputError, match="top_n"):
        agreement([1.0, 2.0], [1.0, 2.0], top_n=0)
