"""The circuit of a Hugging Face model's output for one text: ``semiring-backprop
circuit``. The explained scalar is ``explain``'s for the same ``task``
(:data:`~semiring_backprop.targets.TASKS`): ``lm``, ``log p(target) - log p(foil)`` at
the mask (or the next position of a causal LM); ``classification``, a label's logit
(or its margin to a foil label); ``token``, a label's logit at one position;
``similarity``, one dimension of the text's pooled embedding. A baseline text, of as
many tokens, makes the seed the difference of the two texts' token embeddings
(``x - x'``), from which ``ig_steps`` integrated-gradients steps may run; without one
the seed is ``x`` or ``structural``."""

from __future__ import annotations

import os

import torch

from ..errors import InputError

#: the model class each task reads (a loaded model of another class is refused)
_HEADS = {"classification": "ForSequenceClassification", "token": "ForTokenClassification"}


def circuit_of_text(model, text: str, target: str | None = None, foil: str | None = None, *,
                    task: str = "lm", tokenizer=None, text_pair: str | None = None,
                    position: int | None = None, pooling=None, score: str = "logit",
                    dim: int | None = None, baseline_text: str | None = None,
                    semirings=None, kind: str | None = None, dtype=torch.float32,
                    device="cpu", seed: str = "x", ig_steps: int = 0,
                    ig_method: str = "gausslegendre", gguf_file: str | None = None,
                    weights: str = "gradient"):  # fmt: skip
    """The :class:`~semiring_backprop.circuits.Circuit` of ``task``'s scalar for
    ``text`` (the arguments as for ``explain``: ``target`` is the word of ``lm`` or the
    label of ``classification`` and ``token``; ``text_pair``, ``position``,
    ``pooling``, ``score``, ``dim`` where the task reads them). ``model``: a hub id, a
    local directory, or a loaded model (with ``tokenizer``). ``baseline_text``: a text
    of the same number of tokens; the seed is then ``x - x'`` at the token embeddings
    (else ``seed``: ``"x"``, each source's own value, or ``"structural"``, one at every
    element). ``ig_steps=N`` (with ``baseline_text``): Real summed over ``N``
    integrated-gradients steps from the baseline (``ig_method``: the quadrature), as for
    :func:`~semiring_backprop.circuits.circuit`. ``weights``: ``"gradient"`` (default)
    or ``"relevance"`` (RelP's rules, as for ``backprop``). These are checked before the
    model is loaded.

    A circuit is read from one example: a task that needs a batch (the similarity of
    two texts; an ``lm`` word of several tokens) is refused with what to give instead.

    For example::

        circuit_of_text(DIR, "a fine film", "positive", task="classification")
        circuit_of_text(DIR, "a cat sat", task="similarity", dim=3, pooling="mean")
    """
    from ..engine import relevance
    from ..hf.gguf import checkpoint
    from ..hf.loading import check_device, lm_kind, load
    from ..hf.tasks import load_task, prepare
    from ..targets import TASKS
    from . import circuit

    if task not in TASKS:
        raise InputError(f"task {task!r}: choose one of {', '.join(TASKS)}")
    _check_seed(seed, baseline_text, ig_steps, ig_method)
    relevance.check(weights)
    if task == "similarity" and text_pair is not None:
        raise InputError(
            "a circuit is read from one text, and the similarity of two texts runs the "
            "model on both (a batch of two): give --dim N (dim=N) to explain one "
            "dimension of the text's pooled embedding instead of --text-pair"
        )
    if isinstance(model, str | os.PathLike):
        model_id = checkpoint(model, gguf_file)
        if task == "lm":
            model, tokenizer, kind = load(model_id, kind, dtype, check_device(device))
        else:
            model, tokenizer = load_task(model_id, task, dtype, check_device(device))
    elif tokenizer is None:
        raise InputError("pass tokenizer= with a loaded model (or give a hub id / directory)")
    else:
        model_id = getattr(model.config, "_name_or_path", "") or type(model).__name__
        if task == "lm":
            kind = kind or lm_kind(model.config, tokenizer, type(model).__name__)
        name = type(model).__name__
        if task in _HEADS and _HEADS[task] not in name:
            raise InputError(
                f"the {task} task reads a {_HEADS[task][3:]} model's logits; {name} is not "
                f"one: load it with AutoModel{_HEADS[task]}.from_pretrained"
            )
        model = model.eval()

    def prepared(words: str):
        return prepare(task, model, tokenizer, words, target, foil, kind=kind,
                       text_pair=text_pair, position=position, pooling=pooling, score=score,
                       dim=dim, model_id=model_id)  # fmt: skip

    prep = prepared(text)
    if len(prep.examples) != 1:
        raise InputError(
            f"a circuit is read from one text: {target!r} or {foil!r} is several tokens, "
            "which takes a batch; give words of one token each"
        )
    baseline = None
    if baseline_text is not None:
        other = prepared(baseline_text)
        ids, base_ids = prep.inputs["input_ids"], other.inputs["input_ids"]
        if base_ids.shape != ids.shape:
            raise InputError(
                f"the baseline text has {base_ids.shape[-1]} tokens and the text "
                f"{ids.shape[-1]}: give a baseline of as many tokens (a corrupted copy)"
            )
        baseline = {"input_ids": base_ids}  # x' where the paths start: computed
    c = circuit(model, kwargs=prep.inputs, output=prep.target, semirings=semirings,
                baseline=baseline, seed=seed, tokens=prep.examples[0], what=prep.what,
                ig_steps=ig_steps, ig_method=ig_method, weights=weights)  # fmt: skip
    c.model_id = model_id
    return c


def _check_seed(seed, baseline_text, ig_steps, ig_method) -> None:
    """Refuse what ``circuit`` would refuse after the pass (``check_call``), before the
    model is loaded, naming the arguments and the command line's flags."""
    from ..engine.marginals import SEEDS
    from .ig import check_steps

    if seed not in SEEDS:
        raise InputError(f"seed={seed!r} (--seed): use one of {', '.join(SEEDS)}")
    try:
        check_steps(ig_steps, ig_method)
    except InputError as e:
        raise InputError(f"{e} (--ig-steps, --ig-method)") from None
    if baseline_text is not None and seed != "x":
        raise InputError(
            f"a baseline text makes the seed x - x' (--baseline-text): seed={seed!r} "
            "(--seed) cannot be used with it; leave the seed at x, or give no baseline"
        )
    if ig_steps and baseline_text is None:
        raise InputError(
            f"ig_steps={ig_steps} (--ig-steps) integrates from a baseline x' to the input: "
            "give a corrupted text of as many tokens (baseline_text=, --baseline-text)"
        )
