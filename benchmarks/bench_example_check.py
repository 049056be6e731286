"""What the ``per_example`` check costs the data-set runner: time in the check over the
time of the whole batch call, measured in one run.

Every ``per_example=True`` call runs each example of the batch alone (no autograd) and
compares its output with the batched one (``semiring_backprop.independence``). This
script explains batches of the runner's benchmark data (BERT 6L-512, random weights,
sentences of 10-60 tokens, the three semirings max, entropy, real, batch size 8) and
times the check inside each call:

    python benchmarks/bench_example_check.py --n 64 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_runner import data_file, model_dir  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64, help="sentences (default 64)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from semiring_backprop import independence
    from semiring_backprop.hf.explain import semirings_for
    from semiring_backprop.hf.loading import load
    from semiring_backprop.runner.compute import Explainer, prepare
    from semiring_backprop.runner.driver import batches
    from semiring_backprop.runner.readers import read_examples

    checked = []
    plain = independence.check

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return plain(*a, **k)
        finally:
            checked.append(time.perf_counter() - t)

    independence.check = timed
    words = [f"w{i}" for i in range(2000)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        model, tok, kind = load(model_dir(root / "model", words))
        data = data_file(root / "data.jsonl", words, args.n)
        examples, _ = read_examples(data)
        items = [prepare(e, tok, model.config, kind) for e in examples]
        ex = Explainer(model, tok, semirings_for(["max", "entropy", "real"]))
        ex([items[0], items[0]])  # trace and compile, untimed
        checked.clear()
        total, n_batches = 0.0, 0
        for batch in batches(items, args.batch_size):
            t = time.perf_counter()
            ex(batch)
            total += time.perf_counter() - t
            n_batches += 1
    spent = sum(checked)
    print(f"BERT 6L-512 (random), {len(items)} sentences in {n_batches} batches of at most "
          f"{args.batch_size}, {args.threads} thread(s), torch {torch.__version__}")  # fmt: skip
    print(f"batch calls {total:.2f} s, of which the per_example check {spent:.2f} s "
          f"({spent / total:.1%})")  # fmt: skip


if __name__ == "__main__":
    main()
