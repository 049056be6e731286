"""Per-ATen-op rules, grouped by kind. Importing this package fills the registry."""

from . import composite, contraction, nondifferentiable, pointwise, reduction, routing  # noqa: F401
from .registry import Op, Prepared, Rule, lookup, register, registered, supported_ops

__all__ = ["Op", "Prepared", "Rule", "lookup", "register", "registered", "supported_ops"]
