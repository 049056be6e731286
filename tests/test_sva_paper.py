"""The paper's quantity in the ``sva`` experiment and the runner's ``paper`` setting.

One small ``sva`` run (a random one-layer BERT, two synthetic sentences) is made once
and shared. Its paper block is checked against an independent computation: for each
example, ``sbp.backprop(..., paper=True)`` of the logit difference on the plain model
with constant indices, ``layer_table(aggregate="paper")``, and the test's own pandas
means (pooled over a group's tokens, zeros kept, the subject at its first token, as the
paper's notebook averaged). The runner's refusals cost no trace.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop.experiments import sva  # noqa: E402
from semiring_backprop.runner import Settings, load_results, run  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

CONFIG = sva.Config(limit=2, synthetic=20, aggregation=("oplus",), bert_hidden=16,
                    bert_layers=1, bert_heads=2, bert_intermediate=32)  # fmt: skip
ONE = [{"text": "the dog ***mask*** here", "target": "is", "foil": "are"}]


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory, _offline_quiet):
    out = tmp_path_factory.mktemp("sva_paper")
    return out, sva.run(out, CONFIG, progress=False)


def _independent(out) -> pd.DataFrame:
    """Per example of the run, the paper's per-token table from a pass of its own (the
    plain model, the logit difference with constant indices, paper mode), with each
    token's groups: one row per example x token x layer x sublayer x branch x group."""
    tok = transformers.AutoTokenizer.from_pretrained(out / "model")
    model = transformers.BertForMaskedLM.from_pretrained(out / "model").eval()
    runner = load_results(out / "runner_paper")
    frames = []
    for ex in runner["examples"].itertuples():
        toks = runner["tokens"][runner["tokens"]["example_id"] == ex.example_id]
        toks = toks.sort_values("token")
        ids = torch.tensor([tok.convert_tokens_to_ids(toks["token_text"].tolist())])
        pos, good, bad = ex.position, ex.target_id, ex.foil_id

        def score(y, pos=pos, good=good, bad=bad):
            return y.logits[0, pos, good] - y.logits[0, pos, bad]

        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        res = sbp.backprop(model, kwargs=kwargs, output=score, paper=True,
                           semirings=[sbp.MaxProduct("tensor")])  # fmt: skip
        with torch.no_grad():  # the runner's score: log p(good) - log p(bad), the same number
            logp = model(**kwargs).logits[0, pos].log_softmax(-1)
        assert ex.score == pytest.approx(float(logp[good] - logp[bad]), abs=1e-5)
        table = res.layer_table(aggregate="paper", by="role")
        names = toks["group"].fillna("").str.split(",")
        subject = toks.loc[names.map(lambda n: "subject" in n), "token"].tolist()
        groups = {
            "all": toks["token"].tolist(),
            "subject": subject[:1],
            "attractor": toks.loc[names.map(lambda n: "attractors" in n), "token"].tolist(),
        }
        for group, tokens in groups.items():
            part = table[table["token"].isin(tokens)]
            frames.append(part.assign(example_id=ex.example_id, token_group=group))
    return pd.concat(frames, ignore_index=True)


def test_paper_block_equals_an_independent_pass(paper_run):
    out, result = paper_run
    mine = _independent(out)
    assert set(mine["token_group"]) == {"all", "subject", "attractor"}  # each group checked
    assert mine["semiring"].eq("MaxProduct(tensor)").all()
    # the paper's means: pooled over the group's tokens of all examples, zeros kept
    expected = mine.groupby(["token_group", "layer", "sublayer", "branch"])["value"].agg(
        ["mean", "size"]
    )
    assert (expected["mean"] == 0).any() and (expected["mean"] > 0).any()
    table = pd.read_csv(out / "branches_paper.csv")
    got = table.set_index(["token_group", "layer", "sublayer", "branch"])
    assert sorted(got.index) == sorted(expected.index)
    for key, row in expected.iterrows():
        assert got.loc[key, "value"] == pytest.approx(row["mean"], rel=1e-5, abs=1e-12)
        assert got.loc[key, "tokens"] == row["size"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary == result["summary"]
    block = summary["paper"]
    for (group, layer, sub, branch), v in got["value"].items():
        assert block["branches"][group][f"{layer}.{sub}"][branch] == pytest.approx(v)
    assert block["explained"] == 2
    assert block["quantity"].startswith("the paper's quantity: brunoflow's computation")
    assert "winner-take-all per token, zeros kept" in block["quantity"]
    assert summary["branches_quantity"].startswith("ours: MaxProduct(neuron), oplus")
    names = {p.rsplit("/", 1)[-1] for p in result["files"]}
    assert {"branches.csv", "branches_paper.csv", "summary.json"} <= names


def test_paper_pass_is_a_paper_mode_runner_run(paper_run):
    out, _ = paper_run
    settings = json.loads((out / "runner_paper" / "config.json").read_text())
    assert settings["paper"] is True and settings["granularity"] == "tensor"
    assert settings["semirings"] == ["max"] and settings["aggregation"] == ["paper"]
    assert json.loads((out / "runner" / "config.json").read_text())["paper"] is False
    # the runner's own summary averages the paper's aggregation with its zeros, too
    branches = load_results(out / "runner_paper")["branches"]
    assert set(branches["aggregation"]) == {"paper"}
    means = json.loads((out / "runner_paper" / "summary.json").read_text())["branches"]
    table = pd.read_csv(out / "branches_paper.csv")
    for r in table[table["token_group"] == "all"].itertuples():
        got = means["MaxProduct(tensor), paper"][f"{r.layer}.{r.sublayer}"][r.branch]["mean"]
        assert got == pytest.approx(r.value)


# -- the runner ----------------------------------------------------------------------------


def test_runner_refuses_paper_at_neuron_granularity(tmp_path):
    with pytest.raises(sbp.InputError, match="granularity='tensor'"):
        run("some-model", examples=ONE, out=tmp_path, semirings=("max",), paper=True,
            granularity="neuron")  # fmt: skip
    with pytest.raises(sbp.InputError, match="paper=True computes what the paper"):
        Settings(model="m", data=None, semirings=("max",), paper=True).check()


def test_runner_refuses_the_paper_aggregation_without_paper_mode(tmp_path):
    for granularity in ("neuron", "tensor"):
        with pytest.raises(sbp.InputError, match="pass paper=True"):
            run("some-model", examples=ONE, out=tmp_path, semirings=("max",),
                granularity=granularity, aggregation=("paper",))  # fmt: skip
    with pytest.raises(sbp.InputError, match="add the semiring 'max'"):
        Settings(model="m", data=None, semirings=("entropy",), granularity="tensor",
                 aggregation=("paper",), paper=True).check()  # fmt: skip
    # paper=True alone: tensor granularity and the paper's aggregation
    s = Settings(model="m", data=None, semirings=("max",), granularity="tensor",
                 aggregation=("paper",), paper=True)  # fmt: skip
    s.check()


def test_runner_refuses_to_resume_with_another_paper_setting(paper_run, tmp_path):
    out = tmp_path / "runner_paper"
    shutil.copytree(paper_run[0] / "runner_paper", out)
    model = str(paper_run[0] / "model")
    with pytest.raises(sbp.InputError, match=r"other settings \(.*paper.*\)"):
        run(model, examples=ONE, out=out, semirings=("max",), granularity="tensor",
            aggregation=("oplus",), progress=False)  # fmt: skip
    # the reverse: a run that was not in paper mode
    plain = tmp_path / "plain"
    shutil.copytree(paper_run[0] / "runner_paper", plain)
    before = json.loads((plain / "config.json").read_text())
    before.update(paper=False, aggregation=["oplus"])
    (plain / "config.json").write_text(json.dumps(before))
    with pytest.raises(sbp.InputError, match=r"other settings \(.*paper.*\)"):
        run(model, examples=ONE, out=plain, semirings=("max",), paper=True,
            aggregation=("oplus",), progress=False)  # fmt: skip


def test_a_worker_explains_in_paper_mode(paper_run):
    """A Ray actor's body, without Ray: the settings' paper flag reaches its explainer,
    whose tables equal the paper pass's for the same example."""
    from semiring_backprop.runner import Example, Item, workers

    out = paper_run[0]
    settings = Settings(model=str(out / "model"), data=None, semirings=("max",),
                        granularity="tensor", kind="masked", aggregation=("paper",),
                        paper=True, batch_size=1)  # fmt: skip
    worker = workers.Worker(str(out / "model"), settings, "cpu", 1)
    assert worker.explainer.wrapper.logits and worker.explainer.bp._traces.options["paper"]
    runner = load_results(out / "runner_paper")
    first = runner["examples"].iloc[0]
    toks = runner["tokens"][runner["tokens"]["example_id"] == first["example_id"]]
    toks = toks.sort_values("token")
    ids = worker.explainer.tokenizer.convert_tokens_to_ids(toks["token_text"].tolist())
    ex = Example(id=first["example_id"], text=first["text"], target=first["target"],
                 foil=first["foil"])  # fmt: skip
    item = Item(ex, ids, int(first["position"]), int(first["target_id"]),
                int(first["foil_id"]), toks["word"].tolist())  # fmt: skip
    tables = worker.explain((0, [item]))
    keys = ["layer", "sublayer", "token", "branch"]
    mine = tables["branches"].sort_values(keys).reset_index(drop=True)
    theirs = runner["branches"][runner["branches"]["example_id"] == first["example_id"]]
    theirs = theirs.sort_values(keys).reset_index(drop=True)
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine["value"], theirs["value"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-9) or (math.isinf(a) and a == b)


def test_toggling_paper_in_a_rerun_is_allowed(paper_run):
    """Last in the module: it reruns into the shared directory (a copy would hold
    another model path) and leaves it as it was."""
    out = paper_run[0]
    done = (out / "runner_paper" / "done.jsonl").read_text()
    result = sva.run(out, replace(CONFIG, paper=False), progress=False)
    assert "paper" not in result["summary"] and not (out / "branches_paper.csv").exists()
    again = sva.run(out, CONFIG, progress=False)  # runner_paper is complete: resumed
    assert (out / "runner_paper" / "done.jsonl").read_text() == done  # nothing recomputed
    assert again["summary"]["paper"] == paper_run[1]["summary"]["paper"]


def test_cli_run_paper(paper_run, tmp_path, capsys):
    """``semiring-backprop run --paper``: tensor granularity and the paper's aggregation by
    default, recorded in the run's settings; another granularity is one clear line."""
    from semiring_backprop.cli import main

    out, _ = paper_run
    model, data = str(out / "model"), str(out / "synthetic.jsonl")
    runs = tmp_path / "cli"
    argv = ["run", model, "--data", data, "--limit", "2", "--semiring", "max", "--no-figures"]
    assert main([*argv, "--paper", "--out", str(runs)]) == 0
    settings = json.loads((runs / "config.json").read_text())
    assert settings["paper"] is True and settings["granularity"] == "tensor"
    assert list(settings["aggregation"]) == ["paper"]
    branches = load_results(runs)["branches"]
    assert set(branches["aggregation"]) == {"paper"} and len(branches)
    capsys.readouterr()
    bad = ["--paper", "--granularity", "neuron", "--out", str(tmp_path / "bad")]
    assert main([*argv, *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "tensor" in err and len(err.strip().splitlines()) == 1
