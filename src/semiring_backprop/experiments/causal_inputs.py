"""An agreement example as a causal LM reads it: the sentence cut before the verb, and
the two verbs as the next token.

A causal LM predicts the verb from the words before it, so the prefix is the input
and the score is read at its last position: ``logit(correct verb) - logit(wrong verb)``
(the runner's ``logits=True``; the same number as the difference of their
log-probabilities). Each verb is read as the tokenizer reads it after the prefix: with
its leading space, one token, and the prefix's tokens unchanged by it
(:func:`prefix_inputs` checks both). Per token, the index of its word (from the
tokenizer's character offsets: a byte-level BPE may split a word) gives the token
groups. What cannot be read so is a ``{"skipped": reason, "kind": kind}``.

:func:`random_causal_lm` makes a small random Llama over a list of words (a word-level
tokenizer), for runs that only check the pipeline (its numbers mean nothing).
"""

from __future__ import annotations

import bisect
from pathlib import Path

import torch

from ..errors import InputError


def _skip(kind: str, reason: str) -> dict:
    return {"skipped": reason, "kind": kind}


def verb_token(tokenizer, verb: str) -> int | None:
    """The id of ``" " + verb`` where it is one token of the vocabulary, else None."""
    ids = tokenizer(" " + verb, add_special_tokens=False)["input_ids"]
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        return None
    return ids[0]


def encode_prefix(tokenizer, words) -> tuple[list[int], list[int]]:
    """``(ids, word of each token)`` of the words joined by spaces, with the special
    tokens the tokenizer puts before a text (a trailing end token is dropped: the
    prediction is read after the last word); -1 for a special token."""
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(
            f"{type(tokenizer).__name__} is not a fast tokenizer: the token of each word is "
            "read from the fast tokenizers' character offsets; load the model's fast one"
        )
    text = " ".join(words)
    enc = tokenizer(text, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    special = set(tokenizer.all_special_ids)
    while ids and ids[-1] in special and offsets[-1][0] == offsets[-1][1]:
        ids.pop()
        offsets.pop()
    starts, at = [], 0
    for w in words:
        starts.append(at)
        at += len(w) + 1
    word_of = []
    for (a, b), i in zip(offsets, ids):
        # the token's last character lies in its word (a leading space may not)
        word_of.append(-1 if a == b or i in special else bisect.bisect_right(starts, b - 1) - 1)
    return ids, word_of


def prefix_inputs(ex, tokenizer, max_length: int | None) -> dict:
    """The prefix of ``ex`` (an :class:`~semiring_backprop.data.AgreementExample`) before
    its verb: ``ids``, the verbs' ids ``good`` and ``bad``, per token its word
    (``words``), the token groups (``subject``, ``attractor``, ``all``) and ``source``,
    the subject's last token (the position whose key and value are ablated); or
    ``{"skipped": reason, "kind": kind}``."""
    good, bad = verb_token(tokenizer, ex.good), verb_token(tokenizer, ex.bad)
    if good is None or bad is None:
        which = ex.good if good is None else ex.bad
        return _skip("verb", f"the verb {' ' + which!r} is not one token of the vocabulary")
    if good == bad:
        return _skip("same_token", f"the verbs {ex.good!r} and {ex.bad!r} are the same token")
    if ex.subject is None:
        return _skip("no_subject", ex.unlocated or "no subject found")
    words = list(ex.words[: ex.mask_index])
    if not words:
        return _skip("empty_prefix", "no words before the verb")
    ids, word_of = encode_prefix(tokenizer, words)
    for verb, vid in ((ex.good, good), (ex.bad, bad)):
        whole, _ = encode_prefix(tokenizer, [*words, verb])
        if whole != [*ids, vid]:
            return _skip("verb_merges", f"the prefix followed by {verb!r} is not its tokens "
                         f"and {' ' + verb!r}: the tokenizer reads them together")  # fmt: skip
    if max_length is not None and len(ids) > max_length:
        return _skip("too_long", f"{len(ids)} tokens, more than the model's {max_length}")
    spans: list[list[int]] = [[] for _ in words]
    for t, w in enumerate(word_of):
        if w >= 0:
            spans[w].append(t)
    subject = spans[ex.subject] if ex.subject < len(spans) else []
    if not subject:
        return _skip("subject_no_tokens", f"the subject {ex.words[ex.subject]!r} has no tokens")
    attractors = sorted({t for w in ex.attractor_positions or () for t in spans[w]})
    return {"ids": ids, "good": good, "bad": bad, "words": word_of, "source": subject[-1],
            "groups": {"subject": subject, "attractor": attractors,
                       "all": list(range(len(ids)))}}  # fmt: skip


def item(example, prepared: dict):
    """The runner's :class:`~semiring_backprop.runner.Item`: the last position explained."""
    from ..runner import Item

    p = prepared
    return Item(example, p["ids"], len(p["ids"]) - 1, p["good"], p["bad"], p["words"])


def max_length(model_config) -> int | None:
    return getattr(model_config, "max_position_embeddings", None)


# -- a random model, for runs that check the pipeline --------------------------------

SPECIAL = ("[UNK]", "<s>")


def random_causal_lm(path, words, *, hidden=32, layers=2, heads=4, kv_heads=2,
                     intermediate=64, seed=0) -> str:  # fmt: skip
    """A random ``LlamaForCausalLM`` whose vocabulary is ``[UNK]``, ``<s>`` (put before
    each text) and ``words`` (split on whitespace), saved to directory ``path`` (kept
    on a rerun; a directory holding another vocabulary is an error); its path."""
    import json

    import tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    vocab = list(SPECIAL) + sorted(set(words) - set(SPECIAL))
    listed = path / "words.json"
    if (path / "config.json").exists() and listed.exists():
        if json.loads(listed.read_text()) != vocab:
            raise InputError(
                f"{path} holds a random model with another vocabulary (other data or "
                "settings); delete it or write into a new output directory"
            )
        return str(path.resolve())
    table = {w: i for i, w in enumerate(vocab)}
    wl = tokenizers.Tokenizer(tokenizers.models.WordLevel(table, unk_token="[UNK]"))
    wl.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    wl.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]", bos_token="<s>")
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=None, pad_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    listed.write_text(json.dumps(vocab))
    return str(path.resolve())


def words_of(examples) -> list[str]:
    """Every word of the examples and both verbs: what a random model's vocabulary holds."""
    from ..data import MASK

    out = set()
    for ex in examples:
        out.update(w for w in (*ex.words, ex.good, ex.bad) if w != MASK)
    return sorted(out)
