"""Makes docs/img/report.png, the picture of a report on the front page.

The model is the demo's: the one-layer BERT-style classifier that
``semiring-backprop demo`` trains on FirstTokenRepeatedOnce (does the first token occur
again?), seed 0, the same weights (the same data, seed and settings). It is trained here
(about 30 s), or read from a demo run's directory with ``--demo runs/demo``. It is saved
as a Hugging Face checkpoint whose tokens 1..19 are the letters a..s, a validation
example the model gets right is explained with

    semiring-backprop explain DIR --task classification --text "..." --label repeated \\
        --html report.html

and headless Chromium (the Debian package ``chromium``) takes the screenshot:

    python docs/picture.py                      # writes docs/img/report.png
    python docs/picture.py --demo runs/demo     # reuses the demo's trained model
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
LETTERS = "abcdefghijklmnopqrs"  # token ids 1..19 (0 is padding)


def demo_model(demo_dir: Path):
    """The demo's seed-0 model, trained into ``demo_dir`` unless a run left it there."""
    from semiring_backprop.experiments import first_token
    from semiring_backprop.experiments.common import bert_classifier

    config = replace(first_token.Config.quick(), seeds=1, explain_limit=1)
    first_token.run(demo_dir, config, progress=False)  # trains seed 0, or reloads it
    model = bert_classifier(config.vocab_size, 2, hidden=config.hidden, heads=config.heads,
                            intermediate=config.intermediate, layers=1,
                            length=config.length, seed=config.seed)  # fmt: skip
    state = torch.load(demo_dir / "seed0" / "model" / "model.pt", weights_only=True)
    model.load_state_dict(state)
    return model.eval(), config


def save_checkpoint(model, directory: Path) -> None:
    """The model with label names and a tokenizer of one letter per token id."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    model.config.id2label = {0: "not repeated", 1: "repeated"}
    model.config.label2id = {"not repeated": 0, "repeated": 1}
    model.save_pretrained(directory)
    vocab = {"[PAD]": 0, **{c: i + 1 for i, c in enumerate(LETTERS)}, "[UNK]": 20}
    words = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]"
    )
    tokenizer.save_pretrained(directory)


def example(model, config) -> str:
    """The first validation positive (the first token occurs again) the model gets
    right, as letters."""
    from semiring_backprop.data import make_task

    task = make_task("FirstTokenRepeatedOnce", config.n, length=config.length,
                     vocab_size=config.vocab_size, seed=config.seed)  # fmt: skip
    with torch.no_grad():
        predicted = model(input_ids=task.val.x).logits.argmax(-1)
    for ids, label, guess in zip(task.val.x.tolist(), task.val.y.tolist(), predicted.tolist()):
        if label == 1 and guess == 1:
            return " ".join(LETTERS[i - 1] for i in ids)
    raise SystemExit("no validation positive is classified right: is the model trained?")


def screenshot(html: Path, png: Path, size: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--hide-scrollbars", f"--screenshot={png}", f"--window-size={size}",
                    html.as_uri()], check=True, capture_output=True, timeout=120)  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, help="a demo run's directory to reuse")
    parser.add_argument("--out", type=Path, default=HERE / "img" / "report.png")
    parser.add_argument("--size", default="1000,760", help="window width,height in pixels")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, config = demo_model(args.demo or tmp / "demo")
        save_checkpoint(model, tmp / "first-token")
        text = example(model, config)
        cmd = ["semiring-backprop", "explain", "first-token", "--task", "classification",
               "--text", text, "--label", "repeated", "--html", "report.html"]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=tmp)  # the report names the model "first-token"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        screenshot(tmp / "report.html", args.out, args.size)
    shown = " ".join(cmd[:6] + [json.dumps(text)] + cmd[7:])
    print(
        f"{args.out} ({args.out.stat().st_size // 1024} KB): the report of\n{shown}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
