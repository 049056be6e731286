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

from ..ablation.faithfulness import cmd, cpr, edges_needed, normalized
from ..errors import InputError
from ..runner.records import write_json
from .common import write_csv

AGREEMENT = tuple(f"{w}_{k}" for w in ("edges", "nodes")
                  for k in ("pearson", "kendall", "top_n_overlap"))  # fmt: skip
INDUCTION = ("previous_in_top3", "induction_in_top3", "kcomposition_in_top5")
#: the ranks behind them (1: first), worst over a model's pairs in the tables
RANKS = ("previous_rank", "induction_rank", "kcomposition_rank", "previous_rank_position",
         "induction_rank_position", "kcomposition_rank_position")  # fmt: skip


#: what every pair's record holds (:func:`.faithfulness.explain_pair`), and each of its methods
RECORD_FIELDS = ("clean", "empty", "model_clean", "model_corrupted", "edges", "methods",
                 "heads", "forward_seconds", "node_patching", "seconds")  # fmt: skip
METHOD_FIELDS = ("method", "evaluations", "seconds", "curve")


def check_methods(rec) -> None:
    """Refuse a record whose methods are not those :func:`.faithfulness.explain_pair` writes."""
    for row in rec.rows:
        methods_ = row["methods"]
        bad = not isinstance(methods_, list) or any(
            not isinstance(m, dict) or any(f not in m for f in METHOD_FIELDS) for m in methods_
        )
        if bad:
            raise InputError(
                f"{rec.path}: the record of pair {row[rec.key]!r} has methods without "
                f"{', '.join(METHOD_FIELDS)} (another version of this package wrote it, or "
                "it was edited): delete its line to compute it again, or the file to start "
                "over"
            )


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
                fwd = r.get("forward_seconds")
                row = {**pair, "method": m["method"], "evaluations": m["evaluations"],
                       "seconds": m["seconds"], "edges": r["edges"],
                       "forwards": m["seconds"] / fwd if fwd else math.nan,
                       "pair_seconds": r.get("seconds", math.nan)}  # fmt: skip
                row.update({k: m.get(k) for k in AGREEMENT})
                row.update(_areas(pd.DataFrame(pts), r.get("level", 0.8)))
                methods.append(row)
                if r.get("heads"):
                    heads = {k: v for k, v in r["heads"].items() if not k.endswith("scores")}
                    induction.append({**pair, "method": m["method"], **heads,
                                      **{k: m.get(k) for k in (*INDUCTION, *RANKS)}})  # fmt: skip
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
    import pandas as pd

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
            needed = [None if v is None or v != v else int(v) for v in ar["edges_needed"]]
            evals = pd.to_numeric(rows["evaluations"], errors="coerce")
            entry["methods"][method] = {
                "cpr": _stats(ar["cpr"]), "cmd": _stats(ar["cmd"]), "edges_needed": needed,
                **{k: _stats(per_seed[k]) if k in per_seed else _stats([]) for k in AGREEMENT},
                "evaluations": None if evals.isna().all() else float(evals.mean()),
                # medians: a model's first pair also traces it (once per model, not per pair)
                "seconds": float(rows["seconds"].median()),
                "forwards": float(rows["forwards"].median()),
                "per_seed": {str(seed): {"cpr": _num(a.cpr), "cmd": _num(a.cmd), "edges_needed": n,
                                         **{k: _num(per_seed[k].get(seed)) for k in AGREEMENT
                                            if k in per_seed}}
                             for a, n, seed in zip(ar.itertuples(), needed, ar["seed"])},
            }  # fmt: skip
        per_pair = mb.drop_duplicates(["seed", "pair"]).groupby("seed")["pair_seconds"].sum()
        entry["seconds_per_model"] = {str(k): _num(v) for k, v in per_pair.items()}
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
            model = next((m for m in models if m.get("benchmark") == "induction"
                          and m.get("seed") == seed and m.get("heads")), None)  # fmt: skip
            if model:  # every head's attention score: does one head hold each role?
                row["previous_scores"] = model["heads"]["previous_scores"]
                row["induction_scores"] = model["heads"]["induction_scores"]
            for method, part in s.groupby("method", sort=False):
                row[method] = {k: float(part[k].astype(float).mean()) for k in INDUCTION
                               if k in part and part[k].notna().all()}  # fmt: skip
                row[method].update({f"worst_{k}": int(part[k].max()) for k in RANKS
                                    if k in part and part[k].notna().all()})  # fmt: skip
            seeds.append(row)
        out["induction"] = seeds
    return out


def _num(v):
    return None if v is None or v != v else float(v)


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


def _g(v, fmt=".3f") -> str:
    return "-" if v is None or v != v else format(v, fmt)


def table_markdown(summary: dict) -> str:
    """Per benchmark: a table per method (CPR and CMD, mean ± sd over the models; the
    edges needed per model; Pearson and Kendall against the exact site and edge effects;
    the top-n overlap of edges; the graph forwards counted, seconds and
    forward-equivalents per pair) and a table per model and method; then the induction
    heads' ranks and the goals' verdicts (:func:`goals`)."""
    lines = []
    level = summary["level"]
    for bench, entry in summary["benchmarks"].items():
        lines += [f"**{bench}** ({entry['edges']} edges, {len(entry['seeds'])} models, "
                  f"{entry['pairs']} pairs each)", "",
                  f"| method | CPR ↑ | CMD ↓ | edges for f ≥ {level} | Pearson (sites) "
                  "| Kendall (sites) | Pearson (edges) | Kendall (edges) | top-n overlap (edges) "
                  "| graph forwards | seconds | forward-equivalents |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for method, s in entry["methods"].items():
            needed = ", ".join("-" if v is None else str(v) for v in s["edges_needed"])
            ev = "-" if s["evaluations"] is None else f"{s['evaluations']:g}"
            cost = f"{_g(s['seconds'], '.2f')} | {_g(s.get('forwards'), '.0f')}"
            lines.append(f"| {method} | {_cell(s['cpr'])} | {_cell(s['cmd'])} | {needed} | "
                         f"{_cell(s['nodes_pearson'])} | {_cell(s['nodes_kendall'])} | "
                         f"{_cell(s['edges_pearson'])} | {_cell(s['edges_kendall'])} | "
                         f"{_cell(s['edges_top_n_overlap'])} | {ev} | {cost} |")  # fmt: skip
        lines += ["", f"**{bench}**, per model", "",
                  f"| seed | method | Pearson (sites) | Kendall (sites) | Pearson (edges) "
                  f"| Kendall (edges) | CPR | CMD | edges for f ≥ {level} |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for seed in entry["seeds"]:
            for method, s in entry["methods"].items():
                m = s.get("per_seed", {}).get(str(seed), {})
                lines.append(f"| {seed} | {method} | {_g(m.get('nodes_pearson'))} | "
                             f"{_g(m.get('nodes_kendall'))} | {_g(m.get('edges_pearson'))} | "
                             f"{_g(m.get('edges_kendall'))} | {_g(m.get('cpr'))} | "
                             f"{_g(m.get('cmd'))} | {_g(m.get('edges_needed'), 'g')} "
                             "|")  # fmt: skip
        lines.append("")
    if summary.get("induction"):
        lines += ["**induction**: the heads by the model's own attention, and each method's "
                  "rank of the previous-token head, the induction head (among the heads, "
                  "positions summed; among every site at every position) and the "
                  "K-composition edge between them (among the edges, positions summed; at "
                  "every position), the worst over the model's pairs", "",
                  "| seed | previous-token head | induction head | method | previous | "
                  "induction | K edge | previous (per position) | induction (per position) "
                  "| K edge (per position) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in summary["induction"]:
            for method, r in row.items():
                if not isinstance(r, dict):
                    continue
                lines.append(
                    f"| {row['seed']} | {_heads(row, 'previous')} | "
                    f"{_heads(row, 'induction')} | {method} | "
                    + " | ".join(_g(r.get(f"worst_{k}"), "g") for k in RANKS)
                    + " |"
                )
        lines.append("")
    verdicts = goals(summary)
    if verdicts:
        lines += ["**goals**", "", "| goal | met | numbers |", "|---|---|---|"]
        lines += [f"| {g['goal']} | {g['met']} | {g['numbers']} |" for g in verdicts]
        lines.append("")
    return "\n".join(lines)


def _heads(row, role) -> str:
    heads = row.get(f"{role}_head") or []
    layer = 0 if role == "previous" else 1
    scores = row.get(f"{role}_scores")
    named = ", ".join(f"a{layer}.h{h}" for h in heads)
    return named + (f" ({'/'.join(f'{v:.2f}' for v in scores)})" if scores else "")


def _met(ok) -> str:
    return "n/a" if ok is None else ("met" if ok else "not met")


def goals(summary: dict) -> list[dict]:
    """The experiment's goals, each with its verdict read from ``summary``:

    1. Real's site scores (seed ``x - x'``) agree with exact node patching at Pearson
       >= 0.95 on every benchmark (every model);
    2. Real's CMD at most EAP-IG's and at most half of EAP's (means over the models),
       and ``f >= level`` with fewer edges than EAP on every model;
    3. induction: Real puts both heads among its top 3 heads and the K-composition
       edge among its top 5 edges on every pair of every model;
    4. Real's circuit costs at least 100 times fewer forward-equivalents (seconds
       over one forward of the graph) than exact edge patching."""
    b = summary.get("benchmarks", {})
    out = []
    rows = []
    for bench, entry in b.items():
        real = entry["methods"].get("Real")
        if real:
            per = [v.get("nodes_pearson") for v in real.get("per_seed", {}).values()]
            rows.append((bench, real["nodes_pearson"].get("mean"), per))
    if rows:
        ok = all(m is not None and all(v is not None and v >= 0.95 for v in per)
                 for _, m, per in rows)  # fmt: skip
        nums = "; ".join(f"{n}: {_g(m)} (models: {', '.join(_g(v) for v in per)})"
                         for n, m, per in rows)  # fmt: skip
        out.append({"goal": "Real's sites agree with exact node patching, Pearson ≥ 0.95",
                    "met": _met(ok), "numbers": nums})  # fmt: skip
    cmds, oks, fewer = [], [], []
    for bench, entry in b.items():
        m = entry["methods"]
        ig = next((k for k in m if k.startswith("EAP-IG")), None)
        if not {"Real", "EAP"} <= set(m) or ig is None:
            continue
        r, e, i = (m[k]["cmd"]["mean"] for k in ("Real", "EAP", ig))
        oks.append(None if None in (r, e, i) else r <= i and r <= e / 2)
        cmds.append(f"{bench}: {_g(r)} vs {ig} {_g(i)}, EAP {_g(e)}")
        pairs = list(zip(m["Real"]["edges_needed"], m["EAP"]["edges_needed"]))
        fewer.append(all(x is not None and y is not None and x < y for x, y in pairs))
        cmds[-1] += (
            f"; edges Real {_list(m['Real']['edges_needed'])}, EAP "
            f"{_list(m['EAP']['edges_needed'])}"
        )
    if cmds:
        out.append(
            {
                "goal": "CMD ≤ EAP-IG's and ≤ half of EAP's",
                "met": _met(None if None in oks else all(oks)),
                "numbers": "; ".join(cmds),
            }
        )
        out.append({"goal": f"f ≥ {summary['level']} with fewer edges than EAP",
                    "met": _met(all(fewer)), "numbers": "see the line above"})  # fmt: skip
    ind = summary.get("induction")
    if ind:
        per = []
        for row in ind:
            r = row.get("Real", {})
            per.append(all(r.get(k) == 1.0 for k in INDUCTION))
        out.append({"goal": "induction circuit in Real's top 3 heads / top 5 edges, every model",
                    "met": _met(all(per)),
                    "numbers": "; ".join(f"seed {r['seed']}: worst ranks "
                                         f"{_ranks(r.get('Real', {}))}" for r in ind)})  # fmt: skip
    costs = []
    for bench, entry in b.items():
        m = entry["methods"]
        if "Real" in m and "patching" in m and m["Real"].get("forwards"):
            costs.append((bench, m["patching"]["forwards"] / m["Real"]["forwards"],
                          m["Real"]["forwards"], m["patching"]["forwards"],
                          entry.get("seconds_per_model", {})))  # fmt: skip
    if costs:
        out.append({"goal": "circuit ≥ 100x cheaper than exact edge patching",
                    "met": _met(all(c[1] >= 100 for c in costs)),
                    "numbers": "; ".join(f"{n}: {x:.1f}x ({r:.0f} vs {p:.0f} "
                                         "forward-equivalents per pair)"
                                         for n, x, r, p, _ in costs)})  # fmt: skip
        out.append({"goal": "one benchmark and seed in minutes",
                    "met": _met(all(v is not None and v < 600 for *_, sec in costs
                                    for v in sec.values())),
                    "numbers": "; ".join(f"{n}: " + ", ".join(f"{_g(v, '.0f')} s" for v in
                                         sec.values()) for n, *_, sec in costs)})  # fmt: skip
    return out


def _ranks(r) -> str:
    """previous / induction / K edge, positions summed (per position)."""
    g = [_g(r.get(f"worst_{k}"), "g") for k in RANKS]
    return "/".join(g[:3]) + " (per position " + "/".join(g[3:]) + ")"


def _list(v) -> str:
    return ", ".join("-" if x is None else str(x) for x in v)


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
