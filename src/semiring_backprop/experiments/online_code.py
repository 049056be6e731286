"""The online (prequential) code length of a data set's labels (Voita & Titov 2020):
the labels sent block by block, each block coded by a model trained on the blocks
before it, the first one with the uniform code. The difficulty measure of
:mod:`.entropy_mdl` (paper §5.3)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from ..errors import InputError

__all__ = ["block_ends", "online_code_length"]


def block_ends(n: int, fractions: Sequence[float]) -> list[int]:
    """Block end indices for a train set of ``n``: each fraction of ``n`` rounded (at
    least 1), duplicates merged. The fractions must increase and end at 1.0."""
    fr = list(fractions)
    if n < 1:
        raise InputError(f"block_ends: the train set is empty (n={n}); nothing to code")
    if not fr or any(not 0 < f <= 1 for f in fr) or fr != sorted(set(fr)) or fr[-1] != 1:
        raise InputError(
            f"mdl_fractions must increase within (0, 1] and end at 1.0 (the code covers the "
            f"whole train set), got {tuple(fractions)!r}"
        )
    return sorted({max(1, min(n, math.floor(f * n + 0.5))) for f in fr})


def online_code_length(
    fit: Callable,
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    blocks: Sequence[int],
    *,
    done: Mapping[int, float] | None = None,
    on_block: Callable[[dict], None] | None = None,
    batch_size: int = 1024,
) -> dict:
    """Prequential code length of labels ``y`` given inputs ``x``, in bits.

    ``blocks`` are the increasing block ends ``t_1 < ... < t_n == len(y)``. The first
    block costs ``t_1 · log2(num_classes)`` (uniform code); block ``t_i .. t_{i+1}-1``
    costs ``Σ -log2 p(y_j | x_j)`` under ``fit(x[:t_i], y[:t_i])``, called once per block
    and expected to train a fresh model on exactly that prefix. It returns a function
    from a batch of inputs to class scores ``(m, C)``, ``C >= num_classes``; the first
    ``num_classes`` are renormalized by a softmax (the other outputs are ignored).

    ``done`` maps a block's start to its bits from an earlier run (that block is not
    fitted again); ``on_block(row)`` receives each newly coded block.

    Returns ``{"bits": total, "uniform_bits": len(y) · log2 K, "compression":
    uniform / total, "blocks": [{"start", "end", "bits"}, ...]}``.

    A model that always says "uniform" codes each label in one bit of K = 2::

        uniform = lambda xs, ys: (lambda x: torch.zeros(len(x), 2))
        online_code_length(uniform, x, y, 2, [10, 20, 40])["bits"]  # 40.0 for 40 labels
    """
    n, ends, done = len(y), [int(t) for t in blocks], dict(done or {})
    if len(x) != n:
        raise InputError(f"online_code_length: {len(x)} inputs but {n} labels")
    if not ends or ends[0] < 1 or ends[-1] != n or any(a >= b for a, b in zip(ends, ends[1:])):
        raise InputError(
            f"online_code_length: blocks must be increasing ends from >= 1 up to len(y)={n}, "
            f"got {list(blocks)}"
        )
    if not isinstance(num_classes, int) or num_classes < 2:
        raise InputError(
            f"online_code_length: num_classes must be an int >= 2, got {num_classes!r}"
        )
    if n and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise InputError(
            f"online_code_length: labels must lie in 0..{num_classes - 1}, got "
            f"{int(y.min())}..{int(y.max())}; pass the task's number of classes"
        )
    rows = []
    for start, end in zip([0, *ends], ends):
        if start in done:
            bits = float(done[start])
        elif start == 0:
            bits = end * math.log2(num_classes)
        else:
            predict = fit(x[:start], y[:start])
            bits = _bits(predict, x[start:end], y[start:end], num_classes, batch_size)
        row = {"start": start, "end": end, "bits": bits}
        if start not in done and on_block is not None:
            on_block(row)
        rows.append(row)
    total = sum(r["bits"] for r in rows)
    uniform = n * math.log2(num_classes)
    return {"bits": total, "uniform_bits": uniform,
            "compression": uniform / total if total > 0 else math.inf, "blocks": rows}  # fmt: skip


@torch.no_grad()
def _bits(predict, x, y, num_classes, batch_size) -> float:
    """Σ -log2 p(y | x) with p the softmax over the first ``num_classes`` scores."""
    total = 0.0
    for i in range(0, len(y), batch_size):
        scores = predict(x[i : i + batch_size])
        m = len(y[i : i + batch_size])
        if scores.dim() != 2 or scores.shape[0] != m or scores.shape[1] < num_classes:
            raise InputError(
                f"online_code_length: the fitted model gave scores of shape "
                f"{tuple(scores.shape)} for {m} inputs; expected ({m}, >= {num_classes})"
            )
        logp = torch.log_softmax(scores[:, :num_classes].double(), -1)
        total -= float(logp.gather(-1, y[i : i + batch_size, None]).sum()) / math.log(2)
    return total
