"""Semirings: one module per family, one small shared interface (see ``base``)."""

from .base import Semiring, Value, fmap, fmap2, stack
from .entropy import Entropy, EntropyReadout
from .logspace import LogAbs, LogAbsReadout, MaxAbs, MaxAbsReadout, PathCount, PathCountReadout
from .maxproduct import MaxProduct, MaxProductReadout
from .real import Real
from .topk import TopK, TopKReadout

__all__ = [
    "Entropy",
    "EntropyReadout",
    "LogAbs",
    "LogAbsReadout",
    "MaxAbs",
    "MaxAbsReadout",
    "MaxProduct",
    "MaxProductReadout",
    "PathCount",
    "PathCountReadout",
    "Real",
    "Semiring",
    "TopK",
    "TopKReadout",
    "Value",
    "fmap",
    "fmap2",
    "stack",
]
