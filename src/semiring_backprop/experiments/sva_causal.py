"""Paper §5.2 and App. B.2 on a causal LM: which route of self-attention carries the
subject's number to the verb, read from the gradient graph and checked by ablation.

A causal LM reads agreement at the last position of the sentence cut before the verb
(:mod:`.causal_inputs`): the subject reaches that prediction only through attention, so
the paper's question (key or value?) has a causal answer. The run:

- **Branches** (as the masked path, :mod:`.sva`): ``logit(correct) - logit(wrong)`` at
  the last position explained by the data-set runner with ``MaxProduct`` and
  ``Entropy`` (``out/runner``, resumable; Ray with ``workers``); per layer the branch
  values for the subject, the attractors and all tokens (``branches.csv``), the
  entropy against the attractors (``entropy.csv``). With ``paper``, the paper's quantity
  (tensor granularity, paper mode) in ``out/runner_paper``: tried on a first batch, and
  where every example of it overflows the float range (the tensor granularity's sums
  grow with depth: 30 layers do not fit in float32) reported as such and not run on.
- **Accuracy** by attractor count: the share of pairs where the model prefers the
  correct verb (the paper's ``is_correct``: 956 of its 1,000).
- **Ablation** (``ablation``, :mod:`.sva_ablation`): per layer, the subject's key edge
  and value edge into the last query replaced by the data set's mean or by the
  counterpart sentence's (subject of the other number); the change of the margin and of
  the accuracy (``ablation.csv``), beside the branch the top path names there.

Data: a BLiMP JSON-lines or Linzen TSV file, or, without one, ``synthetic`` pairs of
:func:`~semiring_backprop.data.agreement_pairs.agreement_pairs` (``synthetic.jsonl``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import InputError
from ..runner.records import same_settings
from . import sva_ablation, sva_causal_report
from .causal_inputs import item, max_length, prefix_inputs
from .entropy_sanity import lm_threads, quiet
from .sva_inputs import agreement_data

#: settings that choose how much is computed or reported, not what (see :mod:`.sva`)
FREE = ("limit", "length_bins", "workers", "batch_size", "threads", "paper", "ablation")


def is_causal(model) -> bool:
    """Whether ``model`` (an id, directory, GGUF file or ``smol``) is a causal LM, read
    from its config and tokenizer; False where they cannot be read (the masked path
    then says what is wrong)."""
    from ..errors import SemiringBackpropError
    from ..hf.gguf import checkpoint
    from ..runner.driver import load_tokenizer

    try:
        return load_tokenizer(checkpoint(model))[2] == "causal"
    except (SemiringBackpropError, OSError, ValueError):
        return False


def run(out, config, progress: bool = True) -> dict:
    """The causal path of :func:`~semiring_backprop.experiments.sva.run` (same
    ``Config``): the files of the masked path, with ``accuracy`` and ``ablation`` in the
    summary and ``ablation.csv`` and ``ablation.png`` beside them."""
    from ..data.agreement_pairs import write_agreement_pairs
    from ..hf.gguf import checkpoint
    from ..runner.driver import load_tokenizer

    if config.workers:
        from ..runner.workers import require_ray

        require_ray()
    out = Path(out)
    same_settings(out, config, free=FREE)
    data, every, located = agreement_data(
        config, progress, lambda: write_agreement_pairs(out / "synthetic.jsonl",
                                                        config.synthetic, config.seed))  # fmt: skip
    model = checkpoint(config.model)
    tokenizer, model_config, _ = load_tokenizer(model)
    examples, ready, skips = _prepare(located, tokenizer, model_config)
    with lm_threads(config), quiet(progress):
        _explain(model, out / "runner", examples, ready, config, progress,
                 semirings=("max", "entropy"), granularity=config.granularity,
                 aggregation=config.aggregation, logits=True)  # fmt: skip
        paper_error = None
        if config.paper:
            paper_error = _paper(model, out, examples, ready, config, progress)
        records, patch_skips = None, {}
        if config.ablation:
            records, patch_skips = _ablate(model, located, tokenizer, model_config, out, progress)
    order = {ex.id: k for k, ex in enumerate(examples)}
    from ..runner import load_results

    mine = lambda where: {name: (t[t["example_id"].isin(order)] if len(t) else t)
                          for name, t in load_results(out / where).items()}  # fmt: skip
    tables = mine("runner")
    if not len(tables["examples"]):
        raise InputError(f"{data}: none of the {len(examples)} examples could be explained "
                         f"(the reasons are in {out / 'runner' / 'summary.json'})")  # fmt: skip
    paper = mine("runner_paper") if config.paper and paper_error is None else None
    skips = _skips(out / "runner", order, skips)
    return sva_causal_report.report(out, tables, order, skips, config, every.skipped, data,
                                    paper, paper_error, records, patch_skips)  # fmt: skip


def _prepare(located, tokenizer, model_config):
    """``(examples, ready, skips)`` as :func:`.sva._prepare` makes them, for the prefix."""
    from ..runner import from_agreement

    examples, ready, skips = [], {}, {}
    for ex in located:
        base = from_agreement(ex)
        got = prefix_inputs(ex, tokenizer, max_length(model_config))
        count = ex.attractors if ex.attractors is not None else len(ex.attractor_positions or ())
        extra = {**base.extra, "attractors": count, "length": ex.mask_index,
                 "verb_tokens": 1}  # fmt: skip
        runner_ex = replace(base, extra=extra)
        examples.append(runner_ex)
        if "skipped" in got:
            ready[base.id] = got["skipped"]
            skips[base.id] = (got["skipped"], got["kind"])
        else:
            ready[base.id] = item(runner_ex, got)
    return examples, ready, skips


def _explain(model, where: Path, examples, ready, config, progress, limit=None, **how):
    from ..runner import run as explain_data

    return explain_data(model, out=where, examples=examples, kind="causal",
                        batch_size=config.batch_size, workers=config.workers,
                        threads=config.threads, figures=False, progress=progress,
                        prepare=lambda ex, *_: ready[ex.id], limit=limit, **how)  # fmt: skip


def _paper(model, out: Path, examples, ready, config, progress) -> str | None:
    """The paper's pass: a first batch, then the rest unless every example of that
    batch overflowed; the overflow's reason (None where the pass ran)."""
    from ..runner import skipped_examples

    how = dict(semirings=("max",), granularity="tensor", aggregation=("paper",), paper=True)
    where = out / "runner_paper"
    first = _explain(model, where, examples, ready, config, progress,
                     limit=config.batch_size, **how)  # fmt: skip
    if first["explained"] == 0:
        reasons = [r for i, r in skipped_examples(where).items()
                   if not isinstance(ready.get(i), str)]  # fmt: skip
        if reasons and all(r.startswith("NonFiniteError") for r in reasons):
            return reasons[0]
    _explain(model, where, examples, ready, config, progress, **how)
    return None


def _ablate(model_id, located, tokenizer, model_config, out: Path, progress):
    from ..ablation.reads import LastQueryReads
    from ..hf.loading import load

    todo, skipped = sva_ablation.pairs(located, tokenizer, max_length(model_config))
    model = load(model_id, "causal")[0]
    try:
        LastQueryReads(model)
    except InputError as e:  # not a Llama-like attention: the rest of the run stands
        return None, {"error": str(e)}
    records = sva_ablation.run(model, todo, out, progress)
    mine = {p["id"] for p in todo}
    return [r for r in records.rows if r["key"] in mine], skipped


def _skips(run_dir: Path, order: dict, prepared: dict) -> dict:
    from ..runner import skipped_examples

    return {i: (why, prepared[i][1] if i in prepared else "failed")
            for i, why in skipped_examples(run_dir).items() if i in order}  # fmt: skip
