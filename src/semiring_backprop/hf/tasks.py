"""From a checkpoint and words to a model and a target: what ``explain --task`` does.

:func:`load_task` loads a checkpoint for a task (refusing one whose task head would be
initialized at random); :func:`prepare` tokenizes the text and builds the target
(:mod:`.targets`) from label names, words or a second text; :func:`read_pooling` reads
how a sentence-transformers checkpoint pools, without that package.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..errors import InputError, LoadError
from ..targets import (
    ONE_OUTPUT,
    POOLING,
    TASKS,
    ClassLabel,
    EmbeddingDim,
    Similarity,
    TokenLabel,
    WordChoice,
    check_score,
    output_field,
)
from ..tokens import readable_tokens, token_line


def _shown(ids, tokenizer) -> list[str]:
    """The tokens of ``ids`` as people read them (`` Mary``, not ``ĠMary``)."""
    return readable_tokens(tokenizer.convert_ids_to_tokens(ids), tokenizer)


# -- labels ---------------------------------------------------------------------------


def label_index(config, label) -> int:
    """The index of ``label`` (a name from ``config.id2label`` or an index, as int or
    string) among the model's labels."""
    names = {int(i): str(n) for i, n in (getattr(config, "id2label", None) or {}).items()}
    n = getattr(config, "num_labels", None) or len(names)
    by_name = {v: k for k, v in names.items()}
    if str(label) in by_name:
        return by_name[str(label)]
    try:
        i = int(label)
    except (TypeError, ValueError):
        i = None
    if i is not None and -n <= i < n:
        return i % n
    listed = ", ".join(f"{k}: {v}" for k, v in sorted(names.items())) or f"0..{n - 1}"
    raise InputError(
        f"label {label!r} is not one of the model's {n} labels ({listed}); give a name "
        "from that list or an index"
    )


# -- pooling from a sentence-transformers checkpoint ------------------------------------


@dataclass(frozen=True)
class Pooling:
    """How a sentence-transformers checkpoint pools: ``modes`` (concatenated), whether a
    ``Normalize`` module follows, and the folder of its ``Transformer`` module."""

    modes: tuple
    normalize: bool = False
    transformer: str = ""


_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
}
_UNSUPPORTED_KEYS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def read_pooling(model_id: str) -> Pooling | None:
    """The pooling of a sentence-transformers checkpoint (a local directory or a hub id
    in the cache), read from its ``modules.json`` and ``1_Pooling/config.json``; None
    where it has no ``modules.json`` (not a sentence-transformers checkpoint)."""
    modules = _read_json(model_id, "modules.json")
    if modules is None:
        return None
    if not isinstance(modules, list):
        raise LoadError(f"{model_id!r}: modules.json is not a list of modules")
    modes, normalize, transformer, found = None, False, "", False
    for m in sorted(modules, key=lambda m: m.get("idx", 0) if isinstance(m, dict) else 0):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else ""
        path = str(m.get("path", "")) if isinstance(m, dict) else ""
        if kind == "Transformer":
            transformer, found = path, True
        elif kind == "Pooling":
            modes = _pooling_modes(model_id, path)
        elif kind == "Normalize":
            normalize = True
        else:
            raise LoadError(
                f"{model_id!r}: modules.json has a {kind or m!r} module after the encoder, "
                "which this package does not compute (it reads Transformer, Pooling and "
                "Normalize). Explain the encoder's pooled output instead: --pooling MODE"
            )
    if not found or modes is None:
        return None
    return Pooling(modes, normalize, transformer)


def _pooling_modes(model_id, folder) -> tuple:
    name = f"{folder}/config.json" if folder else "config.json"
    cfg = _read_json(model_id, name)
    if not isinstance(cfg, dict):
        raise LoadError(f"{model_id!r}: {name} is missing or not an object")
    odd = [k for k in _UNSUPPORTED_KEYS if cfg.get(k)]
    if odd:
        raise LoadError(
            f"{model_id!r}: {name} turns on {', '.join(odd)}, which this package does not "
            f"compute; give --pooling ({', '.join(POOLING)}) to explain another pooling"
        )
    modes = tuple(mode for key, mode in _MODE_KEYS.items() if cfg.get(key))
    if not modes:
        raise LoadError(f"{model_id!r}: {name} turns on no pooling mode; give --pooling")
    return modes


def _read_json(model_id: str, name: str):
    """A JSON file of a checkpoint (local directory or a cached hub id), or None."""
    local = os.path.join(os.path.expanduser(model_id), name)
    if os.path.isdir(os.path.expanduser(model_id)):
        path = local if os.path.isfile(local) else None
    else:
        from transformers.utils import cached_file

        try:
            path = cached_file(model_id, name, _raise_exceptions_for_missing_entries=False)
        except (OSError, ValueError):
            path = None
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise LoadError(f"{model_id!r}: {name} cannot be read as JSON ({e})") from None


def pooling_for(model_id: str | None, pooling=None) -> Pooling:
    """``pooling`` (a mode or tuple; overrides) or the checkpoint's own, else an error
    that says how to give it."""
    found = read_pooling(model_id) if model_id else None
    if pooling is not None:
        modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
        if found is None:
            return Pooling(modes)
        return Pooling(modes, found.normalize, found.transformer)
    if found is None:
        raise InputError(
            f"{model_id or 'the model'} says nothing about pooling (no sentence-transformers "
            "modules.json with a Pooling module): give it, --pooling mean|cls|max|lasttoken "
            "on the command line or pooling='mean' in Python"
        )
    return found


# -- loading a checkpoint for a task ----------------------------------------------------

_HEADS = {"classification": "sequence-classification", "token": "token-classification"}


def load_task(model_id: str, task: str, dtype=torch.float32, device="cpu",
              gguf_file: str | None = None):  # fmt: skip
    """``(model, tokenizer)`` for ``task`` (``classification``, ``token`` or
    ``similarity``) from a hub id or a local directory. A checkpoint without the task's
    head (a bare encoder asked to classify) is a :class:`LoadError`: transformers would
    initialize the head at random."""
    from . import gguf
    from .loading import (
        check_local,
        config_and_tokenizer,
        from_pretrained,
        need_transformers,
        refuse_fresh_weights,
    )

    transformers = need_transformers()
    if task not in ("classification", "token", "similarity"):
        raise InputError(f"task {task!r}: load_task loads classification, token or similarity")
    model_id = gguf.checkpoint(model_id, gguf_file)
    where = model_id
    if task == "similarity" and not gguf.is_gguf(model_id):
        found = read_pooling(model_id)
        if found is not None and found.transformer and os.path.isdir(model_id):
            where = os.path.join(model_id, found.transformer)
    cls = {
        "classification": transformers.AutoModelForSequenceClassification,
        "token": transformers.AutoModelForTokenClassification,
        "similarity": transformers.AutoModel,
    }[task]
    check_local(model_id, where)
    config, tokenizer = config_and_tokenizer(model_id, where)
    model, info = from_pretrained(cls, where, model_id, dtype)
    if task == "similarity":  # the pooler's output is not what a sentence embedding pools
        info = {**info, "missing_keys": [k for k in info.get("missing_keys") or ()
                                         if "pooler" not in k.split(".")]}  # fmt: skip
    refuse_fresh_weights(model_id, _HEADS.get(task, "encoder"), config, model, info)
    return model.to(device).eval(), tokenizer


# -- inputs and targets for explain ----------------------------------------------------


@dataclass
class Prepared:
    """What :func:`prepare` made: model inputs, the target, the tokens of each example,
    the explained position (None: a whole text), and what the scalar is, in words."""

    inputs: dict
    target: object
    examples: list
    position: int | None
    what: str
    target_name: str | None = None
    foil_name: str | None = None


def check_ids(tokenizer, model, ids, what: str = "the text") -> None:
    """Refuse, before tracing, ids past the model's vocabulary, a text whose every
    word is unknown to the tokenizer, and an input longer than the model's positions
    (the numbers named)."""
    from ..tracing.checks import max_positions

    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is not None and ids.numel() and int(ids.max()) >= rows:
        bad = int(ids.max())
        raise InputError(
            f"the tokenizer gives {what} the id {bad} ({_shown([bad], tokenizer)[0]!r}"
            f"), but the model's vocabulary has {rows} entries (ids 0..{rows - 1}): the "
            "tokenizer is not this model's own. Save the model and its tokenizer from one "
            "checkpoint"
        )
    unk = tokenizer.unk_token_id
    special = set(tokenizer.all_special_ids) - {unk}
    words = [i for i in ids.flatten().tolist() if i not in special]
    if unk is not None and words and all(i == unk for i in words):
        shown = token_line(_shown(ids.flatten().tolist(), tokenizer))
        raise InputError(
            f"no word of {what} is in the tokenizer's vocabulary: each reads as "
            f"{tokenizer.unk_token!r} ({shown}). The tokenizer is not this model's own, or "
            "its vocabulary files are missing: "
            "save the model's tokenizer with it (tokenizer.save_pretrained(DIR))"
        )
    limit = max_positions(model)
    if limit is not None and ids.shape[-1] > limit:
        raise InputError(
            f"{what} is {ids.shape[-1]} tokens long; the model takes at most {limit}: shorten it"
        )


def prepare(task, model, tokenizer, text, target=None, foil=None, *, kind=None,
            text_pair=None, position=None, pooling=None, score="logit", dim=None,
            model_id=None) -> Prepared:  # fmt: skip
    """Inputs and target object for ``task`` (see :data:`TASKS`)."""
    if task not in TASKS:
        raise InputError(f"task {task!r}: choose one of {', '.join(TASKS)}")
    given = {"--text-pair": text_pair, "--target/--label": target, "--foil": foil,
             "--position": position, "--pooling": pooling, "--dim": dim,
             "--score": None if score == "logit" else score}  # fmt: skip
    for option, value in given.items():
        if value is not None and option not in _OPTIONS[task]:
            raise InputError(
                f"{option} does not apply to the {task} task (it reads "
                f"{', '.join(_OPTIONS[task])}); drop it, or pick the task it belongs to"
            )
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"the text {text!r} gives no tokens: give a text to explain")
    if task == "lm":
        return _prepare_lm(model, tokenizer, text, target, foil, kind)
    if task == "similarity":
        return _prepare_similarity(model, tokenizer, text, text_pair, pooling, dim, model_id)
    return _prepare_labels(task, model, tokenizer, text, text_pair, target, foil, position, score)


_OPTIONS = {
    "lm": ("--target/--label", "--foil"),
    "classification": ("--text-pair", "--target/--label", "--foil", "--score"),
    "token": ("--text-pair", "--target/--label", "--foil", "--position", "--score"),
    "similarity": ("--text-pair", "--pooling", "--dim"),
}


def _prepare_labels(task, model, tokenizer, text, pair, label, foil, position, score):
    check_score(score)
    enc = tokenizer(text, *([pair] if pair else []), return_tensors="pt")
    what = "the text and its pair" if pair else "the text"
    check_ids(tokenizer, model, enc["input_ids"], what)
    tokens = _shown(enc["input_ids"][0].tolist(), tokenizer)
    inputs = {k: v.to(model.device) for k, v in enc.items()}
    names = {int(i): str(n) for i, n in (model.config.id2label or {}).items()}
    if task == "token":
        n = len(tokens)
        if position is None or not -n <= int(position) < n:
            listed = " ".join(f"{i}:{t}" for i, t in enumerate(tokens))
            raise InputError(
                f"the token task explains one position: give --position N with N in 0..{n - 1}"
                f" (got {position!r}); the tokens are {listed}"
            )
        position = int(position) % n
    predicted = ""
    if label is None:  # the model's own choice
        with torch.no_grad():
            logits = output_field(model(**inputs), "logits")[0]
        label = int((logits[position] if task == "token" else logits).argmax())
        predicted = ", the predicted label"
    i = label_index(model.config, label)
    j = None if foil is None else label_index(model.config, foil)
    if i == j:
        raise InputError(f"label {label!r} and foil {foil!r} are the same label ({i})")
    multi = getattr(model.config, "problem_type", None) == "multi_label_classification"
    outputs = getattr(model.config, "num_labels", None)
    if score == "logprob" and outputs == 1 and not multi:
        raise InputError(ONE_OUTPUT)
    name = names.get(i, str(i))
    fname = None if j is None else names.get(j, str(j))
    f = "log p" if score == "logprob" else "logit"
    said = f"{f}({name})" if j is None else f"{f}({name}) - {f}({fname})"
    if multi and score == "logprob":
        said += " (multi-label: p = sigmoid(logit))"
    if task == "token":
        t = TokenLabel(position, i, j, score, multi_label=multi)
        said += f" at position {position} ({tokens[position]!r})"
    else:
        t = ClassLabel(i, j, score, multi_label=multi)
    return Prepared(inputs, t, [tokens], position, said + predicted, name, fname)


def _prepare_similarity(model, tokenizer, text, pair, pooling, dim, model_id):
    how = pooling_for(model_id, pooling)
    if dim is None and pair is None:
        raise InputError(
            "the similarity task compares two texts: give --text-pair (or --dim N to "
            "explain one dimension of the text's embedding)"
        )
    if dim is not None and pair is not None:
        raise InputError("--dim explains one text's embedding: drop --text-pair")
    texts = [text] if pair is None else [text, pair]
    if pair is not None and not pair.strip():
        raise InputError(f"the text pair {pair!r} gives no tokens: give a second text")
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    for e in range(len(texts)):
        check_ids(tokenizer, model, enc["input_ids"][e][enc["attention_mask"][e].bool()],
                  "the text" if e == 0 else "the text pair")  # fmt: skip
    examples = [_shown(row.tolist(), tokenizer) for row in enc["input_ids"]]
    inputs = {k: v.to(model.device) for k, v in enc.items()}
    mode = "+".join(how.modes) + (" pooling, normalized" if how.normalize else " pooling")
    if dim is None:
        target = Similarity(enc["attention_mask"], how.modes, how.normalize)
        return Prepared(inputs, target, examples, None, f"cos(text, text pair), {mode}")
    target = EmbeddingDim(enc["attention_mask"], dim, how.modes, how.normalize)
    width = model.config.hidden_size * len(how.modes)
    if not -width <= int(dim) < width:
        raise InputError(
            f"--dim {dim}: the pooled embedding has {width} dimensions (0..{width - 1})"
        )
    return Prepared(inputs, target, examples, None, f"dimension {dim} of the embedding, {mode}")


def word_pieces(tokenizer, word: str, kind: str) -> list[int]:
    """The vocabulary ids of ``word``: one where the vocabulary has it whole, else its
    pieces (a causal LM's next word follows a space)."""
    if not isinstance(word, str) or not word.strip():
        raise InputError(f"the word {word!r} is empty: give a word of the vocabulary")
    tries = [" " + word, word] if kind == "causal" else [word, " " + word]
    unk = tokenizer.unk_token_id
    splits = []
    for w in tries:
        ids = tokenizer(w, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] != unk:
            return ids
        splits.append(ids)
    usable = [s for s in splits if s and (unk is None or unk not in s)]
    if not usable:
        raise InputError(f"{word!r} is not in the model's vocabulary; pick another word")
    return usable[0]


def _prepare_lm(model, tokenizer, text, target, foil, kind):
    from .loading import encode

    if target is None:
        raise InputError("the lm task explains a word: give --target WORD (and --foil WORD)")
    inputs, pos = encode(tokenizer, model, text, kind)
    tp = word_pieces(tokenizer, target, kind)
    fp = None if foil is None else word_pieces(tokenizer, foil, kind)
    if fp == tp:
        one = "token" if len(tp) == 1 else "tokens"
        raise InputError(f"target {target!r} and foil {foil!r} are the same {one}")
    ids = inputs["input_ids"][0].tolist()
    at = f"at position {pos} ({_shown([ids[pos]], tokenizer)[0]!r})"
    if len(tp) == 1 and (fp is None or len(fp) == 1):  # today's case: the text as it is
        terms = [(0, pos, tp[0], 1)] + ([] if fp is None else [(0, pos, fp[0], -1)])
        tokens = _shown(ids, tokenizer)
        what = f"log p({target})" + ("" if fp is None else f" - log p({foil})") + " " + at
        return Prepared(inputs, WordChoice(tuple(terms)), [tokens], pos, what, target, foil)
    seqs, terms = [], []
    words = [(tp, 1)] + ([] if fp is None else [(fp, -1)])
    for pieces, sign in sorted(words, key=lambda w: -len(w[0])):
        if kind == "masked":  # the mask becomes one mask per piece
            seq = ids[:pos] + [tokenizer.mask_token_id] * len(pieces) + ids[pos + 1 :]
        else:  # teacher forcing: the pieces before the last follow the text
            seq = ids + pieces[:-1]
        # a causal LM reads a one-piece word at the text's end of any sequence
        if seq not in seqs and (kind == "masked" or len(pieces) > 1 or not seqs):
            seqs.append(seq)
        e = seqs.index(seq) if seq in seqs else 0
        terms += [(e, pos + k, p, sign) for k, p in enumerate(pieces)]
    for seq in seqs:
        check_ids(tokenizer, model, torch.tensor([seq]), f"the text with {target!r} in pieces")
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    inputs = {"input_ids": batch.to(model.device), "attention_mask": mask.to(model.device)}
    examples = [_shown(s, tokenizer) for s in batch.tolist()]

    def say(word, pieces):
        if len(pieces) == 1:
            return f"log p({word})"
        shown = " + ".join(repr(t) for t in _shown(pieces, tokenizer))
        return f"log p({word} = {shown})"

    what = say(target, tp) + ("" if fp is None else f" - {say(foil, fp)}")
    how = "masks" if kind == "masked" else "next tokens"
    what += f" from position {pos}, pieces as consecutive {how}"
    return Prepared(inputs, WordChoice(tuple(terms)), examples, pos, what, target, foil)
