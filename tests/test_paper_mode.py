"""Paper mode equals the paper's library, brunoflow, at every node (issue 30).

The reference (``tests/data/brunoflow_reference.json``, made by
``tests/brunoflow_reference.py`` with brunoflow itself on the weights in
``tests/data/brunoflow_reference.safetensors``) holds, for every module input and output
of a 1-layer BERT classifier (the §5.1 model's shape) and a 2-layer BERT masked LM,
brunoflow's max-product values (both signs), its entropy and its gradient. Both sides
compute in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import semiring_backprop as sbp

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "brunoflow_reference.json").read_text())
SEMIRINGS = [sbp.MaxProduct("tensor"), sbp.Entropy(), sbp.Real()]
#: brunoflow's nodes without a counterpart: the position and token type embeddings depend
#: on no input (no path starts there), and attention's dropout module is not called by
#: Hugging Face's attention functions (brunoflow's records the attention probabilities)
UNSEEN = ("position_embeddings", "token_type_embeddings", "self.dropout:input")
CASES = [(name, i) for name, m in REFERENCE["models"].items() for i in range(len(m["examples"]))]


def _array(x) -> np.ndarray:
    def conv(v):
        if isinstance(v, list):
            return [conv(u) for u in v]
        return np.nan if v is None else float(v)

    return np.array(conv(x), dtype=np.float64)


def _model(name: str):
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    config = BertConfig(**REFERENCE["models"][name]["config"])
    cls = BertForSequenceClassification if name == "classifier" else BertForMaskedLM
    model = cls(config).eval()
    weights = load_file(str(DATA / "brunoflow_reference.safetensors"))
    state = {k.removeprefix(name + "."): v for k, v in weights.items() if k.startswith(name)}
    _, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    return model


def _explain(name: str, i: int, paper: bool = True):
    example = REFERENCE["models"][name]["examples"][i]
    ids = torch.tensor([example["input_ids"]])
    t = example["target"]
    pick = (lambda y: y.logits[0, t]) if isinstance(t, int) else (lambda y: y.logits[0, t[0], t[1]])
    model = _model(name)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(logits, _array(example["logits"]), rtol=1e-4, atol=1e-5)
    res = sbp.backprop(model, kwargs={"input_ids": ids}, output=pick, semirings=SEMIRINGS,
                       paper=paper)  # fmt: skip
    return example, res


def _ours(res, path: str) -> dict:
    top, ent, grad = (res.at(path, sr) for sr in SEMIRINGS)
    fields = {"hi": top.hi, "lo": top.lo, "z": ent.log_z.exp(), "entropy": ent.entropy}
    return {k: v.detach().double().numpy() for k, v in {**fields, "grad": grad}.items()}


def _close(ours, ref, scale) -> np.ndarray:
    """Within float32 agreement: 1e-4 relative, or 1e-5 of the node's largest value
    (the forward values differ in their last bits, and a local derivative near its root,
    GELU's at x ≈ -0.75, keeps only their absolute precision)."""
    return (ours == ref) | (np.abs(ours - ref) <= 1e-4 * np.abs(ref) + 1e-5 * scale)


@pytest.mark.parametrize("name,i", CASES)
def test_paper_mode_is_brunoflow_at_every_node(name, i):
    example, res = _explain(name, i)
    checked = 0
    for path, node in example["nodes"].items():
        if "same_as" in node:
            continue
        if path.endswith(UNSEEN):
            continue
        ours = _ours(res, path)
        ref = {f: _array(node[f]) for f in ("hi", "lo", "grad", "entropy")}
        ref["z"] = np.exp(_array(node["log_z"]))
        for f in ("hi", "lo", "grad", "z"):
            got = ours[f].reshape(ref[f].shape)
            ok = _close(got, ref[f], np.abs(ref[f]).max())
            assert ok.all(), (path, f, got[~ok][:5], ref[f][~ok][:5])
        # the entropy, where both have a path of nonzero weight (brunoflow: 0/0 elsewhere)
        both = (ref["z"] > 0) & (ours["z"].reshape(ref["z"].shape) > 0)
        got = ours["entropy"].reshape(ref["entropy"].shape)[both]
        np.testing.assert_allclose(got, ref["entropy"][both], rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked >= 15


def test_the_default_is_not_brunoflow():
    """Without paper mode the attention input's values differ (decompositions and
    selections): the reference can tell the two apart."""
    example, res = _explain("classifier", 0, paper=False)
    path = "bert.embeddings.LayerNorm"  # (the attention input)
    ref = _array(example["nodes"][path]["hi"])
    got = _ours(res, path)["hi"].reshape(ref.shape)
    assert not _close(got, ref, np.abs(ref).max()).all()


def test_paper_aggregate_is_winner_take_all():
    """aggregate="paper": per token, the best hidden unit's value (brunoflow's) goes to
    the branch that wins that unit, and every other branch has 0."""
    example, res = _explain("classifier", 0)
    where = "bert.encoder.layer.0.attention:input"
    sr = SEMIRINGS[0]
    paper = res.branches(where, sr, aggregate="paper")
    oplus = res.branches(where, sr, aggregate="oplus")
    best = _array(example["nodes"]["bert.embeddings.LayerNorm"]["hi"])[0].max(-1)
    for t, rows in paper.groupby("token"):
        assert (rows["value"] != 0).sum() <= 1
        assert rows["value"].sum() == pytest.approx(best[t], rel=1e-4, abs=1e-6)
        won = rows.loc[rows["winner"], "role"].tolist()
        assert won == oplus.loc[(oplus["token"] == t) & oplus["winner"], "role"].tolist()
    with pytest.raises(sbp.InputError, match="selective"):
        res.branches(where, SEMIRINGS[1], aggregate="paper")
