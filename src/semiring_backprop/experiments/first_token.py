"""Paper §5.1, Fig. 2: which attention branch carries the top gradient path, per token.

A one-layer BERT-style classifier learns FirstTokenRepeatedOnce (does the first token
occur again?). For every validation example the gold-class logit is explained with
``MaxProduct`` at both granularities, and the top path value at the attention input is
split over its four consumers: the skip connection and the query, key and value
projections. The paper found the first token's top path goes through the query, and the
repeated token's through the key (the largest value of all).

One trained model is one sample: ``seeds`` models (default 3, seeds ``seed``,
``seed + 1``, ...) are trained on the same data and explained alike; the summary gives the
mean over models, the spread, and how many models agree on each token's top branch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .._threads import threads
from ..api import Backprop
from ..semirings import MaxProduct
from .common import (
    GoldLogit,
    Records,
    bert_classifier,
    lock,
    same_settings,
    train,
    trained,
    write_csv,
    write_json,
)

BRANCHES = ("skip", "query", "key", "value")
CLASSES = ("first", "repeated", "other")
AGGREGATIONS = ("oplus", "bucket_sum")
GRANULARITIES = ("neuron", "tensor")
WHERE = "bert.encoder.layer.0.attention:input"


@dataclass(frozen=True)
class Config:
    n: int = 10_000
    length: int = 10
    vocab_size: int = 20
    hidden: int = 16
    heads: int = 2
    intermediate: int = 32
    lr: float = 1e-3
    batch_size: int = 32
    max_epochs: int = 100  #: a cap: training stops at 100% validation accuracy
    seed: int = 0
    seeds: int = 3  #: models trained, with seeds seed, seed + 1, ...
    explain_batch: int = 200  #: validation examples per semiring pass
    explain_limit: int | None = None  #: explain only this many validation examples

    @classmethod
    def quick(cls) -> Config:
        return replace(cls(), explain_limit=200)  # the same models: training takes ~70 s


def token_classes(x: torch.Tensor, y: torch.Tensor) -> list[list[str]]:
    """``first`` at position 0, ``repeated`` where a positive repeats it, else ``other``."""
    out = []
    for ids, label in zip(x.tolist(), y.tolist()):
        row = ["first"] + ["other"] * (len(ids) - 1)
        if label == 1:
            for t in range(1, len(ids)):
                if ids[t] == ids[0]:
                    row[t] = "repeated"
        out.append(row)
    return out


@threads()
def run(out, config: Config | None = None, progress: bool = True) -> dict:
    """Train (or reload), explain the validation set, write CSV, figure and summary
    (on one thread, or ``SEMIRING_BACKPROP_THREADS``; training always on one)."""
    import pandas as pd

    from ..data import make_task

    config = config or Config()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # which examples are explained, how many per pass and how many models change no
    # result on disk (each model's files are its own)
    same_settings(out, config, free=("explain_batch", "explain_limit", "seeds"))
    task = make_task("FirstTokenRepeatedOnce", config.n, length=config.length,
                     vocab_size=config.vocab_size, seed=config.seed)  # fmt: skip
    frames, models = [], []
    for seed in range(config.seed, config.seed + config.seeds):
        model = bert_classifier(
            config.vocab_size, 2, hidden=config.hidden, heads=config.heads,
            intermediate=config.intermediate, layers=1, length=config.length, seed=seed,
        )  # fmt: skip
        model, history = trained(model, out / f"seed{seed}" / "model", lambda m, s=seed: train(
            m, task.train, task.val, epochs=config.max_epochs, lr=config.lr,
            batch_size=config.batch_size, seed=s, stop_at=1.0, progress=progress,
            desc=f"train (seed {s})",
        ))  # fmt: skip
        rows = explain(model, task.val, out / f"seed{seed}" / "values.jsonl", config, progress)
        frames.append(_frame(rows).assign(seed=seed))
        models.append({"seed": seed, "val_accuracy": history[-1]["val_accuracy"],
                       "epochs": len(history)})  # fmt: skip
    frame = pd.concat(frames, ignore_index=True)
    write_csv(frame, out / "branches.csv")
    summary = {**_summary(frame), "models": models}
    write_json(out / "summary.json", summary)
    files = [str(out / "branches.csv"), str(out / "summary.json")]
    try:
        files.append(figure(summary, out / "figure.png"))
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"summary": summary, "val_accuracy": min(m["val_accuracy"] for m in models),
            "epochs": [m["epochs"] for m in models], "models": models,
            "explained": int(frame["example"].nunique()), "files": files}  # fmt: skip


def explain(model, split, path, config: Config, progress: bool = True) -> list[dict]:
    """One line per validation example (written as it is computed; a rerun resumes)."""
    from tqdm.auto import tqdm

    records = Records(path)
    srs = [MaxProduct(g) for g in GRANULARITIES]
    bp = Backprop(GoldLogit(model).eval(), output=lambda y: y, semirings=srs, per_example=True)
    n = len(split) if config.explain_limit is None else min(config.explain_limit, len(split))
    classes = token_classes(split.x[:n], split.y[:n])
    starts = [
        s
        for s in range(0, n, config.explain_batch)
        if not all(records.has(i) for i in range(s, min(s + config.explain_batch, n)))
    ]
    for s in tqdm(starts, desc="explain", disable=not progress, leave=False):
        e = min(s + config.explain_batch, n)
        res = bp((split.x[s:e], split.y[s:e]))
        values: dict = {}
        for sr in srs:
            for agg in AGGREGATIONS:
                df = res.branches(WHERE, sr, aggregate=agg)
                df = df[df["role"].isin(BRANCHES)]
                for r in df.itertuples():
                    ex = int(getattr(r, "example", 0))
                    key = (agg, sr.granularity, int(r.token), r.role)
                    values.setdefault(ex, {})[key] = float(r.value)
        for ex, vals in sorted(values.items()):
            i = s + ex
            if records.has(i):
                continue
            records.add({
                "key": i, "label": int(split.y[i]), "tokens": split.x[i].tolist(),
                "classes": classes[i],
                "values": [[*k, v] for k, v in vals.items()],
            })  # fmt: skip
    return [r for r in records.rows if r["key"] < n]


def _frame(rows):
    """Tidy rows; a branch with no path (the semiring zero, -inf) has value NaN."""
    import pandas as pd

    flat = [
        {"example": r["key"], "label": r["label"], "token": tok, "token_class": r["classes"][tok],
         "aggregation": agg, "granularity": gran, "branch": branch, "value": value}
        for r in rows for agg, gran, tok, branch, value in r["values"]
    ]  # fmt: skip
    frame = pd.DataFrame(flat)
    frame.loc[frame["value"] == float("-inf"), "value"] = float("nan")
    return frame


def _summary(frame) -> dict:
    """``{aggregation: {granularity: {token_class: {branch: mean value}}}}``: per model,
    the mean over the tokens where the branch has a path; then the mean over models
    (``None`` where it never has one, e.g. the query of a token other than the first,
    which the readout never queries). ``spread`` holds the models' standard deviation,
    min and max in the same layout; ``agreement`` (⊕ aggregation), per granularity and
    token class, the branch most models find largest and how many do."""
    keys = ["aggregation", "granularity", "token_class", "branch"]
    per_model = frame.groupby([*keys, "seed"])["value"].mean().reset_index()
    stats = per_model.groupby(keys)["value"].agg(["mean", "std", "min", "max"])
    out: dict = {}
    spread: dict = {}
    for (agg, gran, cls, branch), row in stats.iterrows():
        number = lambda v: float(v) if v == v else None  # noqa: E731  (NaN: None)
        out.setdefault(agg, {}).setdefault(gran, {}).setdefault(cls, {})[branch] = number(
            row["mean"]
        )
        spread.setdefault(agg, {}).setdefault(gran, {}).setdefault(cls, {})[branch] = {
            k: number(row[k]) for k in ("std", "min", "max")
        }
    out["spread"] = spread
    agreement: dict = {}
    oplus = per_model[per_model["aggregation"] == "oplus"].dropna(subset=["value"])
    for (gran, cls), part in oplus.groupby(["granularity", "token_class"]):
        winners = part.loc[part.groupby("seed")["value"].idxmax(), "branch"]
        counts = winners.value_counts()
        agreement.setdefault(gran, {})[cls] = {
            "branch": str(counts.index[0]),
            "models": int(counts.iloc[0]),
            "of": len(winners),
        }
    out["agreement"] = agreement
    return out


def figure(summary: dict, path) -> str:
    """Fig. 2: mean branch value per token class, one panel per aggregation × granularity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(AGGREGATIONS), len(GRANULARITIES), figsize=(10, 7),
                             squeeze=False)  # fmt: skip
    width = 0.8 / len(BRANCHES)
    for i, agg in enumerate(AGGREGATIONS):
        for j, gran in enumerate(GRANULARITIES):
            ax = axes[i][j]
            table = summary.get(agg, {}).get(gran, {})
            spread = summary.get("spread", {}).get(agg, {}).get(gran, {})
            for b, branch in enumerate(BRANCHES):
                ys = [table.get(c, {}).get(branch) for c in CLASSES]
                ys = [float("nan") if v is None else v for v in ys]
                sd = [(spread.get(c, {}).get(branch) or {}).get("std") for c in CLASSES]
                sd = [0.0 if v is None else v for v in sd]
                xs = [k + (b - (len(BRANCHES) - 1) / 2) * width for k in range(len(CLASSES))]
                ax.bar(xs, ys, width, yerr=sd, capsize=2, label=branch)
            ax.set_xticks(range(len(CLASSES)), CLASSES)
            ax.set_title(f"{agg}, {gran} granularity")
            ax.set_ylabel("mean top path value (± sd over models)")
            ax.axhline(0, color="black", linewidth=0.5)
    axes[0][0].legend(title="branch")
    fig.suptitle("FirstTokenRepeatedOnce: top gradient path value by attention branch")
    fig.tight_layout()
    from .._files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))
    plt.close(fig)
    return str(path)


def reading(summary: dict) -> str:
    """One line on what the table shows, per granularity (⊕ aggregation)."""
    parts = []
    for gran in GRANULARITIES:
        table = summary.get("oplus", {}).get(gran, {})
        best = {c: max((b for b in t if t[b] is not None), key=t.get) for c, t in table.items()}
        top = max(((c, b) for c, t in table.items() for b, v in t.items() if v is not None),
                  key=lambda cb: table[cb[0]][cb[1]])  # fmt: skip
        parts.append(
            f"{gran} granularity: the first token's top path goes mostly through the "
            f"{best.get('first')}, the repeated token's through the {best.get('repeated')}; "
            f"largest of all: {top[0]}/{top[1]}"
        )
    return "; ".join(parts) + " (paper, tensor granularity: first/query, repeated/key)."


def table_text(summary: dict) -> str:
    """The branch table (mean top path value per token class, ± the models' standard
    deviation), one block per setting."""
    lines = []
    for agg in AGGREGATIONS:
        for gran in GRANULARITIES:
            lines.append(f"{agg}, {gran} granularity")
            lines.append("  token     " + "".join(f" {b:>17}" for b in BRANCHES))
            for cls in CLASSES:
                row = summary.get(agg, {}).get(gran, {}).get(cls, {})
                sds = summary.get("spread", {}).get(agg, {}).get(gran, {}).get(cls, {})
                cells = ""
                for b in BRANCHES:
                    sd = (sds.get(b) or {}).get("std")
                    text = "-" if row.get(b) is None else f"{row[b]:.3g}"
                    text += "" if sd is None or row.get(b) is None else f" ± {sd:.2g}"
                    cells += f" {text:>17}"
                lines.append(f"  {cls:<10} {cells}")
    return "\n".join(lines)


def agreement_text(summary: dict) -> str:
    """How many trained models agree on each token's top branch (⊕ aggregation)."""
    parts = []
    for gran in GRANULARITIES:
        table = summary.get("agreement", {}).get(gran, {})
        said = [
            f"the {cls} token's through the {a['branch']} in {a['models']} of {a['of']}"
            for cls in ("first", "repeated")
            if (a := table.get(cls))
        ]
        if said:
            parts.append(f"{gran} granularity: " + ", ".join(said))
    return "; ".join(parts)


#: what the demo's block titles mean, printed above the table
LEGEND = """Each block's title says how the values were computed:
  oplus        a branch's value is the oplus (here: the max) over the token's hidden
               units: the value of the single best path through that branch;
  bucket_sum   each hidden unit goes to the branch its best path leaves through, and
               a branch's value is the sum over the units it won;
  neuron       granularity: the exact best path, every number of every tensor its own
               node of the graph;
  tensor       granularity: the paper's variant (what its figures show): sums inside
               each op, a max only where one tensor feeds several ops.
"""


def demo(out="runs/demo", progress: bool = True, print_fn=print) -> dict:
    """``first-token-repeated --quick``: train three models (about 70 s in all on 2
    cores), explain 200 validation examples with each, print the branch table with a
    one-line reading and how many models agree."""
    with lock(out):
        result = run(out, Config.quick(), progress=progress)
    p = print_fn
    models = result["models"]
    accuracies = ", ".join(f"{m['val_accuracy']:.1%}" for m in models)
    epochs = ", ".join(str(m["epochs"]) for m in models)
    p("FirstTokenRepeatedOnce (does the first token occur again?): "
      f"{len(models)} 1-layer BERT-style")  # fmt: skip
    p(f"classifiers (seeds {models[0]['seed']}-{models[-1]['seed']}) reached {accuracies} "
      f"validation accuracy in {epochs} epochs.")  # fmt: skip
    p(f"For {result['explained']} validation examples, the gold-class logit's top gradient "
      "path value (MaxProduct)")  # fmt: skip
    p("at the attention input, split over its consumers (skip / query / key / value), mean")
    p("per token class over the models ± their standard deviation ('-': that branch never")
    p("reaches the output from such a token).\n")
    p(LEGEND)
    p(table_text(result["summary"]))
    p("\nReading (mean over models): " + reading(result["summary"]))
    p("Models agreeing (top branch per model): " + agreement_text(result["summary"]) + ".")
    p(f"\nwrote {', '.join(result['files'])}")
    return result
