"""What the last position of a causal LM reads from one earlier position: its key and
value edges, ablated for the last query alone.

The prediction at the last position reads an earlier token ``t`` only through
attention: at each layer, each head's query at the last position scores ``t``'s key and
mixes in ``t``'s value by that score. Replacing ``t``'s key (or value) at one layer *for
the last query only* cuts exactly that edge; every other query still reads the real one,
so every other position is computed as before. (A hook on the key projection's output
would change what every later query reads, and so every later position.)

How: the prefix (all tokens but the last) runs once and keeps its keys and values (the
model's own cache); the last token then runs as a batch of variants, each row reading a
copy of the cache in which one layer's key or value at ``t`` is replaced. Only the last
query reads the cache, so the edge is cut for it alone; the variants of one sentence
share one forward pass of one token each. A replacement is given as the projection's
output at ``t`` (``k_proj`` / ``v_proj``, all key/value heads, before the rotary
embedding): a key is rotated at ``t``'s position as the model rotates its own, so a mean
over sentences (where ``t`` differs) is a mean of the keys' content, not of rotations.
A variant that replaces nothing gives the model's own next-token logits.

The source may be the last position itself (the subject just before the verb): its
key and value are then the last query's own, computed in the last token's run, so
there they are replaced at the projections' outputs of that run, row by row (the model
rotates the key as its own); no other query reads them.

Models: attention modules with ``k_proj`` and ``v_proj`` and a rotary embedding applied
by their module's ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2 and their kin).

For example::

    reads = LastQueryReads(model)
    states = reads.states(ids, t)                       # per layer, k and v at t
    logits = reads.logits(ids, t, [Variant(), Variant(5, "key", mean_key[5])])
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch

from ..errors import InputError

BRANCHES = ("key", "value")


@dataclass(frozen=True)
class Variant:
    """One row of :meth:`LastQueryReads.logits`: at ``layer``, the last query reads
    ``vector`` (the projection's output, ``(kv_heads * head_dim,)``) as the ``branch``
    ("key" or "value") of the source position; ``layer=None``: nothing replaced."""

    layer: int | None = None
    branch: str = "key"
    vector: torch.Tensor | None = None


class LastQueryReads:
    """The key and value edges from one position into the last query, for a causal LM
    (see the module's docstring)."""

    def __init__(self, model):
        self.model = model.eval()
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if layers is None or not all(_has_kv(layer) for layer in layers):
            raise InputError(
                f"{type(model).__name__}: the last query's key and value edges are read in "
                "decoder layers whose self_attn has k_proj and v_proj (Llama, Mistral, "
                "Qwen2); this model's layers are not such"
            )
        self.attention = [layer.self_attn for layer in layers]
        if any(hasattr(a, "k_norm") for a in self.attention):
            raise InputError(
                f"{type(model).__name__}: its keys are normalized after k_proj (k_norm), so "
                "k_proj's output is not the key read: this ablation does not cover it"
            )
        self.rotary = getattr(base, "rotary_emb", None)
        self.rotate = getattr(sys.modules[type(self.attention[0]).__module__],
                              "apply_rotary_pos_emb", None)  # fmt: skip
        if self.rotary is None or self.rotate is None:
            raise InputError(
                f"{type(model).__name__}: no rotary embedding (model.model.rotary_emb and "
                "apply_rotary_pos_emb) to rotate a replaced key as the model does"
            )
        params = inspect.signature(model.forward).parameters
        self.cache_name = "cache" if "cache" in params else "past_key_values"

    @property
    def layers(self) -> int:
        return len(self.attention)

    @torch.no_grad()
    def states(self, ids, source: int) -> dict:
        """``{"key": (layers, kv_dim), "value": (layers, kv_dim)}``: the projections'
        outputs at position ``source`` of the token ids ``ids`` (a 1-d sequence)."""
        ids = _checked(ids, source)
        got: dict = {b: [None] * self.layers for b in BRANCHES}

        def save(i, branch):
            def hook(_m, _a, out):
                got[branch][i] = out[0, source].detach().clone()

            return hook

        # the run :meth:`logits` keeps the cache of (all but the last token), so that a
        # position's own states are its cache's bit for bit; the last token: all of them
        end = max(source + 1, len(ids) - 1)
        with _hooks(self._projections(), save):
            self.model(input_ids=ids[None, :end], use_cache=False)
        return {b: torch.stack(got[b]) for b in BRANCHES}

    @torch.no_grad()
    def logits(self, ids, source: int, variants: list[Variant]) -> torch.Tensor:
        """The last position's logits, ``(len(variants), vocab)``, of the token ids ``ids``
        (1-d, at least two), one row per variant: its layer's key or value at ``source``
        replaced for the last query."""
        ids = _checked(ids, source)
        for v in variants:
            if v.layer is not None and not (0 <= v.layer < self.layers and v.branch in BRANCHES):
                raise InputError(f"{v}: layer in 0..{self.layers - 1}, branch one of {BRANCHES}")
        out = self.model(input_ids=ids[None, :-1], use_cache=True)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        cache.batch_repeat_interleave(len(variants))
        own: dict = {}  # (layer, branch) -> [(row, vector)]: the last position's own
        cos, sin = self._rotation(source, ids.device)
        for row, v in enumerate(variants):
            if v.layer is None:
                continue
            if source == len(ids) - 1:
                own.setdefault((v.layer, v.branch), []).append((row, v.vector))
                continue
            keys, values = _layer(cache, v.layer)
            heads, dim = keys.shape[1], keys.shape[-1]
            vec = v.vector.to(keys.dtype).view(1, heads, 1, dim)
            if v.branch == "key":
                vec = self.rotate(vec, vec, cos, sin)[1]
                keys[row, :, source] = vec[0, :, 0]
            else:
                values[row, :, source] = vec[0, :, 0]

        def swap(i, branch):
            rows = own.get((i, branch))
            if rows is None:
                return None

            def hook(_m, _a, out):
                out = out.clone()
                for row, vec in rows:
                    out[row, -1] = vec.to(out.dtype)
                return out

            return hook

        last = ids[-1:].expand(len(variants), 1)
        with _hooks(self._projections(), swap):
            out = self.model(input_ids=last, use_cache=True, **{self.cache_name: cache})
        return out.logits[:, -1]

    def _projections(self):
        """``(layer, branch, module)``: every layer's key and value projection."""
        for i, attn in enumerate(self.attention):
            yield i, "key", attn.k_proj
            yield i, "value", attn.v_proj

    def _rotation(self, position: int, device):
        """``(cos, sin)`` of the rotary embedding at one position, as the model makes it."""
        dtype = next(self.model.parameters()).dtype
        probe = torch.zeros(1, 1, 1, dtype=dtype, device=device)
        return self.rotary(probe, torch.tensor([[position]], device=device))


def _checked(ids, source: int) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or len(ids) < 2 or not 0 <= source < len(ids):
        raise InputError(
            f"ids of shape {tuple(ids.shape)}, source {source}: give one sequence of at least "
            "two token ids (the last one the query) and a source position in it"
        )
    return ids


@contextlib.contextmanager
def _hooks(projections, make):
    """Forward hooks ``make(layer, branch)`` (None: no hook there) on the projections,
    removed on leaving."""
    handles = []
    try:
        for i, branch, proj in projections:
            hook = make(i, branch)
            if hook is not None:
                handles.append(proj.register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


def _has_kv(layer) -> bool:
    attn = getattr(layer, "self_attn", None)
    return attn is not None and hasattr(attn, "k_proj") and hasattr(attn, "v_proj")


def _layer(cache, i: int):
    """``(keys, values)`` of layer ``i`` of a transformers cache, ``(batch, kv_heads,
    positions, head_dim)``: the tensors themselves (written in place)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]  # transformers before 4.56
