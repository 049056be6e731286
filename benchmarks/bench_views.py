"""Render time and size of the explain report (``Explanation.to_html``) for a long input,
against the goals: under 1 s and under 2 MB for 512 tokens. Prints both and their ratios
to the goals, measured in one run.

The model is a random BERT masked LM (``--layers``, hidden size 16, 512 positions) with
a tokenizer written from a small vocabulary; the text is ``--tokens`` tokens with one
[MASK]. The pass itself is not timed: the views only read what it computed.

    python benchmarks/bench_views.py [--tokens 512] [--layers 4] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

WORDS = "the keys to cabinet is are on table a dog cat".split()
GOAL_SECONDS, GOAL_BYTES = 1.0, 2_000_000


def _explanation(tokens: int, layers: int):
    import transformers

    from semiring_backprop.hf.explain import explain

    d = tempfile.mkdtemp()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    with open(os.path.join(d, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizer(os.path.join(d, "vocab.txt"))
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=layers,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg).eval()
    words = [WORDS[i % len(WORDS)] for i in range(tokens - 3)]  # + [CLS] [MASK] [SEP]
    words.insert(len(words) // 2, "[MASK]")
    start = time.perf_counter()
    ex = explain(model, " ".join(words), "are", "is", tokenizer=tok)
    return ex, time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", help="keep the report here (default: a temporary file)")
    args = p.parse_args(argv)
    ex, pass_seconds = _explanation(args.tokens, args.layers)
    out = args.out or os.path.join(tempfile.mkdtemp(), "report.html")
    times = []
    for _ in range(args.reps):  # the whole of to_html: building the page and writing it
        start = time.perf_counter()
        ex.to_html(out)
        times.append(time.perf_counter() - start)
    size = os.path.getsize(out)
    render = statistics.median(times)
    print(f"input: {len(ex.tokens)} tokens, {args.layers} layers "
          f"(explain, not timed below: {pass_seconds:.1f} s)")  # fmt: skip
    print(f"render + write: {render:.3f} s (median of {args.reps}: "
          f"{', '.join(f'{t:.3f}' for t in times)}); goal {GOAL_SECONDS:.0f} s, "
          f"ratio {render / GOAL_SECONDS:.2f}")  # fmt: skip
    print(f"size: {size / 1e6:.2f} MB; goal {GOAL_BYTES / 1e6:.0f} MB, "
          f"ratio {size / GOAL_BYTES:.2f}  ({out})")  # fmt: skip


if __name__ == "__main__":
    main()
