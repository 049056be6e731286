"""Reading a pass: paths, branches at fan-out points, per-layer tables."""

from .steps import Path, Step

__all__ = ["Path", "Step"]
