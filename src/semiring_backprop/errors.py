"""One exception family. Every message names the input, the place and the fix."""

from __future__ import annotations


class SemiringBackpropError(Exception):
    """Base class of every error this library raises on purpose."""


class UnsupportedOpError(SemiringBackpropError, NotImplementedError):
    """An op in the traced graph has no rule."""


class TracingError(SemiringBackpropError):
    """The model could not be traced to an ATen graph."""


class InputError(SemiringBackpropError, ValueError):
    """Bad arguments: an output that is not a scalar, an unknown input, and so on."""


class LoadError(InputError):
    """A model or tokenizer could not be loaded, or loaded only in part (weights that
    transformers would initialize at random)."""


class PathMismatchError(SemiringBackpropError, RuntimeError):
    """A path read from back-pointers does not reproduce the semiring's value: the
    result is inconsistent (changed after the pass, or a bug); the path is not returned."""


class ForwardError(SemiringBackpropError, RuntimeError):
    """Running the traced model on the given inputs failed (an op raised)."""


class NonFiniteError(SemiringBackpropError, FloatingPointError):
    """The forward pass produced NaN or inf."""


class OutOfMemoryError(SemiringBackpropError, MemoryError):
    """A pass could not allocate the memory it needs; the message lists what uses less."""


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure from torch (CPU or CUDA), under any of its exception types."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "out of memory" in text.lower() or "can't allocate memory" in text
    )


class TrainingModeError(SemiringBackpropError):
    """The model is in training mode, which makes edges random (dropout)."""


class NotFoundError(SemiringBackpropError, KeyError):
    """``Result.at`` was asked for a place the graph does not have."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


def where(node, module: str | None) -> str:
    """``while running node `addmm_3` (`bert.encoder.layer.0.attention.self.key`)``."""
    place = f" (`{module}`)" if module else ""
    return f"node `{node.name}`{place}"
