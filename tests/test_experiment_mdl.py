"""entropy-vs-mdl (paper §5.3): the online code length against sums done by hand, the
entropy against single-example passes, and a tiny run: its files, and a rerun that
trains and explains nothing."""

import json
import math

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop import InputError
from semiring_backprop.experiments import entropy_mdl as em
from semiring_backprop.experiments.common import GoldLogit, bert_classifier


@pytest.fixture(autouse=True)
def _one_thread():
    """Two threads on two shared cores are many times slower than one here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- online code length ------------------------------------------------------------------

N, BLOCKS = 40, [3, 7, 15, 40]


def _data(k):
    """Inputs are the example's index, so a fake predictor can look its label up."""
    g = torch.Generator().manual_seed(1)
    return torch.arange(N)[:, None], torch.randint(0, k, (N,), generator=g)


def _fit(x_all, y_all, predictor):
    """A fake ``fit`` that checks it gets exactly a prefix and logs its size."""
    calls = []

    def fit(xp, yp):
        t = len(yp)
        assert torch.equal(xp, x_all[:t]) and torch.equal(yp, y_all[:t])
        calls.append(t)
        return predictor(t)

    return fit, calls


def _probs(y_all, k, q, extra=0):
    """Scores whose softmax over the first k gives the gold label probability q; ``extra``
    columns of large junk scores that the code must ignore."""

    def predict(x):
        gold = y_all[x[:, 0]]
        p = torch.full((len(x), k), (1 - q) / (k - 1), dtype=torch.float64)
        p[torch.arange(len(x)), gold] = q
        return torch.cat([p.log(), torch.full((len(x), extra), 50.0, dtype=p.dtype)], 1)

    return predict


@pytest.mark.parametrize("k", [2, 3, 36])
def test_uniform_predictor_costs_log_k_per_label(k):
    x, y = _data(k)
    fit, calls = _fit(x, y, lambda t: lambda xs: torch.zeros(len(xs), k))
    code = em.online_code_length(fit, x, y, k, BLOCKS)
    assert code["bits"] == pytest.approx(N * math.log2(k), rel=1e-12)
    assert code["uniform_bits"] == pytest.approx(N * math.log2(k), rel=1e-12)
    assert calls == BLOCKS[:-1]  # once per coded block, on exactly its prefix
    assert [(b["start"], b["end"]) for b in code["blocks"]] == [(0, 3), (3, 7), (7, 15), (15, 40)]


def test_perfect_predictor_costs_only_the_first_block():
    x, y = _data(3)

    def perfect(t):
        def predict(xs):
            scores = torch.full((len(xs), 3), -math.inf)
            scores[torch.arange(len(xs)), y[xs[:, 0]]] = 0.0
            return scores

        return predict

    fit, calls = _fit(x, y, perfect)
    code = em.online_code_length(fit, x, y, 3, BLOCKS)
    assert code["bits"] == BLOCKS[0] * math.log2(3)
    assert [b["bits"] for b in code["blocks"][1:]] == [0.0, 0.0, 0.0]
    assert calls == [3, 7, 15]


@pytest.mark.parametrize("k", [2, 4])
def test_known_gold_probability_per_block(k):
    """The model fit on t examples gives the gold label q(t) = t / (t + 2): each block is
    coded by the model of its own prefix; scores past the first k are ignored."""
    x, y = _data(k)
    q = lambda t: t / (t + 2)
    fit, calls = _fit(x, y, lambda t: _probs(y, k, q(t), extra=3))
    code = em.online_code_length(fit, x, y, k, BLOCKS)
    expected = BLOCKS[0] * math.log2(k) + sum(
        (b - a) * -math.log2(q(a)) for a, b in zip(BLOCKS, BLOCKS[1:])
    )
    assert code["bits"] == pytest.approx(expected, rel=1e-9)
    assert code["compression"] == pytest.approx(N * math.log2(k) / expected, rel=1e-9)
    assert calls == BLOCKS[:-1]


def test_done_blocks_are_not_fitted_again():
    x, y = _data(2)
    fit, calls = _fit(x, y, lambda t: _probs(y, 2, 0.75))
    seen = []
    code = em.online_code_length(fit, x, y, 2, BLOCKS, done={0: 5.0, 3: 1.5}, on_block=seen.append)
    assert calls == [7, 15]
    assert [r["start"] for r in seen] == [7, 15]
    assert code["bits"] == pytest.approx(5.0 + 1.5 + 33 * -math.log2(0.75))


def test_code_length_errors():
    x, y = _data(3)
    fit = lambda xp, yp: lambda xs: torch.zeros(len(xs), 3)
    with pytest.raises(InputError, match="blocks"):
        em.online_code_length(fit, x, y, 3, [3, 7, 15])  # does not reach len(y)
    with pytest.raises(InputError, match="blocks"):
        em.online_code_length(fit, x, y, 3, [7, 3, 40])
    with pytest.raises(InputError, match="labels must lie"):
        em.online_code_length(fit, x, y, 2, BLOCKS)
    with pytest.raises(InputError, match="shape"):
        em.online_code_length(lambda xp, yp: lambda xs: torch.zeros(len(xs), 2), x, y, 3, BLOCKS)


def test_block_ends():
    assert em.block_ends(3600, em.VOITA_TITOV) == [4, 7, 14, 29, 58, 115, 225, 450, 900,
                                                   1800, 3600]  # fmt: skip
    assert em.block_ends(10, (0.01, 0.02, 0.5, 1.0)) == [1, 5, 10]  # merged, at least 1
    with pytest.raises(InputError, match="end at 1.0"):
        em.block_ends(100, (0.1, 0.5))


def test_parse_task():
    assert em.parse_task("Contains1") == ("Contains1", {})
    assert em.parse_task("BinCountOnes(k=4)") == ("BinCountOnes", {"k": 4})
    assert em.parse_task("ContainsTokenSet(tokens=1)") == ("ContainsTokenSet", {"tokens": (1,)})
    assert em.parse_task("ContainsTokenSet(tokens=1+2+3)")[1] == {"tokens": (1, 2, 3)}
    for bad in ("Nope", "BinCountOnes(k=two)", "BinCountOnes(k)"):
        with pytest.raises(InputError):
            em.parse_task(bad)


# -- entropy -------------------------------------------------------------------------------


def test_batched_entropy_equals_single_example_passes():
    model = bert_classifier(8, 36, hidden=8, heads=2, intermediate=16, layers=1, length=6)
    model.eval()
    x = torch.randint(1, 8, (3, 6))
    y = torch.tensor([0, 1, 1])
    batched = em.token_entropy(em.explainer(model), x, y)
    assert batched.shape == (3,)
    srs = [sbp.Entropy(), sbp.PathCount()]
    for i in range(3):
        res = sbp.backprop(GoldLogit(model).eval(), (x[i : i + 1], y[i : i + 1]),
                           output=lambda v: v[0], semirings=srs)  # fmt: skip
        h = res.at("model.bert.embeddings.word_embeddings", srs[0]).entropy
        log_n = res.at("model.bert.embeddings.word_embeddings", srs[1]).log_count
        assert h.shape == (1, 6, 8)
        assert bool(((h >= -1e-5) & (h <= log_n + 1e-4)).all())  # 0 <= H <= log #paths
        torch.testing.assert_close(batched[i], h.mean(), rtol=1e-5, atol=1e-5)


# -- the experiment ----------------------------------------------------------------------

TINY = em.Config(
    tasks=("Contains1",), seeds=(0,), sizes=(40, 6, 6), length=6, vocab_size=8, hidden=8,
    heads=2, intermediate=16, layers=1, epochs=1, mdl_epochs=1,
    mdl_fractions=(0.25, 0.5, 1.0), explain_batch=2, explain_limit=4,
)  # fmt: skip


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _forbid(monkeypatch, *names):
    def fail(*args, **kwargs):
        raise AssertionError("a rerun must reuse what was written")

    for name in names:
        monkeypatch.setattr(em, name, fail)


def test_tiny_run_writes_its_files_and_a_rerun_reuses_them(tmp_path, monkeypatch):
    sizes = []
    real_train = em.train
    monkeypatch.setattr(em, "train", lambda m, split, *a, **kw: (
        sizes.append(len(split)), real_train(m, split, *a, **kw))[1])  # fmt: skip
    result = em.run(tmp_path, TINY, progress=False)
    assert sizes == [40, 10, 20]  # the model, then a fresh model per coded block
    for name in ("runs.jsonl", "runs.csv", "summary.json", "figure.png", "mdl_blocks.jsonl"):
        assert (tmp_path / name).exists()
        assert str(tmp_path / name) in result["files"]
    (row,) = _jsonl(tmp_path / "runs.jsonl")
    fields = {"task", "params", "seed", "val_accuracy", "mdl_bits", "mean_entropy", "dropped"}
    assert fields <= set(row)
    assert row["task"] == "Contains1" and row["seed"] == 0 and row["explained"] == 4
    blocks = _jsonl(tmp_path / "mdl_blocks.jsonl")
    assert [b["start"] for b in blocks] == [0, 10, 20]
    assert blocks[0]["bits"] == 10.0  # 10 labels, uniform over 2 classes
    assert row["mdl_bits"] == pytest.approx(sum(b["bits"] for b in blocks))
    entropies = [r["entropy"] for r in _jsonl(tmp_path / "entropy.jsonl")]
    assert row["mean_entropy"] == pytest.approx(sum(entropies) / 4)
    saved = torch.load(tmp_path / "models" / "Contains1_seed=0" / "model.pt", weights_only=True)
    fresh = em._classifier(TINY, 0).classifier  # trained over the task's 2 outputs only:
    assert torch.equal(saved["classifier.weight"][2:], fresh.weight[2:])  # the rest untouched
    assert not torch.equal(saved["classifier.weight"][:2], fresh.weight[:2])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"] == 1 and summary["spearman"] is None
    assert summary["dropped"] == int(row["dropped"])
    if row["dropped"]:
        assert summary["note"].startswith("ALL 1 runs were dropped")

    _forbid(monkeypatch, "train", "explainer")
    assert em.run(tmp_path, TINY, progress=False)["summary"] == result["summary"]
    # with the run rows lost, the models, blocks and entropies written are reused
    (tmp_path / "runs.jsonl").unlink()
    assert em.run(tmp_path, TINY, progress=False)["summary"] == result["summary"]
    assert json.loads((tmp_path / "runs.jsonl").read_text()) == row


def test_bad_task_fails_before_training(tmp_path, monkeypatch):
    _forbid(monkeypatch, "train", "explainer")
    bad = em.Config(tasks=("Contains1", "BinCountOnes(k=5)"), seeds=(0,))
    with pytest.raises(InputError, match="k=5 must divide"):
        em.run(tmp_path / "out", bad, progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="end at 1.0"):
        em.run(tmp_path / "out", em.Config(mdl_fractions=(0.5,)), progress=False)


def test_quick_config_is_small():
    quick = em.Config.quick()
    assert len(quick.tasks) * len(quick.seeds) <= 3 and quick.sizes[0] <= 1000
    assert em.Config().sizes == (3600, 360, 360) and len(em.Config().tasks) == 17
