"""Moved to :mod:`semiring_backprop.ablation.faithfulness` (``normalized``, ``curve``,
``cpr``, ``cmd``, ``edges_needed``, ``agreement``, ``ranking``, ``FRACTIONS``). This old
path is kept for code that imports it: it is that very module (``sys.modules`` maps this
name to it), so its names are the same objects and anything set on it is set there."""

import sys

from ..ablation import faithfulness

sys.modules[__name__] = faithfulness
