"""Semiring backpropagation on unmodified PyTorch models.

Examples:
    One pass computes several semirings; ``mlp`` is a small ``nn.Module`` and ``x`` its
    input (``docs/api.md`` makes both):

    >>> import semiring_backprop as sbp
    >>> res = sbp.backprop(mlp, args=(x,), output=lambda y: y[0, 1],
    ...                    semirings=[sbp.Real(), sbp.MaxProduct(), sbp.Entropy()])
    >>> res.at(0, sbp.Real())            # the gradient
    tensor([[ 0.0269, -0.0301,  0.0204, -0.0475]], dtype=torch.float64)
    >>> res.at(0, sbp.MaxProduct()).hi   # the most positive path product
    tensor([[0.0343, 0.0232, 0.0451, 0.0403]], dtype=torch.float64)
"""

import sys

from . import views
from ._backprop import Backprop, backprop, clear_traces
from ._threads import threads
from .ablation import faithfulness as _faithfulness
from .ablation import patching as _patching
from .analysis import Path, Step
from .circuits import Circuit, circuit
from .circuits import view as _circuit_view
from .errors import (
    ForwardError,
    InputError,
    LoadError,
    NonFiniteError,
    NotFoundError,
    OutOfMemoryError,
    PathMismatchError,
    SemiringBackpropError,
    TracingError,
    TrainingModeError,
    UnsupportedOpError,
)
from .graph import Graph
from .result import Result
from .rules import register, register_forward, supported_ops
from .runner import load_results, run
from .semirings import (
    Entropy,
    LogAbs,
    MaxAbs,
    MaxProduct,
    PathCount,
    Real,
    Semiring,
    TopK,
)
from .targets import ClassLabel, EmbeddingDim, Similarity, TokenLabel, WordChoice
from .tracing.trace import trace

#: old paths of modules that moved, kept for code that imports them: each old name is the
#: very module at its new path (``sys.modules`` maps it there, so its names are the same
#: objects). They are set here, above every folder, so that no folder imports from one
#: that stands above it (``import semiring_backprop.analysis.patching`` imports this
#: package first, then finds the name here).
_MOVED = {
    "analysis.patching": _patching,
    "analysis.faithfulness": _faithfulness,
    "views.circuit": _circuit_view,
}
for _old, _module in _MOVED.items():
    _folder, _name = _old.split(".")
    sys.modules[f"{__name__}.{_old}"] = _module
    setattr(sys.modules[f"{__name__}.{_folder}"], _name, _module)
del _old, _module, _folder, _name

__all__ = [
    "Backprop",
    "Circuit",
    "ClassLabel",
    "EmbeddingDim",
    "Entropy",
    "ForwardError",
    "Graph",
    "InputError",
    "LoadError",
    "LogAbs",
    "MaxAbs",
    "MaxProduct",
    "NonFiniteError",
    "NotFoundError",
    "OutOfMemoryError",
    "Path",
    "PathCount",
    "PathMismatchError",
    "Real",
    "Result",
    "Semiring",
    "SemiringBackpropError",
    "Similarity",
    "Step",
    "TokenLabel",
    "TopK",
    "TracingError",
    "TrainingModeError",
    "UnsupportedOpError",
    "WordChoice",
    "backprop",
    "circuit",
    "clear_traces",
    "load_results",
    "register",
    "register_forward",
    "run",
    "supported_ops",
    "threads",
    "trace",
    "views",
]

__version__ = "0.1.0"
