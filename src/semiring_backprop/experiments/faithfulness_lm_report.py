"""The real-model faithfulness benchmark's tables and summary (:mod:`.faithfulness_lm`).

The toy experiment's report (:mod:`.faithfulness_report`) writes the curves, the
per-pair method rows, ``table.md``, the figure and ``summary.json`` with each task as a
benchmark (one model: the seed of the pairs stands where the toy experiment has a
model's seed). Added here: ``lm_methods.csv``, one row per task and method with the
means over the pairs of every agreement (sites, heads with positions summed, sampled
edges), CPR, CMD and cost; and in ``summary.json`` the model, that table, the ground
truth's cost and each task's dropped pairs and split words.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..runner.records import write_json
from . import faithfulness_report as toy
from .common import write_csv

__all__ = ["RECORD_FIELDS", "check_methods", "lm_table", "write"]

RECORD_FIELDS = (*toy.RECORD_FIELDS, "clean_text", "corrupted_text", "answer", "foil",
                 "tokens", "sites", "sampled_edges", "edge_patching")  # fmt: skip
check_methods = toy.check_methods
AGREEMENT = tuple(f"{w}_{k}" for w in ("nodes", "heads", "edges")
                  for k in ("pearson", "kendall", "top_n_overlap"))  # fmt: skip


def lm_table(records: dict, methods_frame):
    """Per task and method: the means over the pairs of the agreements, of each pair's
    CPR and CMD, of the graph forwards and seconds; and the pairs counted."""
    import pandas as pd

    rows = []
    for (task, _), recs in records.items():
        for r in recs:
            for m in r["methods"]:
                rows.append({"task": task, "pair": r["key"], "method": m["method"],
                             **{k: m.get(k) for k in AGREEMENT}})  # fmt: skip
    if not rows:
        return pd.DataFrame()
    frame = pd.DataFrame(rows)
    per = methods_frame.rename(columns={"benchmark": "task"})[
        ["task", "pair", "method", "cpr", "cmd", "evaluations", "seconds"]]  # fmt: skip
    frame = frame.merge(per, on=["task", "pair", "method"], how="left")
    numbers = [*AGREEMENT, "cpr", "cmd", "evaluations", "seconds"]
    frame[numbers] = frame[numbers].apply(pd.to_numeric, errors="coerce")
    g = frame.groupby(["task", "method"], sort=False)
    table = g[numbers].mean()
    table["pairs"] = g["pair"].nunique()
    return table.reset_index()


def _cost(records: dict) -> dict:
    out = {}
    for (task, _), recs in records.items():
        if not recs:
            continue
        n = len(recs)

        def mean(key, i, recs=recs, n=n):
            return sum(r[key][i] for r in recs) / n

        out[task] = {"pairs": n, "tokens": [r["tokens"] for r in recs],
                     "sites": recs[0]["sites"], "edges": [r["edges"] for r in recs],
                     "sampled_edges": [r["sampled_edges"] for r in recs],
                     "node_patching_forwards": mean("node_patching", 0),
                     "node_patching_seconds": mean("node_patching", 1),
                     "edge_patching_forwards": mean("edge_patching", 0),
                     "edge_patching_seconds": mean("edge_patching", 1),
                     "forward_seconds": sum(r["forward_seconds"] for r in recs) / n,
                     "edge_list_seconds": sum(r.get("edge_list_seconds", 0) for r in recs) / n,
                     "curve_seconds": sum(r.get("curve_seconds", 0) for r in recs) / n,
                     "pair_seconds": sum(r["seconds"] for r in recs) / n,
                     "margin_clean": [r["model_clean"] for r in recs],
                     "margin_corrupted": [r["model_corrupted"] for r in recs]}  # fmt: skip
    return out


def _markdown(table) -> str:
    cols = ["nodes_pearson", "nodes_kendall", "heads_pearson", "heads_kendall",
            "edges_pearson", "edges_kendall", "edges_top_n_overlap", "cpr", "cmd",
            "evaluations", "seconds"]  # fmt: skip
    lines = ["| task | method | " + " | ".join(cols) + " | pairs |",
             "|---|---|" + "---|" * (len(cols) + 1)]  # fmt: skip
    for r in table.itertuples(index=False):
        v = r._asdict()
        cells = ["-" if v[c] is None or (isinstance(v[c], float) and math.isnan(v[c]))
                 else f"{v[c]:.3g}" for c in cols]  # fmt: skip
        lines.append(f"| {v['task']} | {v['method']} | " + " | ".join(cells) + f" | {v['pairs']} |")
    return "\n".join(lines) + "\n"


def write(out, config, records: dict, tasks: dict) -> dict:
    """The toy report's files, then ``lm_methods.csv`` / ``lm_table.md`` and the
    summary with the model, the per-task table and the costs."""
    from .._files import atomic_write

    out = Path(out)
    result = toy.write(out, config, records, [])
    methods_frame = toy.tables(records)["methods"]
    table = lm_table(records, methods_frame)
    s = result["summary"]
    s["model"], s["tasks"], s["cost"] = config.model, tasks, _cost(records)
    s["lm_methods"] = table.to_dict("records") if len(table) else []
    if len(table):
        result["files"].append(str(write_csv(table, out / "lm_methods.csv")))
        text = _markdown(table)
        atomic_write(out / "lm_table.md", lambda tmp: tmp.write_text(text, encoding="utf-8"))
        result["files"].append(str(out / "lm_table.md"))
    write_json(out / "summary.json", s)
    return result
