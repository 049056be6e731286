"""``semiring-backprop explain``: one semiring pass over a Hugging Face model's choice,
printed as a report and written as files."""

from __future__ import annotations

import sys

from .arguments import check_html_file, directory, task_arguments, weights_argument, writable


def add_parser(sub):
    from ..hf.explain import SEMIRINGS

    e = sub.add_parser(
        "explain",
        help="explain a Hugging Face model's word choice, label, or text similarity",
        description="One semiring pass over a Hugging Face model: per-layer branches "
        "(skip/query/key/value/mlp) per token, the top gradient path and per-token path "
        "entropy of the explained scalar (--task): lm, log p(target) - log p(foil) at the "
        "[MASK] (or next) position; classification, a label's logit (or the margin to "
        "--foil); token, a label's logit at --position; similarity, the cosine similarity "
        "of the pooled embeddings of --text and --text-pair.",
    )
    task_arguments(
        e,
        pair="the second text: of a sentence pair, or for similarity",
        target="lm: the word whose log-probability is explained (several tokens: the sum of "
        "their log-probabilities); classification, token: the label, a name or an index "
        "(default: the predicted label)",
    )
    e.add_argument("--dim", type=int, help="similarity: explain this embedding dimension")
    e.add_argument(
        "--semiring",
        nargs="+",
        default=["max", "entropy"],
        choices=list(SEMIRINGS),
        help="; ".join(f"{k}: {v}" for k, v in SEMIRINGS.items()),
    )
    e.add_argument(
        "--granularity",
        choices=["neuron", "tensor"],
        help="neuron (default) or tensor; --paper computes at tensor granularity",
    )
    e.add_argument(
        "--paper",
        action="store_true",
        help="paper mode: trace as the paper's library (brunoflow) did, at tensor granularity, "
        "and print the paper's per-token branch table (winner-take-all, zeros kept) beside ours",
    )
    weights_argument(e)
    e.add_argument(
        "--per-head",
        action="store_true",
        help="split the query, key and value branches by attention head (a head_index column)",
    )
    e.add_argument("--kind", choices=["masked", "causal"], help="default: from the config")
    e.add_argument("--device", default="cpu")
    e.add_argument("--out", type=directory, help="directory for JSON, CSV and figure files")
    e.add_argument(
        "--format", choices=["png", "svg", "pdf"], default="png", help="figure format (--out)"
    )
    e.add_argument(
        "--html",
        metavar="FILE",
        help="write the report as one self-contained HTML file (opens offline)",
    )


def command(args) -> int:
    import torch

    from ..errors import InputError, SemiringBackpropError
    from ..hf.explain import explain

    try:
        if args.out:  # checked before the work, not after it
            writable(args.out)
        if args.html:
            check_html_file(args.html)
        ex = explain(
            args.model,
            args.text,
            args.target,
            args.foil,
            task=args.task,
            text_pair=args.text_pair,
            position=args.position,
            pooling=args.pooling,
            score=args.score,
            dim=args.dim,
            semirings=args.semiring,
            granularity=args.granularity,
            kind=args.kind,
            dtype=getattr(torch, args.dtype),
            device=args.device,
            per_head=args.per_head,
            paper=args.paper,
            gguf_file=args.gguf_file,
            weights=args.weights,
        )
        print(ex.report())
        if args.out:
            try:
                files = ex.write(args.out, args.format)
            except OSError as e:
                raise InputError(
                    f"--out {args.out!r}: cannot write {e.filename or 'the files'} ({e.strerror})"
                ) from None
            print(
                f"\nwrote {len(files)} files to {args.out}: "
                + ", ".join(f.rsplit("/", 1)[-1] for f in files)
            )
        if args.html:
            print(f"wrote {ex.to_html(args.html)}")
    except SemiringBackpropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
