"""The circuit of a Hugging Face language model's word choice: ``semiring-backprop
circuit``. The explained scalar is ``explain``'s (``log p(target) - log p(foil)`` at the
mask, or at the next position of a causal LM); a baseline text, of as many tokens, makes
the seed the difference of the two texts' token embeddings (``x - x'``)."""

from __future__ import annotations

import torch

from ..errors import InputError


def circuit_of_text(model, text: str, target: str, foil: str | None = None, *,
                    tokenizer=None, baseline_text: str | None = None, semirings=None,
                    kind: str | None = None, dtype=torch.float32, device="cpu"):  # fmt: skip
    """The :class:`~semiring_backprop.circuits.Circuit` of ``log p(target) - log p(foil)``
    for ``text``; ``model``: a hub id, a local directory, or a loaded model (with
    ``tokenizer``). ``baseline_text``: a text of the same number of tokens; the seed is
    then ``x - x'`` at the token embeddings (else ``x``)."""
    from ..hf.loading import check_device, lm_kind, load
    from ..hf.tasks import prepare
    from . import circuit

    if isinstance(model, str):
        model_id = model
        model, tokenizer, kind = load(model_id, kind, dtype, check_device(device))
    elif tokenizer is None:
        raise InputError("pass tokenizer= with a loaded model (or give a hub id / directory)")
    else:
        model_id = getattr(model.config, "_name_or_path", "") or type(model).__name__
        kind = kind or lm_kind(model.config, tokenizer, type(model).__name__)
        model = model.eval()
    prep = prepare("lm", model, tokenizer, text, target, foil, kind=kind, model_id=model_id)
    if len(prep.examples) != 1:
        raise InputError(
            f"a circuit is read from one text: {target!r} or {foil!r} is several tokens, "
            "which takes a batch; give words of one token each"
        )
    emb = model.get_input_embeddings()
    place = next(n for n, m in model.named_modules() if m is emb)
    baseline = None
    if baseline_text is not None:
        other = prepare("lm", model, tokenizer, baseline_text, target, foil, kind=kind,
                        model_id=model_id)  # fmt: skip
        ids, base_ids = prep.inputs["input_ids"], other.inputs["input_ids"]
        if base_ids.shape != ids.shape:
            raise InputError(
                f"the baseline text has {base_ids.shape[-1]} tokens and the text "
                f"{ids.shape[-1]}: give a baseline of as many tokens (a corrupted copy)"
            )
        with torch.no_grad():
            baseline = {place: emb(base_ids).detach()}
    c = circuit(model, kwargs=prep.inputs, output=prep.target, semirings=semirings,
                baseline=baseline, seed="x", tokens=prep.examples[0], what=prep.what)  # fmt: skip
    c.model_id = model_id
    return c
