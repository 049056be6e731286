"""Time per model family: one ``sbp.backprop`` call (trace + forward + pass) and one pass
on an already traced ``Backprop``, each against torch.autograd's forward + backward on
the same input, measured in one run. The families and inputs are those of the model
matrix (tests/test_families.py): tiny random configs in float64.

    python benchmarks/bench_families.py [--semirings Real MaxProduct Entropy] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import semiring_backprop as sbp  # noqa: E402
import test_families as tf  # noqa: E402


def _autograd_time(model, kwargs, key, output):
    start = time.perf_counter()
    tf._autograd(model, kwargs, key, output)
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--semirings", nargs="+", default=["Real", "MaxProduct", "Entropy"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--families", nargs="*", default=list(tf.FAMILIES))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    semirings = [getattr(sbp, name)() for name in args.semirings]
    print("| family | first call (s) | pass (s) | autograd (s) | pass × autograd |")
    print("|---|---|---|---|---|")
    for name in args.families:
        model = tf._model(name)
        kwargs, key, output = tf._inputs(name, model)
        bp = sbp.Backprop(model, output, semirings)
        start = time.perf_counter()
        bp(kwargs=kwargs)
        first = time.perf_counter() - start
        ratios, ours, theirs = [], [], []
        for _ in range(args.reps):  # in turn, so that a slow spell hits both sides
            t_ref = _autograd_time(model, kwargs, key, output)
            start = time.perf_counter()
            bp(kwargs=kwargs)
            t_ours = time.perf_counter() - start
            ours.append(t_ours)
            theirs.append(t_ref)
            ratios.append(t_ours / t_ref)
        print(
            f"| {name} | {first:.2f} | {statistics.median(ours):.3f} | "
            f"{statistics.median(theirs):.3f} | {statistics.median(ratios):.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
