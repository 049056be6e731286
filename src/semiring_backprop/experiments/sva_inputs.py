"""The inputs of the ``sva`` experiment: an agreement example as the model sees it.

A sentence's words become word pieces (a word may split in several), the verb becomes
the model's mask token (one per piece of the verb, where a verb of several pieces is
scored), and the subject's and attractors' words become token groups. What cannot be
explained is a ``{"skipped": reason, "kind": kind}``, counted by kind in the summary;
the rest becomes a :class:`~semiring_backprop.runner.Item` (:func:`item`), explained by
the runner.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .entropy_sanity import with_special_tokens


def word_pieces(tokenizer, words) -> tuple[list[int], list[list[int]]]:
    """Input ids of ``words`` (with the model's special tokens) and, per word, the
    positions of its tokens (a word may split into several pieces).

    A fast tokenizer maps tokens to words itself (``word_ids``); otherwise each word is
    tokenized on its own.
    """
    words = list(words)
    if getattr(tokenizer, "is_fast", False):
        try:
            enc = tokenizer(words, is_split_into_words=True)
            spans: list[list[int]] = [[] for _ in words]
            for t, w in enumerate(enc.word_ids()):
                if w is not None:
                    spans[w].append(t)
            return list(enc["input_ids"]), spans
        except (ValueError, TypeError, AssertionError):  # e.g. BPE without add_prefix_space
            pass
    pieces = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in words]
    flat = [i for p in pieces for i in p]
    ids = with_special_tokens(tokenizer, flat)
    start = next(k for k in range(len(ids)) if ids[k : k + len(flat)] == flat) if flat else 0
    spans, at = [], start
    for p in pieces:
        spans.append(list(range(at, at + len(p))))
        at += len(p)
    return ids, spans


def verb_pieces(tokenizer, ex, verb: str) -> list[int]:
    """Token ids of ``verb`` at the example's verb position, tokenized in its sentence."""
    words = list(ex.words)
    words[ex.mask_index] = verb
    ids, spans = word_pieces(tokenizer, words)
    return [ids[t] for t in spans[ex.mask_index]]


def _skip(kind: str, reason: str) -> dict:
    return {"skipped": reason, "kind": kind}


MULTI_TOKEN_SKIP = "the verb splits into several tokens (multi_token=True scores it)"


def targets(ex, tokenizer, multi_token: bool = False) -> dict:
    """``{"good": ids, "bad": ids}``, one id per mask, or ``{"skipped", "kind"}``."""
    from ..hf.loading import word_id

    try:
        good, bad = word_id(tokenizer, ex.good, "masked"), word_id(tokenizer, ex.bad, "masked")
    except InputError as e:
        error = e
    else:
        if good == bad:
            return _skip("same_token", f"the verbs {ex.good!r} and {ex.bad!r} are the same token")
        return {"good": [good], "bad": [bad]}
    good, bad = (verb_pieces(tokenizer, ex, v) for v in (ex.good, ex.bad))
    unknown = tokenizer.unk_token_id is not None and tokenizer.unk_token_id in good + bad
    if unknown or len(good) < 2 and len(bad) < 2:
        return _skip("verb", f"verb: {error}")
    if not multi_token:
        return _skip("multi_token_verb", MULTI_TOKEN_SKIP)
    if len(good) != len(bad):
        return _skip("multi_token_lengths", "the verbs split into different numbers of tokens; "
                     "consecutive masks score only verbs of as many pieces")  # fmt: skip
    if good == bad:
        return _skip("same_token", f"the verbs {ex.good!r} and {ex.bad!r} are the same tokens")
    return {"good": good, "bad": bad}  # one id per mask, in order


def prepare(ex, tokenizer, max_length: int | None, multi_token: bool = False) -> dict:
    """The inputs of one example and its token groups, or ``{"skipped": reason, "kind"}``:
    ``ids``, the masks read (``positions``, ``good`` and ``bad`` ids, one each), the
    verb's token count, per token the index of its word (``words``, -1: a special token)
    and the token groups (``subject``, ``attractor``, ``all``).

    For example, a subject of two word pieces at tokens 2 and 3::

        prepare(ex, tokenizer, 512)["groups"]["subject"]  # [2, 3]
    """
    verbs = targets(ex, tokenizer, multi_token)
    if "skipped" in verbs:
        return verbs
    if ex.subject is None:
        return _skip("no_subject", ex.unlocated or "no subject found")
    words = list(ex.words)
    words[ex.mask_index] = tokenizer.mask_token
    ids, spans = word_pieces(tokenizer, words)
    masks = [t for t, i in enumerate(ids) if i == tokenizer.mask_token_id]
    if masks != spans[ex.mask_index]:
        return _skip("mask_in_sentence", "the sentence holds the mask token other than at the verb")
    k, at = len(verbs["good"]), masks[0]
    if k > 1:  # as many masks as the verb has pieces, where its pieces would be
        ids = [*ids[:at], *[tokenizer.mask_token_id] * k, *ids[at + 1 :]]
        spans = [[t + k - 1 if t > at else t for t in span] for span in spans]
        spans[ex.mask_index] = list(range(at, at + k))
    if max_length is not None and len(ids) > max_length:
        return _skip("too_long", f"{len(ids)} tokens, more than the model's {max_length}")
    attractors = sorted({t for w in ex.attractor_positions or () for t in spans[w]})
    groups = {"subject": spans[ex.subject], "attractor": attractors, "all": list(range(len(ids)))}
    if not groups["subject"]:
        return _skip("subject_no_tokens", f"the subject {ex.words[ex.subject]!r} has no tokens")
    count = ex.attractors if ex.attractors is not None else len(ex.attractor_positions or ())
    # pieces the verbs share at one place ("hasn't" / "haven't": "'", "t") add the same
    # log-probability to both sides: they cancel exactly, and are left out of the score
    # (their paths would be spurious under max)
    read = [j for j, (g, b) in enumerate(zip(verbs["good"], verbs["bad"])) if g != b]
    positions = [spans[ex.mask_index][j] for j in read]
    good, bad = [verbs["good"][j] for j in read], [verbs["bad"][j] for j in read]
    words = [-1] * len(ids)
    for w, span in enumerate(spans):
        for t in span:
            words[t] = w
    return {"ids": ids, "position": positions[0], "positions": positions, "verb_tokens": k,
            "good": good, "bad": bad, "groups": groups, "attractors": count,
            "words": words}  # fmt: skip


def item(example, prepared: dict):
    """The runner's :class:`~semiring_backprop.runner.Item` of a :func:`prepare` result:
    the first mask read is the item's position, the others its further ``masks`` (the
    runner's score sums ``log p(good) - log p(bad)`` over all of them)."""
    from ..runner import Item

    p = prepared
    masks = tuple(zip(p["positions"][1:], p["good"][1:], p["bad"][1:]))
    return Item(example, p["ids"], p["positions"][0], p["good"][0], p["bad"][0], p["words"],
                masks=masks)  # fmt: skip


def agreement_data(config, progress: bool, synthetic) -> tuple[Path, list, list]:
    """``(data, every, located)`` for an agreement experiment's ``config`` (``data``,
    ``limit``, ``nlp``): the file read (``config.data``, or the generated one
    ``synthetic()`` writes and returns), every example in it, and the first ``limit``
    with their subject and attractor positions (:func:`~semiring_backprop.data.locate`:
    an :class:`InputError` where positions are needed and spaCy or its pipeline is
    missing)."""
    from ..data import locate, read_agreement

    data = synthetic() if config.data is None else Path(config.data)
    every = read_agreement(data)
    if not every:
        raise InputError(
            f"{data}: no examples (the file is empty or holds only blank lines); give a "
            "BLiMP JSON-lines or Linzen/Goldberg TSV file with at least one example"
        )
    located = locate(every[: config.limit], nlp=config.nlp, progress=progress)
    return data, every, located
