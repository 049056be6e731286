"""The first-token-repeated experiment (paper §5.1), the demo, results on disk and the CLI.

Oracles: token classes from a plain loop over the sequences; the recorded branch values
against an independent one-example ``sbp.backprop`` per example; ``summary.json`` against
a pandas group-by of the written CSV; resuming against functions that must not run.
"""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("pandas")

import pandas as pd  # noqa: E402
import torch  # noqa: E402

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import experiments  # noqa: E402
from semiring_backprop.cli import main  # noqa: E402
from semiring_backprop.data import make_task  # noqa: E402
from semiring_backprop.experiments import common  # noqa: E402
from semiring_backprop.experiments import first_token as ft  # noqa: E402
from semiring_backprop.runner import records  # noqa: E402

TINY = dict(n=400, max_epochs=2, explain_limit=12, explain_batch=5, seeds=2)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ftr")
    result = experiments.run("first-token-repeated", out, progress=False, **TINY)
    return out, result


def test_token_classes_follow_the_data():
    task = make_task("FirstTokenRepeatedOnce", 200, length=10, vocab_size=20, seed=3)
    classes = ft.token_classes(task.train.x, task.train.y)
    for ids, label, row in zip(task.train.x.tolist(), task.train.y.tolist(), classes):
        assert row[0] == "first"
        repeats = [t for t in range(1, 10) if ids[t] == ids[0]]
        assert len(repeats) == (1 if label else 0)
        for t in range(1, 10):
            assert row[t] == ("repeated" if t in repeats else "other")


def test_files_and_summary_shape(tiny_run):
    out, result = tiny_run
    for name in ("branches.csv", "summary.json", "config.json", "figure.png",
                 "seed0/values.jsonl", "seed1/values.jsonl", "seed1/model/model.pt"):  # fmt: skip
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"oplus", "bucket_sum", "paper", "spread", "agreement", "models"}
    assert set(summary["paper"]) == {"tensor"}  # the paper's quantity (Config.paper)
    assert set(summary["agreement"]) == {"neuron", "tensor", "paper"}
    assert (out / "seed0" / "paper.jsonl").exists()
    assert [m["seed"] for m in summary["models"]] == [0, 1]
    for agg in ("oplus", "bucket_sum"):
        assert set(summary[agg]) == {"neuron", "tensor"}
        for gran in summary[agg].values():
            assert set(gran) <= {"first", "repeated", "other"} and "first" in gran
            for branches in gran.values():
                assert set(branches) == {"skip", "query", "key", "value"}
    assert result["explained"] == TINY["explain_limit"]


def test_models_differ_and_the_spread_and_agreement_follow_them(tiny_run):
    """Per model, a pandas mean; across models, their mean, sd, min and max; the
    agreement counts the models whose largest branch is the majority's."""
    out, _ = tiny_run
    frame = pd.read_csv(out / "branches.csv")
    summary = json.loads((out / "summary.json").read_text())
    a = torch.load(out / "seed0" / "model" / "model.pt", weights_only=True)
    b = torch.load(out / "seed1" / "model" / "model.pt", weights_only=True)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # two models, not one twice
    keys = ["aggregation", "granularity", "token_class", "branch"]
    per_model = frame.groupby([*keys, "seed"])["value"].mean()
    for (agg, gran, cls, branch), group in per_model.groupby(level=keys):
        vals = group.dropna()
        spread = summary["spread"][agg][gran][cls][branch]
        if vals.empty:
            assert summary[agg][gran][cls][branch] is None
            continue
        assert summary[agg][gran][cls][branch] == pytest.approx(vals.mean())
        assert spread["min"] == pytest.approx(vals.min())
        assert spread["max"] == pytest.approx(vals.max())
        if len(vals) > 1:
            assert spread["std"] == pytest.approx(vals.std())
    for gran, table in summary["agreement"].items():
        for cls, said in table.items():
            # (branch, seed) -> value; "paper": the paper's quantity, at tensor granularity
            at = ("paper", "tensor") if gran == "paper" else ("oplus", gran)
            sub = per_model.loc[(*at, cls)].dropna()
            winners = [sub.xs(s, level="seed").idxmax() for s in sorted(set(
                sub.index.get_level_values("seed")))]  # fmt: skip
            assert said["of"] == len(winners)
            assert said["models"] == max(winners.count(w) for w in set(winners))
            assert winners.count(said["branch"]) == said["models"]


def test_summary_is_the_mean_of_the_csv(tiny_run):
    out, _ = tiny_run
    frame = pd.read_csv(out / "branches.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert frame["example"].nunique() == TINY["explain_limit"]
    for (agg, gran, cls, branch), group in frame.groupby(
        ["aggregation", "granularity", "token_class", "branch"]
    ):
        means = []  # each model's mean over the tokens with a path, by a plain loop
        for seed in sorted(set(group["seed"])):
            vals = group[group["seed"] == seed]["value"].dropna().tolist()
            if vals:
                means.append(sum(vals) / len(vals))
        want = summary[agg][gran][cls][branch]
        if not means:
            assert want is None
        else:
            assert want == pytest.approx(sum(means) / len(means), rel=1e-9)


def test_readout_never_queries_later_tokens(tiny_run):
    # the pooler reads position 0 only: a later token reaches it through keys and values,
    # never through its own query or skip connection (the semiring zero: no path)
    out, _ = tiny_run
    frame = pd.read_csv(out / "branches.csv")
    later = frame[(frame["token"] > 0) & frame["branch"].isin(["query", "skip"])]
    oplus = later[later["aggregation"] == "oplus"]
    assert oplus["value"].isna().all()
    assert (later[later["aggregation"] == "bucket_sum"]["value"] == 0).all()


def test_values_equal_one_example_passes(tiny_run):
    out, _ = tiny_run
    cfg = experiments.config("first-token-repeated", **TINY)
    task = make_task("FirstTokenRepeatedOnce", cfg.n, length=10, vocab_size=20, seed=0)
    model = common.bert_classifier(20, 2, hidden=16, heads=2, intermediate=32, layers=1,
                                   length=10)  # fmt: skip
    model.load_state_dict(torch.load(out / "seed0" / "model" / "model.pt", weights_only=True))
    model.eval()
    frame = pd.read_csv(out / "branches.csv")
    frame = frame[frame["seed"] == 0]
    for i in (0, 7):  # from different explain batches
        x, y = task.val.x[i : i + 1], task.val.y[i : i + 1]
        gold = int(y[0])
        srs = [sbp.MaxProduct("neuron"), sbp.MaxProduct("tensor")]
        res = sbp.backprop(model, kwargs={"input_ids": x},
                           output=lambda out, g=gold: out.logits[0, g], semirings=srs)  # fmt: skip
        for sr in srs:
            for agg in ("oplus", "bucket_sum"):
                want = res.branches(ft.WHERE, sr, aggregate=agg)
                got = frame[(frame["example"] == i) & (frame["granularity"] == sr.granularity)
                            & (frame["aggregation"] == agg)]  # fmt: skip
                for r in want[want["role"].isin(ft.BRANCHES)].itertuples():
                    v = got[(got["token"] == r.token) & (got["branch"] == r.role)]["value"]
                    assert len(v) == 1
                    if r.value == float("-inf"):
                        assert pd.isna(v.iloc[0])
                    else:
                        assert v.iloc[0] == pytest.approx(r.value, rel=1e-4, abs=1e-7)


def test_paper_values_equal_one_example_paper_passes(tiny_run):
    """The paper's quantity: an independent one-example ``sbp.backprop(paper=True)`` with
    MaxProduct("tensor"), read by ``aggregate="paper"`` (winner-take-all, zeros kept)."""
    out, _ = tiny_run
    cfg = experiments.config("first-token-repeated", **TINY)
    task = make_task("FirstTokenRepeatedOnce", cfg.n, length=10, vocab_size=20, seed=0)
    model = common.bert_classifier(20, 2, hidden=16, heads=2, intermediate=32, layers=1,
                                   length=10)  # fmt: skip
    model.load_state_dict(torch.load(out / "seed0" / "model" / "model.pt", weights_only=True))
    model.eval()
    frame = pd.read_csv(out / "branches.csv")
    frame = frame[(frame["seed"] == 0) & (frame["aggregation"] == "paper")]
    assert set(frame["granularity"]) == {"tensor"}
    sr = sbp.MaxProduct("tensor")
    for i in (0, 7):
        x, gold = task.val.x[i : i + 1], int(task.val.y[i])
        res = sbp.backprop(model, kwargs={"input_ids": x}, semirings=[sr], paper=True,
                           output=lambda out, g=gold: out.logits[0, g])  # fmt: skip
        best = res.at(ft.WHERE, sr).hi[0].max(-1).values  # each token's best unit
        got = frame[frame["example"] == i]
        for t in range(10):
            vals = got[got["token"] == t].set_index("branch")["value"]
            assert set(vals.index) == set(ft.BRANCHES)
            assert (vals != 0).sum() <= 1  # one branch holds it, the rest are 0
            assert vals.sum() == pytest.approx(float(best[t]), rel=1e-4, abs=1e-7)
        want = res.branches(ft.WHERE, sr, aggregate="paper")
        for r in want[want["role"].isin(ft.BRANCHES)].itertuples():
            v = got[(got["token"] == r.token) & (got["branch"] == r.role)]["value"]
            assert v.iloc[0] == pytest.approx(r.value, rel=1e-4, abs=1e-7)


def test_paper_training_builds_the_papers_config(tmp_path, monkeypatch):
    """Config(paper_training=True): the paper's model (512 positions, two token types,
    dropout 0.2, hidden 16, 2 heads, 1 layer) trained 42 epochs without stopping early,
    on 10,000 examples, batch 32, lr 1e-3 (train() is replaced: nothing trains 42 epochs
    here)."""
    cfg = ft.Config(paper_training=True)
    assert ft.Config.paper_trained() == cfg
    assert ft.training(cfg) == {
        "n": 10_000, "hidden": 16, "heads": 2, "lr": 1e-3, "batch_size": 32, "layers": 1,
        "epochs": 42, "stop_early": False, "max_position_embeddings": 512,
        "type_vocab_size": 2, "dropout": 0.2,
    }  # fmt: skip
    bert = ft.model(cfg, 0).config
    assert (bert.max_position_embeddings, bert.type_vocab_size) == (512, 2)
    assert bert.hidden_dropout_prob == bert.attention_probs_dropout_prob == 0.2
    assert (bert.hidden_size, bert.num_attention_heads, bert.num_hidden_layers) == (16, 2, 1)
    ours = ft.model(ft.Config(), 0).config  # the default is unchanged
    assert (ours.max_position_embeddings, ours.type_vocab_size) == (10, 1)
    assert ours.hidden_dropout_prob == ours.attention_probs_dropout_prob == 0.0
    with pytest.raises(sbp.InputError, match="hidden=32"):
        ft.training(ft.Config(paper_training=True, hidden=32))

    calls = []

    def fake_train(model, train_split, val_split, **kw):
        calls.append((model.config, len(train_split) + len(val_split), kw))
        return [{"epoch": 1, "loss": 0.7, "val_accuracy": 0.5}]

    monkeypatch.setattr(ft, "train", fake_train)
    experiments.run("first-token-repeated", tmp_path, progress=False, paper_training=True,
                    seeds=1, explain_limit=2, paper=False)  # fmt: skip
    ((bert, n, kw),) = calls
    # of the 10,000 examples made: 7,000 train and 1,000 validation (2,000 are the test split)
    assert n == 8_000 and bert.max_position_embeddings == 512 and bert.type_vocab_size == 2
    assert bert.hidden_dropout_prob == 0.2
    assert kw["epochs"] == 42 and kw["stop_at"] is None
    assert kw["lr"] == 1e-3 and kw["batch_size"] == 32
    with pytest.raises(sbp.InputError, match="paper_training"):  # not mixed with ours
        experiments.run("first-token-repeated", tmp_path, progress=False, seeds=1,
                        explain_limit=2, paper=False)  # fmt: skip


def test_demo_says_which_quantity_each_number_is(tiny_run, tmp_path, monkeypatch):
    """The demo's words name each block's quantity, and the paper's block holds the
    pandas means of the paper's rows of branches.csv, zeros included."""
    out, result = tiny_run
    monkeypatch.setattr(ft, "run", lambda *a, **k: result)
    lines = []
    ft.demo(tmp_path, progress=False, print_fn=lines.append)
    text = "\n".join(lines)
    for words in (
        "ours: oplus, neuron granularity",
        "ours: bucket_sum, tensor granularity",
        "the paper's quantity: brunoflow's computation (paper mode, tensor granularity), "
        "winner-take-all per token, zeros kept",
        "ours (neuron granularity, ⊕ per branch): the first token's top path",
        "the paper's quantity (brunoflow's computation, winner-take-all per token, zeros "
        "kept): the first token's largest branch is the",
        "The paper reported, in its quantity: first/query, repeated/key",
        "the paper's quantity: the first token's through the",
    ):
        assert words in text, words
    assert "paper, tensor granularity: first/query" not in text
    frame = pd.read_csv(out / "branches.csv")
    paper = frame[frame["aggregation"] == "paper"]
    assert paper["value"].notna().all() and (paper["value"] == 0).any()  # zeros kept
    block = text.split("the paper's quantity: brunoflow's computation")[1].splitlines()
    first = next(ln for ln in block if ln.strip().startswith("first"))
    per_seed = paper[paper["token_class"] == "first"].groupby(["branch", "seed"])["value"]
    means = per_seed.mean().groupby("branch").mean()
    for b in ft.BRANCHES:
        assert f"{means[b]:.3g}" in first


def test_rerun_resumes_without_training_or_explaining(tiny_run, monkeypatch):
    out, first = tiny_run

    def fail(*a, **k):
        raise AssertionError("a rerun must reuse what is on disk")

    monkeypatch.setattr(ft, "train", fail)
    monkeypatch.setattr(sbp.Backprop, "__call__", fail)
    again = experiments.run("first-token-repeated", out, progress=False, **TINY)
    assert again["summary"] == first["summary"]


def test_interrupted_explanation_resumes(tmp_path, monkeypatch):
    cfg = dict(TINY, explain_limit=10, explain_batch=5, seeds=1)
    calls = []
    real = sbp.Backprop.__call__

    def counting(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(sbp.Backprop, "__call__", counting)
    with pytest.raises(KeyboardInterrupt):
        experiments.run("first-token-repeated", tmp_path, progress=False, **cfg)
    lines = (tmp_path / "seed0" / "values.jsonl").read_text().splitlines()
    assert len(lines) == 5  # the first batch was written before the interruption
    calls.clear()
    monkeypatch.setattr(sbp.Backprop, "__call__", real)
    result = experiments.run("first-token-repeated", tmp_path, progress=False, **cfg)
    assert result["explained"] == 10
    lines = (tmp_path / "seed0" / "values.jsonl").read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]
    assert sorted(keys) == list(range(10))


def test_records_drop_a_cut_off_last_line_and_refuse_a_broken_one(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"key": 1}\n{"key": 2}\n{"key": 3, "x"')
    rec = records.Records(path)
    assert [r["key"] for r in rec.rows] == [1, 2] and rec.has(2) and not rec.has(3)
    rec.add({"key": 3, "v": float("inf")})
    assert json.loads(path.read_text().splitlines()[-1]) == {"key": 3, "v": None}
    path.write_text('{"key": 1}\nnot json\n{"key": 2}\n')
    with pytest.raises(sbp.InputError, match="r.jsonl:2"):
        records.Records(path)


def test_unknown_experiment_and_option_are_clear_errors():
    with pytest.raises(sbp.InputError, match="first-token-repeated"):
        experiments.run("first-token", "/tmp/x")
    with pytest.raises(sbp.InputError, match="no option epochs"):
        experiments.config("first-token-repeated", epochs=3)


def test_cli_experiment_and_set(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["experiment", "first-token-repeated", "--out", str(out), "--set"]
    argv += [f"{k}={v}" for k, v in TINY.items()]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "oplus" in printed and (out / "summary.json").exists()
    assert json.loads((out / "config.json").read_text())["n"] == TINY["n"]
    assert main(["experiment", "first-token-repeated", "--set", "n=many"]) == 2
    assert "expected a int" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_reaches_full_accuracy_and_explains(tmp_path, capsys):
    lines = []
    result = ft.demo(tmp_path, progress=False, print_fn=lines.append)
    assert result["val_accuracy"] == 1.0
    text = "\n".join(lines)
    assert "Reading (mean over models):" in text and "tensor granularity" in text
    assert "Models agreeing" in text and "of 3" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == result["summary"]
    assert (tmp_path / "figure.png").stat().st_size > 0
    # the CLI's demo into the same directory reuses the trained model and the records
    assert main(["demo", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "100.0%, 100.0%, 100.0% validation accuracy" in printed and "repeated" in printed
