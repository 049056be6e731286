"""``experiment sva`` and ``experiment entropy`` on a causal LM, end to end on a tiny
random Llama with a word-level tokenizer built here (a few pairs).

Oracles: the model's own forward (each pair's margin at the last position of the
prefix), the ablation module called directly (its records), scipy's Spearman on the
written CSV, and a rerun that computes nothing again."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("pandas")
pytest.importorskip("scipy")

from semiring_backprop import experiments  # noqa: E402
from semiring_backprop.ablation.reads import LastQueryReads, Variant  # noqa: E402
from semiring_backprop.data import read_blimp  # noqa: E402
from semiring_backprop.data.agreement_pairs import agreement_pairs  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402
from semiring_backprop.experiments import sva, sva_causal  # noqa: E402
from semiring_backprop.experiments.causal_inputs import (  # noqa: E402
    prefix_inputs,
    random_causal_lm,
)

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

PAIRS = 6
CONFIG = sva.Config(synthetic=PAIRS, aggregation=("oplus",), paper=False, threads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, _offline_quiet):
    words = set()
    for line in agreement_pairs(300, seed=0) + agreement_pairs(40, seed=0, words=(6, 30)):
        words.update(line["sentence_good"].split() + line["sentence_bad"].split())
    return random_causal_lm(tmp_path_factory.mktemp("llama") / "m", sorted(words), hidden=16,
                            layers=2, heads=2, kv_heads=1, intermediate=32)  # fmt: skip


@pytest.fixture(scope="module")
def causal_run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sva-causal")
    return out, sva.run(out, replace(CONFIG, model=model_dir), progress=False)


def _margin(model, tok, ids, good, bad) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    return float(logits[good] - logits[bad])


def test_causal_sva_is_chosen_by_the_model_and_writes_its_files(causal_run, model_dir):
    out, result = causal_run
    assert sva_causal.is_causal(model_dir)
    names = {p.rsplit("/", 1)[-1] for p in result["files"]}
    assert names == {"branches.csv", "entropy.csv", "ablation.csv", "summary.json",
                     "branches.png", "attractors.png", "ablation.png"}  # fmt: skip
    s = result["summary"]
    assert s["model_kind"] == "causal" and s["explained"] == PAIRS and s["skipped"] == 0
    assert set(s["branches"]) == {"subject", "attractor", "all"}
    assert sorted(s["branches"]["subject"]) == ["0.attention", "0.mlp", "1.attention", "1.mlp"]
    assert set(s["top_branch"]["subject"].values()) <= {"skip", "query", "key", "value"}
    assert "multi_token_verbs" not in s and "paper" not in s


def test_scores_and_accuracy_are_the_models_own_margins(causal_run, model_dir):
    out, result = causal_run
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    data = read_blimp(out / "synthetic.jsonl")
    examples = pd.read_csv(out / "entropy.csv")
    by_count: dict = {}
    for ex, score in zip(data, examples["score"]):
        got = prefix_inputs(ex, tok, None)
        assert tok.convert_ids_to_tokens(got["ids"])[0] == "<s>"
        assert got["groups"]["subject"] == [ex.subject + 1]  # one token per word, after <s>
        m = _margin(model, tok, got["ids"], got["good"], got["bad"])
        assert score == pytest.approx(m, abs=1e-5)
        by_count.setdefault(ex.attractors, []).append(m > 0)
    acc = result["summary"]["accuracy"]["by_attractors"]
    assert {int(k): v["correct"] for k, v in acc.items()} == {
        k: sum(v) for k, v in by_count.items()
    }


def test_ablation_rows_are_the_reads_themselves(causal_run, model_dir):
    out, result = causal_run
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(x) for x in (out / "ablation.jsonl").read_text().splitlines()]
    assert len(rows) == PAIRS and result["summary"]["ablation"]["patched"] == PAIRS
    reads = LastQueryReads(model)
    data = read_blimp(out / "synthetic.jsonl")
    inputs = [prefix_inputs(ex, tok, None) for ex in data]
    mean_key = torch.stack([reads.states(p["ids"], p["source"])["key"] for p in inputs]).mean(0)
    from semiring_backprop.data.agreement_pairs import counterpart

    for ex, p, row in zip(data, inputs, rows):
        assert row["clean"] == pytest.approx(_margin(model, tok, p["ids"], p["good"], p["bad"]),
                                             abs=1e-5)  # fmt: skip
        twin = prefix_inputs(counterpart(ex), tok, None)
        other = reads.states(twin["ids"], p["source"])["value"][1]
        logits = reads.logits(
            p["ids"], p["source"], [Variant(1, "value", other), Variant(0, "key", mean_key[0])]
        )
        margins = (logits[:, p["good"]] - logits[:, p["bad"]]).tolist()
        assert row["patch_value"][1] == pytest.approx(margins[0], abs=1e-5)
        assert row["mean_key"][0] == pytest.approx(margins[1], abs=1e-5)
    table = pd.read_csv(out / "ablation.csv")
    assert len(table) == 2 * 2 * 2  # methods x branches x layers
    one = table[(table.method == "patch") & (table.branch == "value") & (table.layer == 1)].iloc[0]
    want = sum(r["patch_value"][1] - r["clean"] for r in rows) / PAIRS
    assert one["margin_change"] == pytest.approx(want, abs=1e-9)
    assert one["accuracy_ablated"] == pytest.approx(
        sum(r["patch_value"][1] > 0 for r in rows) / PAIRS
    )


def test_causal_sva_rerun_resumes_without_computing(causal_run, model_dir, monkeypatch):
    out, first = causal_run
    from semiring_backprop.runner import compute

    def refuse(*a, **k):
        raise AssertionError("computed again")

    monkeypatch.setattr(compute.Explainer, "__call__", refuse)
    monkeypatch.setattr(LastQueryReads, "logits", refuse)
    again = sva.run(out, replace(CONFIG, model=model_dir), progress=False)
    assert again["summary"] == first["summary"]
    with pytest.raises(InputError, match="granularity"):
        sva.run(out, replace(CONFIG, model=model_dir, granularity="tensor"), progress=False)


def test_causal_sva_paper_pass_and_no_ablation(model_dir, tmp_path):
    cfg = replace(CONFIG, model=model_dir, synthetic=2, paper=True, ablation=False)
    s = sva.run(tmp_path, cfg, progress=False)["summary"]
    assert s["paper"]["explained"] == 2 and "ablation" not in s
    assert (tmp_path / "branches_paper.csv").exists() and not (tmp_path / "ablation.csv").exists()


def test_entropy_experiment_on_the_cli(model_dir, tmp_path, capsys):
    from scipy.stats import spearmanr

    from semiring_backprop import cli

    out = tmp_path / "ent"
    argv = ["experiment", "entropy", "--model", model_dir, "--out", str(out), "--set",
            "synthetic=16", "words=6,30", "length_bins=5,15,40", "threads=1"]  # fmt: skip
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    frame = pd.read_csv(out / "entropy.csv")
    assert summary["explained"] == len(frame) == 16 and summary["model_kind"] == "causal"
    assert sorted(frame["attractors"].unique()) == [1, 2, 3, 4]
    rho = spearmanr(frame["tokens"], frame["entropy"]).statistic
    assert summary["length"]["spearman_rho"] == pytest.approx(rho)
    part = frame[(frame.tokens >= 15) & (frame.tokens < 40)]
    rho = spearmanr(part["attractors"], part["entropy"]).statistic
    assert summary["attractors"]["15-40"]["spearman_rho"] == pytest.approx(rho)
    assert {"length.png", "attractors.png"} <= {p.name for p in out.iterdir()}
    capsys.readouterr()
    assert cli.main([*argv[:6], "--set", f"model={tmp_path}"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_entropy_experiment_refuses_bad_settings(tmp_path):
    with pytest.raises(InputError, match="words"):
        experiments.run("entropy", tmp_path, words=(10, 5), progress=False)
    with pytest.raises(InputError, match="attractors"):
        experiments.run("entropy", tmp_path, attractors=(5,), progress=False)


def test_the_docs_tables_are_the_runs_numbers(causal_run, capsys):
    """docs/paper_tables.py prints the run's files: the accuracy rows of the summary, a
    branch cell of branches.csv, each ablation cell of ablation.csv."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "paper_tables.py"
    spec = importlib.util.spec_from_file_location("paper_tables", path)
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    out, result = causal_run
    tables.main([str(out)])
    printed = capsys.readouterr().out
    acc = result["summary"]["accuracy"]["all"]
    assert f"| all | {acc['pairs']} | {acc['correct']} | {acc['accuracy']:.3f} |" in printed
    b = pd.read_csv(out / "branches.csv")
    cell = b[(b.semiring == "MaxProduct(neuron)") & (b.aggregation == "oplus")
             & (b.sublayer == "attention") & (b.token_group == "subject") & (b.layer == 1)
             & (b.branch == "key")]["value"]  # fmt: skip
    assert len(cell) == 1
    row = next(line for line in printed.split("## Branches at the attention input, subject")[1]
               .splitlines() if line.startswith("| 1 |"))  # fmt: skip
    assert row.split(" | ")[3] == f"{cell.iloc[0]:.3g}"  # layer, skip, query, key
    for r in pd.read_csv(out / "ablation.csv").itertuples():
        assert f"{r.margin_change:+.3f}" in printed
