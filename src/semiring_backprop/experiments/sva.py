"""Paper §5.2 and Appendix B.2, Fig. 4 and 7: subject-verb agreement in a masked LM.

For every agreement example the masked LM explains ``log p(correct) - log p(incorrect)``
at the masked verb, in one pass with ``MaxProduct`` (the top gradient path), ``Entropy``
and ``PathCount``. Two readings:

- **Branches.** Per layer, the value of each branch (skip / query / key / value at the
  attention input, skip / mlp at the MLP input), for three token groups: the subject's
  wordpieces, the attractors' (nouns between subject and verb of the other number) and
  all tokens. Within an example a group's value is the mean over its tokens where the
  branch has a path (the semiring zero, no path, is left out); ``branches.csv`` holds the
  mean over examples.
- **Attractors.** The mean path entropy of the word embeddings against the number of
  attractors, within sentence-length bins, with Spearman's ρ (the paper found more
  attractors, higher entropy).

Data: a BLiMP JSON-lines or Linzen/Goldberg TSV file (see :mod:`semiring_backprop.data`);
malformed lines are skipped and listed in the summary with their ``file:line``.
Subject and attractor positions come from the data where given, else from a spaCy parse
(``nlp``, default ``en_core_web_sm``): the parse's subject of the verb, or, where it has
none that agrees with the verb, no subject (the example is skipped, with the reason);
without spaCy or the pipeline, :func:`~semiring_backprop.data.locate` says what is
missing. A verb that splits into several tokens ("hasn't") is skipped and counted,
unless ``multi_token``: then the verb's pieces are masked together and the score is the
sum of their log-probabilities (each piece at its own mask, all of them masked), for
both verbs when they split into the same number of pieces; pieces the two share at one
place cancel exactly and are left out of the explained function.

With ``data=None`` a small synthetic set ("the N1 of the N2 ***mask*** ...", positions
given) is written to the output directory; with ``model=None`` the model is a random
small BERT over the data's words: a smoke run, whose numbers mean nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..api import Backprop
from ..errors import InputError
from ..semirings import Entropy, MaxProduct, PathCount
from .common import Records, same_settings, spearman, write_csv, write_json
from .entropy_sanity import (
    MaskedScore,
    embedding_entropy,
    embedding_place,
    language_model,
    lm_threads,
)
from .sva_inputs import MaskedSumScore, prepare

GROUPS = ("subject", "attractor", "all")
BRANCHES = ("skip", "query", "key", "value", "mlp")
AGGREGATIONS = ("oplus", "bucket_sum")
RANDOM_NOTE = (
    "model=None: a random, untrained BERT. These numbers check that the pipeline runs; "
    "they say nothing about agreement. Give model= (a masked LM id or directory)."
)


@dataclass(frozen=True)
class Config:
    model: str | None = None  #: masked LM id or directory; None: a random small BERT
    data: str | None = None  #: BLiMP .jsonl or Linzen .tsv; None: a built-in synthetic set
    limit: int | None = None  #: explain only the first examples
    length_bins: tuple[int, ...] = (0, 10, 20, 40, 1000)  #: sentence length (words) bins
    aggregation: tuple[str, ...] = AGGREGATIONS  #: over hidden units: ⊕, or bucket sums
    granularity: str = "neuron"  #: MaxProduct granularity ("neuron" or "tensor")
    synthetic: int = 500  #: size of the built-in synthetic set
    seed: int = 0
    bert_hidden: int = 64  #: sizes of the random BERT
    bert_layers: int = 2
    bert_heads: int = 2
    bert_intermediate: int = 128
    nlp: str = "en_core_web_sm"  #: spaCy pipeline (name or directory) that finds subjects
    multi_token: bool = False  #: score verbs of several tokens (sum over consecutive masks)

    @classmethod
    def quick(cls) -> Config:
        return replace(cls(), limit=20, aggregation=("oplus",))

    def check(self) -> None:
        bad = [a for a in self.aggregation if a not in AGGREGATIONS]
        if bad or not self.aggregation:
            raise InputError(f"aggregation must be some of {AGGREGATIONS}, got {self.aggregation}")
        if self.granularity not in ("neuron", "tensor"):
            raise InputError(f"granularity must be 'neuron' or 'tensor', got {self.granularity!r}")
        bins = list(self.length_bins)
        if len(bins) < 2 or any(a >= b for a, b in zip(bins, bins[1:])):
            raise InputError(f"length_bins must be increasing edges, got {self.length_bins}")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"limit must be positive or None, got {self.limit}")
        if not self.nlp.strip():
            raise InputError(
                "nlp must name a spaCy pipeline (e.g. en_core_web_sm) or its directory"
            )


# -- data ---------------------------------------------------------------------------------

_NOUNS = [
    ("dog", "dogs"), ("key", "keys"), ("author", "authors"), ("cabinet", "cabinets"),
    ("teacher", "teachers"), ("car", "cars"), ("house", "houses"), ("friend", "friends"),
    ("boy", "boys"), ("girl", "girls"), ("painting", "paintings"), ("letter", "letters"),
]  # fmt: skip
_ADJECTIVES = ["old", "small", "red", "new", "big", "famous"]
_PREPOSITIONS = ["of", "near", "behind", "beside", "with"]
_TAILS = ["here", "on the table", "in the old house", "very happy today", "quite small",
          "with the red car near the river", "not far from the station", "there every day",
          "in the garden behind the school"]  # fmt: skip


def synthetic_agreement(path, n: int = 500, seed: int = 0) -> Path:
    """``n`` template sentences "the (ADJ) N1 [PREP the (ADJ) N]* ***mask*** TAIL" as
    BLiMP JSON lines with ``subject`` and ``attractors`` (the nouns between subject and
    verb whose number differs from the subject's); verbs is/are."""
    from ..data import MASK

    rng = np.random.default_rng(seed)
    pick = lambda items: items[int(rng.integers(len(items)))]
    adjective = lambda: [pick(_ADJECTIVES)] if rng.random() < 0.3 else []
    lines = []
    for _ in range(n):
        plural = bool(rng.integers(2))
        words = ["the", *adjective()]
        subject = len(words)
        words.append(pick(_NOUNS)[plural])
        attractors = []
        for _ in range(int(rng.integers(4))):
            other = bool(rng.integers(2))
            words += [pick(_PREPOSITIONS), "the", *adjective()]
            if other != plural:
                attractors.append(len(words))
            words.append(pick(_NOUNS)[other])
        tail = " ".join(pick(_TAILS) for _ in range(int(rng.integers(6)))).split()
        good, bad = ("are", "is") if plural else ("is", "are")
        line = {
            "sentence_good": " ".join([*words, good, *tail]),
            "sentence_bad": " ".join([*words, bad, *tail]),
            "one_prefix_prefix": " ".join(words),
            "one_prefix_word_good": good,
            "one_prefix_word_bad": bad,
            "subject": subject,
            "attractors": attractors,
            "template": f"the N1 [PREP the N]* {MASK} ...",
        }
        lines.append(json.dumps(line))
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path


def vocabulary(examples) -> list[str]:
    """The words a BERT tokenizer makes of the examples (lowercased, punctuation split),
    with both verbs: what the random model's vocabulary must hold."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    from ..data import MASK

    norm, pre = BertNormalizer(lowercase=True), BertPreTokenizer()
    words = set()
    for ex in examples:
        text = " ".join(w for w in (*ex.words, ex.good, ex.bad) if w != MASK)
        words.update(w for w, _ in pre.pre_tokenize_str(norm.normalize_str(text)))
    return sorted(words)


# -- the experiment ---------------------------------------------------------------------


def run(out, config: Config | None = None, progress: bool = True) -> dict:
    """Explain every example; write ``branches.csv``, ``entropy.csv``, ``summary.json``
    and the figures ``branches.png`` and ``attractors.png``."""
    from ..data import locate, read_agreement

    config = config or Config()
    config.check()
    out = Path(out)
    same_settings(out, config, free=("limit", "length_bins"))
    if config.data is None:
        data = synthetic_agreement(out / "synthetic.jsonl", config.synthetic, config.seed)
    else:
        data = Path(config.data)
    every = read_agreement(data)
    if not every:
        raise InputError(
            f"{data}: no examples (the file is empty or holds only blank lines); give a "
            "BLiMP JSON-lines or Linzen/Goldberg TSV file with at least one example"
        )
    # an InputError if positions are needed and spaCy or its pipeline is missing
    examples = locate(every[: config.limit], nlp=config.nlp, progress=progress)
    rows = explain(examples, every, out, config, progress)
    done = [r for r in rows if "skipped" not in r]
    if rows and not done:
        reasons = sorted({r["skipped"] for r in rows})
        raise InputError(
            f"{data}: none of the {len(rows)} examples could be explained; each was "
            f"skipped ({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''}). "
            f"The reasons are in {out / 'examples.jsonl'}"
        )
    branches = _branches(done)
    entropy = _entropy(done, config.length_bins)
    write_csv(branches, out / "branches.csv")
    write_csv(entropy, out / "entropy.csv")
    summary = _summary(branches, entropy, rows, config, every.skipped)
    write_json(out / "summary.json", summary)
    files = [str(out / f) for f in ("branches.csv", "entropy.csv", "summary.json")]
    try:
        files.append(branch_figure(summary, out / "branches.png"))
        files.append(attractor_figure(entropy, summary, out / "attractors.png"))
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"summary": summary, "files": files, "explained": len(done),
            "skipped": len(rows) - len(done), "data": str(data)}  # fmt: skip


def explain(examples, every, out: Path, config: Config, progress: bool = True) -> list[dict]:
    """One record per example (explained, or skipped with the reason), written as it is
    computed; a rerun resumes."""
    from tqdm.auto import tqdm

    records = Records(out / "examples.jsonl")
    todo = [(i, ex) for i, ex in enumerate(examples) if not records.has(i)]
    with lm_threads(config):
        if todo:
            model, tok = language_model(config, out, vocabulary(every), progress)
            top = MaxProduct(config.granularity)
            semirings = [top, Entropy(), PathCount()]
            wrapper = MaskedScore(model).eval()
            place = embedding_place(wrapper)
            bp = Backprop(wrapper, output=lambda y: y, semirings=semirings)
            # a verb of several tokens: its own score function (traced on first use)
            bp_sum = Backprop(MaskedSumScore(model).eval(), output=lambda y: y,
                              semirings=semirings)  # fmt: skip
            max_length = getattr(model.config, "max_position_embeddings", None)
        for i, ex in tqdm(todo, desc="examples", disable=not progress, leave=False):
            head = {"key": i, "source": ex.source, "length": len(ex.words)}
            item = prepare(ex, tok, max_length, config.multi_token)
            if "skipped" in item:
                records.add({**head, "skipped": item["skipped"], "kind": item["kind"]})
                continue
            res = (bp if len(item["good"]) == 1 else bp_sum)(kwargs=item["inputs"])
            tokens = tok.convert_ids_to_tokens(item["ids"])
            values = []
            for agg in config.aggregation:
                table = res.layer_table(semirings=[top, Entropy()], aggregate=agg, tokens=tokens,
                                        by="role")  # fmt: skip
                values += group_values(table, item["groups"], agg)
            records.add({**head, "attractors": item["attractors"], "tokens": len(item["ids"]),
                         "input_ids": item["ids"], "position": item["position"],
                         "positions": item["positions"], "verb_tokens": item["verb_tokens"],
                         "good": item["good"][0], "bad": item["bad"][0],
                         "good_ids": item["good"], "bad_ids": item["bad"],
                         "subject_tokens": item["groups"]["subject"],
                         "attractor_tokens": item["groups"]["attractor"],
                         "score": float(res.values[res.graph.output_node]),
                         **embedding_entropy(res, place), "values": values})  # fmt: skip
    return [r for r in records.rows if r["key"] < len(examples)]


def group_values(table, groups: dict, aggregation: str) -> list[list]:
    """``[semiring, aggregation, layer, sublayer, branch, group, value]`` rows: the mean
    over a group's tokens of a ``layer_table``, leaving out branches with no path
    (MaxProduct's zero, -inf; that marks the other semirings' rows too)."""
    key = ["layer", "sublayer", "token", "branch"]
    table = table[["semiring", *key, "value"]].copy()
    top = table[table["semiring"].str.startswith("MaxProduct")]
    dead = top.loc[top["value"] == -math.inf, key].assign(_dead=True)
    table = table.merge(dead, on=key, how="left")
    table.loc[table["_dead"].eq(True) | ~np.isfinite(table["value"]), "value"] = np.nan
    out = []
    for group, tokens in groups.items():
        part = table[table["token"].isin(tokens)]
        if part.empty:
            continue
        means = part.groupby(["semiring", "layer", "sublayer", "branch"])["value"].mean()
        out += [[sr, aggregation, int(layer), sub, branch, group, None if v != v else float(v)]
                for (sr, layer, sub, branch), v in means.items()]  # fmt: skip
    return out


# -- tables, summary, figures -----------------------------------------------------------


def _branches(done):
    import pandas as pd

    cols = ["semiring", "aggregation", "layer", "sublayer", "branch", "token_group", "value"]
    flat = pd.DataFrame([v for r in done for v in r["values"]], columns=cols)
    flat["value"] = flat["value"].astype(float)
    keys = cols[:-1]
    return flat.groupby(keys, sort=True)["value"].agg(value="mean", n="count").reset_index()


def _bin_labels(bins) -> list[str]:
    return [f"{lo}-{hi - 1}" for lo, hi in zip(bins, bins[1:])]


def _entropy(done, bins):
    import pandas as pd

    cols = ["key", "source", "length", "attractors", "tokens", "score", "entropy",
            "log_paths", "normalized"]  # fmt: skip
    frame = pd.DataFrame([{c: r[c] for c in cols} for r in done], columns=cols)
    frame = frame.rename(columns={"key": "example"})
    which = np.digitize(frame["length"], bins) - 1
    labels = _bin_labels(bins)
    frame["length_bin"] = [labels[k] if 0 <= k < len(labels) else None for k in which]
    return frame


def _summary(branches, entropy, rows, config: Config, malformed=()) -> dict:
    first = config.aggregation[0]
    top = branches[branches["semiring"].str.startswith("MaxProduct")
                   & (branches["aggregation"] == first)]  # fmt: skip
    table: dict = {}
    for r in top.itertuples():
        v = None if r.value != r.value else float(r.value)
        where = table.setdefault(r.token_group, {}).setdefault(f"{r.layer}.{r.sublayer}", {})
        where[r.branch] = v
    attractors = {}
    for label in _bin_labels(config.length_bins):
        part = entropy[entropy["length_bin"] == label]
        attractors[label] = spearman(part["attractors"], part["entropy"])
    reasons: dict = {}
    kinds: dict = {}
    for r in rows:
        if "skipped" in r:
            reasons[r["skipped"]] = reasons.get(r["skipped"], 0) + 1
            kinds[r.get("kind", "other")] = kinds.get(r.get("kind", "other"), 0) + 1
    out = {
        "branches": table,
        "branches_setting": f"{top['semiring'].iloc[0] if len(top) else 'MaxProduct'}, {first}",
        "attractors": attractors,
        "attractors_all": spearman(entropy["attractors"], entropy["entropy"]),
        "explained": len(entropy),
        "skipped": sum(reasons.values()),
        "skip_reasons": reasons,
        "skipped_by_kind": kinds,
        "multi_token_verbs": _multi_token(rows, kinds, config),
        "malformed_lines": len(malformed),
        "malformed": [f"{m.source}: {m.reason}" for m in malformed[:MALFORMED_SHOWN]],
    }
    if config.model is None:
        out["note"] = RANDOM_NOTE
    return out


MALFORMED_SHOWN = 20  #: malformed lines listed by name in the summary (all are counted)


def _multi_token(rows, kinds: dict, config: Config) -> dict:
    """How the verbs of several tokens fared: explained (summed over consecutive masks)
    or skipped, and what to do about the skipped ones."""
    explained = sum(r.get("verb_tokens", 1) > 1 for r in rows if "skipped" not in r)
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


def branch_figure(summary: dict, path) -> str:
    """Fig. 4: per layer and sublayer, the mean top path value of each branch, one panel
    per token group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import COLORS

    groups = [g for g in GROUPS if g in summary["branches"]]
    fig, axes = plt.subplots(len(groups) or 1, 1, figsize=(10, 2.8 * max(len(groups), 1)),
                             squeeze=False)  # fmt: skip
    width = 0.8 / len(BRANCHES)
    for ax, group in zip(axes[:, 0], groups):
        table = summary["branches"][group]
        places = list(table)
        for b, branch in enumerate(BRANCHES):
            ys = [table[p].get(branch) for p in places]
            ys = [math.nan if v is None else v for v in ys]
            xs = [k + (b - (len(BRANCHES) - 1) / 2) * width for k in range(len(places))]
            ax.bar(xs, ys, width, label=branch, color=COLORS.get(branch))
        ax.set_xticks(range(len(places)), [p.replace(".", " ") for p in places])
        ax.set_title(f"{group} tokens")
        ax.set_ylabel("mean top path value")
        ax.axhline(0, color="black", linewidth=0.5)
    if groups:
        axes[0][0].legend(title="branch", fontsize=8)
    fig.suptitle(f"branches per layer ({summary['branches_setting']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def attractor_figure(entropy, summary: dict, path) -> str:
    """Fig. 7: mean embedding path entropy vs number of attractors, per length bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, part in entropy.groupby("length_bin", sort=False):
        means = part.groupby("attractors")["entropy"].mean()
        rho = summary["attractors"].get(label, {}).get("spearman_rho")
        tag = "n/a" if rho is None else f"{rho:.2f}"
        ax.plot(means.index, means.values, marker="o", label=f"{label} words (ρ={tag})")
    ax.set_xlabel("number of attractors")
    ax.set_ylabel("mean path entropy of the word embeddings")
    ax.set_title("entropy vs attractors, by sentence length")
    if len(entropy):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
