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
    assert names == ["Real", "Real-IG2", "MaxProduct", "EAP", "EAP-IG2", "patching", "random"]
    for m in rec["methods"]:
        fraction, n, metric = m["curve"][-1]
        assert (fraction, n) == (1.0, rec["edges"])
        assert metric == pytest.approx(rec["model_clean"], abs=1e-9), m["method"]
    curves = pd.read_csv(out / "model_curves.csv")
    assert curves[curves.fraction == 1.0].f.tolist() == pytest.approx([1.0] * len(names))


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


@pytest.mark.parametrize(("options", "message"), [
    ({"benchmarks": ("ioi",)}, "benchmarks"),
    ({"fractions": (0.5, 0.2)}, "fractions"),
    ({"fractions": (0.5, 1.5)}, "fractions"),
    ({"ind_hidden": 10, "ind_heads": 4}, "ind_hidden"),
    ({"ig_steps": (0,)}, "ig_steps"),
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
    assert (out / "table.md").read_text().count("| patching |") == 3
