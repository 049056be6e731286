"""Moved to :mod:`semiring_backprop.ablation.patching` (``Patching``, ``EDGE_KEY``,
``NODE_KEY``, ``MODES``, ``BRANCHES``). This old path is kept for code that imports it:
it is that very module (``sys.modules`` maps this name to it), so its names are the same
objects and anything set on it is set there."""

import sys

from ..ablation import patching

sys.modules[__name__] = patching
