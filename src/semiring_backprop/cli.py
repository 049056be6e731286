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
    _circuit_parser(sub)
    _run_parser(sub)
    _experiment_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "explain":
        return _explain(args)
    if args.command == "circuit":
        return _circuit(args)
    if args.command == "run":
        return _run(args)
    if args.command in ("experiment", "demo"):
        return _experiment(args)
    if args.command in (None, "quickstart"):
        from .quickstart import run

        seed = getattr(args, "seed", 0)
        if not -(2**63) <= seed < 2**64:  # torch.manual_seed's range
            parser.error(f"--seed {seed}: a seed must fit in 64 bits, e.g. --seed 0")
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
    from .hf.explain import SEMIRINGS

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
    _task_arguments(
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
    e.add_argument(
        "--per-head",
        action="store_true",
        help="split the query, key and value branches by attention head (a head_index column)",
    )
    e.add_argument("--kind", choices=["masked", "causal"], help="default: from the config")
    e.add_argument("--device", default="cpu")
    e.add_argument("--out", type=_directory, help="directory for JSON, CSV and figure files")
    e.add_argument(
        "--format", choices=["png", "svg", "pdf"], default="png", help="figure format (--out)"
    )
    e.add_argument(
        "--html",
        metavar="FILE",
        help="write the report as one self-contained HTML file (opens offline)",
    )


def _explain(args) -> int:
    import torch

    from .errors import InputError, SemiringBackpropError
    from .hf.explain import explain

    try:
        if args.out:  # checked before the work, not after it
            _writable(args.out)
        if args.html:
            _check_html_file(args.html)
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


#: what a model argument may be
_MODEL_HELP = (
    "a Hugging Face hub id, a local directory, a GGUF file (model.gguf; or a directory with "
    "--gguf-file NAME), or smol (SmolLM2-135M-Instruct, where installed)"
)


def _model_arguments(p) -> None:
    """The model and how it is loaded: the same for explain, circuit and run."""
    p.add_argument("model", help=_MODEL_HELP)
    p.add_argument(
        "--gguf-file",
        metavar="NAME",
        help="the GGUF file to load from the directory MODEL (or pass the file's path as MODEL)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="the weights' dtype (a GGUF file's quantized weights are dequantized to it)",
    )


def _task_arguments(p, pair: str, target: str) -> None:
    """The model, the text and what is explained (--task and its options): the same for
    ``explain`` and ``circuit``, with help of their own for --text-pair and --target."""
    from .targets import POOLING, TASKS

    _model_arguments(p)
    p.add_argument("--task", choices=TASKS, default="lm", help="what is explained (default: lm)")
    p.add_argument("--text", required=True, help="the input; a masked LM needs one mask token")
    p.add_argument("--text-pair", help=pair)
    p.add_argument("--target", "--label", dest="target", help=target)
    p.add_argument(
        "--foil", help="the word (lm) or label whose log-probability (logit) is subtracted"
    )
    p.add_argument("--position", type=int, help="token task: the token index explained")
    p.add_argument(
        "--score",
        choices=["logit", "logprob"],
        default="logit",
        help="classification, token: a label's logit or its log-probability",
    )
    p.add_argument(
        "--pooling",
        choices=POOLING,
        help="similarity: pooling over tokens (default: the checkpoint's 1_Pooling/config.json)",
    )


def _circuit_parser(sub):
    from .analysis.marginals import SEEDS
    from .circuits.ig import METHODS

    c = sub.add_parser(
        "circuit",
        help="the circuit (heads, MLPs and the edges between them) of a word choice, label "
        "or embedding dimension",
        description="One pass over a Hugging Face model: per attention head, MLP and "
        "position the total flow (Real) and the best path (MaxProduct) of the explained "
        "scalar (--task, as for explain: lm, log p(target) - log p(foil); classification, a "
        "label's logit or its margin to --foil; token, a label's logit at --position; "
        "similarity, one --dim of the pooled embedding), with the edges between them; "
        "written as EAP-IG graph JSON, a Neuronpedia / circuit-tracer attribution graph and "
        "an HTML drawing.",
    )
    _task_arguments(
        c,
        pair="classification, token: the second text of a pair",
        target="lm: the word whose log-probability is explained; classification, token: the "
        "label, a name or an index (default: the predicted label)",
    )
    c.add_argument(
        "--dim",
        type=int,
        help="similarity: explain this dimension of the text's pooled embedding (a circuit "
        "is read from one text, so not the similarity of two)",
    )
    c.add_argument(
        "--baseline-text",
        help="a corrupted text of as many tokens: the seed is the difference of the two "
        "texts' token embeddings (x - x'), as in activation patching",
    )
    c.add_argument(
        "--seed",
        choices=SEEDS,
        default="x",
        help="without --baseline-text: x, each source's own value (default), or structural, "
        "one at every element of every source",
    )
    c.add_argument(
        "--ig-steps",
        type=int,
        default=0,
        metavar="N",
        help="with --baseline-text: Real summed over N integrated-gradients steps from the "
        "baseline to the text (each site's conductance; the other semirings stay at the "
        "text); default 0, the seed x - x' at the text alone",
    )
    c.add_argument(
        "--ig-method",
        choices=METHODS,
        default="gausslegendre",
        help="the steps' quadrature, Captum's names (default: gausslegendre)",
    )
    c.add_argument("--top-n", type=int, help="keep the N strongest head/MLP sites (|Real|)")
    c.add_argument("--threshold", type=float, help="keep the sites of |Real| at least this")
    c.add_argument(
        "--cumulative", type=float, help="keep the strongest sites that carry this share of |Real|"
    )
    c.add_argument("--kind", choices=["masked", "causal"], help="lm: default from the config")
    c.add_argument("--device", default="cpu")
    c.add_argument("--json", metavar="FILE", help="write EAP-IG / MIB graph JSON (Real scores)")
    c.add_argument(
        "--neuronpedia", metavar="DIR", help="write a circuit-tracer / Neuronpedia graph here"
    )
    c.add_argument("--html", metavar="FILE", help="write the drawing as one HTML file")


def _circuit(args) -> int:
    import torch

    from .circuits.hf import circuit_of_text
    from .errors import InputError, SemiringBackpropError

    try:
        if args.html:
            _check_html_file(args.html)
        c = circuit_of_text(
            args.model, args.text, args.target, args.foil, task=args.task,
            text_pair=args.text_pair, position=args.position, pooling=args.pooling,
            score=args.score, dim=args.dim, baseline_text=args.baseline_text,
            kind=args.kind, dtype=getattr(torch, args.dtype), device=args.device,
            seed=args.seed, ig_steps=args.ig_steps, ig_method=args.ig_method,
            gguf_file=args.gguf_file,
        )  # fmt: skip
        if args.top_n is not None or args.threshold is not None or args.cumulative is not None:
            c = c.prune(top_n=args.top_n, threshold=args.threshold, cumulative=args.cumulative)
        print(c.view().text())
        try:
            if args.json:
                c.to_eap_json(args.json)
                print(f"wrote {args.json}")
            if args.neuronpedia:
                from .hf.explanation import model_name

                slug = "".join(ch if ch.isalnum() else "-" for ch in model_name(c.model_id))
                c.to_neuronpedia(args.neuronpedia, slug=f"{slug}-circuit",
                                 scan=model_name(c.model_id))  # fmt: skip
                print(f"wrote {args.neuronpedia}")
        except OSError as e:
            raise InputError(f"cannot write {e.filename or 'the files'} ({e.strerror})") from None
        if args.html:
            print(f"wrote {c.to_html(args.html)}")
    except SemiringBackpropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_html_file(file) -> None:
    """Refuse an --html path that cannot be written, before any work."""
    import os

    from .errors import InputError

    if os.path.isdir(file):
        raise InputError(f"--html {file}: is a directory; give a file name such as report.html")
    parent = os.path.dirname(os.path.abspath(file))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise InputError(f"--html {file}: cannot write under {parent}; give another file")


def _directory(text: str) -> str:
    """An --out value: an empty one (an unset shell variable) would write into the
    current directory, or nowhere."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty name; give a directory, e.g. --out runs/x")
    return text


def _writable(out) -> None:
    """``--out`` as a directory this process can write into (made if missing)."""
    import os
    import tempfile
    from pathlib import Path

    from .errors import InputError

    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        # a new file of a random name, made exclusively: no planted link is followed
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(
            f"--out {str(out)!r}: cannot write there ({e.strerror}); give a directory you "
            "can write into"
        ) from None


def _experiment_parsers(sub):
    from .experiments import EXPERIMENTS

    x = sub.add_parser(
        "experiment",
        help="run one of the paper's experiments (data, summary.json, figures)",
        description="Run one of the paper's experiments; results are written as they are "
        "produced, and a rerun into the same --out resumes.",
    )
    x.add_argument("name", choices=list(EXPERIMENTS))
    x.add_argument("--quick", action="store_true", help="reduced size, minutes on a CPU")
    x.add_argument("--out", type=_directory, help="output directory (default: runs/NAME[-quick])")
    x.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override config fields, e.g. --set seeds=0,1 model=bert-base-uncased",
    )
    d = sub.add_parser(
        "demo",
        help="first-token-repeated --quick: train, explain, print the branch table",
    )
    d.add_argument(
        "--out", type=_directory, default="runs/demo", help="output directory (default: runs/demo)"
    )


def _experiment(args) -> int:
    from . import experiments
    from .errors import SemiringBackpropError

    try:
        if args.command == "demo":
            from .experiments.first_token import demo

            demo(args.out)
            return 0
        options = _options(args.name, args.set)
        out = args.out or f"runs/{args.name}{'-quick' if args.quick else ''}"
        result = experiments.run(args.name, out, quick=args.quick, **options)
    except SemiringBackpropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.get("summary", {}), indent=2))
    files = result.get("files", [])
    print(f"\nwrote {len(files)} files to {out}: " + ", ".join(f.rsplit("/", 1)[-1] for f in files))
    return 0


def _options(name, pairs) -> dict:
    """``KEY=VALUE`` strings to config fields, each parsed like the field's default."""
    import dataclasses

    from .errors import InputError
    from .experiments import module

    defaults = {f.name: f.default for f in dataclasses.fields(module(name).Config)}
    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in defaults:
            raise InputError(
                f"--set {pair!r}: expected KEY=VALUE with KEY one of {', '.join(defaults)}"
            )
        out[key] = _parse(text, defaults[key], key)
    return out


def _parse(text: str, default, key: str):
    from .errors import InputError

    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if isinstance(default, tuple):
            kind = type(default[0]) if default else str
            return tuple(kind(t) for t in text.split(",") if t)
        if isinstance(default, int | float):
            return type(default)(text)
        if default is None and text.lower() == "none":
            return None
        if default is None:
            for kind in (int, float):
                try:
                    return kind(text)
                except ValueError:
                    pass
        return text
    except ValueError:
        raise InputError(
            f"--set {key}={text}: expected a {type(default).__name__} like {default!r}"
        ) from None


def _run_parser(sub):
    from .hf.explain import SEMIRINGS
    from .runner import FORMATS

    r = sub.add_parser(
        "run",
        help="explain log p(target) - log p(foil) for every example of a data set",
        description="Explain every (text, target, foil) example of a data file or Hugging "
        "Face data set: scores, per-token readouts and per-layer branch tables as Parquet "
        "shards, summary.json and figures. Results are written as they are computed; a "
        "rerun into the same --out resumes.",
    )
    _model_arguments(r)
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


def _run(args) -> int:
    from .errors import InputError, SemiringBackpropError
    from .runner import run

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


if __name__ == "__main__":
    sys.exit(main())
