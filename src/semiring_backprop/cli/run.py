"""``semiring-backprop run``: explain every example of a data set into Parquet shards,
a summary and figures."""

from __future__ import annotations

import sys

from .arguments import model_arguments


def add_parser(sub):
    from ..hf.explain import SEMIRINGS
    from ..runner import FORMATS

    r = sub.add_parser(
        "run",
        help="explain log p(target) - log p(foil) for every example of a data set",
        description="Explain every (text, target, foil) example of a data file or Hugging "
        "Face data set: scores, per-token readouts and per-layer branch tables as Parquet "
        "shards, summary.json and figures. Results are written as they are computed; a "
        "rerun into the same --out resumes.",
    )
    model_arguments(r)
    r.add_argument("--data", required=True, help="data file or directory, or a data set name")
    r.add_argument("--format", choices=list(FORMATS), default="auto")
    r.add_argument(
        "--column",
        nargs="+",
        default=[],
        metavar="FIELD=NAME",
        help="column names, e.g. --column text=sentence target=good foil=bad "
        "(fields: text, target, foil, id, positions; extra=COL1,COL2 copies columns)",
    )
    r.add_argument("--split", help="split of a Hugging Face data set")
    r.add_argument(
        "--semiring", nargs="+", default=["max", "entropy", "real"], choices=list(SEMIRINGS)
    )
    r.add_argument(
        "--granularity", choices=["neuron", "tensor"],
        help="neuron (default) or tensor (--paper: tensor, the only one it takes)",
    )  # fmt: skip
    r.add_argument("--kind", choices=["masked", "causal"], help="default: from the config")
    r.add_argument("--device", default="cpu")
    r.add_argument("--top-path", action="store_true", help="also the top gradient path")
    r.add_argument(
        "--aggregation", nargs="+", choices=["oplus", "bucket_sum", "paper"],
        help="branch values over hidden units: the semiring's oplus and/or bucket sums "
        "(default oplus), or with --paper the paper's winner-take-all (its default)",
    )  # fmt: skip
    r.add_argument(
        "--paper", action="store_true",
        help="paper mode: trace as the paper's library (brunoflow) did, at tensor "
        "granularity, the score as the difference of the two logits",
    )  # fmt: skip
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--limit", type=int, help="explain only the first N examples")
    r.add_argument("--workers", type=int, default=0, help="Ray actors (pip install '.[ray]')")
    r.add_argument("--address", help="join this Ray cluster instead of starting one")
    r.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    r.add_argument("--out", default="runs/data", help="output directory (default: runs/data)")
    r.add_argument("--no-figures", action="store_true")


def command(args) -> int:
    from ..errors import InputError, SemiringBackpropError
    from ..runner import run

    try:
        columns = {}
        for pair in args.column:
            key, sep, name = pair.partition("=")
            if not sep or not key or not name:
                raise InputError(f"--column {pair!r}: expected FIELD=NAME, e.g. text=sentence")
            columns[key] = name
        result = run(
            args.model, args.data, args.out, format=args.format, columns=columns,
            split=args.split, semirings=args.semiring, granularity=args.granularity,
            kind=args.kind, dtype=args.dtype, device=args.device, top_path=args.top_path,
            aggregation=args.aggregation, paper=args.paper, batch_size=args.batch_size,
            limit=args.limit, workers=args.workers, address=args.address, threads=args.threads,
            figures=not args.no_figures, gguf_file=args.gguf_file,
        )  # fmt: skip
    except SemiringBackpropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = result["summary"]
    speed = s["this_run"]["examples_per_second"]
    print(
        f"{s['explained']} of {s['examples']} examples explained ({s['skipped']} skipped, "
        f"{s['malformed']} malformed rows)"
        + (f"; this run: {s['this_run']['explained']} at {speed} examples/s" if speed else "")
    )
    print(f"wrote {args.out}: examples/, tokens/, branches/ (Parquet), " + ", ".join(s["files"]))
    return 0
