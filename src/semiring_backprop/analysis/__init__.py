"""Reading a pass: paths, branches at fan-out points, per-layer tables."""

from .paths import Path, Step

__all__ = ["Path", "Step"]
