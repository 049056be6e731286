"""What several commands share: the model and task arguments, and the checks of
``--out`` and ``--html`` made before any work."""

from __future__ import annotations

import argparse

#: what a model argument may be
MODEL_HELP = (
    "a Hugging Face hub id, a local directory, a GGUF file (model.gguf; or a directory with "
    "--gguf-file NAME), or smol (SmolLM2-135M-Instruct, where installed)"
)


def model_arguments(p) -> None:
    """The model and how it is loaded: the same for explain, circuit and run."""
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--gguf-file",
        metavar="NAME",
        help="the GGUF file to load from the directory MODEL (or pass the file's path as MODEL)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="the weights' dtype (a GGUF file's quantized weights are dequantized to it)",
    )


def task_arguments(p, pair: str, target: str) -> None:
    """The model, the text and what is explained (--task and its options): the same for
    ``explain`` and ``circuit``, with help of their own for --text-pair and --target."""
    from ..targets import POOLING, TASKS

    model_arguments(p)
    p.add_argument("--task", choices=TASKS, default="lm", help="what is explained (default: lm)")
    p.add_argument("--text", required=True, help="the input; a masked LM needs one mask token")
    p.add_argument("--text-pair", help=pair)
    p.add_argument("--target", "--label", dest="target", help=target)
    p.add_argument(
        "--foil", help="the word (lm) or label whose log-probability (logit) is subtracted"
    )
    p.add_argument("--position", type=int, help="token task: the token index explained")
    p.add_argument(
        "--score",
        choices=["logit", "logprob"],
        default="logit",
        help="classification, token: a label's logit or its log-probability",
    )
    p.add_argument(
        "--pooling",
        choices=POOLING,
        help="similarity: pooling over tokens (default: the checkpoint's 1_Pooling/config.json)",
    )


def weights_argument(p, default: str | None = "gradient", said: str = "default") -> None:
    """--weights: what each edge of the pass weighs (DESIGN §3c), for explain and circuit
    (``default`` None: the command chooses, as ``said`` tells)."""
    from ..engine.relevance import WEIGHTS

    p.add_argument(
        "--weights",
        choices=WEIGHTS,
        default=default,
        help=f"edge weights: gradient (the local derivatives; {said}) or relevance (the "
        "local rules of relevance propagation as RelP applies them: norms' scale and the "
        "attention pattern held constant, activations as f(x)/x, the half rule for products)",
    )


def check_html_file(file) -> None:
    """Refuse an --html path that cannot be written, before any work."""
    import os

    from ..errors import InputError

    if os.path.isdir(file):
        raise InputError(f"--html {file}: is a directory; give a file name such as report.html")
    parent = os.path.dirname(os.path.abspath(file))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise InputError(f"--html {file}: cannot write under {parent}; give another file")


def directory(text: str) -> str:
    """An --out value: an empty one (an unset shell variable) would write into the
    current directory, or nowhere."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty name; give a directory, e.g. --out runs/x")
    return text


def writable(out) -> None:
    """``--out`` as a directory this process can write into (made if missing)."""
    import os
    import tempfile
    from pathlib import Path

    from ..errors import InputError

    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        # a new file of a random name, made exclusively: no planted link is followed
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(
            f"--out {str(out)!r}: cannot write there ({e.strerror}); give a directory you "
            "can write into"
        ) from None
