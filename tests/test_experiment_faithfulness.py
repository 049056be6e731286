"""The faithfulness experiment (experiments/faithfulness.py), end to end on tiny models.

Oracles: the model's own forward (keeping every edge gives the clean output, ablating
every edge from the corrupted input gives the corrupted output), the records a first
run wrote (a rerun computes nothing again and reports the same), and the config's
refusals. The whole quick run (three benchmarks, through the CLI) is in the slow tier.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("transformers")
pytest.importorskip("scipy")

from semiring_backprop import experiments  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402
from semiring_backprop.experiments import faithfulness  # noqa: E402

TINY = {"benchmarks": ("first-token",), "pairs": 1, "ig_steps": (2,), "eap_ig_steps": 2,
        "fractions": (0.1, 0.5, 1.0)}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("faith")
    return out, experiments.run("faithfulness", out, quick=True, progress=False, **TINY)


def test_every_circuit_of_all_edges_is_the_model(tiny_run):
    out, result = tiny_run
    rec = json.loads((out / "first-token" / "seed0" / "pairs.jsonl").read_text().splitlines()[0])
    # m(M) and m(∅) against the model's own forward on the clean and corrupted inputs
    assert rec["clean"] == pytest.approx(rec["model_clean"], abs=1e-9)
    assert rec["empty"] == pytest.approx(rec["model_corrupted"], abs=1e-9)
    names = [m["method"] for m in rec["methods"]]
    assert names == ["Real", "Real-IG2", "Real-relevance", "MaxProduct", "EAP", "EAP-IG2",
                     "EAP-QK", "Real-relevance-QK", "patching", "random"]  # fmt: skip
    for m in rec["methods"]:
        fraction, n, metric = m["curve"][-1]
        assert (fraction, n) == (1.0, rec["edges"])
        assert metric == pytest.approx(rec["model_clean"], abs=1e-9), m["method"]
    curves = pd.read_csv(out / "model_curves.csv")
    assert curves[curves.fraction == 1.0].f.tolist() == pytest.approx([1.0] * len(names))
    # exact edge patching: one forward per edge, besides the clean and corrupted runs
    rows = {m["method"]: m for m in rec["methods"]}
    assert rows["patching"]["evaluations"] == rec["edges"] + 2
    assert rows["Real"]["evaluations"] is None  # a circuit's passes are not forwards
    assert rec["forward_seconds"] > 0 and rec["seconds"] > rows["Real"]["seconds"] > 0
    assert rows["Real-IG2"]["seconds"] > rows["Real"]["seconds"]  # it reuses Real's pass
    for m in rows.values():
        assert -1 <= m["nodes_pearson"] <= 1 and -1 <= m["edges_pearson"] <= 1, m["method"]
    assert rows["patching"]["nodes_pearson"] == pytest.approx(1.0)


def test_files_summary_and_resume(tiny_run, monkeypatch):
    out, result = tiny_run
    for name in ("curves", "methods", "branches", "model_curves", "model_areas"):
        assert (out / f"{name}.csv").is_file()
    s = result["summary"]
    entry = s["benchmarks"]["first-token"]
    assert set(entry["methods"]) == set(faithfulness.methods(faithfulness.Config(**{
        k: v for k, v in TINY.items() if k in ("ig_steps", "eap_ig_steps")})))  # fmt: skip
    assert 0 <= entry["methods"]["patching"]["cpr"]["mean"] <= 1
    branch = s["first_token"]["first-token"][0]
    assert branch["path"] and set(branch["path"]) <= set(faithfulness.BRANCHES)

    def boom(*a, **k):
        raise AssertionError("a rerun explains a pair again")

    monkeypatch.setattr(faithfulness, "explain_pair", boom)
    again = experiments.run("faithfulness", out, quick=True, progress=False, **TINY)
    assert again["summary"]["benchmarks"] == json.loads(json.dumps(s["benchmarks"]))


@pytest.mark.parametrize("edit, said", [
    (lambda r: r.pop("methods"), "without methods"),
    (lambda r: r.pop("clean"), "without clean"),
    (lambda r: r["methods"][0].pop("curve"), "methods without"),
])  # fmt: skip
def test_a_record_without_its_fields_is_refused_on_resume(tiny_run, tmp_path, edit, said):
    """Valid JSON, but not the record a run writes: named, never a traceback."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(tiny_run[0], out)
    (records,) = out.glob("first-token/seed*/pairs.jsonl")
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    edit(rows[0])
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=said):
        experiments.run("faithfulness", out, quick=True, progress=False, **TINY)


def test_induction_ranks_by_hand():
    """Ranks read off small frames whose order is written down here."""
    heads = {"previous_head": 1, "induction_head": 0}
    nodes = pd.DataFrame({"layer": [None, 0, 0, 0, 0, 1, 1], "position": [0, 0, 1, 0, 1, 0, 1],
                          "head_index": [None, 0, 0, 1, 1, 0, 0],
                          "role": ["embedding", "head", "head", "head", "head", "head", "head"],
                          "score": [9.0, 5.0, 0.5, 1.0, -2.5, -0.2, 4.0]})  # fmt: skip
    # heads summed: a0.h0 5.5, a1.h0 3.8, a0.h1 -1.5; sites: input@0, a0.h0@0, a1.h0@1, ...
    edge = {"src_layer": [0, None, 0], "src_role": ["head", "embedding", "head"],
            "src_head_index": [1, None, 1], "dst_layer": [1, 1, 1],
            "dst_role": ["head", "head", "head"], "dst_head_index": [0, 0, 0],
            "input": ["k", "v", "k"], "position": [0, 0, 1], "score": [-1.0, 2.0, 2.5]}  # fmt: skip
    got = faithfulness._induction_ranks(heads, pd.DataFrame(edge), nodes, "Real")
    # K edge summed 1.5 after input->a1.h0<v> 2.0; at position 1 (2.5) it comes first
    assert got == {"previous_rank": 3, "induction_rank": 2, "previous_rank_position": 4,
                   "induction_rank_position": 3, "previous_in_top3": True,
                   "induction_in_top3": True, "kcomposition_rank": 2,
                   "kcomposition_rank_position": 1, "kcomposition_in_top5": True}  # fmt: skip
    # MaxProduct: the ⊕ is the value of largest size (2.5), not the sum (1.5)
    got = faithfulness._induction_ranks(heads, pd.DataFrame(edge), None, "MaxProduct")
    assert got["kcomposition_rank"] == 1 and "previous_rank" not in got


def test_goals_read_the_summary():
    """The verdicts of a summary whose numbers are written down here."""
    from semiring_backprop.experiments.faithfulness_report import goals

    def method(cmd, needed, pearson, fwd):
        return {"cmd": {"mean": cmd}, "edges_needed": needed, "nodes_pearson": {"mean": pearson},
                "per_seed": {"0": {"nodes_pearson": pearson}}, "forwards": fwd}  # fmt: skip

    summary = {"level": 0.8, "benchmarks": {"b": {"seconds_per_model": {"0": 30.0}, "methods": {
        "Real": method(0.04, [3], 0.97, 2.0), "EAP": method(0.1, [4], 0.9, 1.0),
        "EAP-IG5": method(0.05, [3], 0.9, 5.0), "patching": method(0.0, [2], 1.0, 250.0)}}},
        "induction": [{"seed": 0, "Real": {"previous_in_top3": 1.0, "induction_in_top3": 1.0,
                                           "kcomposition_in_top5": 0.5}}]}  # fmt: skip
    got = {g["goal"]: g["met"] for g in goals(summary)}
    assert list(got.values()) == ["met", "met", "met", "not met", "met", "met"], got
    summary["benchmarks"]["b"]["methods"]["Real"] = method(0.06, [4], 0.94, 2.0)
    got = {g["goal"]: g["met"] for g in goals(summary)}
    assert list(got.values())[:3] == ["not met"] * 3, got


@pytest.mark.parametrize(("options", "message"), [
    ({"benchmarks": ("ioi",)}, "benchmarks"),
    ({"fractions": (0.5, 0.2)}, "fractions"),
    ({"fractions": (0.5, 1.5)}, "fractions"),
    ({"ind_hidden": 10, "ind_heads": 4}, "ind_hidden"),
    ({"ig_steps": (0,)}, "ig_steps"),
    ({"ind_corrupt": "shuffle"}, "ind_corrupt"),
    ({"seeds": 0}, "seeds=0"),
    ({"pairs": 0}, "pairs=0"),
    ({"top_n": -1}, "top_n"),
    ({"reference": 2.5}, "reference"),
    ({"level": 0.0}, "level"),
])  # fmt: skip
def test_config_refusals(options, message):
    with pytest.raises(InputError, match=message):
        experiments.config("faithfulness", quick=True, **options)


def test_quick_run_through_the_cli(tmp_path):
    """The whole quick run, three benchmarks (slow tier)."""
    out = tmp_path / "faith"
    done = subprocess.run([sys.executable, "-m", "semiring_backprop", "experiment", "faithfulness",
                           "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert set(s["benchmarks"]) == set(faithfulness.BENCHMARKS)
    assert s["induction"][0]["EAP"].keys() >= {"previous_in_top3", "kcomposition_in_top5"}
    lines = (out / "table.md").read_text().splitlines()
    # one summary table per benchmark (rows start with the method; the per-model and
    # induction tables' rows start with the seed)
    assert sum(line.startswith("| patching |") for line in lines) == 3
    assert sum(line.startswith("| 0 | patching |") for line in lines) == 3
