"""The semirings as Captum attribution methods (optional extra: ``pip install
"semiring-backprop[captum]"``).

``SemiringAttribution`` is a ``captum.attr.GradientAttribution``: ``attribute``
takes Captum's inputs (a tensor or a tuple of tensors whose first dimension is the
batch), ``target`` and ``additional_forward_args``, and returns one real number per
input element: the ⊕ over the paths from that element to the target output, read out
as a tensor. So Captum's visualization and metrics (``infidelity``, ``sensitivity_max``)
take it as they take ``Saliency``.

What each semiring reads out (the semiring's own headline, as in branch tables):
``Real`` the gradient; ``MaxProduct`` the most positive path product (``hi``;
``field="lo"`` the most negative); ``MaxAbs`` the largest ``|path product|``;
``LogAbs`` ``log Σ |path products|``; ``Entropy`` the path entropy; ``PathCount`` the
log number of paths; ``TopK`` the heaviest path's signed product. ``field=`` picks
another field of the readout. An element with no path to the target (a pixel max
pooling does not select) reads the semiring's "no path" value: 0 for ``Real`` and
``MaxAbs``, ``-inf`` for ``MaxProduct``'s hi and for ``LogAbs``. Captum's metrics and
heat maps need finite numbers: on such models give them ``Real`` or ``MaxAbs``.

The examples of a batch are explained at once (one pass, per-example scalars seeded
together: ``backprop(..., per_example=True)``); they must not interact (no batch norm in
training mode, no attention across examples). Every call checks this by running each
example alone, and refuses a batch whose examples interact.

Examples:
    >>> from semiring_backprop.captum import SemiringAttribution
    >>> xs = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)  # a batch of 3
    >>> best = SemiringAttribution(mlp, sbp.MaxProduct()).attribute(xs, target=1)
    >>> best.shape                    # the best path's product per input element
    torch.Size([3, 4])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from ._backprop import backprop
from .errors import InputError
from .semirings import MaxProduct, Real
from .semirings.base import Semiring

try:
    from captum.attr import GradientAttribution
except ImportError:
    raise InputError(
        "semiring_backprop.captum needs Captum, an optional extra: pip install "
        '"semiring-backprop[captum]"'
    ) from None

__all__ = ["SemiringAttribution"]


def _method(fn):
    """An attribution method as Captum shapes its own: wrapped (there, by its usage
    logger), the plain function as ``__wrapped__``, which ``NoiseTunnel`` calls."""

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    return method


def _unknown_options(other: dict) -> str:
    names = ", ".join(f"{k}=" for k in other)
    if "baselines" in other:
        return (
            "SemiringAttribution takes no baselines=: it reads the paths at the input itself, "
            "as Saliency and InputXGradient read the gradient there. For attributions "
            "relative to a baseline use a Captum method that takes one (IntegratedGradients, "
            "GradientShap, DeepLift); to average over noisy inputs wrap this method in "
            "NoiseTunnel"
        )
    return (
        f"SemiringAttribution.attribute takes inputs, target and additional_forward_args; "
        f"not {names}: drop it"
    )


#: semirings whose readout is a path product (or a sum of them): times the input, it is
#: that input's share of the output along those paths (``InputXGradient`` for Real)
_PRODUCTS = (Real, MaxProduct)


class SemiringAttribution(GradientAttribution):
    """A semiring as a Captum attribution method.

    Args:
        forward_func: the model (an ``nn.Module`` in eval mode) or a function of tensors,
            as for any Captum method.
        semiring: what is computed (default ``Real()``: the gradient).
        field: the field of the semiring's readout to return (``"lo"`` for
            ``MaxProduct``'s most negative path); default: the semiring's headline.
        multiply_by_inputs: multiply by the input, as ``InputXGradient`` does
            (``Real`` and ``MaxProduct`` only: their readouts are path products).

    Examples:
        The ``Real`` semiring is Captum's ``Saliency(abs=False)`` and, multiplied by the
        inputs, ``InputXGradient``:

        >>> from captum.attr import InputXGradient, Saliency
        >>> from semiring_backprop.captum import SemiringAttribution
        >>> xs = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        >>> grad = SemiringAttribution(mlp, sbp.Real()).attribute(xs, target=1)
        >>> torch.allclose(grad, Saliency(mlp).attribute(xs, target=1, abs=False))
        True
        >>> ixg = SemiringAttribution(mlp, multiply_by_inputs=True).attribute(xs, target=1)
        >>> torch.allclose(ixg, InputXGradient(mlp).attribute(xs, target=1))
        True

        ``MaxProduct``'s most negative path per input (``paths`` are the MLP's paths,
        written out in the set-up):

        >>> lo = SemiringAttribution(mlp, sbp.MaxProduct(), field="lo").attribute(x, target=1)
        >>> torch.equal(lo[0], paths.amin(0))
        True
    """

    def __init__(self, forward_func: Callable, semiring: Semiring | None = None, *,
                 field: str | None = None, multiply_by_inputs: bool = False) -> None:  # fmt: skip
        super().__init__(forward_func)
        semiring = Real() if semiring is None else semiring
        if not isinstance(semiring, Semiring):
            raise InputError(
                f"semiring must be a Semiring such as Real() or MaxProduct(), got {semiring!r}"
            )
        if multiply_by_inputs and not isinstance(semiring, _PRODUCTS):
            raise InputError(
                f"multiply_by_inputs=True multiplies a path product by the input; "
                f"{semiring.name}'s readout is not one (use Real or MaxProduct)"
            )
        self.semiring = semiring
        self.field = field
        self._multiply_by_inputs = multiply_by_inputs

    @property
    def multiplies_by_inputs(self) -> bool:
        return self._multiply_by_inputs

    @_method
    def attribute(self, inputs, target=None, additional_forward_args=None, **other):
        """Per-input-element values, shaped as ``inputs`` (a tuple where it is one).

        ``target``: as in Captum: an int (or a tuple of ints) indexing every example's
        output, a tensor or list with one per example, or None for a model whose output
        is one number per example. No ``baselines``: the paths are read at the input
        itself, as ``Saliency`` and ``InputXGradient`` read the gradient there.
        Captum's ``NoiseTunnel`` takes the method as it takes ``Saliency``
        (``NoiseTunnel(SemiringAttribution(model)).attribute(x, nt_type="smoothgrad",
        target=1)``: the mean over noisy copies of the input).

        Examples:
            >>> from semiring_backprop.captum import SemiringAttribution
            >>> SemiringAttribution(mlp, sbp.Entropy()).attribute(x, target=1).shape
            torch.Size([1, 4])
        """
        if other:
            raise InputError(_unknown_options(other))
        is_tuple = isinstance(inputs, tuple)
        xs = inputs if is_tuple else (inputs,)
        for i, x in enumerate(xs):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise InputError(
                    f"inputs[{i}] must be a floating-point tensor (attributions are per "
                    f"element of a real input), got {_describe(x)}; explain token ids "
                    "through their embeddings"
                )
        extra = _as_tuple(additional_forward_args)
        args = (*xs, *extra)
        per_example = self._check_output(args, target)
        output = functools.partial(_select, target=target)
        res = backprop(self.forward_func, args=args, output=output, semirings=[self.semiring],
                       keep=list(range(len(xs))), per_example=per_example)  # fmt: skip
        outs = []
        for i, x in enumerate(xs):
            a = self._read(res.value(i, self.semiring))
            outs.append(a * x.detach() if self._multiply_by_inputs else a)
        return tuple(outs) if is_tuple else outs[0]

    def _check_output(self, args, target) -> bool:
        """Run the model once: the target must pick one number per example (or one
        number). Returns whether the output is per example."""
        with torch.no_grad():
            out = self.forward_func(*args)
        if not isinstance(out, torch.Tensor):
            raise InputError(
                f"the model returned {type(out).__name__}; Captum methods need a tensor "
                "output (wrap the model in a function that returns the logits)"
            )
        try:
            picked = _select(out, target)
        except (IndexError, RuntimeError, TypeError, ValueError) as e:
            raise InputError(
                f"target={_describe(target)} does not select from the model's output of "
                f"shape {tuple(out.shape)}: {e}. Give an int (a column of every example), "
                "a tuple of ints, or one per example (a list or a 1-D tensor)"
            ) from None
        n = out.shape[0] if out.dim() else 1
        if picked.dim() == 0:
            return False
        if picked.numel() != n:
            raise InputError(
                f"target={_describe(target)} selects {tuple(picked.shape)} from the model's "
                f"output of shape {tuple(out.shape)}; it must select one number per example "
                "(a target index for each)"
            )
        return True

    def _read(self, value) -> torch.Tensor:
        if self.field is None:  # the headline: what branch tables show
            return self.semiring.scalar(value)
        readout = self.semiring.finalize(value)
        names = [f.name for f in dataclasses.fields(readout)] if _is_dataclass(readout) else []
        if self.field not in names:
            raise InputError(
                f"{self.semiring.name}'s readout has no field {self.field!r}; "
                + (f"its fields: {', '.join(names)}" if names else "it is one tensor: drop field=")
            )
        return getattr(readout, self.field)


def _is_dataclass(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _select(out: torch.Tensor, target) -> torch.Tensor:
    """Captum's target convention: None (the output is one number per example), an int
    or a tuple of ints (indices after the batch dim, the same for every example), or
    one per example (a 1-D tensor or list of ints, a list of tuples)."""
    if target is None:
        picked = out
    elif isinstance(target, torch.Tensor) and target.numel() == 1:
        picked = out[:, int(target.item())]
    elif isinstance(target, int):
        picked = out[:, target]
    elif isinstance(target, tuple):
        picked = out[(slice(None), *target)]
    elif (
        isinstance(target, torch.Tensor | list) and len(target) and not isinstance(target[0], tuple)
    ):
        index = torch.as_tensor(target, device=out.device).reshape(-1)
        if index.numel() != out.shape[0] or out.dim() != 2:
            raise ValueError(
                f"one target per example needs a 2-D output and {out.shape[0]} targets, got "
                f"{index.numel()}"
            )
        picked = out.gather(1, index.reshape(-1, 1)).squeeze(-1)
    elif isinstance(target, list) and len(target) == out.shape[0]:
        picked = torch.stack([out[(i, *t)] for i, t in enumerate(target)])
    else:
        raise ValueError("not an int, a tuple, a tensor or a list of one per example")
    return picked.reshape(-1) if picked.dim() else picked


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    return x if isinstance(x, tuple) else (x,)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return repr(x) if len(repr(x)) < 60 else type(x).__name__
