"""Exact node patching (``Patching.node_effects``: each site's forward from its node on,
the clean run's values before it, the sites of one node batched, the unembedding's rows
the output reads alone) against one whole forward of the model per site, written here
with forward hooks; float64, tiny random Llamas (heads of their own and grouped-query).

Oracle: a site's effect is m(clean) - m(the model with that site's value at that position
from the corrupted run): the token embedding (``embed_tokens``' output), a head's columns
of ``o_proj``'s input, an MLP's output, each put in place by a hook.
"""

from __future__ import annotations

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.ablation import Patching

T = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")

F64 = torch.float64
IDS = torch.tensor([[0, 3, 4, 5, 3, 4, 5]])
COR = torch.tensor([[0, 7, 4, 8, 6, 4, 9]])
HIDDEN, HEADS = 8, 2


def _llama(kv):
    torch.manual_seed(1)
    cfg = T.LlamaConfig(vocab_size=12, hidden_size=HIDDEN, intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=HEADS,
                        num_key_value_heads=kv, max_position_embeddings=16,
                        initializer_range=0.5, attn_implementation="sdpa")  # fmt: skip
    return T.LlamaForCausalLM(cfg).to(F64).eval()


def last_margin(out):  # reads the last position alone: the unembedding's one row
    return out.logits[0, -1, 5] - out.logits[0, -1, 6]


def spread(out):  # reads three positions
    return out.logits[0, -1, 5] - out.logits[0, 2, 6] + out.logits[0, 4, 1].sin()


def every(out):  # reads every position: the whole unembedding
    return (out.logits[0, :, 5] * torch.arange(1.0, 8.0, dtype=F64)).sum()


ROWS = {last_margin: [6], spread: [2, 4, 6], every: None}


def _where(model):
    """``{(role, layer): (module, reads its input)}`` of every site."""
    layers = model.model.layers
    out = {("embedding", -1): (model.model.embed_tokens, False)}
    for i, layer in enumerate(layers):
        out[("head", i)] = (layer.self_attn.o_proj, True)
        out[("mlp", i)] = (layer.mlp, False)
    return out


def _hooked_effects(model, metric) -> dict:
    """``{(layer, position, head, role): effect}``: one whole forward per site."""
    where = _where(model)
    saved = {}

    def keep(key, pre):
        def hook(mod, args, output=None):
            saved[key] = (args[0] if pre else output).detach().clone()

        return hook

    handles = [m.register_forward_pre_hook(keep(k, True)) if pre
               else m.register_forward_hook(keep(k, False))
               for k, (m, pre) in where.items()]  # fmt: skip
    with torch.no_grad():
        model(input_ids=COR)
    for h in handles:
        h.remove()

    def run(key=None, position=None, cols=slice(None)):
        handle = None
        if key is not None:
            mod, pre = where[key]

            def put(mod, args, output=None):
                x = (args[0] if pre else output).clone()
                x[:, position, cols] = saved[key][:, position, cols]
                return (x, *args[1:]) if pre else x

            handle = (mod.register_forward_pre_hook(put) if pre
                      else mod.register_forward_hook(put))  # fmt: skip
        try:
            with torch.no_grad():
                return float(metric(model(input_ids=IDS)))
        finally:
            if handle is not None:
                handle.remove()

    clean, d = run(), HIDDEN // HEADS
    out = {}
    for role, layer in where:
        heads = range(HEADS) if role == "head" else [None]
        for h in heads:
            cols = slice(None) if h is None else slice(h * d, (h + 1) * d)
            for q in range(IDS.shape[1]):
                out[(layer, q, h, role)] = clean - run((role, layer), q, cols)
    return out


@pytest.mark.parametrize("kv", [HEADS, 1], ids=["own-heads", "grouped-query"])
@pytest.mark.parametrize("metric", list(ROWS), ids=["last-row", "rows", "every-row"])
def test_node_effects_are_one_hooked_forward_per_site(kv, metric):
    model = _llama(kv)
    res = sbp.backprop(model, kwargs={"input_ids": IDS}, output=metric, semirings=[sbp.Real()])
    p = Patching(res, {"input_ids": COR}, batch=4)  # batches of 4: some partly full
    want = _hooked_effects(model, metric)
    got = p.node_effects()
    assert len(got) == len(want) == (1 + 2 * (HEADS + 1)) * IDS.shape[1]
    for row in got.itertuples():
        head = None if pd.isna(row.head_index) else int(row.head_index)
        key = (int(row.layer), int(row.position), head, row.role)
        assert row.effect == pytest.approx(want[key], abs=1e-6), key
    assert max(abs(v) for v in want.values()) > 1e-2  # sites that do something
    tail = p.remainder(p.lay.components[0].nodes).tail  # the embedding's: the whole forward
    assert (None if tail is None else tail.rows.tolist()) == ROWS[metric]
