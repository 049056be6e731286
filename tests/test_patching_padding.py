"""Patching of an input whose attention mask pads positions: its edges are the rows of
``Circuit.edges`` (as documented: the same rows, in their order), and no site, edge or
faithfulness curve counts a padded position (padding carries nothing to explain)."""

from __future__ import annotations

import functools

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.analysis import faithfulness as F
from semiring_backprop.analysis.patching import EDGE_KEY, Patching

T = pytest.importorskip("transformers")

IDS = torch.tensor([[0, 0, 1, 2, 3, 4]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1]])  # two positions of left padding
BAD = torch.tensor([[0, 0, 1, 7, 3, 4]])
PAD = {0, 1}


@functools.cache
def gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                       bos_token_id=0, eos_token_id=0)  # fmt: skip
    return T.GPT2LMHeadModel(cfg).eval()


def margin(o):
    return o.logits[0, -1, 3] - o.logits[0, -1, 4]


@functools.cache
def made():
    kwargs = {"input_ids": IDS, "attention_mask": MASK}
    c = sbp.circuit(gpt2(), kwargs=kwargs, output=margin, baseline={"input_ids": BAD})
    return c, Patching(c.result, {"input_ids": BAD})


def test_the_edges_are_the_circuits_rows():
    c, p = made()
    assert p.padding == PAD
    edges = p.edges()
    assert edges.equals(c.edges[list(EDGE_KEY)].reset_index(drop=True))
    assert not edges["position"].isin(PAD).any()
    # and the unpadded input has more: the padded positions' edges were there to drop
    whole = Patching(sbp.backprop(gpt2(), kwargs={"input_ids": IDS}, output=margin,
                                  semirings=[sbp.MaxProduct()]), {"input_ids": BAD})  # fmt: skip
    assert whole.padding == frozenset()
    assert whole.edges()["position"].isin(PAD).any()


def test_no_site_at_a_padded_position():
    c, p = made()
    effects = p.node_effects()
    assert len(effects) and not effects["position"].isin(PAD).any()
    sites = c.nodes[c.nodes.role.isin(["embedding", "head", "mlp"])]
    key = ["layer", "position", "head_index", "role"]
    assert set(map(tuple, effects[key].astype(object).values.tolist())) == set(
        map(tuple, sites[key].astype(object).values.tolist())
    )


def test_the_curve_counts_the_real_edges_only():
    c, p = made()
    scores = c.edges[list(EDGE_KEY)].assign(score=c.edges["Real"].to_numpy())
    curve = F.curve(scores, p.faithfulness, fractions=(0.5, 1.0))
    assert int(curve["n_edges"].iloc[-1]) == len(p.edges())
    assert curve["f"].iloc[-1] == pytest.approx(1.0)  # every real edge kept: the model
