"""Command line: ``semiring-backprop quickstart``. Thin: parses, calls, prints."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="semiring-backprop",
        description="Backpropagation over semirings: gradients, top gradient paths, entropy.",
    )
    sub = parser.add_subparsers(dest="command")
    q = sub.add_parser("quickstart", help="run several semirings on a small built-in model")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--json", action="store_true", help="print the table as JSON")
    sub.add_parser("ops", help="list the ops that have semiring rules")
    _explain_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "explain":
        return _explain(args)
    if args.command in (None, "quickstart"):
        from .quickstart import run

        seed = getattr(args, "seed", 0)
        if getattr(args, "json", False):
            print(json.dumps(run(seed, print_fn=lambda *a: None), indent=2))
        else:
            run(seed)
        return 0
    if args.command == "ops":
        from .rules import supported_ops

        for op, kind in supported_ops().items():
            print(f"{kind:18} {op}")
        print("(plus any other op tagged pointwise, through forward-mode autograd)")
        return 0
    parser.print_help()
    return 2


def _explain_parser(sub):
    from .explain import SEMIRINGS

    e = sub.add_parser(
        "explain",
        help="explain log p(target) - log p(foil) of a Hugging Face masked or causal LM",
        description="One semiring pass over a masked or causal LM: per-layer branches "
        "(skip/query/key/value/mlp) per token, the top gradient path and per-token path "
        "entropy of log p(target) - log p(foil) at the [MASK] (or next) position.",
    )
    e.add_argument("model", help="Hugging Face hub id or local directory")
    e.add_argument("--text", required=True, help="the input; a masked LM needs one mask token")
    e.add_argument("--target", required=True, help="the word whose log-probability is added")
    e.add_argument("--foil", required=True, help="the word whose log-probability is subtracted")
    e.add_argument(
        "--semiring",
        nargs="+",
        default=["max", "entropy"],
        choices=list(SEMIRINGS),
        help="; ".join(f"{k}: {v}" for k, v in SEMIRINGS.items()),
    )
    e.add_argument("--granularity", choices=["neuron", "tensor"], default="neuron")
    e.add_argument("--kind", choices=["masked", "causal"], help="default: from the config")
    e.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    e.add_argument("--device", default="cpu")
    e.add_argument("--out", help="directory for JSON, CSV and PNG files")


def _explain(args) -> int:
    import torch

    from .errors import SemiringBackpropError
    from .explain import explain

    try:
        ex = explain(
            args.model,
            args.text,
            args.target,
            args.foil,
            semirings=args.semiring,
            granularity=args.granularity,
            kind=args.kind,
            dtype=getattr(torch, args.dtype),
            device=args.device,
        )
        print(ex.report())
        if args.out:
            files = ex.write(args.out)
            print(
                f"\nwrote {len(files)} files to {args.out}: "
                + ", ".join(f.rsplit("/", 1)[-1] for f in files)
            )
    except SemiringBackpropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
