"""Paper §5.3, Fig. 5: gradient-graph entropy against task difficulty (online MDL).

For every task and seed a 2-layer BERT-style classifier (hidden 64, 4 heads,
intermediate 4 × 64 = 256, a 36-way output for every task: classes a task does not have
never occur) is trained on 3,600 examples (length 36, vocabulary 60; 360 validation)
for 50 epochs (Adam, lr 1e-3, batches of 32). With ``task_classes_only`` (default) the
cross-entropy and the accuracy use only the task's K outputs of the 36: trained over
all 36 (``False``), this classifier collapses on the tasks whose signal is weak at first
(Contains1, seed 0, stayed at chance for 50 epochs at full size, its pooled output
constant over inputs; with the loss over its 2 outputs it reached 100 % in 2 epochs).
The explained gold-class logit is the same output either way. Then:

* **Difficulty** is the online (prequential) code length of the training labels in bits
  (Voita & Titov 2020), :func:`online_code_length`: the train set is cut at
  ``t_1 < ... < t_n = N`` (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.25, 12.5, 25, 50, 100 % of
  it); the first block is sent with the uniform code over the task's K classes
  (``t_1 · log2 K``; K = 2 for the binary tasks, k for ``BinCountOnes``: the code is for
  the task's labels, not for the 36 outputs), and each later block ``t_i .. t_{i+1}-1``
  costs ``Σ -log2 p(y | x)`` under a *fresh* model (same initialization seed, same
  optimizer) trained on exactly the first ``t_i`` examples for ``mdl_epochs`` epochs, its
  36-way scores renormalized over the first K (a softmax over the task's classes). The
  total is the sum over all blocks. Since the prefixes double, all block models together
  cost about ``mdl_epochs`` epochs on the whole set, so the default trains them as long
  as the main model (50 epochs); no early stopping, so the smallest prefixes, which get
  few optimizer steps, cost about as much as the uniform code.
* **Entropy** is that of the gradient-path distribution (``Entropy`` semiring) from the
  input token representations to the gold-class logit, on validation examples: one
  per-example pass per batch, read at the output of
  ``bert.embeddings.word_embeddings`` (the token's own embedding row, before position
  embeddings and LayerNorm are added, so every path starts at the token itself), in
  nats, the mean over hidden units and tokens per example, then over examples.
* Runs under 90 % final validation accuracy (``min_accuracy``) are kept in the data,
  flagged ``dropped``, and left out of the per-task means, the correlation (Spearman's
  ρ between MDL and entropy over the kept runs) and the scatter plot.

Tasks are given as strings, ``"Name"`` or ``"Name(param=value)"`` with a ``+`` between
the items of a collection: ``"ContainsTokenSet(tokens=1+2+3)"``, ``"BinCountOnes(k=4)"``.

``Config.quick()``: Contains1 and BinCountOnes k = 2, 3, one seed, 600/120/120 examples,
15 epochs (block models too), blocks at 5, 10, 25, 50, 100 %, 32 explained examples:
1–3 minutes on 2 CPU cores. Like every experiment it runs on one thread (see
:func:`semiring_backprop.threads`).

Files: ``runs.jsonl`` / ``runs.csv`` (one row per task × seed), ``mdl_blocks.jsonl``
(bits per block), ``entropy.jsonl`` (per validation example), ``summary.json``,
``figure.png``, and the trained models under ``models/``. Every row is written when it is
computed; a rerun into the same directory skips finished runs, blocks and examples and
reloads trained models (other settings, apart from more tasks or seeds, are refused: use
a new directory).

For example::

    from semiring_backprop import experiments
    result = experiments.run("entropy-vs-mdl", "runs/mdl", quick=True)
    result["summary"]["spearman"]
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .._backprop import Backprop
from .._threads import threads
from ..errors import InputError
from ..runner.records import Records, same_settings, write_json
from ..semirings import Entropy
from .common import (
    GoldLogit,
    accuracy,
    bert_classifier,
    logits,
    spearman,
    train,
    trained,
    write_csv,
)
from .online_code import block_ends, online_code_length

BINARY = (
    "FirstTokenRepeatedOnce", "FirstTokenRepeatedImmediately", "FirstTokenRepeatedLast",
    "AdjacentDuplicate", "Contains1",
)  # fmt: skip
TASKS = (
    *BINARY,
    "ContainsTokenSet(tokens=1)", "ContainsTokenSet(tokens=1+2)",
    "ContainsTokenSet(tokens=1+2+3)", "ContainsTokenSet(tokens=1+2+3+4+5+6)",
    *(f"BinCountOnes(k={k})" for k in (2, 3, 4, 6, 9, 12, 18, 36)),
)  # fmt: skip
#: timesteps of Voita & Titov (2020), as fractions of the train set
VOITA_TITOV = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.0625, 0.125, 0.25, 0.5, 1.0)
#: the input token representations (``GoldLogit`` wraps the classifier as ``model``)
WHERE = "model.bert.embeddings.word_embeddings"
ENTROPY = Entropy()


@dataclass(frozen=True)
class Config:
    tasks: tuple[str, ...] = TASKS
    seeds: tuple[int, ...] = (0, 1, 2)
    sizes: tuple[int, int, int] = (3600, 360, 360)  #: train, validation, test
    length: int = 36
    vocab_size: int = 60
    hidden: int = 64
    heads: int = 4
    intermediate: int = 256
    layers: int = 2
    num_labels: int = 36  #: the classifier's outputs, the same for every task
    lr: float = 1e-3
    batch_size: int = 32
    epochs: int = 50
    mdl_epochs: int = 50  #: epochs of each prequential block model
    mdl_fractions: tuple[float, ...] = VOITA_TITOV  #: block ends; must end at 1.0
    min_accuracy: float = 0.9  #: runs below this validation accuracy are dropped
    #: train (cross-entropy) and score accuracy over the task's K outputs only
    task_classes_only: bool = True
    explain_batch: int = 60  #: validation examples per semiring pass
    explain_limit: int | None = None  #: explain only this many validation examples

    @classmethod
    def quick(cls) -> Config:
        """Three tasks, one seed, 600 training examples: 1–3 minutes on 2 CPU cores."""
        return replace(
            cls(), tasks=("Contains1", "BinCountOnes(k=2)", "BinCountOnes(k=3)"), seeds=(0,),
            sizes=(600, 120, 120), epochs=15, mdl_epochs=15,
            mdl_fractions=(0.05, 0.1, 0.25, 0.5, 1.0), explain_batch=32, explain_limit=32,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Entropy at the input token representations


def explainer(model) -> Backprop:
    """A reusable per-example ``Entropy`` pass on the gold-class logit of ``model``."""
    return Backprop(GoldLogit(model).eval(), output=lambda v: v, semirings=[ENTROPY],
                    per_example=True, keep=(WHERE,))  # fmt: skip


def token_entropy(bp: Backprop, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per example ``(n,)``: the path entropy at the token embeddings, averaged over
    tokens and hidden units (``bp`` from :func:`explainer`)."""
    return bp((x, y)).at(WHERE, ENTROPY).entropy.mean(dim=(1, 2))


# ---------------------------------------------------------------------------------------
# The experiment


def parse_task(spec: str) -> tuple[str, dict]:
    """``"BinCountOnes(k=4)"`` -> ``("BinCountOnes", {"k": 4})``; ``+`` joins the items
    of a collection parameter (``"ContainsTokenSet(tokens=1+2)"``)."""
    from ..data import TASKS as GENERATORS

    m = re.fullmatch(r"\s*(\w+)\s*(?:\((.*)\))?\s*", spec)
    if not m or m.group(1) not in GENERATORS:
        raise InputError(
            f"task {spec!r}: expected Name or Name(param=value) with Name one of "
            f"{', '.join(GENERATORS)}, e.g. 'BinCountOnes(k=4)' or 'ContainsTokenSet(tokens=1+2)'"
        )
    name, inner = m.groups()
    defaults = {p.name: p.default for p in inspect.signature(GENERATORS[name]).parameters.values()}
    params = {}
    for part in filter(str.strip, (inner or "").split(";")):
        key, sep, text = (s.strip() for s in part.partition("="))
        try:
            items = tuple(int(t) for t in text.split("+"))
        except ValueError:
            items = ()
        if not sep or not items:
            raise InputError(f"task {spec!r}: expected param=integer(s), got {part.strip()!r}")
        collection = isinstance(defaults.get(key), tuple | list) or len(items) > 1
        params[key] = items if collection else items[0]
    return name, params


def run_key(spec: str, seed: int) -> str:
    return f"{spec.strip()}/seed={seed}"


@threads()
def run(out, config: Config | None = None, progress: bool = True) -> dict:
    """Train every task × seed (or reload), code its labels, measure the entropy, write
    the rows, summary and figure. The data of every task is made first, so a bad task
    fails before any training."""
    from tqdm.auto import tqdm

    config = config or Config()
    out = Path(out)
    data = _make_data(config)
    out.mkdir(parents=True, exist_ok=True)
    # more tasks or seeds add runs; any other change would make the rows on disk stale
    same_settings(out, config, free=("tasks", "seeds"))
    records = {name: Records(out / f"{name}.jsonl") for name in ("runs", "mdl_blocks", "entropy")}
    keys = [run_key(spec, seed) for spec in config.tasks for seed in config.seeds]
    todo = [k for k in keys if not records["runs"].has(k)]
    for key in tqdm(todo, desc="entropy-vs-mdl", disable=not progress):
        records["runs"].add(_one_run(key, data[key], out, config, records, progress))
    rows = [r for r in records["runs"].rows if r["key"] in keys]
    frame = records["runs"].frame()
    frame = frame[frame["key"].isin(keys)].copy() if len(frame) else frame
    if "params" in frame:  # as in the task strings: k=4, tokens=1+2
        frame["params"] = frame["params"].map(_show_params)
    write_csv(frame, out / "runs.csv")
    summary = _summary(rows, config)
    write_json(out / "summary.json", summary)
    files = [str(out / f) for f in ("runs.jsonl", "runs.csv", "mdl_blocks.jsonl",
                                    "entropy.jsonl", "summary.json")]  # fmt: skip
    try:
        files.append(figure(rows, summary, out / "figure.png"))
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"summary": summary, "files": files}


def _show_params(params: dict) -> str:
    show = lambda v: "+".join(map(str, v)) if isinstance(v, list | tuple) else str(v)
    return ";".join(f"{k}={show(v)}" for k, v in params.items())


def _make_data(config: Config) -> dict:
    """``{run key: (spec, name, params, TaskData)}`` for every run (errors before training)."""
    from ..data import make_task

    if not config.tasks or not config.seeds:
        raise InputError("entropy-vs-mdl: tasks and seeds must not be empty")
    block_ends(config.sizes[0], config.mdl_fractions)  # checks the fractions
    data = {}
    for spec in config.tasks:
        name, params = parse_task(spec)
        for seed in config.seeds:
            task = make_task(name, sizes=tuple(config.sizes), length=config.length,
                             vocab_size=config.vocab_size, seed=seed, **params)  # fmt: skip
            if task.num_classes > config.num_labels:
                raise InputError(
                    f"task {spec!r} has {task.num_classes} classes but the classifier has "
                    f"num_labels={config.num_labels}; raise num_labels"
                )
            data[run_key(spec, seed)] = (spec, name, params, task)
    return data


def _classifier(config: Config, seed: int):
    return bert_classifier(
        config.vocab_size, config.num_labels, hidden=config.hidden, heads=config.heads,
        intermediate=config.intermediate, layers=config.layers, length=config.length,
        seed=seed,
    )  # fmt: skip


class TaskOutputs(torch.nn.Module):
    """The first ``k`` scores of a classifier: what it is trained and scored on when
    ``task_classes_only`` (its other outputs then get no gradient)."""

    def __init__(self, model, k: int):
        super().__init__()
        self.model, self.k = model, k

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits[:, : self.k]


def _head(model, task, config: Config):
    return TaskOutputs(model, task.num_classes) if config.task_classes_only else model


def _one_run(key, item, out: Path, config: Config, records: dict, progress: bool) -> dict:
    spec, name, params, task = item
    seed = task.seed
    slug = re.sub(r"[^\w.=+-]+", "_", key).strip("_")
    model, history = trained(_classifier(config, seed), out / "models" / slug, lambda m: train(
        _head(m, task, config), task.train, task.val, epochs=config.epochs, lr=config.lr,
        batch_size=config.batch_size, seed=seed, desc=f"train {key}", progress=progress,
    ))  # fmt: skip
    val_accuracy = accuracy(_head(model, task, config), task.val)
    entropy = _entropies(model, task.val, key, records["entropy"], config, progress)
    code = _code_length(task, key, records["mdl_blocks"], config, progress)
    return {
        "key": key, "task": task.name, "spec": spec, "family": name, "params": params,
        "seed": seed, "num_classes": task.num_classes, "val_accuracy": val_accuracy,
        "epochs": len(history), "mdl_bits": code["bits"], "uniform_bits": code["uniform_bits"],
        "compression": code["compression"], "mean_entropy": sum(entropy) / len(entropy),
        "explained": len(entropy), "dropped": val_accuracy < config.min_accuracy,
    }  # fmt: skip


def _entropies(model, split, key, records: Records, config: Config, progress) -> list[float]:
    """Mean token entropy per validation example, one row each (a rerun resumes)."""
    from tqdm.auto import tqdm

    n = len(split) if config.explain_limit is None else min(config.explain_limit, len(split))
    if n == 0:
        raise InputError("entropy-vs-mdl: no validation example to explain; raise sizes[1]")
    step = config.explain_batch
    ek = lambda i: f"{key}/example={i}"
    starts = [s for s in range(0, n, step)
              if not all(records.has(ek(i)) for i in range(s, min(s + step, n)))]  # fmt: skip
    bp = explainer(model) if starts else None
    for s in tqdm(starts, desc="entropy", disable=not progress, leave=False):
        e = min(s + step, n)
        values = token_entropy(bp, split.x[s:e], split.y[s:e])
        for i, v in zip(range(s, e), values.tolist()):
            if not records.has(ek(i)):
                records.add({"key": ek(i), "run": key, "example": i, "entropy": v})
    by_key = {r["key"]: r["entropy"] for r in records.rows if r["run"] == key}
    return [by_key[ek(i)] for i in range(n)]


def _code_length(task, key, records: Records, config: Config, progress) -> dict:
    """``online_code_length`` of the train split with fresh classifiers per block."""
    from tqdm.auto import tqdm

    from ..data import Split

    ends = block_ends(len(task.train), config.mdl_fractions)
    done = {r["start"]: r["bits"] for r in records.rows if r["run"] == key}
    bar = tqdm(total=len(ends), initial=len(done), desc="mdl blocks", disable=not progress,
               leave=False)  # fmt: skip

    def fit(x, y):
        model = _classifier(config, task.seed)
        train(_head(model, task, config), Split(x, y), epochs=config.mdl_epochs, lr=config.lr,
              batch_size=config.batch_size, seed=task.seed, desc=f"block 0..{len(y)}",
              progress=progress)  # fmt: skip
        return lambda inputs: logits(model, inputs)

    def on_block(row):
        records.add({"key": f"{key}/block={row['start']}", "run": key, **row})
        bar.update(1)

    code = online_code_length(fit, task.train.x, task.train.y, task.num_classes, ends,
                              done=done, on_block=on_block)  # fmt: skip
    bar.close()
    return code


def _summary(rows: list[dict], config: Config) -> dict:
    """Per task: runs, kept runs, mean accuracy; mean MDL and entropy over kept runs.
    Spearman's ρ over all kept runs (``None`` under 3 points or with a constant side)."""
    kept = [r for r in rows if not r["dropped"]]
    mean = lambda v: sum(v) / len(v) if v else None
    tasks = {}
    for spec in config.tasks:
        mine = [r for r in rows if r["spec"] == spec.strip()]
        ok = [r for r in mine if not r["dropped"]]
        tasks[spec] = {
            "task": mine[0]["task"] if mine else None, "family": parse_task(spec)[0],
            "runs": len(mine), "kept": len(ok),
            "val_accuracy": mean([r["val_accuracy"] for r in mine]),
            "mdl_bits": mean([r["mdl_bits"] for r in ok]),
            "mean_entropy": mean([r["mean_entropy"] for r in ok]),
        }  # fmt: skip
    rank = spearman([r["mdl_bits"] for r in kept], [r["mean_entropy"] for r in kept])
    corr = None
    if rank["spearman_rho"] is not None:
        corr = {"rho": rank["spearman_rho"], "p_value": rank["p"], "n": rank["n"]}
    threshold = f"{config.min_accuracy:.0%} validation accuracy"
    if not kept:
        note = (f"ALL {len(rows)} runs were dropped (under {threshold}): nothing is plotted "
                "or correlated; the data is in runs.jsonl / runs.csv")  # fmt: skip
    elif corr is None:
        why = "Spearman's rho needs at least 3" if len(kept) < 3 else "one side is constant"
        note = f"{len(kept)} of {len(rows)} runs reached {threshold}; no correlation ({why})"
    else:
        rho, p = corr["rho"], corr["p_value"]
        note = (f"{len(kept)} of {len(rows)} runs reached {threshold}; Spearman's rho "
                f"between MDL and mean entropy {rho:.3f} (p={p:.3g})")  # fmt: skip
    return {"runs": len(rows), "kept": len(kept), "dropped": len(rows) - len(kept),
            "min_accuracy": config.min_accuracy, "spearman": corr, "note": note,
            "tasks": tasks}  # fmt: skip


def figure(rows: list[dict], summary: dict, path) -> str:
    """Fig. 5: one point per kept run, MDL (bits) against mean entropy, colored by family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    kept = [r for r in rows if not r["dropped"]]
    for family in dict.fromkeys(r["family"] for r in kept):
        mine = [r for r in kept if r["family"] == family]
        ax.scatter([r["mdl_bits"] for r in mine], [r["mean_entropy"] for r in mine],
                   label=family, alpha=0.8)  # fmt: skip
    if kept:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "all runs dropped (under the accuracy threshold)",
                ha="center", va="center", transform=ax.transAxes)  # fmt: skip
    rho = summary["spearman"]
    ax.set_title("Gradient-graph entropy vs. task difficulty"
                 + (f" (Spearman ρ = {rho['rho']:.2f})" if rho else ""))  # fmt: skip
    ax.set_xlabel("online code length (MDL, bits)")
    ax.set_ylabel("mean path entropy at the input tokens (nats)")
    fig.tight_layout()
    from .._files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))
    plt.close(fig)
    return str(path)
