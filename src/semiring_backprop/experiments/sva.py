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

With ``paper`` (the default) every example is explained a second time in the paper's
own quantity, by a second runner pass into ``out/runner_paper``: traced as the
paper's library (brunoflow) built its graph, ``MaxProduct`` at tensor granularity, the
score taken as the difference of the two logits (as the paper's ``analyze_kvq.py`` did:
the same number), and aggregated as the paper did (``aggregation="paper"``: per token, the
best hidden unit's value goes to the branch that wins that unit, every other branch
gets 0). ``branches_paper.csv`` and ``summary["paper"]`` hold it, averaged as the
paper's notebook (``analysis/sva_max_grad.ipynb``) did: the zeros kept, the mean pooled
over the group's tokens of all examples, the subject read at its first token
(:func:`~semiring_backprop.experiments.sva_report.paper_table`).

The examples are explained by the data-set runner (:mod:`semiring_backprop.runner`):
its Parquet shards in ``out/runner`` (read them with
:func:`~semiring_backprop.runner.load_results`: one row per example x token x layer x
branch), written as they are computed, so a run that stops resumes where it stopped;
``workers`` runs Ray actors (``pip install "semiring-backprop[ray]"``), with the same
numbers. The tables, summary and figures are read from those shards
(:mod:`~semiring_backprop.experiments.sva_report`).

A causal LM (``model``: a Llama, GPT-2, ..., ``smol`` for SmolLM2-135M) reads the
sentence cut before the verb and explains ``logit(correct) - logit(wrong)`` at its last
position, with the accuracy by attractor count and an ablation of the subject's key and
value edges into that position: :mod:`.sva_causal`.

With ``data=None`` a small synthetic set ("the N1 of the N2 ***mask*** ...", positions
given) is written to the output directory; with ``model=None`` the model is a random
small BERT over the data's words, saved in ``out/model``: a smoke run, whose numbers
mean nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..runner.records import same_settings, write_json
from . import sva_inputs, sva_report
from .common import write_csv
from .entropy_sanity import lm_threads, quiet, random_masked_lm
from .sva_report import attractor_figure, branch_figure

AGGREGATIONS = ("oplus", "bucket_sum")
#: settings that choose how (or how much) is computed or reported, not what: a rerun
#: into the same directory may change them (``paper`` adds or leaves out a pass with its
#: own directory, ``runner_paper``, whose runner refuses other settings itself)
FREE = ("limit", "length_bins", "workers", "batch_size", "threads", "paper", "ablation")


@dataclass(frozen=True)
class Config:
    #: masked or causal LM: an id, directory, GGUF file or ``smol``; None: a random small BERT
    model: str | None = None
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
    workers: int = 0  #: Ray actors (the ``ray`` extra); 0: this process
    batch_size: int = 8  #: examples of one token length explained together
    threads: int = 0  #: torch threads; 0: one for the random BERT, the caller's for a model
    #: also the paper's quantity (paper mode, MaxProduct("tensor"), aggregation "paper")
    paper: bool = True
    #: a causal LM only: ablate the subject's key and value edges into the verb's position
    ablation: bool = True

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
        for name, low in (("workers", 0), ("batch_size", 1), ("threads", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise InputError(f"{name} must be a whole number >= {low}, got {v!r}")
        for name in ("paper", "ablation"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False, got {getattr(self, name)!r}")
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
    from .._files import atomic_write

    return atomic_write(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))


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
    """Explain every example with the data-set runner (its results in ``out/runner``:
    Parquet shards, resumable); write ``branches.csv``, ``entropy.csv``,
    ``summary.json`` and the figures ``branches.png`` and ``attractors.png``. With
    ``config.paper``, a second pass in the paper's quantity (``out/runner_paper``,
    resumable alike) gives ``branches_paper.csv`` and ``summary["paper"]``.

    For example::

        run("runs/sva", Config(model="bert-base-uncased", data="agreement.tsv", workers=2))
    """
    from ..runner import load_results
    from ..runner import run as explain_data

    config = config or Config()
    config.check()
    if config.model is not None:
        from . import sva_causal

        if sva_causal.is_causal(config.model):  # the sentence cut before the verb
            return sva_causal.run(out, config, progress)
    if config.workers:
        from ..runner.workers import require_ray

        require_ray()  # before reading or parsing anything
    out = Path(out)
    same_settings(out, config, free=FREE)
    data, every, located = sva_inputs.agreement_data(
        config, progress, lambda: synthetic_agreement(out / "synthetic.jsonl", config.synthetic,
                                                      config.seed))  # fmt: skip
    model = _model(config, out, every, progress)
    examples, ready, skips = _prepare(located, model, config)
    passes = [("runner", dict(semirings=("max", "entropy"), granularity=config.granularity,
                              aggregation=config.aggregation))]  # fmt: skip
    if config.paper:  # the paper's quantity: its graph, score and aggregation
        passes.append(("runner_paper", dict(semirings=("max",), granularity="tensor",
                                            aggregation=("paper",), paper=True)))  # fmt: skip
    with lm_threads(config), quiet(progress):
        for where, how in passes:
            explain_data(
                model, out=out / where, examples=examples, kind="masked",
                batch_size=config.batch_size, workers=config.workers, threads=config.threads,
                figures=False, progress=progress, prepare=lambda ex, *_: ready[ex.id], **how,
            )  # fmt: skip
    order = {ex.id: k for k, ex in enumerate(examples)}
    mine = lambda where: {name: (t[t["example_id"].isin(order)] if len(t) else t)
                          for name, t in load_results(out / where).items()}  # fmt: skip
    tables = mine("runner")
    paper = mine("runner_paper") if config.paper else None
    skips = _skips(out / "runner", order, skips)
    if not len(tables["examples"]):
        reasons = sorted({why for why, _ in skips.values()})
        raise InputError(
            f"{data}: none of the {len(examples)} examples could be explained; each was "
            f"skipped ({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''}). "
            f"The reasons are in {out / 'runner' / 'summary.json'}"
        )
    return _report(out, tables, order, skips, config, every.skipped, data, paper)


def _model(config: Config, out: Path, every, progress: bool) -> str:
    """The masked LM's id or directory: ``config.model``, or the random small BERT over
    the data's words, saved in ``out/model`` (the runner and its workers load it from
    there)."""
    if config.model is not None:
        return config.model
    with quiet(progress):
        random_masked_lm(
            out / "model", vocabulary(every), hidden=config.bert_hidden,
            layers=config.bert_layers, heads=config.bert_heads,
            intermediate=config.bert_intermediate, seed=config.seed,
        )  # fmt: skip
    return str((out / "model").resolve())


def _prepare(located, model: str, config: Config):
    """``(examples, ready, skips)``: the runner's examples (the subject and attractors as
    positions, the attractor count, length and verb pieces as columns), per id the
    runner's item or the reason it is skipped, and per skipped id ``(reason, kind)``."""
    from ..runner import from_agreement
    from ..runner.driver import load_tokenizer

    tokenizer, model_config, kind = load_tokenizer(model)
    if kind != "masked" or tokenizer.mask_token is None:
        raise InputError(
            f"{model!r} is a {kind} LM; this experiment explains the prediction at "
            "[MASK]: give a masked LM (BERT, RoBERTa, ...)"
        )
    max_length = getattr(model_config, "max_position_embeddings", None)
    examples, ready, skips = [], {}, {}
    for ex in located:
        base = from_agreement(ex)
        got = sva_inputs.prepare(ex, tokenizer, max_length, config.multi_token)
        count = ex.attractors if ex.attractors is not None else len(ex.attractor_positions or ())
        extra = {**base.extra, "attractors": count, "length": len(ex.words),
                 "verb_tokens": got.get("verb_tokens", 0)}  # fmt: skip
        runner_ex = replace(base, extra=extra)
        examples.append(runner_ex)
        if "skipped" in got:
            ready[base.id] = got["skipped"]
            skips[base.id] = (got["skipped"], got["kind"])
        else:
            ready[base.id] = sva_inputs.item(runner_ex, got)
    return examples, ready, skips


def _skips(run_dir: Path, order: dict, prepared: dict) -> dict:
    """``(reason, kind)`` per skipped example of this data: the kind :func:`_prepare`
    gave, or ``failed`` where the runner skipped it (a forward pass that failed)."""
    from ..runner import skipped_examples

    return {i: (why, prepared[i][1] if i in prepared else "failed")
            for i, why in skipped_examples(run_dir).items() if i in order}  # fmt: skip


def _report(out: Path, tables: dict, order: dict, skips: dict, config: Config, malformed,
            data, paper: dict | None = None) -> dict:  # fmt: skip
    values = sva_report.group_values(tables["branches"], tables["tokens"])
    branches = sva_report.branches_table(values)
    entropy = sva_report.entropy_table(tables["examples"], tables["tokens"], order,
                                       config.length_bins)  # fmt: skip
    write_csv(branches, out / "branches.csv")
    write_csv(entropy, out / "entropy.csv")
    multi = int((tables["examples"]["verb_tokens"] > 1).sum())
    summary = sva_report.summary(branches, entropy, skips, multi, config, malformed)
    names = ["branches.csv", "entropy.csv", "summary.json"]
    if paper is not None:  # the paper's quantity, beside ours
        table = sva_report.paper_table(paper["branches"], paper["tokens"])
        write_csv(table, out / "branches_paper.csv")
        summary["paper"] = sva_report.paper_summary(table, paper["examples"])
        names.insert(1, "branches_paper.csv")
    else:  # a file of an earlier run with paper=True would not match these results
        (out / "branches_paper.csv").unlink(missing_ok=True)
    write_json(out / "summary.json", summary)
    files = [str(out / f) for f in names]
    try:
        files.append(branch_figure(summary, out / "branches.png"))
        files.append(attractor_figure(entropy, summary, out / "attractors.png"))
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"summary": summary, "files": files, "explained": len(entropy),
            "skipped": len(skips), "data": str(data)}  # fmt: skip
