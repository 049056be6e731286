"""Per-ATen-op rules, grouped by kind. Importing this package fills the registry."""

from . import (  # noqa: F401
    composite,
    contraction,
    nondifferentiable,
    pointwise,
    reduction,
    routing,
    window,
)
from .registry import Op, Prepared, Rule, lookup, register, registered, supported_ops

__all__ = ["Op", "Prepared", "Rule", "lookup", "register", "registered", "supported_ops"]
