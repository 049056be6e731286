"""The tables, summary and figures of ``sva`` on a causal LM (:mod:`.sva_causal`).

The branch and entropy tables are the masked path's (:mod:`.sva_report`); beside them:
the accuracy by attractor count (:func:`accuracy`), the branch the top path names per
layer for each token group (:func:`top_branches`), and the ablation table with its
figure (:func:`ablation_figure`).
"""

from __future__ import annotations

from pathlib import Path

from ..runner.records import write_json
from . import sva_ablation, sva_report
from .common import write_csv

TARGET = "logit(correct verb) − logit(wrong verb) at the last position (before the verb)"
ATTENTION = ("skip", "query", "key", "value")
ACCURACY = (
    "the share of pairs whose margin logit(correct) - logit(wrong) at the verb's position "
    "is positive (the paper's is_correct)"
)


def accuracy(examples) -> dict:
    """``{"all": {...}, "by_attractors": {count: {"pairs", "correct", "accuracy"}}}``."""

    def one(part) -> dict:
        correct = int((part["score"] > 0).sum())
        return {"pairs": int(len(part)), "correct": correct,
                "accuracy": correct / len(part) if len(part) else None}  # fmt: skip

    by = {int(k): one(part) for k, part in examples.groupby("attractors", sort=True)}
    return {"what": ACCURACY, "all": one(examples), "by_attractors": by}


def top_branches(branches, semiring: str = "MaxProduct", aggregation: str = "oplus") -> dict:
    """``{group: {layer: branch}}``: at each layer's attention input, the branch with the
    highest mean top path value for the token group (``branches.csv``'s rows)."""
    b = branches[branches["semiring"].str.startswith(semiring)
                 & (branches["aggregation"] == aggregation)
                 & (branches["sublayer"] == "attention")
                 & branches["branch"].isin(ATTENTION)].dropna(subset=["value"])  # fmt: skip
    out: dict = {}
    for (group, layer), part in b.groupby(["token_group", "layer"], sort=True):
        out.setdefault(group, {})[int(layer)] = str(part.loc[part["value"].idxmax(), "branch"])
    return out


def report(out: Path, tables: dict, order: dict, skips: dict, config, malformed, data,
           paper, paper_error, records, patch_skips) -> dict:  # fmt: skip
    values = sva_report.group_values(tables["branches"], tables["tokens"])
    branches = sva_report.branches_table(values)
    entropy = sva_report.entropy_table(tables["examples"], tables["tokens"], order,
                                       config.length_bins)  # fmt: skip
    write_csv(branches, out / "branches.csv")
    write_csv(entropy, out / "entropy.csv")
    summary = sva_report.summary(branches, entropy, skips, 0, config, malformed)
    del summary["multi_token_verbs"]  # a masked LM's question: here a verb is one token
    summary["model_kind"] = "causal"
    summary["target"] = TARGET
    summary["accuracy"] = accuracy(tables["examples"])
    top = top_branches(branches, aggregation=config.aggregation[0])
    summary["top_branch"] = top
    names = ["branches.csv", "entropy.csv"]
    if paper is not None:
        table = sva_report.paper_table(paper["branches"], paper["tokens"])
        write_csv(table, out / "branches_paper.csv")
        summary["paper"] = sva_report.paper_summary(table, paper["examples"])
        names.append("branches_paper.csv")
    else:
        (out / "branches_paper.csv").unlink(missing_ok=True)
        if paper_error is not None:
            summary["paper"] = {"quantity": sva_report.PAPER_QUANTITY, "explained": 0,
                                "error": paper_error.splitlines()[0][:400]}  # fmt: skip
    ablation = None
    if records is not None:
        ablation = sva_ablation.table(records, top.get("subject"))
        write_csv(ablation, out / "ablation.csv")
        names.append("ablation.csv")
        summary["ablation"] = _ablation_summary(ablation, records, patch_skips)
    else:
        (out / "ablation.csv").unlink(missing_ok=True)
        if "error" in patch_skips:
            summary["ablation"] = {"error": patch_skips["error"]}
    names.append("summary.json")
    write_json(out / "summary.json", summary)
    files = [str(out / f) for f in names]
    try:
        files.append(sva_report.branch_figure(summary, out / "branches.png", TARGET))
        files.append(sva_report.attractor_figure(entropy, summary, out / "attractors.png",
                                                 TARGET))  # fmt: skip
        if ablation is not None and len(ablation):
            files.append(ablation_figure(ablation, summary, out / "ablation.png"))
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"summary": summary, "files": files, "explained": len(entropy),
            "skipped": len(skips), "data": str(data)}  # fmt: skip


def _ablation_summary(table, records, patch_skips: dict) -> dict:
    """Per method and branch, the layer whose ablation moves the margin most, and the
    pairs patched or skipped."""
    out: dict = {"pairs": len(records), "patched": int(sum(r["patch_key"] is not None
                                                          for r in records)),
                 "patch_skipped": patch_skips, "strongest": {}}  # fmt: skip
    for (method, branch), part in table.groupby(["method", "branch"], sort=True):
        r = part.loc[part["margin_change"].idxmin()]
        out["strongest"][f"{method}_{branch}"] = {
            "layer": int(r["layer"]), "margin_change": float(r["margin_change"]),
            "accuracy_ablated": float(r["accuracy_ablated"]),
            "accuracy_clean": float(r["accuracy_clean"]),
        }  # fmt: skip
    return out


def ablation_figure(table, summary: dict, path) -> str:
    """Per layer: the margin's mean change when the subject's key or value edge into the
    last query is ablated (mean, patch), over the subject's top path values per branch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import COLORS

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True)
    for (method, branch), part in table.groupby(["method", "branch"], sort=True):
        style = "-" if method == "patch" else "--"
        top.plot(part["layer"], part["margin_change"], style, marker="o", markersize=3,
                 color=COLORS.get(branch), label=f"{branch}, {method}")  # fmt: skip
    top.axhline(0, color="black", linewidth=0.5)
    top.set_ylabel("mean change of the margin")
    top.set_title("the subject's key / value edge into the last query, ablated", fontsize=10)
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    subject = summary["branches"].get("subject", {})
    for branch in ATTENTION:
        xs = [int(p.split(".")[0]) for p in subject if p.endswith(".attention")]
        ys = [subject[f"{x}.attention"].get(branch) for x in xs]
        ys = [float("nan") if y is None else y for y in ys]
        bottom.plot(xs, ys, marker="o", markersize=3, color=COLORS.get(branch), label=branch)
    bottom.set_xlabel("layer")
    bottom.set_ylabel("subject: mean top path value")
    bottom.set_yscale("symlog", linthresh=1e-6)
    bottom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    n = summary.get("ablation", {}).get("pairs", 0)
    fig.suptitle(f"Ablation against the top path: {summary.get('model', 'the model')}, {n} "
                 f"pairs\ntarget: {TARGET}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    from .._files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return str(path)
