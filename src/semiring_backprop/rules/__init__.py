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
from .registry import (
    Op,
    Prepared,
    Rule,
    lookup,
    lookup_forward,
    register,
    register_forward,
    registered,
    supported_ops,
    takes_rows,
    without_forward,
)

__all__ = [
    "Op",
    "Prepared",
    "Rule",
    "lookup",
    "lookup_forward",
    "register",
    "register_forward",
    "registered",
    "supported_ops",
    "takes_rows",
    "without_forward",
]
