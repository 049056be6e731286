"""Prints the tables of docs/paper_real_model.md from the runs that made them.

    semiring-backprop experiment sva --model smol --out runs/sva-smol \\
        --set synthetic=1000 threads=1
    semiring-backprop experiment entropy --model smol --out runs/entropy-smol \\
        --set synthetic=1000 threads=1
    python docs/paper_tables.py runs/sva-smol runs/entropy-smol

Every number is read from the runs' files (``summary.json``, ``branches.csv``,
``ablation.csv``); nothing is computed here but means over layers and rounding.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

ATTENTION = ("skip", "query", "key", "value")
GROUPS = ("subject", "attractor", "all")


def _md(frame: pd.DataFrame, floats: str = "{:.4g}") -> str:
    cols = list(frame.columns)
    fmt = lambda v: floats.format(v) if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in frame.itertuples(False)]
    return "\n".join(lines)


def accuracy(summary: dict) -> str:
    acc = summary["accuracy"]
    rows = [{"attractors": k, "pairs": v["pairs"], "correct": v["correct"],
             "accuracy": v["accuracy"]} for k, v in acc["by_attractors"].items()]  # fmt: skip
    rows.append({"attractors": "all", "pairs": acc["all"]["pairs"],
                 "correct": acc["all"]["correct"], "accuracy": acc["all"]["accuracy"]})  # fmt: skip
    return _md(pd.DataFrame(rows), "{:.3f}")


def _attention(table: pd.DataFrame, group: str) -> pd.DataFrame:
    """Layer x branch: the attention input's branch values for ``group`` (ours:
    ``MaxProduct(neuron)``, ⊕ over the hidden units)."""
    t = table[(table["semiring"] == "MaxProduct(neuron)") & (table["aggregation"] == "oplus")
              & (table["sublayer"] == "attention") & (table["token_group"] == group)]  # fmt: skip
    return t.pivot_table(index="layer", columns="branch", values="value").reindex(
        columns=list(ATTENTION))


def branches(table: pd.DataFrame, group: str) -> str:
    """Per layer, the attention input's four branches for ``group`` (the mean over pairs
    of the ⊕ of the group's paths leaving through each), the winner, and the key's share
    of key + value."""
    wide = _attention(table, group)
    wide["top"] = wide.idxmax(axis=1)
    wide["key / (key + value)"] = wide["key"] / (wide["key"] + wide["value"])
    wide = wide.reset_index()
    return _md(wide, "{:.3g}")


def ablation(table: pd.DataFrame, branches_table: pd.DataFrame) -> str:
    """Per layer, the mean change of the margin (ablated - clean, ± its standard error)
    for each method and branch, beside the top path's reading of the same two edges:
    the subject's key and value values (MaxProduct(neuron), oplus) and the key's share."""
    top = _attention(branches_table, "subject")
    rows = []
    for layer, part in table.groupby("layer", sort=True):
        row = {"layer": int(layer)}
        for _, r in part.iterrows():
            se, cell = r["margin_change_se"], f"{r['margin_change']:+.3f}"
            row[f"{r['method']} {r['branch']}"] = f"{cell} ± {se:.3f}" if pd.notna(se) else cell
        k, v = top.loc[layer, "key"], top.loc[layer, "value"]
        row["top path: key"], row["top path: value"] = f"{k:.3g}", f"{v:.3g}"
        row["key / (key + value)"] = f"{k / (k + v):.2f}"
        rows.append(row)
    return _md(pd.DataFrame(rows))


def ablation_accuracy(table: pd.DataFrame) -> str:
    """The five layers whose removal lowers the margin most, per method and branch."""
    rows = []
    for (method, branch), part in table.groupby(["method", "branch"], sort=False):
        worst = part.nsmallest(5, "margin_change")
        for _, r in worst.iterrows():
            rows.append({"method": method, "branch": branch, "layer": int(r["layer"]),
                         "margin change": r["margin_change"], "accuracy": r["accuracy_ablated"],
                         "accuracy, clean": r["accuracy_clean"]})  # fmt: skip
    return _md(pd.DataFrame(rows), "{:.3f}")


def entropy(summary: dict) -> str:
    length = summary["length"]
    rows = [{"tokens": k, "sentences": v["sentences"], "mean entropy (nats)": v["entropy"]}
            for k, v in length["by_tokens"].items()]  # fmt: skip
    out = _md(pd.DataFrame(rows), "{:.2f}")
    out += (f"\n\nSpearman of entropy against length: {length['spearman_rho']:.3f} "
            f"(p = {length['p']:.2g}, n = {length['n']})\n\n")  # fmt: skip
    rows = [{"tokens": k, "sentences": v["n"], "Spearman (attractors, entropy)": v["spearman_rho"],
             "p": v["p"]} for k, v in summary["attractors"].items()]  # fmt: skip
    return out + _md(pd.DataFrame(rows), "{:.3g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sva", type=Path, help="the directory of `experiment sva`")
    parser.add_argument("entropy", type=Path, nargs="?", help="that of `experiment entropy`")
    args = parser.parse_args(argv)
    summary = json.loads((args.sva / "summary.json").read_text())
    table = pd.read_csv(args.sva / "branches.csv")
    print("## Accuracy by attractor count\n\n" + accuracy(summary) + "\n")
    for group in GROUPS:
        print(f"## Branches at the attention input, {group}\n\n" + branches(table, group) + "\n")
    if (args.sva / "ablation.csv").exists():
        abl = pd.read_csv(args.sva / "ablation.csv")
        print("## Ablation, margin change per layer\n\n" + ablation(abl, table) + "\n")
        print("## Ablation, the strongest layers\n\n" + ablation_accuracy(abl) + "\n")
    print("## The paper's quantity\n\n" + json.dumps(summary.get("paper"), indent=1) + "\n")
    if args.entropy is not None:
        print("## Entropy\n\n" + entropy(json.loads((args.entropy / "summary.json")
                                                     .read_text())) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
