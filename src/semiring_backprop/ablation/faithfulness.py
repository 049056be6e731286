"""Faithfulness of a circuit as circuit discovery measures it (DESIGN §3b, last bullet).

A method scores every edge; the circuit of a size keeps the edges of largest |score|
and ablates every other one (patching from a corrupted input, mean or zero: see
:mod:`.patching`). With ``m`` the explained scalar, ``m(M)`` the whole model's value,
``m(∅)`` the value with every edge ablated and ``m(C)`` the circuit's:

- :func:`normalized`: ``f(C) = (m(C) - m(∅)) / (m(M) - m(∅))``, 1 when the circuit
  does all the model does, 0 when it does what nothing does;
- :func:`curve`: ``f`` of the circuits keeping a growing fraction of the edges;
- :func:`cpr` and :func:`cmd`: the area under ``f`` and under ``|1 - f|`` along that
  curve (the MIB benchmark's CPR, higher is better, and CMD, lower is better);
- :func:`edges_needed`: the smallest circuit on the curve with ``f >= level``;
- :func:`agreement`: how well the scores rank the exact ablation effects (Pearson and
  Kendall on the magnitudes, and the overlap of the ``top_n``).

For example, a curve whose evaluations are known (here the circuit's ``f`` is the share
of the edges kept, so the area on the linear axis is about 1/2)::

    >>> import pandas as pd
    >>> scores = pd.Series([4.0, -3.0, 2.0, 1.0])
    >>> c = curve(scores, lambda kept: len(kept) / 4, fractions=(0.25, 0.5, 1.0))
    >>> c
       fraction  n_edges     f
    0      0.25        1  0.25
    1      0.50        2  0.50
    2      1.00        4  1.00
    >>> round(cpr(c), 4), round(cmd(c), 4), edges_needed(c, 0.5)
    (0.4688, 0.2812, 2)
"""

from __future__ import annotations

import math

from ..errors import InputError

__all__ = ["FRACTIONS", "agreement", "cmd", "cpr", "curve", "edges_needed", "normalized", "ranking"]

#: the fractions of the edges at which the MIB benchmark evaluates a circuit
FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def normalized(m_c: float, m_full: float, m_empty: float) -> float:
    """``(m(C) - m(∅)) / (m(M) - m(∅))``: the share of the model's behaviour (its value
    above the all-ablated one) that the circuit recovers.

    >>> normalized(2.0, 3.0, 1.0)
    0.5
    """
    values = {"m_c": m_c, "m_full": m_full, "m_empty": m_empty}
    bad = [k for k, v in values.items() if not math.isfinite(float(v))]
    if bad:
        raise InputError(f"normalized faithfulness: {', '.join(bad)} is not finite ({values})")
    if float(m_full) == float(m_empty):
        raise InputError(
            f"normalized faithfulness: m(M) = m(∅) = {float(m_full)!r}: ablating every edge "
            "leaves the output as it is, so there is nothing to explain; pick a corrupted "
            "input (or ablation) that changes the output"
        )
    return (float(m_c) - float(m_empty)) / (float(m_full) - float(m_empty))


def _magnitudes(scores):
    """|score| per row as floats; a non-finite score (no path: MaxProduct's -inf; NaN)
    ranks below every finite one, as -1."""
    import numpy as np
    import pandas as pd

    if isinstance(scores, pd.DataFrame):
        if "score" not in scores.columns:
            raise InputError(
                f"scores: a DataFrame needs a 'score' column (it has {list(scores.columns)})"
            )
        values = scores["score"]
    else:
        values = scores
    a = np.asarray(pd.Series(values).astype(float), dtype=float)
    if a.ndim != 1:
        raise InputError(f"scores: give one score per edge (a 1-D series), not shape {a.shape}")
    mag = np.abs(a)
    return np.where(np.isfinite(mag), mag, -1.0)


def ranking(scores) -> list[int]:
    """Row positions of ``scores`` by |score|, largest first; ties keep the rows' order
    (a stable sort), and non-finite scores come last."""
    import numpy as np

    mag = _magnitudes(scores)
    return [int(i) for i in np.argsort(-mag, kind="stable")]


def _check_fractions(fractions) -> tuple:
    if isinstance(fractions, str | bytes) or not hasattr(fractions, "__iter__"):
        raise InputError(
            f"curve: fractions={fractions!r}; give a sequence of numbers in (0, 1], e.g. "
            "fractions=(0.01, 0.1, 1.0)"
        )
    try:
        fr = tuple(float(f) for f in fractions)
    except (TypeError, ValueError):
        raise InputError(
            f"curve: fractions={fractions!r} holds something that is not a number; give "
            "numbers in (0, 1], e.g. fractions=(0.01, 0.1, 1.0)"
        ) from None
    if not fr:
        raise InputError("curve: give at least one fraction")
    if any(not 0 < f <= 1 for f in fr):
        raise InputError(f"curve: fractions must lie in (0, 1], got {fr}")
    if any(b <= a for a, b in zip(fr, fr[1:])):
        raise InputError(f"curve: fractions must increase, got {fr}")
    return fr


def curve(scores, evaluate, fractions=FRACTIONS):
    """``f`` of the circuits that keep the top ``fraction`` of the edges by |score|.

    ``scores``: one score per edge, a Series (``evaluate`` then gets the kept rows'
    index labels, a list) or a DataFrame with a ``score`` column (``evaluate`` gets the
    kept rows, without ``score``, as a DataFrame; e.g. the edge keys
    :class:`~.patching.Patching`'s ``faithfulness`` reads). A circuit of ``fraction``
    keeps ``max(1, floor(fraction * n))`` edges (MIB's count, at least one); ties in
    |score| keep the rows' order; non-finite scores rank last. ``evaluate(kept) -> f``
    is called once per distinct size.

    Returns a DataFrame with columns ``fraction``, ``n_edges`` and ``f``, one row per
    fraction."""
    import pandas as pd

    fr = _check_fractions(fractions)
    order = ranking(scores)
    n = len(order)
    if n == 0:
        raise InputError("curve: no edges to score")
    seen: dict[int, float] = {}
    rows = []
    for f in fr:
        # 1e-9: a fraction such as 0.29 of 100 is 28.999999999999996 in floating point
        k = max(1, int(math.floor(f * n + 1e-9)))
        if k not in seen:
            chosen = order[:k]
            if isinstance(scores, pd.DataFrame):
                kept = scores.iloc[chosen].drop(columns="score")
            else:
                kept = list(pd.Series(scores).index[chosen])
            seen[k] = float(evaluate(kept))
        rows.append({"fraction": f, "n_edges": k, "f": seen[k]})
    return pd.DataFrame(rows)


def _check_curve(curve, columns=("fraction", "f"), what: str = "a faithfulness curve"):
    """Refuse what is not a curve frame with ``columns`` (as :func:`curve` returns)."""
    import pandas as pd

    if not isinstance(curve, pd.DataFrame):
        raise InputError(
            f"{what} is a DataFrame with columns {', '.join(columns)} (as curve() returns), "
            f"not a {type(curve).__name__}"
        )
    missing = [c for c in columns if c not in curve.columns]
    if missing:
        raise InputError(
            f"{what} needs the columns {', '.join(columns)} (missing {missing}; it has "
            f"{list(curve.columns)}): pass the frame curve() returns"
        )


def _area(curve, y, log_scale: bool) -> float:
    import numpy as np
    from scipy.integrate import trapezoid

    if len(curve) < 2:
        raise InputError("the area under a faithfulness curve needs at least two fractions")
    x = np.asarray(curve["fraction"], dtype=float)
    return float(trapezoid(y, np.log(x) if log_scale else x))


def cpr(curve, log_scale: bool = False) -> float:
    """Circuit performance ratio: the area under ``f`` over the fraction of edges kept,
    by the trapezoid rule between the curve's fractions (the nominal ones, e.g.
    :data:`FRACTIONS`) on a **linear** axis (``log_scale=True``: on ``log(fraction)``).

    This is the MIB benchmark's definition (Mueller et al., "MIB: A Mechanistic
    Interpretability Benchmark", ICML 2025; its code's
    ``MIB_circuit_track/evaluation.py``, ``evaluate_area_under_curve``, ``area_under``:
    trapezoids over the fractions (.001, .002, .005, ..., .5, 1), ``log_scale=False`` by
    default), not normalized by the axis' length: a circuit with ``f = 1`` everywhere
    scores ``1 - 0.001`` there. Higher is better."""
    import numpy as np

    _check_curve(curve, what="cpr: a faithfulness curve")
    return _area(curve, np.asarray(curve["f"], dtype=float), log_scale)


def cmd(curve, log_scale: bool = False) -> float:
    """Circuit-model distance: the area of ``|1 - f|`` over the fraction of edges kept,
    as :func:`cpr` integrates (MIB's ``area_from_1``: the trapezoids of ``|1 - f|`` at
    the curve's points). Lower is better: 0 when every circuit behaves as the model."""
    import numpy as np

    _check_curve(curve, what="cmd: a faithfulness curve")
    return _area(curve, np.abs(1.0 - np.asarray(curve["f"], dtype=float)), log_scale)


def edges_needed(curve, level: float = 0.8) -> int | None:
    """The fewest edges among the curve's circuits with ``f >= level`` (None if none
    reaches it). Only the curve's sizes are tried: the true minimum lies between the
    returned size and the next smaller size on the curve."""
    if isinstance(level, bool) or not isinstance(level, int | float) or not math.isfinite(level):
        raise InputError(f"edges_needed: level={level!r} must be a finite number")
    _check_curve(curve, ("n_edges", "f"), "edges_needed: a faithfulness curve")
    reached = curve[curve["f"] >= level]
    return int(reached["n_edges"].min()) if len(reached) else None


def _values(x, column: str):
    import pandas as pd

    if isinstance(x, pd.DataFrame):
        if column not in x.columns:
            raise InputError(f"agreement: a DataFrame needs a {column!r} column "
                             f"(it has {list(x.columns)})")  # fmt: skip
        return x[column]
    return pd.Series(x)


def agreement(scores, effects, top_n: int = 10) -> dict:
    """How well ``scores`` rank the exact ``effects`` of ablating each edge (or site):
    Pearson's r and Kendall's tau (scipy, with their p-values) between ``|score|`` and
    ``|effect|``, and ``top_n_overlap``, the share of the ``top_n`` largest |effect|
    that are among the ``top_n`` largest |score| (ties keep the rows' order).

    ``scores`` and ``effects``: aligned 1-D series, or DataFrames with a ``score``
    (``effect``) column, merged on the columns they share (an edge's or site's key).
    Non-finite scores count as 0 in the correlations (no path: no score). A correlation
    of a constant side is None (it is undefined, and scipy would warn).

    >>> a = agreement([3.0, -2.0, 1.0, 0.5], [30.0, 10.0, -20.0, 0.0], top_n=2)
    >>> round(a["pearson"], 4), round(a["kendall"], 4), a["top_n_overlap"]
    (0.7569, 0.6667, 0.5)
    """
    import numpy as np
    import pandas as pd
    from scipy.stats import kendalltau, pearsonr

    if isinstance(scores, pd.DataFrame) and isinstance(effects, pd.DataFrame):
        key = [c for c in scores.columns if c in effects.columns and c not in ("score", "effect")]
        if not key:
            raise InputError("agreement: the scores and effects share no key column")
        for name, frame in (("scores", scores), ("effects", effects)):
            twice = frame[frame.duplicated(key, keep=False)]
            if len(twice):
                first = twice[key].head(1).to_dict("records")[0]
                raise InputError(
                    f"agreement: {len(twice)} rows of the {name} share a key ({key}), e.g. "
                    f"{first}: each edge or site needs one row; drop or sum the duplicates"
                )
        merged = scores[[*key, "score"]].merge(effects[[*key, "effect"]], on=key, how="inner",
                                               validate="one_to_one")  # fmt: skip
        if len(merged) != len(scores) or len(merged) != len(effects):
            raise InputError(
                f"agreement: {len(scores)} scores and {len(effects)} effects, {len(merged)} "
                f"matched on {key}: give one score per effect"
            )
        s, e = merged["score"], merged["effect"]
    else:
        s, e = _values(scores, "score"), _values(effects, "effect")
        if len(s) != len(e):
            raise InputError(f"agreement: {len(s)} scores but {len(e)} effects")
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
        raise InputError(f"agreement: top_n={top_n!r}; give a count, 1 or more")
    a = np.abs(np.asarray(s, dtype=float))
    b = np.abs(np.asarray(e, dtype=float))
    if not np.isfinite(b).all():
        raise InputError("agreement: an effect is not finite (the exact effects are numbers)")
    a = np.where(np.isfinite(a), a, 0.0)
    out: dict = {"n": len(a), "top_n": min(top_n, len(a))}
    constant = len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0
    if constant or len(a) < 3:
        out.update(pearson=None, pearson_p=None, kendall=None, kendall_p=None)
    else:
        r, t = pearsonr(a, b), kendalltau(a, b)
        out.update(pearson=float(r.statistic), pearson_p=float(r.pvalue),
                   kendall=float(t.statistic), kendall_p=float(t.pvalue))  # fmt: skip
    k = out["top_n"]
    top_s = set(np.argsort(-a, kind="stable")[:k].tolist())
    top_e = set(np.argsort(-b, kind="stable")[:k].tolist())
    out["top_n_overlap"] = len(top_s & top_e) / k if k else None
    return out
