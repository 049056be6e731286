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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
