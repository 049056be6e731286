"""The faithfulness experiment's tables, figure and summary, from its per-pair records
(:mod:`.faithfulness`).

A model's faithfulness curve is taken as the MIB benchmark takes it over a data set:
at each fraction the mean over the pairs of the circuit's metric ``m(C)``, of ``m(M)``
and of ``m(∅)``, then ``f = (mean m(C) - mean m(∅)) / (mean m(M) - mean m(∅))`` (a pair
whose corruption changes nothing cannot blow it up). CPR, CMD and the edges needed are
read from that curve, one number per model (seed); the summary gives their mean and
spread over the models. The agreement with the exact effects is averaged over pairs,
then over models.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..analysis.faithfulness import cmd, cpr, edges_needed, normalized
from ..errors import InputError
from ..runner.records import write_json
from .common import write_csv

AGREEMENT = tuple(f"{w}_{k}" for w in ("edges", "nodes")
                  for k in ("pearson", "kendall", "top_n_overlap"))  # fmt: skip
INDUCTION = ("previous_in_top3", "induction_in_top3", "kcomposition_in_top5")


def _f(m_c, m_full, m_empty) -> float:
    try:
        return normalized(m_c, m_full, m_empty)
    except InputError:  # m(M) = m(∅): this pair (or model) has nothing to explain
        return math.nan


def tables(records: dict) -> dict:
    """``records``: ``{(benchmark, seed): [record, ...]}``. Returns DataFrames: ``curves``
    (one row per pair, method and fraction: ``metric`` = m(C), ``clean`` = m(M),
    ``empty`` = m(∅), ``f`` per pair), ``methods`` (one row per pair and method:
    agreement, evaluations, seconds, and the pair's own CPR, CMD and edges needed),
    ``branches`` (the classifier's §5.1 reading per pair) and ``induction`` (per pair
    and method: the heads found and whether the method ranks them high)."""
    import pandas as pd

    curves, methods, branches, induction = [], [], [], []
    for (bench, seed), rows in sorted(records.items()):
        for r in rows:
            pair = {"benchmark": bench, "seed": seed, "pair": r["key"]}
            for m in r["methods"]:
                pts = [{**pair, "method": m["method"], "fraction": fr, "n_edges": int(n),
                        "metric": mc, "clean": r["clean"], "empty": r["empty"],
                        "f": _f(mc, r["clean"], r["empty"])}
                       for fr, n, mc in m["curve"]]  # fmt: skip
                curves += pts
                row = {**pair, "method": m["method"], "evaluations": m["evaluations"],
                       "seconds": m["seconds"], "edges": r["edges"]}  # fmt: skip
                row.update({k: m.get(k) for k in AGREEMENT})
                row.update(_areas(pd.DataFrame(pts), r.get("level", 0.8)))
                methods.append(row)
                if r.get("heads"):
                    induction.append({**pair, "method": m["method"], **r["heads"],
                                      **{k: m.get(k) for k in INDUCTION}})  # fmt: skip
            b = r.get("branches")
            if b:
                branches.append(_branch_row(pair, b))
    return {"curves": pd.DataFrame(curves), "methods": pd.DataFrame(methods),
            "branches": pd.DataFrame(branches), "induction": pd.DataFrame(induction)}  # fmt: skip


def _areas(points, level) -> dict:
    if points.empty or points["f"].isna().any():
        return {"cpr": math.nan, "cmd": math.nan, "edges_needed": None}
    return {"cpr": cpr(points), "cmd": cmd(points), "edges_needed": edges_needed(points, level)}


def _branch_row(pair, b) -> dict:
    row = {**pair, "path": b["path"]}
    row.update({f"path_{k}": v for k, v in b["path_values"].items()})
    for mode in ("mean", "zero"):
        eff = b[mode]
        row.update({f"{mode}_{k}": v for k, v in eff.items()})
        # the larger of the two branches the §5.1 question is about, by ablation
        row[f"{mode}_larger"] = max(("query", "skip"), key=lambda k: abs(eff[k]))
        row[f"{mode}_agrees"] = row["path"] == row[f"{mode}_larger"]
    return row


def seed_curves(curves, level: float = 0.8):
    """One curve per benchmark, model and method, MIB's way (means over the pairs, then
    normalized), and per curve its CPR, CMD and edges needed: (points, areas)."""
    import pandas as pd

    key = ["benchmark", "seed", "method", "fraction"]
    g = curves.groupby(key, sort=False)[["n_edges", "metric", "clean", "empty"]].mean()
    g = g.reset_index()
    g["f"] = [_f(*v) for v in g[["metric", "clean", "empty"]].itertuples(index=False)]
    areas = []
    for (bench, seed, method), pts in g.groupby(["benchmark", "seed", "method"], sort=False):
        areas.append({"benchmark": bench, "seed": seed, "method": method,
                      **_areas(pts, level)})  # fmt: skip
    return g, pd.DataFrame(areas)


def _stats(values) -> dict:
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    if not v:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(v), "max": max(v), "n": len(v)}


def summary(t: dict, areas, config, models: list) -> dict:
    """Per benchmark and method: CPR, CMD (mean and spread over models), the edges
    needed per model, agreement (mean over pairs, then models), evaluations and
    seconds per pair; the classifier's §5.1 reading and the induction heads' ranks."""
    out: dict = {"level": config.level, "fractions": list(config.fractions), "models": models,
                 "benchmarks": {}}  # fmt: skip
    m = t["methods"]
    for bench in m["benchmark"].unique() if len(m) else []:
        mb, ab = m[m.benchmark == bench], areas[areas.benchmark == bench]
        entry: dict = {"edges": int(mb["edges"].iloc[0]),
                       "seeds": sorted(mb.seed.unique().tolist()),
                       "pairs": int(mb.groupby("seed").pair.nunique().max()),
                       "methods": {}}  # fmt: skip
        for method in mb["method"].unique():
            rows, ar = mb[mb.method == method], ab[ab.method == method]
            numbers = rows[["seed", *AGREEMENT]].astype({k: float for k in AGREEMENT})
            per_seed = numbers.groupby("seed").mean()
            entry["methods"][method] = {
                "cpr": _stats(ar["cpr"]), "cmd": _stats(ar["cmd"]),
                "edges_needed": [None if v is None or v != v else int(v)
                                 for v in ar["edges_needed"]],
                **{k: _stats(per_seed[k]) if k in per_seed else _stats([]) for k in AGREEMENT},
                "evaluations": float(rows["evaluations"].mean()),
                "seconds": float(rows["seconds"].mean()),
            }  # fmt: skip
        out["benchmarks"][bench] = entry
    b = t["branches"]
    if len(b):
        out["first_token"] = {}
        for bench, part in b.groupby("benchmark", sort=False):
            seeds = []
            for seed, s in part.groupby("seed"):
                seeds.append({"seed": int(seed),
                              "path": s["path"].value_counts().to_dict(),
                              **{f"{mode}_agrees": float(s[f"{mode}_agrees"].mean())
                                 for mode in ("mean", "zero")},
                              **{f"{mode}_{br}": float(s[f"{mode}_{br}"].mean())
                                 for mode in ("mean", "zero")
                                 for br in ("skip", "query")}})  # fmt: skip
            out["first_token"][bench] = seeds
    i = t["induction"]
    if len(i):
        seeds = []
        for seed, s in i.groupby("seed"):
            row = {"seed": int(seed), "previous_head": s["previous_head"].mode().tolist(),
                   "induction_head": s["induction_head"].mode().tolist()}  # fmt: skip
            for method, part in s.groupby("method", sort=False):
                row[method] = {k: float(part[k].astype(float).mean()) for k in INDUCTION
                               if k in part and part[k].notna().all()}  # fmt: skip
            seeds.append(row)
        out["induction"] = seeds
    return out


def figure(points, path) -> str:
    """The faithfulness curves, one panel per benchmark: per method the mean over the
    models, shaded from the lowest to the highest model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .._files import atomic_write

    benches = list(points["benchmark"].unique())
    fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        part = points[points.benchmark == bench]
        for method, pm in part.groupby("method", sort=False):
            s = pm.groupby("fraction")["f"].agg(["mean", "min", "max"])
            (line,) = ax.plot(s.index, s["mean"], marker="o", markersize=3, label=method)
            ax.fill_between(s.index, s["min"], s["max"], color=line.get_color(), alpha=0.15)
        ax.set_xscale("log")
        ax.axhline(1, color="black", linewidth=0.5)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlabel("fraction of edges kept")
        ax.set_ylabel("normalized faithfulness f")
        ax.set_title(bench)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return str(path)


def _cell(stats) -> str:
    if not stats or stats.get("mean") is None:
        return "-"
    sd = stats.get("std")
    return f"{stats['mean']:.3f}" + (f" ± {sd:.3f}" if sd else "")


def table_markdown(summary: dict) -> str:
    """One Markdown table per benchmark: per method CPR and CMD (mean ± sd over the
    models), the edges needed per model, Pearson and Kendall against the exact edge
    effects, the top-n overlap, and the evaluations per pair."""
    lines = []
    for bench, entry in summary["benchmarks"].items():
        lines += [f"**{bench}** ({entry['edges']} edges, {len(entry['seeds'])} models, "
                  f"{entry['pairs']} pairs each)", "",
                  "| method | CPR ↑ | CMD ↓ | edges for f ≥ "
                  f"{summary['level']} | Pearson (edges) | Kendall (edges) | top-n overlap "
                  "| Kendall (sites) | evaluations |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for method, s in entry["methods"].items():
            needed = ", ".join("-" if v is None else str(v) for v in s["edges_needed"])
            lines.append(f"| {method} | {_cell(s['cpr'])} | {_cell(s['cmd'])} | {needed} | "
                         f"{_cell(s['edges_pearson'])} | {_cell(s['edges_kendall'])} | "
                         f"{_cell(s['edges_top_n_overlap'])} | {_cell(s['nodes_kendall'])} | "
                         f"{s['evaluations']:g} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _parquet(frame, path: Path) -> str | None:
    try:
        import pyarrow  # noqa: F401  (the optional ``data`` extra)
    except ImportError:
        return None
    from .._files import atomic_write

    atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))
    return str(path)


def write(out, config, records: dict, models: list) -> dict:
    """Every table as CSV (and Parquet where pyarrow is installed), the figure (where
    matplotlib is), ``summary.json`` and ``table.md``; returns the summary, the files
    and the models."""
    out = Path(out)
    for rows in records.values():
        for r in rows:
            r.setdefault("level", config.level)
    t = tables(records)
    points, areas = seed_curves(t["curves"], config.level)
    t["model_curves"], t["model_areas"] = points, areas
    files = []
    for name, frame in t.items():
        if frame.empty:
            continue
        files.append(str(write_csv(frame, out / f"{name}.csv")))
        pq = _parquet(frame, out / f"{name}.parquet")
        if pq:
            files.append(pq)
    s = summary(t, areas, config, models)
    write_json(out / "summary.json", s)
    files.append(str(out / "summary.json"))
    from .._files import atomic_write

    text = table_markdown(s)
    atomic_write(out / "table.md", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    files.append(str(out / "table.md"))
    try:
        files.append(figure(points, out / "curves.png"))
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"summary": s, "files": files, "models": models}
