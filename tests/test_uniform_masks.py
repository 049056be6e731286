"""Masks that hold everywhere or nowhere skip their ``where``: the same bits.

On the CPU, ``where`` and ``masked_fill`` whose mask is uniform (the attention mask of
an unpadded input, ``_safe_softmax``'s fully masked rows, which none are) pass the value
and D on, or give the zero, instead of selecting element by element
(``rules.routing.uniform``). The oracle is the general path itself, forced by making
every mask look mixed: every semiring's values at every node, the top paths and the
forward values are equal bit for bit, on BERT (with and without padding) and GPT-2.
The path enumeration of ``tests/test_oracle.py`` (case ``uniform_masks``) checks the
values against the gradient graph's paths.
"""

from __future__ import annotations

import pytest
import torch

import oracles
import semiring_backprop as sbp
from semiring_backprop.rules import routing

pytest.importorskip("transformers")

SEMIRINGS = oracles.all_semirings()


def _mixed(cond):
    return None


def _everything(bp, kwargs):
    """Every node's value under every semiring (the pass with ``keep=None`` computes
    them from its checkpoints when asked: all are asked here), and the top paths."""
    res = bp(kwargs=kwargs)
    got = {}
    for node in bp.graph(kwargs=kwargs).nodes:
        for sr in SEMIRINGS:
            try:
                v = res.value(node, sr)
            except sbp.InputError:  # no path through this node
                continue
            got[node.name, sr.name] = [f.clone() for f in (v if isinstance(v, tuple) else (v,))]
    for sign in "+-":
        p = res.top_path("inputs_embeds", sign=sign)
        got["path", sign] = (p.value, [str(s) for s in p])
    return got


@pytest.mark.parametrize(("name", "padded"), [("bert", False), ("bert", True), ("gpt2", False)])
def test_a_uniform_mask_gives_the_bits_of_the_general_path(monkeypatch, name, padded):
    from test_branches import HF_SPECS

    spec = HF_SPECS[name]
    torch.manual_seed(5)
    model = spec.build().double().eval()
    ids = torch.randint(1, 20, (1, 7))
    kwargs = {"inputs_embeds": model.get_input_embeddings()(ids).detach()}
    if padded:  # the last two positions are padding: the mask is mixed there
        kwargs["attention_mask"] = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    seen = []
    real_uniform = routing.uniform

    def counted(cond):
        got = real_uniform(cond)
        seen.append(got)
        return got

    bp = sbp.Backprop(model, spec.output, SEMIRINGS, keep=None, dynamic=False,
                      cuda_graphs=False)  # fmt: skip
    monkeypatch.setattr(routing, "uniform", counted)
    fast = _everything(bp, kwargs)
    assert any(s is not None for s in seen), "no uniform mask met: nothing was compared"
    monkeypatch.setattr(routing, "uniform", _mixed)
    slow = _everything(bp, kwargs)
    assert fast.keys() == slow.keys() and len(fast) > 100
    for key, a in fast.items():
        b = slow[key]
        if key[0] == "path":
            assert a == b, key
            continue
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y) or torch.equal(x.nan_to_num(), y.nan_to_num()), key
