"""Paper §5.1, Fig. 2: which attention branch carries the top gradient path, per token.

A one-layer BERT-style classifier learns FirstTokenRepeatedOnce (does the first token
occur again?). For every validation example the gold-class logit is explained with
``MaxProduct`` at both granularities, and the top path value at the attention input is
split over its four consumers: the skip connection and the query, key and value
projections. The paper found the first token's top path goes through the query, and the
repeated token's through the key (the largest value of all).

With ``paper`` (the default) each example is explained a second time in the paper's
own quantity: traced as the paper's library (brunoflow) built its graph, at
tensor granularity, and aggregated as the paper did (``aggregate="paper"``: per token,
the best hidden unit's value goes to the branch that wins that unit, every other branch
gets 0, and the zeros are averaged in). ``paper_training`` trains the models as the paper
did (:data:`PAPER_TRAINING`: 42 epochs without stopping early, 512 positions, two token
types, dropout 0.2) instead of ours (no dropout, stop at 100% validation accuracy).

One trained model is one sample: ``seeds`` models (default 3, seeds ``seed``,
``seed + 1``, ...) are trained on the same data and explained alike; the summary gives the
mean over models, the spread, and how many models agree on each token's top branch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .._backprop import Backprop
from .._threads import threads
from ..errors import InputError
from ..runner.records import Records, lock, same_settings, write_json
from ..semirings import MaxProduct
from .common import GoldLogit, bert_classifier, train, trained, write_csv

BRANCHES = ("skip", "query", "key", "value")
CLASSES = ("first", "repeated", "other")
AGGREGATIONS = ("oplus", "bucket_sum")
GRANULARITIES = ("neuron", "tensor")
WHERE = "bert.encoder.layer.0.attention:input"
#: the paper's quantity's key in the tables: aggregation "paper", granularity "tensor"
PAPER = ("paper", "tensor")

#: how the paper trained its §5.1 model (``Config(paper_training=True)``); the first five
#: are Config fields (the defaults), the rest are fixed by the setting
PAPER_TRAINING = {
    "n": 10_000, "hidden": 16, "heads": 2, "lr": 1e-3, "batch_size": 32,
    "layers": 1, "epochs": 42, "stop_early": False, "max_position_embeddings": 512,
    "type_vocab_size": 2, "dropout": 0.2,
}  # fmt: skip


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
    #: also the paper's quantity (paper mode, tensor granularity, aggregate="paper")
    paper: bool = True
    #: train as the paper did (PAPER_TRAINING) instead of stopping at 100% accuracy
    paper_training: bool = False

    @classmethod
    def quick(cls) -> Config:
        return replace(cls(), explain_limit=200)  # the same models: training takes ~70 s

    @classmethod
    def paper_trained(cls) -> Config:
        """The paper's §5.1 setting: models trained as the paper did, explained in both
        quantities (ours and the paper's)."""
        return replace(cls(), paper_training=True, paper=True)


def training(config: Config) -> dict:
    """How each model is built and trained: ``layers``, ``epochs``, ``stop_early``,
    ``max_position_embeddings``, ``type_vocab_size`` and ``dropout`` (plus the Config's
    ``n``, ``hidden``, ``heads``, ``lr`` and ``batch_size``). With ``paper_training`` these
    are :data:`PAPER_TRAINING`, and a Config field set otherwise is refused."""
    if config.paper_training:
        other = [k for k in PAPER_TRAINING if hasattr(config, k)
                 and getattr(config, k) != PAPER_TRAINING[k]]  # fmt: skip
        if other:
            said = ", ".join(f"{k}={getattr(config, k)!r} (the paper: {PAPER_TRAINING[k]!r})"
                             for k in other)  # fmt: skip
            raise InputError(
                f"paper_training=True trains as the paper did; {said} contradicts it "
                "(leave these at their defaults, or drop paper_training)"
            )
        return dict(PAPER_TRAINING)
    return {
        "n": config.n, "hidden": config.hidden, "heads": config.heads, "lr": config.lr,
        "batch_size": config.batch_size, "layers": 1, "epochs": config.max_epochs,
        "stop_early": True, "max_position_embeddings": max(config.length, 8),
        "type_vocab_size": 1, "dropout": 0.0,
    }  # fmt: skip


def model(config: Config, seed: int):
    """One untrained classifier of the experiment (:func:`training`'s shape)."""
    how = training(config)
    return bert_classifier(
        config.vocab_size, 2, hidden=how["hidden"], heads=how["heads"],
        intermediate=config.intermediate, layers=how["layers"], length=config.length,
        seed=seed, max_positions=how["max_position_embeddings"],
        type_vocab_size=how["type_vocab_size"], dropout=how["dropout"],
    )  # fmt: skip


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
    same_settings(out, config, free=("explain_batch", "explain_limit", "seeds", "paper"))
    how = training(config)  # refuses a paper_training config with other sizes
    task = make_task("FirstTokenRepeatedOnce", config.n, length=config.length,
                     vocab_size=config.vocab_size, seed=config.seed)  # fmt: skip
    frames, models = [], []
    for seed in range(config.seed, config.seed + config.seeds):
        net, history = trained(model(config, seed), out / f"seed{seed}" / "model",
                               lambda m, s=seed: train(
            m, task.train, task.val, epochs=how["epochs"], lr=how["lr"],
            batch_size=how["batch_size"], seed=s, stop_at=1.0 if how["stop_early"] else None,
            progress=progress, desc=f"train (seed {s})",
        ))  # fmt: skip
        here = out / f"seed{seed}"
        rows = explain_split(net, task.val, here / "values.jsonl", config, progress)
        frames.append(_frame(rows).assign(seed=seed))
        if config.paper:
            rows = explain_split(net, task.val, here / "paper.jsonl", config, progress,
                                 paper=True)  # fmt: skip
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


def explain_split(model, split, path, config: Config, progress: bool = True,
            paper: bool = False) -> list[dict]:  # fmt: skip
    """One line per validation example (written as it is computed; a rerun resumes).
    Ours: MaxProduct at both granularities, aggregated by ⊕ and by bucket_sum;
    ``paper``: the paper's quantity instead (paper mode, ``MaxProduct("tensor")``,
    ``aggregate="paper"``)."""
    from tqdm.auto import tqdm

    records = Records(path)
    if paper:
        srs, aggregations = [MaxProduct("tensor")], ("paper",)
    else:
        srs, aggregations = [MaxProduct(g) for g in GRANULARITIES], AGGREGATIONS
    bp = Backprop(GoldLogit(model).eval(), output=lambda y: y, semirings=srs, per_example=True,
                  paper=paper)  # fmt: skip
    n = len(split) if config.explain_limit is None else min(config.explain_limit, len(split))
    classes = token_classes(split.x[:n], split.y[:n])
    starts = [
        s
        for s in range(0, n, config.explain_batch)
        if not all(records.has(i) for i in range(s, min(s + config.explain_batch, n)))
    ]
    desc = "explain (paper's quantity)" if paper else "explain"
    for s in tqdm(starts, desc=desc, disable=not progress, leave=False):
        e = min(s + config.explain_batch, n)
        res = bp((split.x[s:e], split.y[s:e]))
        values: dict = {}
        for sr in srs:
            for agg in aggregations:
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
    token class, the branch most models find largest and how many do (and under
    ``"paper"``, the same for the paper's quantity, whose means count the zeros)."""
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
    chosen = per_model[per_model["aggregation"].isin(["oplus", "paper"])]
    chosen = chosen.dropna(subset=["value"])
    for (agg, gran, cls), part in chosen.groupby(["aggregation", "granularity", "token_class"]):
        winners = part.loc[part.groupby("seed")["value"].idxmax(), "branch"]
        counts = winners.value_counts()
        agreement.setdefault(gran if agg == "oplus" else agg, {})[cls] = {
            "branch": str(counts.index[0]),
            "models": int(counts.iloc[0]),
            "of": len(winners),
        }
    out["agreement"] = agreement
    return out


def settings(summary: dict) -> list[tuple[str, str]]:
    """The (aggregation, granularity) blocks a summary holds, ours first, then the
    paper's quantity (:data:`PAPER`) where it was computed."""
    ours = [(a, g) for a in AGGREGATIONS for g in GRANULARITIES]
    return ours + ([PAPER] if PAPER[0] in summary else [])


def title(agg: str, gran: str) -> str:
    """What a block's numbers are, in words."""
    if (agg, gran) == PAPER:
        return ("the paper's quantity: brunoflow's computation (paper mode, tensor "
                "granularity), winner-take-all per token, zeros kept")  # fmt: skip
    return f"ours: {agg}, {gran} granularity"


def figure(summary: dict, path) -> str:
    """Fig. 2: mean branch value per token class, one panel per aggregation × granularity
    (ours), and one for the paper's quantity where it was computed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = settings(summary)
    rows = -(-len(blocks) // len(GRANULARITIES))
    fig, axes = plt.subplots(rows, len(GRANULARITIES), figsize=(11, 3.5 * rows),
                             squeeze=False)  # fmt: skip
    width = 0.8 / len(BRANCHES)
    for ax in axes.flat[len(blocks) :]:
        ax.set_visible(False)
    for i, (agg, gran) in enumerate(blocks):
        ax = axes.flat[i]
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
        ax.set_title(title(agg, gran).replace(": ", ":\n", 1), fontsize=8)
        ax.set_ylabel("mean top path value (± sd over models)")
        ax.axhline(0, color="black", linewidth=0.5)
    axes[0][0].legend(title="branch")
    fig.suptitle("FirstTokenRepeatedOnce: top gradient path value by attention branch")
    fig.tight_layout()
    from .._files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))
    plt.close(fig)
    return str(path)


def _best(table: dict):
    best = {c: max((b for b in t if t[b] is not None), key=t.get) for c, t in table.items()}
    top = max(((c, b) for c, t in table.items() for b, v in t.items() if v is not None),
              key=lambda cb: table[cb[0]][cb[1]])  # fmt: skip
    return best, top


def reading(summary: dict) -> str:
    """What the table shows, one sentence per quantity: ours (⊕ aggregation) per
    granularity, then the paper's quantity where it was computed, then what the paper
    reported (in its quantity)."""
    parts = []
    for gran in GRANULARITIES:
        best, top = _best(summary.get("oplus", {}).get(gran, {}))
        parts.append(
            f"ours ({gran} granularity, ⊕ per branch): the first token's top path goes "
            f"mostly through the {best.get('first')}, the repeated token's through the "
            f"{best.get('repeated')}; largest of all: {top[0]}/{top[1]}"
        )
    if PAPER[0] in summary:
        best, top = _best(summary[PAPER[0]][PAPER[1]])
        parts.append(
            "the paper's quantity (brunoflow's computation, winner-take-all per token, zeros "
            f"kept): the first token's largest branch is the {best.get('first')}, the repeated "
            f"token's the {best.get('repeated')}; largest of all: {top[0]}/{top[1]}"
        )
    return (
        ".\n  ".join(parts)
        + ".\n  The paper reported, in its quantity: first/query, repeated/key (largest)."
    )


def table_text(summary: dict) -> str:
    """The branch table (mean top path value per token class, ± the models' standard
    deviation), one block per setting."""
    lines = []
    for agg, gran in settings(summary):
        lines.append(title(agg, gran))
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
    """How many trained models agree on each token's top branch (ours: ⊕ aggregation;
    and the paper's quantity)."""
    parts = []
    for gran in (*GRANULARITIES, PAPER[0]):
        table = summary.get("agreement", {}).get(gran, {})
        said = [
            f"the {cls} token's through the {a['branch']} in {a['models']} of {a['of']}"
            for cls in ("first", "repeated")
            if (a := table.get(cls))
        ]
        if said:
            name = "the paper's quantity" if gran == PAPER[0] else f"ours, {gran} granularity"
            parts.append(f"{name}: " + ", ".join(said))
    return "; ".join(parts)


#: what the demo's block titles mean, printed above the table
LEGEND = """Each block's title says which quantity its values are. Ours:
  oplus        a branch's value is the oplus (here: the max) over the token's hidden
               units: the value of the single best path through that branch;
  bucket_sum   each hidden unit goes to the branch its best path leaves through, and
               a branch's value is the sum over the units it won;
  neuron       granularity: the exact best path, every number of every tensor its own
               node of the graph;
  tensor       granularity: the paper's variant (what its figures show): sums inside
               each op, a max only where one tensor feeds several ops.
The paper's quantity (what its Fig. 2 shows), where computed:
  paper        brunoflow's computation (the model traced as the paper's library built
               its graph, tensor granularity); winner-take-all per token: the token's
               best hidden unit gives its value to the branch that wins that unit, every
               other branch gets 0, and the zeros are kept in the means.
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
    p("\nReading (mean over models):\n  " + reading(result["summary"]))
    p("Models agreeing (top branch per model): " + agreement_text(result["summary"]) + ".")
    p(f"\nwrote {', '.join(result['files'])}")
    return result
