"""A run's ``summary.json`` and figures, from its committed shards (all runs so far)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from ..errors import InputError
from . import store
from .records import Records, atomic_write, write_json
from .store import TABLES, current

#: malformed rows listed in the summary (all are counted)
LISTED = 100


def summarize(out: Path, settings, chosen, malformed, records, n_new: int, elapsed: float,
              figures: bool = True) -> dict:  # fmt: skip
    needed = ["semiring", "aggregation", "layer", "sublayer", "branch", "value", "winner", "path"]
    tables = load_results(out, columns={"branches": needed})  # the largest: what is read
    wanted = {ex.id for ex in chosen}
    now = current(records.rows, records.path)  # the last word on each example
    skipped = {i: d.skipped for i, d in now.items() if i in wanted and d.skipped is not None}
    reasons: dict = {}
    for reason in skipped.values():
        key = reason.splitlines()[0][:200]
        reasons[key] = reasons.get(key, 0) + 1
    ex = tables["examples"]
    explained = ex[ex["example_id"].isin(wanted)] if len(ex) else ex
    summary = {
        "settings": asdict(settings),
        "examples": len(chosen),
        "explained": len(explained),
        "skipped": len(skipped),
        "skip_reasons": reasons,
        "malformed": len(malformed),
        "malformed_rows": [{"source": m.source, "reason": m.reason} for m in malformed[:LISTED]],
        "this_run": {"explained": n_new, "seconds": round(elapsed, 3),
                     "examples_per_second": round(n_new / elapsed, 3) if n_new else None},
        "score": _describe(explained["score"]) if len(explained) else None,
        "tokens": _token_means(tables["tokens"]),
        "branches": _branch_means(tables["branches"]),
    }  # fmt: skip
    files = [str(out / "summary.json")]
    if figures and len(tables["branches"]):
        try:
            files += branch_figures(tables["branches"], out)
        except ImportError:  # matplotlib is the optional ``plots`` extra
            pass
    summary["files"] = [Path(f).name for f in files]
    write_json(out / "summary.json", summary)
    return {"summary": summary, "files": files, "explained": len(explained),
            "skipped": len(skipped), "malformed": len(malformed), "out": str(out)}  # fmt: skip


def _describe(s) -> dict:
    s = s.astype(float)
    return {"mean": float(s.mean()), "std": float(s.std()) if len(s) > 1 else 0.0,
            "min": float(s.min()), "max": float(s.max()),
            "target_preferred": float((s > 0).mean())}  # fmt: skip


def _token_means(tokens) -> dict:
    if not len(tokens):
        return {}
    skip = {"token", "word"}
    cols = [c for c in tokens.columns if tokens[c].dtype.kind == "f" and c not in skip]
    out = {}
    for c in cols:
        v = tokens[c][tokens[c].map(math.isfinite)]
        out[c] = float(v.mean()) if len(v) else None
    return out


def branch_means(branches):
    """Per semiring, layer, sublayer and branch: the mean value over examples and tokens
    where a path leaves through the branch (aggregation ``paper``: over all of them, its
    zeros kept, as the paper averaged), and the share of tokens it wins. The
    ``semiring`` column names the aggregation where it is not ⊕ ("MaxProduct, bucket_sum")."""
    paper = branches["aggregation"] == "paper" if "aggregation" in branches.columns else False
    branches = branches.assign(semiring=_labels(branches))
    live = branches[branches["path"] | paper]
    live = live[live["value"].map(math.isfinite)]
    keys = ["semiring", "layer", "sublayer", "branch"]
    mean = live.groupby(keys, sort=True)["value"].agg(value="mean", n="count")
    share = branches.groupby(keys, sort=True)["winner"].mean().rename("winner_share")
    return mean.join(share, how="outer").reset_index()


def _labels(branches):
    if "aggregation" not in branches.columns:
        return branches["semiring"]
    other = branches["aggregation"] != "oplus"
    return branches["semiring"].where(~other, branches["semiring"] + ", " + branches["aggregation"])


def _branch_means(branches) -> dict:
    if not len(branches):
        return {}
    out: dict = {}
    for r in branch_means(branches).itertuples():
        place = out.setdefault(r.semiring, {}).setdefault(f"{r.layer}.{r.sublayer}", {})
        place[r.branch] = {
            "mean": None if r.value != r.value else float(r.value),
            "winner_share": None if r.winner_share != r.winner_share else float(r.winner_share),
        }
    return out


def branch_figures(branches, out: Path) -> list[str]:
    """As Fig. 4 of the paper, over the data set: per layer and sublayer, each branch's
    mean value (one panel per semiring) and, for selective semirings, the share of
    tokens whose best value leaves through it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import COLORS

    table = branch_means(branches)
    files = []
    for column, label, name in (
        ("value", "mean value over examples and tokens", "branches"),
        ("winner_share", "share of tokens it wins", "winners"),
    ):
        srs = sorted(set(table["semiring"]))
        if column == "winner_share":
            srs = [s for s in srs if s.startswith(("MaxProduct", "MaxAbs", "TopK"))]
        if not srs:
            continue
        fig, axes = plt.subplots(len(srs), 1, figsize=(10, 2.8 * len(srs)), squeeze=False)
        for ax, sr in zip(axes[:, 0], srs):
            part = table[table["semiring"] == sr]
            places = sorted({(r.layer, r.sublayer) for r in part.itertuples()})
            kinds = [b for b in ("skip", "query", "key", "value", "mlp", "other")
                     if b in set(part["branch"])]  # fmt: skip
            width = 0.8 / max(len(kinds), 1)
            for k, branch in enumerate(kinds):
                rows = part[part["branch"] == branch].set_index(["layer", "sublayer"])[column]
                ys = [float(rows.get(p, math.nan)) for p in places]
                xs = [i + (k - (len(kinds) - 1) / 2) * width for i in range(len(places))]
                ax.bar(xs, ys, width, label=branch, color=COLORS.get(branch))
            ax.set_xticks(range(len(places)), [f"{layer} {sub}" for layer, sub in places])
            ax.set_title(sr)
            ax.set_ylabel(label, fontsize=8)
            ax.axhline(0, color="black", linewidth=0.5)
            ax.legend(title="branch", fontsize=7)
        fig.suptitle(f"branches per layer ({name}, over the data set)")
        fig.tight_layout()
        path = out / f"{name}.png"
        atomic_write(path, lambda tmp, fig=fig: fig.savefig(tmp, dpi=110))
        plt.close(fig)
        files.append(str(path))
    return files


def load_results(out, columns: dict | None = None) -> dict:
    """The committed tables of a run directory: ``{"examples", "tokens", "branches"}``
    as pandas DataFrames (shards in commit order; of an example explained again, only
    its last result); ``columns``: ``{table: [names]}`` reads only those columns of a
    table. Each file is checked against the size and hash its commit recorded: a file
    missing, cut off or changed is an error that names it (a rerun explains its
    examples again)."""
    import pandas as pd

    out = Path(out)
    if not (out / "done.jsonl").exists():
        raise InputError(f"{out} holds no run (no done.jsonl): run semiring-backprop run first")
    records = Records(out / "done.jsonl", key="shard")
    shards = store.live(records.rows, store.current(records.rows, records.path))
    tables = {}
    for table in TABLES:
        cols = (columns or {}).get(table)
        frames = [store.read_shard(out, table, name, row, ids, cols) for name, row, ids in shards]
        tables[table] = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return tables
