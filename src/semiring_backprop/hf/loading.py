"""Checks around loading a checkpoint by name, and the checkpoints ``explain`` keeps.

transformers loads some broken checkpoints without a word, and refuses others with a
traceback that names its own internals; these helpers turn both into one
:class:`~semiring_backprop.errors.LoadError` that names the file and the fix:

* :func:`check_tokenizer`: a directory without tokenizer files still loads a tokenizer
  (the config's class with its special tokens only), which reads every word as unknown;
* :func:`weights_error`: weights whose shapes are not the config's (a ``vocab_size``
  edited in ``config.json``), and a ``pytorch_model.bin`` that holds pickled code
  (``torch.load(weights_only=True)`` refuses it);
* :class:`Kept`: the last few models loaded by name, so that a second ``explain(DIR)``
  reuses the model, and with it the trace and the compiled kernels.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import re
import threading
from collections import OrderedDict

import torch

from ..errors import InputError, LoadError
from ..tracing.checks import max_positions
from . import gguf

#: files that hold a tokenizer's vocabulary (any one of them is enough)
_VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                "sentencepiece.bpe.model", "merges.txt")  # fmt: skip


def check_tokenizer(model_id: str, tokenizer) -> None:
    """Refuse a tokenizer that knows no word: transformers builds one from the config
    alone when a checkpoint directory has no tokenizer files (``[CLS] [UNK] [UNK] [SEP]``
    for any text)."""
    special = set(tokenizer.all_special_tokens)
    vocab = tokenizer.get_vocab()
    if any(token not in special for token in vocab):
        return
    where = os.path.expanduser(model_id)
    files = ""
    if os.path.isdir(where) and not any(
        os.path.exists(os.path.join(where, f)) for f in _VOCAB_FILES
    ):
        files = (
            f" (the directory has no tokenizer files: none of {', '.join(_VOCAB_FILES[:3])}, ...)"
        )
    raise LoadError(
        f"{model_id!r} has no tokenizer vocabulary{files}: transformers built a "
        f"{type(tokenizer).__name__} of {len(vocab)} special tokens only, so no word of any "
        f"text is in the model's vocabulary (each would read as {tokenizer.unk_token!r}). "
        "Save the model's own tokenizer beside it (tokenizer.save_pretrained(DIR)), or load "
        "model and tokenizer yourself and pass both"
    )


def check_config_file(model_id: str, where: str | None = None) -> None:
    """Refuse a local ``config.json`` that is JSON but not an object of settings (a list,
    a number): some transformers versions read it with a ``TypeError`` from their own
    internals. A missing or unparsable file is left to transformers, which names it."""
    path = os.path.join(os.path.expanduser(model_id if where is None else where), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            held = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(held, dict):
        raise LoadError(
            f"could not load {model_id!r}: its config.json holds a JSON "
            f'{type(held).__name__}, not an object of settings ({{"model_type": ...}}). '
            "Restore config.json, or save the model again with model.save_pretrained(DIR)"
        )


def weights_error(model_id: str, where: str, e: Exception) -> LoadError | None:
    """The :class:`LoadError` for an exception of ``from_pretrained`` whose cause is the
    weights file, or None for any other exception."""
    if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e):
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f" (it calls {found.group(1)})" if found else ""
        return LoadError(
            f"could not load {model_id!r}: its weights file holds pickled code{what}, which "
            "torch.load(weights_only=True) refuses to run, and so does this package: use "
            "safetensors. If you trust its source, load it yourself (torch.load(FILE, "
            "weights_only=False), then model.load_state_dict), save the model with "
            "model.save_pretrained(DIR), which writes model.safetensors, and explain DIR"
        )
    text = str(e)
    if isinstance(e, RuntimeError) and (
        "ignore_mismatched_sizes" in text or "size mismatch" in text
    ):
        return LoadError(
            f"could not load {model_id!r}: its weights do not have the shapes its config.json "
            f"gives{_vocab_rows(where)}. config.json was edited or comes from another model: "
            "save the model and its config together (model.save_pretrained(DIR)), or set "
            "config.json back to the saved sizes"
        )
    return None


_EMBEDDING_NAMES = ("word_embeddings.weight", "embed_tokens.weight", "wte.weight", "shared.weight")


def _vocab_rows(where: str) -> str:
    """``: config.json says vocab_size=40, the word embeddings have 20 rows`` where a
    local checkpoint's safetensors and config say so, else ``""``."""
    where = os.path.expanduser(where)
    try:
        with open(os.path.join(where, "config.json"), encoding="utf-8") as f:
            size = json.load(f).get("vocab_size")
        from safetensors import safe_open

        for name in sorted(os.listdir(where)):
            if not name.endswith(".safetensors"):
                continue
            with safe_open(os.path.join(where, name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key.endswith(_EMBEDDING_NAMES):
                        rows = f.get_slice(key).get_shape()[0]
                        if size is not None and rows != size:
                            return (
                                f" (config.json says vocab_size={size}; the word embeddings "
                                f"{key} have {rows} rows)"
                            )
    except (OSError, ValueError, AttributeError, ImportError):
        return ""
    return ""


class Kept:
    """The last ``size`` models loaded by name: ``key -> (model, tokenizer, kind)``.

    A key names the checkpoint, how it was loaded, and for a local directory the size
    and modification time of each of its files, so a checkpoint saved again into the
    same directory is loaded again. A hub id is kept by its name."""

    def __init__(self, size: int = 2):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def key(self, model_id: str, *how) -> tuple:
        return (model_id, *how, _stamp(model_id))

    def get(self, key):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def _stamp(model_id: str) -> tuple:
    """(relative path, size, mtime) of each file of a local checkpoint, two levels deep
    (a sentence-transformers folder keeps its pooling in a subfolder); () otherwise."""
    root = os.path.expanduser(model_id)
    if os.path.isfile(root):  # a GGUF file
        st = os.stat(root)
        return ((os.path.basename(root), st.st_size, st.st_mtime_ns),)
    if not os.path.isdir(root):
        return ()
    out = []
    for folder, dirs, files in os.walk(root):
        depth = os.path.relpath(folder, root).count(os.sep)
        if depth >= 1:
            dirs[:] = []
        for name in files:
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out.append((os.path.relpath(path, root), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


# -- loading --------------------------------------------------------------------------


def load(model_id: str, kind: str | None = None, dtype=torch.float32, device="cpu",
         gguf_file: str | None = None):  # fmt: skip
    """``(model, tokenizer, kind)`` for a hub id, a local directory or a GGUF file (its
    path, or a directory and ``gguf_file``; ``"smol"``: SmolLM2-135M, :func:`.gguf.smollm2`);
    kind is ``"masked"`` or ``"causal"`` (from the config's architecture unless given).
    Every model the package loads by name comes through here: a checkpoint that lacks
    weights of the LM (a ``BertModel`` without the masked-LM head) is a
    :class:`LoadError`. A GGUF file's weights are dequantized to ``dtype``."""
    transformers = need_transformers()
    model_id = gguf.checkpoint(model_id, gguf_file)
    check_local(model_id)
    config, tokenizer = config_and_tokenizer(model_id)
    archs = " ".join(config.architectures or [])
    if kind == "causal" and "MaskedLM" in archs and not getattr(config, "is_decoder", False):
        raise InputError(
            f"{model_id!r} is a masked LM ({archs}): kind='causal' would run it left to right "
            "with its bidirectional weights, a model it never was. Leave --kind out (it is read "
            "from the config) and put a mask token in the text, or use a causal LM"
        )
    kind = kind or lm_kind(config, tokenizer)
    cls = {
        "masked": transformers.AutoModelForMaskedLM,
        "causal": transformers.AutoModelForCausalLM,
    }.get(kind)
    if cls is None:
        raise InputError(f"kind must be 'masked' or 'causal', got {kind!r}")
    model, info = from_pretrained(cls, model_id, model_id, dtype)
    refuse_fresh_weights(model_id, kind, config, model, info)
    return model.to(device).eval(), tokenizer, kind


def need_transformers():
    try:
        import transformers
    except ImportError:
        raise InputError(
            'explain needs transformers: pip install "semiring-backprop[hf]"'
        ) from None
    return transformers


def check_local(model_id: str, where: str | None = None) -> None:
    """Refuse a local path that is not there (a GGUF file, or a directory) before
    transformers takes it for a hub id, and a local ``config.json`` it cannot read."""
    if gguf.is_gguf(model_id):
        gguf.check(model_id)
        return
    if model_id.startswith(("/", "./", "../", "~")) and not os.path.isdir(
        os.path.expanduser(model_id)
    ):
        raise LoadError(
            f"could not load {model_id!r}: no such directory. Pass a local directory written by "
            "model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR), a GGUF file, or a "
            "hub id."
        )
    check_config_file(model_id, where)


def config_and_tokenizer(model_id: str, where: str | None = None):
    """``(config, tokenizer)`` of a checkpoint (``where``: the folder inside ``model_id``
    that holds them), a :class:`LoadError` where they cannot be read; the tokenizer is
    refused where it knows no word (:func:`check_tokenizer`)."""
    transformers = need_transformers()
    where, how = gguf.parts(model_id if where is None else where)
    try:  # never code from the model's directory (and so never a prompt asking)
        if how:  # a GGUF file: its metadata (the vocabulary too) read once per process
            config, tokenizer = _gguf_config_and_tokenizer(where, how["gguf_file"])
        else:
            config = transformers.AutoConfig.from_pretrained(where, trust_remote_code=False)
            tokenizer = transformers.AutoTokenizer.from_pretrained(where, trust_remote_code=False)
    except Exception as e:
        said = gguf.error(model_id, e)
        if said is not None:
            raise said from None
        if not isinstance(e, OSError | ValueError):
            raise
        raise LoadError(load_hint(model_id, e)) from None
    check_tokenizer(model_id, tokenizer)
    return config, tokenizer


def _gguf_config_and_tokenizer(folder: str, name: str):
    """A GGUF file's config and tokenizer, copies of those read the first time (parsing
    the file's metadata, its vocabulary included, takes seconds, and a run reads them
    for the tokenizer, the config and every model it loads); read again where the file
    changed (its size or modification time)."""
    st = os.stat(os.path.join(folder, name))
    config, tokenizer = _gguf_read(folder, name, st.st_size, st.st_mtime_ns)
    return copy.deepcopy(config), copy.deepcopy(tokenizer)


@functools.lru_cache(maxsize=4)
def _gguf_read(folder: str, name: str, _size: int, _mtime: int):
    transformers = need_transformers()
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False,
                                                     gguf_file=name)  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=False,
                                                           gguf_file=name)  # fmt: skip
    return config, tokenizer


def from_pretrained(cls, where: str, model_id: str, dtype):
    """``cls.from_pretrained(where)`` with its loading info; a file that cannot be read is a
    :class:`LoadError` naming ``model_id`` (never code from the directory: no prompt). A
    GGUF file (``where`` its path) is dequantized to ``dtype``, with the config read once
    (:func:`_gguf_config_and_tokenizer`)."""
    where, how = gguf.parts(where)
    try:
        if how:
            how["config"] = _gguf_config_and_tokenizer(where, how["gguf_file"])[0]
        return cls.from_pretrained(
            where, dtype=dtype, output_loading_info=True, trust_remote_code=False, **how
        )
    except Exception as e:
        said = gguf.error(model_id, e) or weights_error(model_id, where, e)
        if said is not None:
            raise said from None
        if isinstance(e, OSError | ValueError):
            raise LoadError(load_hint(model_id, e)) from None
        if type(e).__name__ != "SafetensorError":
            raise
        raise LoadError(
            f"could not load {model_id!r}: its weights file cannot be read ({e}): it is cut "
            "off or not a safetensors file. Save the model again with "
            "model.save_pretrained(DIR), or download it again"
        ) from None


def refuse_fresh_weights(model_id, kind, config, model, info) -> None:
    """Weights the checkpoint lacks are initialized at random by transformers (a
    ``BertModel`` loaded as a masked LM gets a random head): every score would be
    noise, different on every load, so refuse them. Tied weights (a decoder tied to the
    word embeddings) are loaded, and transformers does not report them."""
    fresh = sorted(info.get("missing_keys") or ())
    fresh += sorted(m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys") or ())
    if not fresh:
        return
    names = ", ".join(fresh[:8]) + (f" and {len(fresh) - 8} more" if len(fresh) > 8 else "")
    saved = " / ".join(config.architectures or []) or "a checkpoint"
    wanted = type(model).__name__
    head = {"masked": "masked-LM", "causal": "causal-LM"}.get(kind, kind)
    raise LoadError(
        f"{model_id!r} holds {saved}, which lacks the weights {names}: loaded as {wanted}, "
        "they would be initialized at random and every score would be noise (another on "
        f"every load). Pass a checkpoint with a trained {head} head: a directory written "
        f"by {wanted}.save_pretrained(DIR), or the hub id of a {head} model"
    )


def load_hint(model_id, e) -> str:
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    if "trust_remote_code" in str(e):
        return (
            f"could not load {model_id!r}: it needs Python code of its own (its config's "
            "auto_map) to be built, and this package runs no code from model directories. "
            "Read that code, load the model yourself (AutoModelForMaskedLM.from_pretrained"
            "(..., trust_remote_code=True)) and pass it to semiring_backprop.backprop or "
            "Backprop."
        )
    return (
        f"could not load {model_id!r}: {first}\n"
        f"{model_id!r} is not a local directory with a saved model, and it is not in the "
        "Hugging Face cache (or the hub cannot be reached from here). On a machine with "
        "internet, save a copy (huggingface-cli download ID --local-dir DIR, or "
        "model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)), then pass that "
        "directory: semiring-backprop explain DIR ..."
    )


def lm_kind(config, tokenizer, cls_name: str = "") -> str:
    arch = " ".join([cls_name, *(config.architectures or [])])
    if "MaskedLM" in arch:
        return "masked"
    if "CausalLM" in arch or "LMHead" in arch:
        return "causal"
    return (
        "causal" if getattr(config, "is_decoder", False) or not tokenizer.mask_token else "masked"
    )


# -- inputs ---------------------------------------------------------------------------


def word_id(tokenizer, word: str, kind: str) -> int:
    """The single vocabulary id of ``word`` (a causal LM's next word follows a space)."""
    tries = [" " + word, word] if kind == "causal" else [word, " " + word]
    splits = []
    for w in tries:
        ids = tokenizer(w, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] != tokenizer.unk_token_id:
            return ids[0]
        splits.append(tokenizer.convert_ids_to_tokens(ids))
    if all(tokenizer.unk_token in s for s in splits if s) or not any(splits):
        raise InputError(f"{word!r} is not in the model's vocabulary; pick another word")
    raise InputError(
        f"{word!r} is not one token in the model's vocabulary (it splits into {splits[0]}); "
        "the score compares the probabilities of two single tokens: pick single-token words"
    )


def check_device(device) -> torch.device:
    """``device`` as a torch device this machine has, or an :class:`InputError`."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(
            f"device {device!r} is not a device name (cpu, cuda, cuda:1, mps)"
        ) from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(
                f"device {device!r}: no CUDA device here (torch {torch.__version__} sees "
                "none); use --device cpu, or a machine and torch build with CUDA"
            )
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise InputError(
                f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA "
                f"device(s), numbered from 0"
            )
    if d.type == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"device {device!r}: MPS is not available here; use --device cpu")
    if d.type == "meta":
        raise InputError(
            f"device {device!r} holds shapes only, no values: nothing can be explained on it; "
            "use --device cpu or cuda"
        )
    return d


def encode(tokenizer, model, text: str, kind: str) -> tuple[dict, int]:
    """Model inputs and the position whose prediction is explained."""
    enc = tokenizer(text, return_tensors="pt")
    if kind != "masked":
        enc = _drop_end_tokens(tokenizer, text, enc)
    ids = enc["input_ids"]
    if ids.shape[1] == 0:
        raise InputError(f"the text {text!r} gives no tokens: give a sentence to explain")
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is not None and int(ids.max()) >= rows:  # before tracing, naming the cause
        bad = int(ids.max())
        raise InputError(
            f"the tokenizer gives the text the id {bad} "
            f"({tokenizer.convert_ids_to_tokens(bad)!r}), but the model's vocabulary has "
            f"{rows} entries (ids 0..{rows - 1}): the tokenizer is not this model's own. "
            "Save the model and its tokenizer from one checkpoint"
        )
    limit = max_positions(model)
    if limit is not None and ids.shape[1] > limit:
        raise InputError(
            f"the text is {ids.shape[1]} tokens long; the model takes at most {limit}: shorten it"
        )
    if kind == "masked":
        mask = tokenizer.mask_token
        if mask is None:
            raise InputError("this tokenizer has no mask token; use --kind causal")
        where = (ids[0] == tokenizer.mask_token_id).nonzero().flatten().tolist()
        if len(where) != 1:
            say = "no" if not where else f"{len(where)}"
            raise InputError(
                f"the text has {say} {mask} tokens; a masked LM explains the prediction at "
                f"exactly one, e.g. 'the keys to the cabinet {mask} on the table'"
            )
        pos = where[0]
    else:
        pos = ids.shape[1] - 1
    return {k: v.to(model.device) for k, v in enc.items() if k != "token_type_ids"}, pos


def _drop_end_tokens(tokenizer, text: str, enc) -> dict:
    """``enc`` without the special tokens a tokenizer appends after the text (an end
    token: ``add_eos_token``): a causal LM's next word follows the text, not its end."""
    full = enc["input_ids"][0].tolist()
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    n, m = len(full), len(plain)
    # the text's own tokens sit between what the tokenizer put before and after them
    after = next((k for k in range(n - m + 1) if full[n - m - k : n - k] == plain), 0)
    if not after or not set(full[n - after :]) <= set(tokenizer.all_special_ids):
        return enc
    end = n - after
    return {k: v[:, :end] if torch.is_tensor(v) and v.dim() == 2 else v for k, v in enc.items()}
