"""Command line: ``semiring-backprop quickstart``. Thin: parses, calls, prints.

One module per command that takes more than a few arguments: :mod:`.explain`,
:mod:`.circuit`, :mod:`.run`, :mod:`.experiment` (and ``demo``); what they share is in
:mod:`.arguments`."""

from __future__ import annotations

import argparse
import json

from . import circuit, experiment, explain, run


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
    explain.add_parser(sub)
    circuit.add_parser(sub)
    run.add_parser(sub)
    experiment.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "explain":
        return explain.command(args)
    if args.command == "circuit":
        return circuit.command(args)
    if args.command == "run":
        return run.command(args)
    if args.command in ("experiment", "demo"):
        return experiment.command(args)
    if args.command in (None, "quickstart"):
        from .. import quickstart

        seed = getattr(args, "seed", 0)
        if not -(2**63) <= seed < 2**64:  # torch.manual_seed's range
            parser.error(f"--seed {seed}: a seed must fit in 64 bits, e.g. --seed 0")
        if getattr(args, "json", False):
            print(json.dumps(quickstart.run(seed, print_fn=lambda *a: None), indent=2))
        else:
            quickstart.run(seed)
        return 0
    if args.command == "ops":
        from ..rules import supported_ops

        for op, kind in supported_ops().items():
            print(f"{kind:18} {op}")
        print("(plus any other op tagged pointwise, through forward-mode autograd)")
        return 0
    parser.print_help()
    return 2
