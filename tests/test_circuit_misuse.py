"""Misuse of circuits, patching and the faithfulness metrics is answered by the
package's own errors, saying what was wrong and what to do, before any table is made:
never a traceback from torch or pandas, and never NaN passed off as a result."""

from __future__ import annotations

import functools

import pandas as pd
import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.analysis import faithfulness as F
from semiring_backprop.analysis.patching import Patching
from semiring_backprop.errors import InputError, NonFiniteError

T = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 2, 3, 4, 5]])


@functools.cache
def gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                       bos_token_id=0, eos_token_id=0)  # fmt: skip
    return T.GPT2LMHeadModel(cfg).eval()


def margin(o):
    return o.logits[0, -1, 3] - o.logits[0, -1, 4]


def _circuit(**kw):
    args = {"kwargs": {"input_ids": IDS}, "output": margin, **kw}
    return sbp.circuit(gpt2(), **args)


@pytest.mark.parametrize(
    "baseline, error, said",
    [
        ([1, 2], InputError, "not list"),
        ("x", InputError, "not str"),
        ({}, InputError, "not an empty dict"),
        ({"transformer.wte": torch.zeros(1, 3, 16)}, InputError, "has shape (1, 3, 16)"),
        ({"transformer.wte": "zeros"}, InputError, "is a str"),
        ({"transformer.wte": torch.full((1, 5, 16), float("nan"))}, NonFiniteError, "NaN"),
        ({"transformer.wte": torch.full((1, 5, 16), float("inf"))}, NonFiniteError, "inf"),
    ],
)
def test_a_baseline_that_is_not_one_is_refused(baseline, error, said):
    with pytest.raises(error, match=said.replace("(", r"\(").replace(")", r"\)")):
        _circuit(baseline=baseline)


def test_an_inputs_embeds_baseline_with_nan_is_refused():
    model = gpt2()
    emb = model.get_input_embeddings()(IDS).detach()
    bad = emb.clone()
    bad[0, 2, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"baseline\['inputs_embeds'\] holds NaN"):
        sbp.circuit(model, kwargs={"inputs_embeds": emb}, output=margin,
                    baseline={"inputs_embeds": bad})  # fmt: skip


def test_a_circuit_of_a_hugging_face_model_needs_output():
    with pytest.raises(InputError, match="pass output="):
        sbp.circuit(gpt2(), kwargs={"input_ids": IDS})


@functools.cache
def _embeds_result():
    model = gpt2()
    emb = model.get_input_embeddings()(IDS).detach()
    return emb, sbp.backprop(model, kwargs={"inputs_embeds": emb}, output=margin,
                             semirings=[sbp.Real()])  # fmt: skip


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_patching_refuses_a_corrupted_input_that_is_not_finite(value):
    emb, res = _embeds_result()
    bad = emb.clone()
    bad[0, 1, 0] = value
    with pytest.raises(NonFiniteError, match="corrupted: input 'inputs_embeds'"):
        Patching(res, {"inputs_embeds": bad})


def test_patching_refuses_a_corrupted_input_without_tensors():
    _, res = _embeds_result()
    with pytest.raises(InputError, match="holds no tensor"):
        Patching(res, [1, 2])


@pytest.fixture(scope="module")
def a_curve():
    return F.curve(pd.Series([3.0, 1.0, 2.0, 0.5]), lambda kept: len(kept) / 4,
                   fractions=(0.25, 0.5, 1.0))  # fmt: skip


@pytest.mark.parametrize("fractions", ["0.5", 0.5, ["a", 0.5], None])
def test_curve_fractions_must_be_numbers(fractions):
    with pytest.raises(InputError, match="fractions="):
        F.curve(pd.Series([1.0, 2.0]), len, fractions=fractions)


@pytest.mark.parametrize("metric", [F.cpr, F.cmd, F.edges_needed])
@pytest.mark.parametrize("drop", ["f", "fraction", "n_edges"])
def test_metrics_name_the_column_a_curve_lacks(a_curve, metric, drop):
    needs = {F.cpr: ("fraction", "f"), F.cmd: ("fraction", "f"), F.edges_needed: ("n_edges", "f")}
    frame = a_curve.drop(columns=drop)
    if drop not in needs[metric]:
        metric(frame)  # a column it does not read may be missing
        return
    with pytest.raises(InputError, match=rf"missing \['{drop}'\]"):
        metric(frame)


def test_metrics_refuse_what_is_not_a_curve():
    with pytest.raises(InputError, match="not a list"):
        F.cmd([0.1, 0.5])


def test_agreement_refuses_duplicate_keys():
    scores = pd.DataFrame({"edge": ["a", "a", "b"], "score": [1.0, 2.0, 3.0]})
    effects = pd.DataFrame({"edge": ["a", "b", "c"], "effect": [1.0, 2.0, 3.0]})
    with pytest.raises(InputError, match=r"2 rows of the scores share a key.*'edge': 'a'"):
        F.agreement(scores, effects)
    with pytest.raises(InputError, match="rows of the effects share a key"):
        F.agreement(effects.rename(columns={"effect": "score"}),
                    scores.rename(columns={"score": "effect"}))  # fmt: skip


# -- exports: files the user names, and text inside them ---------------------------------


@functools.cache
def _small_circuit():
    tokens = ['say "hi"', "a\\b", "x] [color=red"]
    return sbp.circuit(gpt2(), kwargs={"input_ids": IDS[:, :3]}, output=margin, tokens=tokens)


def test_dot_labels_hold_any_token_text():
    """Quotes and backslashes are escaped: no token ends a label or adds an attribute."""
    import re

    quoted = re.compile(r'"((?:[^"\\]|\\.)*)"')
    dot = _small_circuit().to_dot()
    for line in dot.splitlines():
        outside = quoted.sub('""', line)
        assert "color=red" not in outside and outside.count('"') % 2 == 0, line
    labels = [m.group(1) for m in quoted.finditer(dot) if "input@" in m.group(1)]
    shown = [bytes(t, "utf-8").decode("unicode_escape") for t in labels]
    assert any('say "hi"' in t for t in shown) and any("a\\b" in t for t in shown)


def test_export_files_that_cannot_be_written_are_said_so(tmp_path, monkeypatch):
    c = _small_circuit()
    with pytest.raises(InputError, match="is a directory"):
        c.to_eap_json(tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(InputError, match="cannot write"):
        c.to_eap_json(a_file / "inside.json")  # its directory is a file
    with pytest.raises(InputError, match="cannot write the graph"):
        c.to_neuronpedia(a_file)  # a file where the directory goes
    with pytest.raises(InputError, match="is a directory"):
        c.top_paths(1).to_json(tmp_path)

    def full(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", full)
    with pytest.raises(InputError, match="No space left on device"):
        c.to_eap_json(tmp_path / "c.json")
    with pytest.raises(InputError, match="No space left on device"):
        c.to_neuronpedia(tmp_path / "graphs")
    assert not (tmp_path / "c.json").exists()
