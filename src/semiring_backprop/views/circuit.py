"""Moved to :mod:`semiring_backprop.circuits.view` (``circuit_view``, ``circuit_svg``):
the circuit draws itself where it is computed, with the views' HTML and colour scale.
This old path is kept for code that imports it: it is that very module (``sys.modules``
maps this name to it), so its names are the same objects."""

import sys

from ..circuits import view

sys.modules[__name__] = view
