"""The ``sva`` experiment's tables, summary and figures, read from the runner's results.

The runner (:mod:`semiring_backprop.runner`) writes one row per example x token x layer
x branch; here they become the paper's readings: per example, each token group's mean
branch value (:func:`group_values`), their mean over examples (``branches.csv``), the
embeddings' mean path entropy per example against its number of attractors
(``entropy.csv``) and the summary with Spearman's ρ per sentence-length bin. The paper's
quantity, from the paper-mode pass, is averaged as the paper did (:func:`paper_table`,
``branches_paper.csv``).

For example::

    tables = load_results("runs/sva/runner")
    branches_table(group_values(tables["branches"], tables["tokens"]))
"""

from __future__ import annotations

import math

import numpy as np

from .common import spearman

GROUPS = ("subject", "attractor", "all")
BRANCHES = ("skip", "query", "key", "value", "mlp")
RANDOM_NOTE = (
    "model=None: a random, untrained BERT. These numbers check that the pipeline runs; "
    "they say nothing about agreement. Give model= (a masked LM id or directory)."
)
MALFORMED_SHOWN = 20  #: malformed lines listed by name in the summary (all are counted)
#: the semirings of the branch tables (PathCount's branch values are not read)
READ = ("MaxProduct", "Entropy")


def group_values(branches, tokens):
    """Per example, semiring, aggregation, layer, sublayer, branch and token group
    (``subject``, ``attractor``, ``all``): the mean over the group's tokens of the branch
    value, leaving out tokens where the branch has no path (MaxProduct's zero, -inf, which
    marks the other semirings' rows too) or the value is not finite; NaN where no token
    is left, no row where the group has no token."""
    keys = ["example_id", "aggregation", "layer", "sublayer", "token", "branch"]
    b = branches.loc[branches["semiring"].str.startswith(READ), [*keys, "semiring", "value"]]
    top = b["semiring"].str.startswith("MaxProduct")
    dead = b.loc[top & (b["value"] == -math.inf), keys].drop_duplicates().assign(_dead=True)
    b = b.merge(dead, on=keys, how="left")
    b["value"] = b["value"].where(b["_dead"].ne(True) & np.isfinite(b["value"]))
    merged = b.merge(_members(tokens), on=["example_id", "token"])
    by = ["example_id", "semiring", "aggregation", "layer", "sublayer", "branch", "token_group"]
    return merged.groupby(by, sort=True)["value"].mean().reset_index()


def _members(tokens):
    """``example_id, token, token_group``: each token in ``all``, and in ``subject`` /
    ``attractor`` where it is a piece of the subject / an attractor."""
    import pandas as pd

    names = tokens["group"].fillna("").str.split(",")
    parts = [tokens[["example_id", "token"]].assign(token_group="all")]
    for group, name in (("subject", "subject"), ("attractor", "attractors")):
        mine = names.map(lambda n, name=name: name in n)
        parts.append(tokens.loc[mine, ["example_id", "token"]].assign(token_group=group))
    return pd.concat(parts, ignore_index=True)


def branches_table(values):
    """``branches.csv``: per semiring, aggregation, layer, sublayer, branch and token
    group, the mean over examples of :func:`group_values` and their number ``n`` (the
    examples where the group has a value)."""
    keys = ["semiring", "aggregation", "layer", "sublayer", "branch", "token_group"]
    return values.groupby(keys, sort=True)["value"].agg(value="mean", n="count").reset_index()


#: what ``branches_paper.csv`` and ``summary["paper"]`` are
PAPER_QUANTITY = (
    "the paper's quantity: brunoflow's computation (paper mode: MaxProduct at tensor "
    "granularity, the score as the difference of the two logits), winner-take-all per "
    "token, zeros kept"
)
PAPER_AVERAGE = (
    "as the paper's notebook averaged (analysis/sva_max_grad.ipynb): per token group, "
    "layer, sublayer and branch, the mean over the group's tokens of all examples pooled, "
    "zeros kept; subject: the subject's first token (the paper's subj_idx[0]); all: every "
    "token, [CLS], [MASK] and [SEP] included. The paper read the attention input only; "
    "the mlp rows are the same reading at the MLP input"
)
#: what ``branches.csv`` and ``summary["branches"]`` are, ``{}``: the semiring and aggregation
OURS = (
    "ours: {} (a branch's value over each token's hidden units); per example, the mean "
    "over the group's tokens where the branch has a path, then the mean over examples"
)


def paper_table(branches, tokens):
    """``branches_paper.csv``: per token group, layer, sublayer and branch, the mean of
    the paper's per-token values (``aggregation == "paper"``: the winning branch holds the
    token's best unit's value, the others 0) over the group's tokens of all examples
    pooled, the zeros kept, as the paper's notebook averaged its rows; ``tokens`` and
    ``examples`` count what went in. The subject is its first token (the paper's
    ``subj_idx[0]``); a value that is not finite (a token with no path at all) is left out."""
    keys = ["example_id", "layer", "sublayer", "token", "branch"]
    b = branches.loc[branches["aggregation"] == "paper", [*keys, "value"]]
    b = b[np.isfinite(b["value"])]
    members = _members(tokens)
    subject = members["token_group"] == "subject"
    first = members[subject].groupby("example_id")["token"].transform("min")
    members = members[~subject | (members["token"] == first.reindex(members.index))]
    merged = b.merge(members, on=["example_id", "token"])
    by = ["token_group", "layer", "sublayer", "branch"]
    return (
        merged.groupby(by, sort=True)
        .agg(value=("value", "mean"), tokens=("value", "size"), examples=("example_id", "nunique"))
        .reset_index()
    )


def paper_summary(table, examples) -> dict:
    """``summary["paper"]``: what the numbers are, how they were averaged, the examples
    explained and ``{token_group: {"layer.sublayer": {branch: mean}}}``."""
    out: dict = {}
    for r in table.itertuples():
        out.setdefault(r.token_group, {}).setdefault(f"{r.layer}.{r.sublayer}", {})[r.branch] = (
            float(r.value)
        )
    return {"quantity": PAPER_QUANTITY, "averaged": PAPER_AVERAGE,
            "explained": int(len(examples)), "branches": out}  # fmt: skip


def bin_labels(bins) -> list[str]:
    return [f"{lo}-{hi - 1}" for lo, hi in zip(bins, bins[1:])]


def entropy_table(examples, tokens, order: dict, bins):
    """``entropy.csv``: per explained example (in the data's order, ``order``: id ->
    rank), the embeddings' path entropy, ``log #paths`` and normalized entropy, each the
    mean over tokens and hidden units, with the example's length bin (words)."""
    cols = {"entropy_unit_mean": "entropy", "log_paths_unit_mean": "log_paths",
            "normalized_entropy_unit_mean": "normalized"}  # fmt: skip
    means = tokens.groupby("example_id")[list(cols)].mean().rename(columns=cols)
    frame = examples.set_index("example_id")[["source", "length", "attractors", "tokens",
                                              "score"]].join(means)  # fmt: skip
    frame = frame.reset_index().rename(columns={"example_id": "example"})
    frame = frame.iloc[np.argsort([order[e] for e in frame["example"]], kind="stable")]
    frame = frame.reset_index(drop=True)
    which = np.digitize(frame["length"], bins) - 1
    labels = bin_labels(bins)
    frame["length_bin"] = [labels[k] if 0 <= k < len(labels) else None for k in which]
    return frame


def summary(branches, entropy, skips: dict, multi_explained: int, config, malformed=()) -> dict:
    """``summary.json``; ``skips``: example id -> (reason, kind) of the skipped examples."""
    first = config.aggregation[0]
    top = branches[branches["semiring"].str.startswith("MaxProduct")
                   & (branches["aggregation"] == first)]  # fmt: skip
    table: dict = {}
    for r in top.itertuples():
        v = None if r.value != r.value else float(r.value)
        where = table.setdefault(r.token_group, {}).setdefault(f"{r.layer}.{r.sublayer}", {})
        where[r.branch] = v
    attractors = {}
    for label in bin_labels(config.length_bins):
        part = entropy[entropy["length_bin"] == label]
        attractors[label] = spearman(part["attractors"], part["entropy"])
    reasons: dict = {}
    kinds: dict = {}
    for reason, kind in skips.values():
        reasons[reason] = reasons.get(reason, 0) + 1
        kinds[kind] = kinds.get(kind, 0) + 1
    from ..hf.explanation import model_name

    out = {
        "data": config.data or "synthetic",
        "model": "a random BERT" if config.model is None else model_name(config.model),
        "branches": table,
        "branches_setting": f"{top['semiring'].iloc[0] if len(top) else 'MaxProduct'}, {first}",
        "branches_quantity": OURS.format(
            f"{top['semiring'].iloc[0] if len(top) else 'MaxProduct'}, {first}"
        ),
        "attractors": attractors,
        "attractors_all": spearman(entropy["attractors"], entropy["entropy"]),
        "explained": len(entropy),
        "skipped": len(skips),
        "skip_reasons": reasons,
        "skipped_by_kind": kinds,
        "multi_token_verbs": _multi_token(multi_explained, kinds, config),
        "malformed_lines": len(malformed),
        "malformed": [f"{m.source}: {m.reason}" for m in malformed[:MALFORMED_SHOWN]],
    }
    if config.model is None:
        out["note"] = RANDOM_NOTE
    return out


def _multi_token(explained: int, kinds: dict, config) -> dict:
    """How the verbs of several tokens fared: explained (summed over consecutive masks)
    or skipped, and what to do about the skipped ones."""
    skipped = kinds.get("multi_token_verb", 0) + kinds.get("multi_token_lengths", 0)
    out = {"multi_token": config.multi_token, "explained": explained, "skipped": skipped}
    if kinds.get("multi_token_verb"):
        out["note"] = (
            f"{kinds['multi_token_verb']} examples were skipped because a verb splits into "
            "several tokens; multi_token=True scores them as the sum of the pieces' "
            "log-probabilities at consecutive masks"
        )
    elif kinds.get("multi_token_lengths"):
        out["note"] = (
            f"{kinds['multi_token_lengths']} examples were skipped because the two verbs "
            "split into different numbers of tokens"
        )
    return out


# -- figures ----------------------------------------------------------------------------

TARGET = "log p(correct verb) − log p(wrong verb) at the masked verb"


def _data_name(summary: dict) -> str:
    data = str(summary.get("data", "synthetic"))
    return data.replace("\\", "/").rsplit("/", 1)[-1]


def branch_plot(summary: dict, target: str = TARGET):
    """Fig. 4 as a matplotlib figure: per layer and sublayer, the mean top path value of
    each branch the sublayer has (its bars centred on the tick; an x at 0 where no path
    leaves through the branch), one panel per token group; the legend sits right of the
    panels, clear of every bar, and the title names the data, target and semiring."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from ..plots import COLORS

    groups = [g for g in GROUPS if g in summary["branches"]]
    fig, axes = plt.subplots(len(groups) or 1, 1, figsize=(10, 2.8 * max(len(groups), 1) + 0.8),
                             squeeze=False)  # fmt: skip
    handles: dict = {}
    for ax, group in zip(axes[:, 0], groups):
        table = summary["branches"][group]
        places = list(table)
        width = 0.8 / max(len(table[p]) for p in places)
        for k, place in enumerate(places):
            present = [b for b in BRANCHES if b in table[place]]
            for j, branch in enumerate(present):
                v, x = table[place][branch], k + (j - (len(present) - 1) / 2) * width
                if v is None:  # no path through this branch: nothing to draw but the mark
                    ax.plot([x], [0], marker="x", color=COLORS.get(branch), linestyle="none")
                    handles.setdefault("no path", Line2D([], [], marker="x", color="black",
                                                         linestyle="none"))  # fmt: skip
                else:
                    handles.setdefault(branch, ax.bar(x, v, width, color=COLORS.get(branch)))
        if len(places) <= 12:
            ax.set_xticks(range(len(places)), [_place(p) for p in places])
        else:  # a deep model: every few layers named, at its attention input
            step = -(-len(places) // 24) * 2
            ticks = [k for k, p in enumerate(places) if p.endswith(".attention")][:: step // 2]
            ax.set_xticks(ticks, [f"layer {places[k].partition('.')[0]}" for k in ticks],
                          fontsize=8)  # fmt: skip
            ax.set_xlabel("each layer: its attention input's branches, then its MLP input's",
                          fontsize=8)  # fmt: skip
        ax.set_xlim(-0.5, len(places) - 0.5)
        ax.set_title(f"{group} tokens", fontsize=10)
        ax.set_ylabel("mean top path value", fontsize=9)
        ax.axhline(0, color="black", linewidth=0.5)
    if handles:
        names = [b for b in (*BRANCHES, "no path") if b in handles]
        axes[0][0].legend([handles[b] for b in names], names, title="branch", fontsize=8,
                          loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # fmt: skip
    sr, _, agg = summary["branches_setting"].partition(", ")
    fig.suptitle(
        f"Branches per layer: {summary.get('model', 'the model')}, {_data_name(summary)}, "
        f"{summary['explained']} sentences\n"
        f"target: {target}; semiring: {sr}, hidden units read by {agg or 'oplus'}",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def _place(place: str) -> str:
    layer, _, sublayer = place.partition(".")
    return f"layer {layer}\n{sublayer}"


def branch_figure(summary: dict, path, target: str = TARGET) -> str:
    """:func:`branch_plot` saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = branch_plot(summary, target)
    from .._files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return str(path)


def attractor_figure(entropy, summary: dict, path, target: str = TARGET) -> str:
    """Fig. 7: mean embedding path entropy vs number of attractors, per length bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    parts = sorted(
        entropy.groupby("length_bin", sort=False), key=lambda kv: int(str(kv[0]).split("-")[0])
    )  # the bins in order
    for label, part in parts:
        means = part.groupby("attractors")["entropy"].mean()
        rho = summary["attractors"].get(label, {}).get("spearman_rho")
        tag = "n/a" if rho is None else f"{rho:.2f}"
        ax.plot(means.index, means.values, marker="o", label=f"{label} words (ρ={tag})")
    ax.set_xlabel("number of attractors")
    ax.set_ylabel("mean path entropy of the word embeddings")
    ax.set_title(
        f"Entropy vs attractors by sentence length: {summary.get('model', 'the model')}, "
        f"{_data_name(summary)}, {summary['explained']} sentences\n"
        f"target: {target}; semiring: Entropy",
        fontsize=9,
    )
    if len(entropy):
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    from .._files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return str(path)
