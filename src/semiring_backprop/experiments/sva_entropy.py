"""Paper App. B.2, Fig. 6a and Fig. 7: the path entropy of agreement sentences against
their length, and against their number of attractors within length bins.

Each sentence explains ``logit(correct verb) - logit(wrong verb)`` at the verb (a
causal LM: at the last position of the sentence cut before it; a masked LM: at its
mask) under ``Entropy`` (and ``PathCount``), by the data-set runner (``out/runner``,
resumable; Ray with ``workers``), without the branch table. A sentence's entropy is the
mean over its tokens of the word embeddings' per-unit path entropy (the paper's
per-element entropies: ``entropy_unit_mean``), as the paper's notebook averaged
(``analysis/sva_entropy.ipynb``); its length is its token count, the model's special
tokens (and the mask) included, as the paper counted.

- Fig. 6a: the mean entropy per ``length_step``-token bin, and Spearman's ρ of entropy
  against length over all sentences (the paper: from about 269.5 at 10 tokens to 277
  at 70);
- Fig. 7: Spearman's ρ of the attractor count against entropy within the token bins
  ``length_bins`` (the paper: .18, .13, .01, .11 in 10-20 ... 40-50).

Data: a BLiMP JSON-lines or Linzen TSV file (``attractors`` as the data gives them), or
``synthetic`` generated pairs (:func:`~semiring_backprop.data.agreement_pairs.
agreement_pairs`: ``attractors`` 1-4 as the paper's 250 each, lengths in ``words``
reached by preambles before the subject). Without ``model``, a random small Llama over
the data's words (saved in ``out/model``): a smoke run, whose numbers mean nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..runner.records import same_settings, write_json
from .common import spearman, write_csv
from .entropy_sanity import lm_threads, quiet
from .sva_inputs import agreement_data

FREE = ("limit", "workers", "batch_size", "threads", "length_bins", "length_step")
RANDOM_NOTE = ("model=None: a random, untrained Llama. These numbers check that the pipeline "
               "runs; they say nothing about agreement. Give model= (an LM).")  # fmt: skip


@dataclass(frozen=True)
class Config:
    model: str | None = None  #: a causal or masked LM (id, directory, GGUF, ``smol``)
    data: str | None = None  #: BLiMP .jsonl or Linzen .tsv; None: generated pairs
    limit: int | None = None
    synthetic: int = 1000  #: generated sentences
    attractors: tuple[int, ...] = (1, 2, 3, 4)  #: generated attractor counts, cycled
    words: tuple[int, int] = (6, 60)  #: generated sentences' lengths in words (drawn)
    length_bins: tuple[int, ...] = (10, 20, 30, 40, 50)  #: Fig. 7's token bins
    length_step: int = 10  #: Fig. 6a's token bins
    seed: int = 0
    nlp: str = "en_core_web_sm"  #: spaCy pipeline, for data without subject positions
    workers: int = 0
    batch_size: int = 8
    threads: int = 0
    llama_hidden: int = 32  #: sizes of the random Llama (model=None)
    llama_layers: int = 2
    llama_heads: int = 4

    @classmethod
    def quick(cls) -> Config:
        return replace(cls(), synthetic=40, limit=40)

    def check(self) -> None:
        bins = list(self.length_bins)
        if len(bins) < 2 or any(a >= b for a, b in zip(bins, bins[1:])):
            raise InputError(f"length_bins must be increasing edges, got {self.length_bins}")
        lo, hi = self.words
        if not 2 <= lo <= hi:
            raise InputError(f"words must be (low, high) with 2 <= low <= high, got {self.words}")
        if min(self.attractors, default=-1) < 0 or max(self.attractors, default=5) > 4:
            raise InputError(f"attractors must be counts from 0 to 4, got {self.attractors}")


def run(out, config: Config | None = None, progress: bool = True) -> dict:
    """Explain every sentence (``out/runner``); write ``entropy.csv`` (one row per
    sentence), ``summary.json`` and the figures ``length.png`` (Fig. 6a) and
    ``attractors.png`` (Fig. 7)."""
    from ..data.agreement_pairs import write_agreement_pairs
    from ..runner import load_results
    from ..runner import run as explain_data
    from ..runner.driver import load_tokenizer

    config = config or Config()
    config.check()
    out = Path(out)
    same_settings(out, config, free=FREE)
    data, every, located = agreement_data(
        config, progress, lambda: write_agreement_pairs(
            out / "synthetic.jsonl", config.synthetic, config.seed,
            attractors=config.attractors, words=config.words))  # fmt: skip
    model = _model(config, out, every, progress)
    tokenizer, model_config, kind = load_tokenizer(model)
    examples, ready = _prepare(located, tokenizer, model_config, kind)
    with lm_threads(config), quiet(progress):
        explain_data(model, out=out / "runner", examples=examples, kind=kind,
                     semirings=("entropy",), logits=True, branches=False,
                     batch_size=config.batch_size, workers=config.workers,
                     threads=config.threads, figures=False, progress=progress,
                     prepare=lambda ex, *_: ready[ex.id])  # fmt: skip
    order = {ex.id: k for k, ex in enumerate(examples)}
    tables = load_results(out / "runner", columns={"branches": ["example_id"]})
    frame = sentences(tables["examples"], tables["tokens"], order)
    if not len(frame):
        raise InputError(f"{data}: none of the {len(examples)} sentences could be explained "
                         f"(the reasons are in {out / 'runner' / 'summary.json'})")  # fmt: skip
    write_csv(frame, out / "entropy.csv")
    summary = _summary(frame, config, kind, len(examples), data)
    write_json(out / "summary.json", summary)
    files = [str(out / "entropy.csv"), str(out / "summary.json")]
    try:
        from .sva_entropy_figures import attractor_figure, length_figure

        files.append(length_figure(frame, summary, out / "length.png"))
        files.append(attractor_figure(frame, summary, out / "attractors.png"))
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"summary": summary, "files": files, "explained": len(frame)}


def _model(config: Config, out: Path, every, progress: bool) -> str:
    from ..hf.gguf import checkpoint
    from .causal_inputs import random_causal_lm, words_of

    if config.model is not None:
        return checkpoint(config.model)
    with quiet(progress):
        return random_causal_lm(out / "model", words_of(every), hidden=config.llama_hidden,
                                layers=config.llama_layers, heads=config.llama_heads,
                                kv_heads=1, seed=config.seed)  # fmt: skip


def _prepare(located, tokenizer, model_config, kind: str):
    """``(examples, ready)``: the runner's examples (attractors as a column) and per id
    its item or the reason it is skipped."""
    from ..runner import from_agreement
    from . import causal_inputs, sva_inputs

    examples, ready = [], {}
    for ex in located:
        base = from_agreement(ex)
        count = ex.attractors if ex.attractors is not None else len(ex.attractor_positions or ())
        runner_ex = replace(base, extra={**base.extra, "attractors": count})
        examples.append(runner_ex)
        if kind == "causal":
            got = causal_inputs.prefix_inputs(ex, tokenizer, causal_inputs.max_length(model_config))
            make = causal_inputs.item
        else:
            if tokenizer.mask_token is None:
                raise InputError(f"{type(tokenizer).__name__}: a masked LM without a mask token")
            got = sva_inputs.prepare(ex, tokenizer, causal_inputs.max_length(model_config))
            make = sva_inputs.item
        ready[base.id] = got["skipped"] if "skipped" in got else make(runner_ex, got)
    return examples, ready


def sentences(examples, tokens, order: dict):
    """``entropy.csv``: per explained sentence (the data's order), its token count, its
    attractors, the margin, and the means over its tokens of the per-unit path entropy,
    ``log #paths`` and their ratio, and of the tokens' whole entropy (⊕ over units)."""
    cols = {"entropy_unit_mean": "entropy", "log_paths_unit_mean": "log_paths",
            "normalized_entropy_unit_mean": "normalized", "entropy": "token_entropy"}  # fmt: skip
    if not len(examples):
        import pandas as pd

        return pd.DataFrame()
    means = tokens.groupby("example_id")[list(cols)].mean().rename(columns=cols)
    frame = examples.set_index("example_id")[["source", "attractors", "tokens", "score"]]
    frame = frame.join(means).reset_index().rename(columns={"example_id": "example"})
    frame = frame[frame["example"].isin(order)]
    frame = frame.iloc[np.argsort([order[e] for e in frame["example"]], kind="stable")]
    return frame.reset_index(drop=True)


def _bins(values, edges) -> list:
    labels = [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])]
    which = np.digitize(values, edges) - 1
    return [labels[k] if 0 <= k < len(labels) else None for k in which]


def _summary(frame, config: Config, kind: str, examples: int, data) -> dict:
    step = config.length_step
    lo = int(frame["tokens"].min()) // step * step
    edges = list(range(lo, int(frame["tokens"].max()) + step + 1, step))
    frame = frame.assign(
        length_bin=_bins(frame["tokens"], edges),
        attractor_bin=_bins(frame["tokens"], list(config.length_bins)),
    )
    by_length = {label: {"sentences": int(len(p)), "entropy": float(p["entropy"].mean())}
                 for label, p in frame.groupby("length_bin", sort=False)}  # fmt: skip
    by_length = dict(sorted(by_length.items(), key=lambda kv: int(kv[0].split("-")[0])))
    attractors = {}
    for lo_, hi_ in zip(config.length_bins, config.length_bins[1:]):
        label = f"{lo_}-{hi_}"
        part = frame[frame["attractor_bin"] == label]
        means = part.groupby("attractors")["entropy"].mean()
        rho = spearman(part["attractors"].tolist(), part["entropy"].tolist())
        attractors[label] = {**rho, "mean_entropy": {int(k): float(v) for k, v in means.items()}}
    from ..hf.explanation import model_name

    out = {
        "data": config.data or "generated pairs",
        "model": "a random Llama" if config.model is None else model_name(config.model),
        "model_kind": kind,
        "examples": examples,
        "explained": int(len(frame)),
        "length": {"by_tokens": by_length,
                   **spearman(frame["tokens"].tolist(), frame["entropy"].tolist())},
        "attractors": attractors,
        "accuracy": float((frame["score"] > 0).mean()),
        "entropy_is": "per sentence, the mean over its tokens of the word embeddings' "
                      "per-unit path entropy (nats)",
        "target": "logit(correct verb) - logit(wrong verb) at the verb's position",
    }  # fmt: skip
    if config.model is None:
        out["note"] = RANDOM_NOTE
    return out
