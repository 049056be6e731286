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

import json
import os
import pickle
import re
import threading
from collections import OrderedDict

from .errors import LoadError

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
