"""Examples per second of the data-set runner, one process and ``--workers 2`` (Ray).

A BERT 6L-512 masked LM with random weights (built from a config, vocabulary of
made-up words) explains ``--n`` sentences of 10-60 tokens with the three semirings
(max, entropy, real): per-token readouts and the branch table of every layer, as
``semiring-backprop run`` writes them. Both runs start from nothing (load, trace, pass),
as a user's run does; each prints its own examples/s, and the ratio is measured here.

    python benchmarks/bench_runner.py --n 1000
    python benchmarks/bench_runner.py --n 40 --workers 2
    python benchmarks/bench_runner.py --n 100 --serial-threads 1 --skip-ray

Before the timed runs, an untimed run of two sentences compiles the fused kernels into
torch.compile's on-disk cache, which every later process on the machine reads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch


def model_dir(root: Path, words: list[str], seed: int = 0) -> str:
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(root / "vocab.txt")).save_pretrained(root)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=512, num_hidden_layers=6,
                     num_attention_heads=8, intermediate_size=2048,
                     max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(seed)
    BertForMaskedLM(cfg).save_pretrained(root)
    return str(root)


def data_file(path: Path, words: list[str], n: int, seed: int = 0) -> Path:
    """``n`` sentences of 8-58 words (10-60 tokens with [CLS] and [SEP]), a mask inside."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            k = rng.randint(8, 58)
            text = [rng.choice(words) for _ in range(k)]
            text[rng.randrange(k)] = "[MASK]"
            target, foil = rng.sample(words, 2)
            f.write(json.dumps({"text": " ".join(text), "target": target, "foil": foil}) + "\n")
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000, help="sentences (default 1000)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--skip-serial", action="store_true")
    p.add_argument("--skip-ray", action="store_true")
    p.add_argument("--ray-first", action="store_true", help="time the Ray run first")
    p.add_argument(
        "--serial-threads",
        type=int,
        default=0,
        help="torch threads of the one-process run (default 0: torch's count)",
    )
    args = p.parse_args(argv)
    from semiring_backprop.runner import run

    words = [f"w{i}" for i in range(2000)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        model = model_dir(root / "model", words)
        data = data_file(root / "data.jsonl", words, args.n)
        print(f"BERT 6L-512 (random), {args.n} sentences of 10-60 tokens, semirings max, "
              f"entropy, real; batch size {args.batch_size}; {os.cpu_count()} CPU cores; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
        # an untimed run first: torch.compile's kernels are compiled once per machine
        # (the on-disk cache), which neither timed run should pay for alone
        warm = data_file(root / "warm.jsonl", words, 2, seed=1)
        run(model, warm, root / "warm", figures=False, progress=False)
        rates = {}
        threads = args.serial_threads or torch.get_num_threads()
        runs = [] if args.skip_serial else [(f"one process, {threads} threads", 0)]
        if not args.skip_ray:
            runs.append((f"--workers {args.workers} (Ray)", args.workers))
        if args.ray_first:
            runs.reverse()
        for label, workers in runs:
            start = time.perf_counter()
            r = run(model, data, root / f"out{workers}", batch_size=args.batch_size,
                    workers=workers, threads=0 if workers else args.serial_threads,
                    figures=False, progress=False)  # fmt: skip
            seconds = time.perf_counter() - start
            rates[workers] = args.n / seconds
            assert r["explained"] == args.n, r["summary"]["skip_reasons"]
            print(f"{label:>24}: {seconds:8.1f} s in all (reading, loading, tracing, Ray's "
                  f"start included), {rates[workers]:6.3f} examples/s")  # fmt: skip
        if 0 in rates and args.workers in rates:
            print(f"ratio --workers {args.workers} / one process: "
                  f"{rates[args.workers] / rates[0]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
