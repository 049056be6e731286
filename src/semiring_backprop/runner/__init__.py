"""Explain a whole data set: readers -> batches -> explain -> Parquet shards, resumable;
one process by default, Ray workers when asked.

For example (``docs/datasets.md`` runs it on a small model)::

    from semiring_backprop.runner import run, load_results
    run("bert-base-uncased", "agreement.jsonl", "runs/agreement", workers=2)
    load_results("runs/agreement")["branches"]      # example x token x layer x branch
"""

from .compute import Explainer, Item, prepare, readouts
from .driver import Settings, batches, run, skipped_examples
from .readers import FORMATS, Example, Malformed, from_agreement, read_examples
from .report import load_results

__all__ = [
    "FORMATS",
    "Example",
    "Explainer",
    "Item",
    "Malformed",
    "Settings",
    "batches",
    "from_agreement",
    "load_results",
    "prepare",
    "read_examples",
    "readouts",
    "run",
    "skipped_examples",
]
