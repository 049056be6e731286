"""``semiring-backprop experiment NAME`` and ``demo``: the paper's experiments, with
``--set KEY=VALUE`` parsed like each config field's default."""

from __future__ import annotations

import json
import sys

from .arguments import directory


def add_parsers(sub):
    from ..experiments import EXPERIMENTS

    x = sub.add_parser(
        "experiment",
        help="run one of the paper's experiments (data, summary.json, figures)",
        description="Run one of the paper's experiments; results are written as they are "
        "produced, and a rerun into the same --out resumes.",
    )
    x.add_argument("name", choices=list(EXPERIMENTS))
    x.add_argument("--quick", action="store_true", help="reduced size, minutes on a CPU")
    x.add_argument("--out", type=directory, help="output directory (default: runs/NAME[-quick])")
    x.add_argument(
        "--model",
        metavar="MODEL",
        help="the LM explained: a hub id, a directory, a .gguf file or smol (SmolLM2-135M); "
        "the same as --set model=MODEL",
    )
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
        "--out", type=directory, default="runs/demo", help="output directory (default: runs/demo)"
    )


def command(args) -> int:
    from .. import experiments
    from ..errors import SemiringBackpropError

    try:
        if args.command == "demo":
            from ..experiments.first_token import demo

            demo(args.out)
            return 0
        given = options(args.name, args.set)
        if getattr(args, "model", None) is not None:
            given = {**given, **_model_option(args.name, args.model, given)}
        out = args.out or f"runs/{args.name}{'-quick' if args.quick else ''}"
        result = experiments.run(args.name, out, quick=args.quick, **given)
    except SemiringBackpropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.get("summary", {}), indent=2))
    files = result.get("files", [])
    print(f"\nwrote {len(files)} files to {out}: " + ", ".join(f.rsplit("/", 1)[-1] for f in files))
    return 0


def _model_option(name: str, model: str, given: dict) -> dict:
    import dataclasses

    from ..errors import InputError
    from ..experiments import module

    if "model" not in {f.name for f in dataclasses.fields(module(name).Config)}:
        raise InputError(f"--model: the experiment {name} takes no model (it trains its own)")
    if "model" in given and given["model"] != model:
        raise InputError(f"--model {model} and --set model={given['model']}: give one of them")
    return {"model": model}


def options(name, pairs) -> dict:
    """``KEY=VALUE`` strings to config fields, each parsed like the field's default."""
    import dataclasses

    from ..errors import InputError
    from ..experiments import module

    defaults = {f.name: f.default for f in dataclasses.fields(module(name).Config)}
    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in defaults:
            raise InputError(
                f"--set {pair!r}: expected KEY=VALUE with KEY one of {', '.join(defaults)}"
            )
        out[key] = parse_value(text, defaults[key], key)
    return out


def parse_value(text: str, default, key: str):
    from ..errors import InputError

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
