"""Per-head branch tables: ``layer_table(per_head=True)`` against ``layer_table()`` on the
same result, and both against the pass that made the result, measured in one run. A
random BERT-style encoder (12 heads of 64 by default) in float32, one sentence.

    python benchmarks/bench_per_head.py [--layers 4] [--tokens 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import transformers

import semiring_backprop as sbp


def _time(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=1000, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
        max_position_embeddings=max(64, args.tokens),
    )  # fmt: skip
    model = transformers.BertForMaskedLM(cfg).eval()
    ids = torch.randint(5, 1000, (1, args.tokens))
    semirings = [sbp.Real(), sbp.MaxProduct()]

    def output(out):
        return out.logits[0, 1, 7]

    bp = sbp.Backprop(model, output, semirings)
    bp(kwargs={"input_ids": ids})  # trace once
    passes, plain, heads = [], [], []
    for _ in range(args.reps):  # in turn, so that a slow spell hits all three
        start = time.perf_counter()
        res = bp(kwargs={"input_ids": ids})
        passes.append(time.perf_counter() - start)
        plain.append(_time(res.layer_table))
        heads.append(_time(functools.partial(res.layer_table, per_head=True)))
    p, a, b = (statistics.median(x) for x in (passes, plain, heads))
    print(f"BERT {args.layers} layers x {args.heads} heads, hidden {args.hidden}, "
          f"{args.tokens} tokens, Real + MaxProduct, {args.threads} threads, "
          f"median of {args.reps}")  # fmt: skip
    print(
        "| pass (s) | layer_table (s) | per_head (s) | per_head / layer_table | per_head / pass |"
    )
    print("|---|---|---|---|---|")
    print(f"| {p:.2f} | {a:.2f} | {b:.2f} | {b / a:.1f} | {b / p:.1f} |")


if __name__ == "__main__":
    main()
