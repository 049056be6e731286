"""The paper's experiments, each a module with a ``Config`` and ``run(out, config)``.

>>> from semiring_backprop import experiments
>>> result = experiments.run("first-token-repeated", "runs/ftr", quick=True)
>>> result["summary"]["oplus"]["tensor"]["repeated"]["key"]

Every experiment writes its data (CSV, JSON lines), ``summary.json`` and figures into
``out``; a rerun reuses trained models and the rows already written.
"""

from __future__ import annotations

import dataclasses
import importlib

from ..errors import InputError

EXPERIMENTS = {  # CLI name -> module
    "first-token-repeated": "first_token",
    "entropy-vs-mdl": "entropy_mdl",
    "entropy-sanity": "entropy_sanity",
    "sva": "sva",
}


def module(name: str):
    if name not in EXPERIMENTS:
        raise InputError(f"no experiment {name!r}; the experiments are {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f".{EXPERIMENTS[name]}", __name__)


def config(name: str, quick: bool = False, **options):
    """The experiment's config: paper size, or reduced with ``quick``; ``options``
    override single fields."""
    cls = module(name).Config
    base = cls.quick() if quick else cls()
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise InputError(
            f"{name} has no option {', '.join(unknown)}; "
            f"its options are {', '.join(sorted(fields))}"
        )
    return dataclasses.replace(base, **options)


def run(name: str, out, quick: bool = False, progress: bool = True, **options) -> dict:
    """Run one experiment into directory ``out``; returns its summary and file list.
    The run holds ``out`` (another run into it is refused while this one lasts)."""
    from .common import lock

    cfg = config(name, quick, **options)
    with lock(out):
        return module(name).run(out, cfg, progress=progress)


__all__ = ["EXPERIMENTS", "config", "module", "run"]
