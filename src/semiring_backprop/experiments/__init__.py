"""The paper's experiments, each a module with a ``Config`` and ``run(out, config)``.

For example (``docs/experiments.md`` runs them)::

    from semiring_backprop import experiments
    result = experiments.run("first-token-repeated", "runs/ftr", quick=True)
    result["summary"]["oplus"]["tensor"]["repeated"]["key"]

Every experiment writes its data (CSV, JSON lines), ``summary.json`` and figures into
``out``; a rerun reuses trained models and the rows already written.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import types
import typing

from ..errors import InputError

EXPERIMENTS = {  # CLI name -> module
    "first-token-repeated": "first_token",
    "entropy-vs-mdl": "entropy_mdl",
    "entropy-sanity": "entropy_sanity",
    "sva": "sva",
    "entropy": "sva_entropy",
    "faithfulness": "faithfulness",
    "faithfulness-lm": "faithfulness_lm",
}


def module(name: str):
    if name not in EXPERIMENTS:
        raise InputError(f"no experiment {name!r}; the experiments are {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f".{EXPERIMENTS[name]}", __name__)


def config(name: str, quick: bool = False, **options):
    """The experiment's config: paper size, or reduced with ``quick``; ``options``
    override single fields. Every field is checked (type and range) before any work."""
    cls = module(name).Config
    base = cls.quick() if quick else cls()
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise InputError(
            f"{name} has no option {', '.join(unknown)}; "
            f"its options are {', '.join(sorted(fields))}"
        )
    cfg = dataclasses.replace(base, **options)
    check(name, cfg)
    return cfg


#: fields whose numbers may be 0 (seeds, bin edges; workers and threads, where 0 means one
#: process and the default count); any other count or size must be at least 1 and any
#: other float above 0; fractions lie in (0, 1] and min_accuracy in [0, 1]
_MAY_BE_ZERO = {"seed", "seeds", "length_bins", "workers", "threads"}
_FRACTIONS = {"mdl_fractions"}
_HEADS = (("hidden", "heads"), ("bert_hidden", "bert_heads"), ("llama_hidden", "llama_heads"))


def check(name: str, cfg) -> None:
    """Refuse a config whose fields have the wrong type or an impossible value (zero
    epochs, no heads, a limit of "abc"), naming the field, before anything runs."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not _fits(value, hints[f.name]):
            raise InputError(f"{name}: {f.name}={value!r} is not a {_show(hints[f.name])}")
        numbers = value if isinstance(value, tuple) else (value,)
        for v in numbers:
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if f.name == "min_accuracy":
                ok, need = 0 <= v <= 1, "between 0 and 1"
            elif f.name in _FRACTIONS:
                ok, need = 0 < v <= 1, "in (0, 1]"
            elif f.name in _MAY_BE_ZERO:
                ok, need = v >= 0, "0 or more"
            elif isinstance(v, int):
                ok, need = v >= 1, "at least 1"
            else:
                ok, need = v > 0 and math.isfinite(v), "a finite number above 0"
            if not ok:
                raise InputError(f"{name}: {f.name}={value!r}: each value must be {need}")
    for hidden, heads in _HEADS:
        h, k = getattr(cfg, hidden, None), getattr(cfg, heads, None)
        if isinstance(h, int) and isinstance(k, int) and h % k:
            raise InputError(
                f"{name}: {hidden}={h} must be a multiple of {heads}={k} (each head gets "
                f"{hidden} / {heads} dimensions)"
            )
    if hasattr(cfg, "check"):
        cfg.check()


def _fits(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _show(hint) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def run(name: str, out, quick: bool = False, progress: bool = True, **options) -> dict:
    """Run one experiment into directory ``out``; returns its summary and file list.
    The run holds ``out`` (another run into it is refused while this one lasts)."""
    from ..runner.records import lock

    cfg = config(name, quick, **options)
    with lock(out):
        return module(name).run(out, cfg, progress=progress)


__all__ = ["EXPERIMENTS", "config", "module", "run"]
