"""The documented path of :mod:`semiring_backprop.hf.explain`, kept working:
``from semiring_backprop.explain import explain`` gets that module itself (not a copy),
so patching one patches the other."""

import sys

from .hf import explain as _module

sys.modules[__name__] = _module
