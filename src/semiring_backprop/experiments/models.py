"""An attention-only transformer (no MLPs) and its training on the induction task.

Signatures::

    class AttentionOnly(nn.Module)
        forward(input_ids) -> logits                 # (batch, positions, vocab_size)
        patterns(input_ids) -> list[Tensor]          # per layer, (batch, heads, t, t)
    def attention_only(vocab_size, hidden=32, heads=4, layers=2, length=17, seed=0)
        -> AttentionOnly
    def train_induction(model, data, *, steps=3000, lr=3e-3, batch_size=64, seed=0,
                        weight_decay=0.01, progress=False) -> (model, history)
    def next_token_accuracy(model, split) -> float  # over the predictable positions

The modules are named as Llama names them (``layers.0.input_layernorm``,
``layers.0.self_attn.q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, ``norm``,
``lm_head``), and each attention module carries ``num_heads`` and ``head_dim``, so the
library finds the blocks, their query / key / value branches and the heads without
``roles=`` or ``heads=``. Each block is ``x + o_proj(attention(input_layernorm(x)))``:
the two-layer attention-only models of the interpretability literature.

Examples:
    >>> from semiring_backprop.data.induction import induction
    >>> data = induction(2000, half=8, vocab_size=24, seed=0)
    >>> model = attention_only(24, length=data.length, seed=0)
    >>> model, history = train_induction(model, data, steps=20)
    >>> model(data.test.x[:2]).shape
    torch.Size([2, 17, 24])
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._threads import TRAIN, threads
from ..errors import InputError

#: the ignored target (``torch.nn.functional.cross_entropy``'s ``ignore_index``)
IGNORE = -100


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with separate query, key, value and output
    projections."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise InputError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.num_heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(hidden, hidden) for _ in range(4)
        )

    def forward(self, x, patterns=None):
        b, t, h = x.shape

        def split(y):
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        a = scores.masked_fill(future, -math.inf).softmax(-1)
        if patterns is not None:
            patterns.append(a.detach())
        return self.o_proj((a @ v).transpose(1, 2).reshape(b, t, h))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = SelfAttention(hidden, heads)

    def forward(self, x, patterns=None):
        return x + self.self_attn(self.input_layernorm(x), patterns)


class AttentionOnly(nn.Module):
    """Token and learned position embeddings, ``layers`` pre-LayerNorm blocks of causal
    attention (no MLP), a final LayerNorm and an unembedding."""

    def __init__(self, vocab_size: int, hidden: int, heads: int, layers: int, length: int):
        super().__init__()
        self.length = length
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.embed_positions = nn.Embedding(length, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size)

    def forward(self, input_ids):
        return self._run(input_ids)

    def _run(self, input_ids, patterns=None):
        t = input_ids.shape[-1]
        positions = torch.arange(t, device=input_ids.device)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x, patterns)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def patterns(self, input_ids) -> list[torch.Tensor]:
        """The attention probabilities of every layer, each (batch, heads, query, key)."""
        out: list = []
        self._run(input_ids, out)
        return out


def attention_only(vocab_size: int, hidden: int = 32, heads: int = 4, layers: int = 2,
                   length: int = 17, seed: int = 0) -> AttentionOnly:  # fmt: skip
    """A fresh :class:`AttentionOnly` with weights drawn from ``seed``; ``length``: the
    number of positions it embeds (the induction data's ``length``)."""
    torch.manual_seed(seed)
    return AttentionOnly(vocab_size, hidden, heads, layers, length)


@torch.no_grad()
def next_token_accuracy(model, split, batch_size: int = 1024) -> float:
    """The share of the predictable next tokens (targets other than ``IGNORE``) that the
    model's argmax gets right."""
    was = model.training
    model.eval()
    right = total = 0
    for i in range(0, len(split), batch_size):
        x, y = split.x[i : i + batch_size], split.y[i : i + batch_size]
        keep = y != IGNORE
        right += int((model(x).argmax(-1)[keep] == y[keep]).sum())
        total += int(keep.sum())
    model.train(was)
    return right / max(total, 1)


@threads(TRAIN)
def train_induction(model, data, *, steps: int = 3000, lr: float = 3e-3, batch_size: int = 64,
                    seed: int = 0, weight_decay: float = 0.01, eval_every: int = 250,
                    stop_at: float | None = None, progress: bool = False):  # fmt: skip
    """AdamW on the cross-entropy of the predictable next tokens (``data.train.y`` other
    than ``IGNORE``), ``steps`` batches drawn in an order fixed by ``seed``, with a linear
    warm-up over the first 5 % of the steps and a cosine decay after it. Returns the model
    (in eval mode) and the history: one dict per ``eval_every`` steps, the mean training
    loss since the last one and the validation accuracy (``next_token_accuracy``); stops
    early once that reaches ``stop_at``.

    Trains on one thread whatever the caller's setting (as ``experiments.common.train``),
    so that one seed gives the same weights on every machine."""
    from tqdm.auto import tqdm

    if steps < 1 or batch_size < 1:
        raise InputError(f"train_induction: steps and batch_size must be >= 1, got "
                         f"{steps} and {batch_size}")  # fmt: skip
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    warm = max(steps // 20, 1)

    def rate(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(steps - warm, 1)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    gen = torch.Generator().manual_seed(seed)
    x, y = data.train.x, data.train.y
    history, total, count = [], 0.0, 0
    model.train()
    for step in tqdm(range(steps), disable=not progress, leave=False, desc="induction"):
        rows = torch.randint(len(x), (batch_size,), generator=gen)
        logits = model(x[rows])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y[rows].flatten(),
                                           ignore_index=IGNORE)  # fmt: skip
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        total, count = total + loss.item(), count + 1
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            row = {"step": step + 1, "loss": total / count,
                   "val_accuracy": next_token_accuracy(model, data.val)}  # fmt: skip
            history.append(row)
            total, count = 0.0, 0
            model.train()
            if stop_at is not None and row["val_accuracy"] >= stop_at:
                break
    model.eval()
    return model, history
