"""The ``entropy-sanity`` and ``sva`` experiments, on tiny random models.

Each experiment runs once per module-scoped fixture (tracing dominates the runtime);
the tests read what it wrote and check it against independent computations: a direct
``sbp.backprop`` on the plain Hugging Face model with constant indices, a brute-force path
enumeration for the MLP, ``scipy.stats.spearmanr`` on the written CSV, and token
positions worked out by hand from the vocabulary.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")
scipy_stats = pytest.importorskip("scipy.stats")
pytest.importorskip("matplotlib")


import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import experiments  # noqa: E402
from semiring_backprop.data import first_feature  # noqa: E402
from semiring_backprop.experiments import entropy_sanity, sva, sva_inputs, sva_report  # noqa: E402

TINY_BERT = dict(bert_hidden=16, bert_layers=1, bert_heads=2, bert_intermediate=32)


pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest


def _vocab(model_dir) -> list[str]:
    return (model_dir / "vocab.txt").read_text().split()


def _direct(model_dir, ids, position, good, bad, semirings):
    """An independent pass: the plain model, the score with constant indices."""
    model = transformers.BertForMaskedLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([ids])

    def score(out):
        logp = out.logits[0, position].log_softmax(-1)
        return logp[good] - logp[bad]

    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    res = sbp.backprop(model, kwargs=kwargs, output=score, semirings=semirings)
    with torch.no_grad():
        expected = float(score(model(**kwargs)))
    return res, expected


# -- entropy-sanity ---------------------------------------------------------------------

SANITY = entropy_sanity.Config(lengths=(4, 9), per_length=1, vocab_words=30, hidden_sizes=(4,),
                               n=100, epochs=2, **TINY_BERT)  # fmt: skip


@pytest.fixture(scope="module")
def sanity(tmp_path_factory, _offline_quiet):
    out = tmp_path_factory.mktemp("sanity")
    return out, entropy_sanity.run(out, SANITY, progress=False)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sanity_writes_its_files(sanity):
    out, result = sanity
    names = {p.rsplit("/", 1)[-1] for p in result["files"]}
    assert names == {"length.csv", "hidden.csv", "summary.json", "figure.png"}
    assert all((out / n).stat().st_size > 0 for n in names)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["length"]["by_length"]) == {"4", "9"}
    assert set(summary["hidden"]["4"]) >= {"relevant", "irrelevant"}
    length = pd.read_csv(out / "length.csv")
    assert sorted(length["length"]) == [4, 9]
    assert (length["entropy"] > 0).all() and (length["normalized"] <= 1 + 1e-9).all()


def test_sanity_sentence_entropy_equals_a_direct_pass(sanity):
    out, _ = sanity
    row = next(r for r in _lines(out / "length.jsonl") if r["length"] == 9)
    vocab = _vocab(out / "model")
    ids = row["input_ids"]
    # [CLS], nine words one of which is [MASK], [SEP]
    assert [vocab[ids[0]], vocab[ids[-1]]] == ["[CLS]", "[SEP]"] and len(ids) == 11
    assert [vocab[i] for i in ids].count("[MASK]") == 1 and vocab[ids[row["position"]]] == "[MASK]"
    good, bad = vocab.index(SANITY.target), vocab.index(SANITY.foil)
    res, score = _direct(out / "model", ids, row["position"], good, bad,
                         [sbp.Entropy(), sbp.PathCount()])  # fmt: skip
    place = "bert.embeddings.word_embeddings"
    h = res.at(place, sbp.Entropy()).entropy.double()
    log_n = res.at(place, sbp.PathCount()).log_count.double()
    assert row["score"] == pytest.approx(score, abs=1e-5)
    assert row["entropy"] == pytest.approx(float(h.mean()), rel=1e-5)
    assert row["normalized"] == pytest.approx(float((h / log_n).mean()), rel=1e-5)


def _brute_force_entropy(mlp, x, gold) -> torch.Tensor:
    """Entropy of p(π) ∝ |w(π)| over the paths x_j -> hidden k -> logit ``gold``."""
    first, last = mlp[0], mlp[2]
    active = (first(x) > 0).double()  # ReLU's local derivative
    out = []
    for j in range(x.shape[-1]):
        w = [float(first.weight[k, j] * active[k] * last.weight[gold, k])
             for k in range(first.out_features)]  # fmt: skip
        p = np.abs(w) / np.abs(w).sum()
        out.append(-sum(q * math.log(q) for q in p if q > 0))
    return torch.tensor(out)


def test_sanity_mlp_entropy_equals_a_direct_pass(sanity):
    out, _ = sanity
    row = next(r for r in _lines(out / "hidden.jsonl") if r["hidden"] == 4)
    mlp = entropy_sanity.mlp(4)
    mlp.load_state_dict(torch.load(out / "mlp-4" / "model.pt", weights_only=True))
    val = first_feature(SANITY.n, seed=SANITY.seed).val
    x, gold = val.x[:1], int(val.y[0])
    res = sbp.backprop(mlp.eval(), args=(x,), output=lambda y: y[0, gold],
                       semirings=[sbp.Entropy()])  # fmt: skip
    direct = res.at(0, sbp.Entropy()).entropy[0].double()
    recorded = torch.tensor(row["per_example"][0], dtype=torch.float64)
    torch.testing.assert_close(recorded, direct, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        brute = _brute_force_entropy(mlp, x[0], gold)
    torch.testing.assert_close(recorded, brute, rtol=1e-4, atol=1e-5)
    # the summary's means are over the validation examples, as written
    per = np.array(row["per_example"])
    assert len(per) == len(val)
    hidden = pd.read_csv(out / "hidden.csv").set_index("hidden")
    assert hidden.loc[4, "relevant"] == pytest.approx(per[:, 0].mean())
    assert hidden.loc[4, "irrelevant"] == pytest.approx(per[:, 1:].mean())


def test_sanity_rerun_resumes_without_recomputing(sanity, monkeypatch):
    out, first = sanity

    def fail(*args, **kwargs):
        raise AssertionError("a rerun recomputed finished work")

    for name in ("Backprop", "train", "random_masked_lm"):
        monkeypatch.setattr(entropy_sanity, name, fail)
    again = entropy_sanity.run(out, SANITY, progress=False)
    assert again["summary"] == first["summary"]


# -- sva --------------------------------------------------------------------------------

SVA = sva.Config(limit=8, synthetic=20, length_bins=(0, 14, 1000),
                 aggregation=("oplus", "bucket_sum"), **TINY_BERT)  # fmt: skip


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory, _offline_quiet):
    out = tmp_path_factory.mktemp("sva")
    return out, sva.run(out, SVA, progress=False)


def test_sva_writes_its_files(synthetic_run):
    out, result = synthetic_run
    names = {p.rsplit("/", 1)[-1] for p in result["files"]}
    assert names == {"branches.csv", "branches_paper.csv", "entropy.csv", "summary.json",
                     "branches.png", "attractors.png"}  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == 0 and summary["explained"] == 8
    assert "random" in summary["note"]
    assert set(summary["branches"]["all"]) == {"0.attention", "0.mlp"}
    assert set(summary["branches"]["subject"]["0.attention"]) == {"skip", "query", "key", "value"}
    assert set(summary["attractors"]) == {"0-13", "14-999"}
    branches = pd.read_csv(out / "branches.csv")
    assert set(branches["aggregation"]) == {"oplus", "bucket_sum"}
    assert set(branches["token_group"]) == {"subject", "attractor", "all"}


def _group_mean(table, semiring, layer, sublayer, branch, tokens, dead):
    vals = []
    for t in tokens:
        row = table[(table.semiring == semiring) & (table.layer == layer)
                    & (table.sublayer == sublayer) & (table.branch == branch)
                    & (table.token == t)]  # fmt: skip
        v = float(row["value"].iloc[0])
        if math.isfinite(v) and (layer, sublayer, branch, t) not in dead:
            vals.append(v)
    return sum(vals) / len(vals) if vals else None


def _example(run_dir, example_id: str) -> dict:
    """What the runner wrote of one example: its row of the examples table, its token
    strings, its token groups and the positions of its masks."""
    from semiring_backprop.runner import load_results

    tables = load_results(run_dir / "runner")
    row = tables["examples"].set_index("example_id").loc[example_id].to_dict()
    toks = tables["tokens"]
    toks = toks[toks["example_id"] == example_id].sort_values("token")
    names = toks["group"].fillna("").str.split(",")
    row["token_texts"] = toks["token_text"].tolist()
    row["subject_tokens"] = toks.loc[names.map(lambda n: "subject" in n), "token"].tolist()
    row["attractor_tokens"] = toks.loc[names.map(lambda n: "attractors" in n), "token"].tolist()
    row["mask_positions"] = [m[0] for m in json.loads(row["masks"])]
    return row


def test_sva_branch_values_equal_a_direct_layer_table(synthetic_run):
    from semiring_backprop.runner import load_results

    out, _ = synthetic_run
    row = _example(out, "2")  # the second line of the data
    line = json.loads((out / "synthetic.jsonl").read_text().splitlines()[1])
    vocab = _vocab(out / "model")
    row["input_ids"] = [vocab.index(t) for t in row["token_texts"]]
    assert line["attractors"]  # all three token groups are checked
    # one token per word here: word i is token i + 1 (after [CLS])
    assert row["subject_tokens"] == [line["subject"] + 1]
    assert row["attractor_tokens"] == [a + 1 for a in line["attractors"]]
    assert row["token_texts"] == ["[CLS]", *line["sentence_good"].split()[: row["position"] - 1],
                                  "[MASK]", *line["sentence_good"].split()[row["position"]:],
                                  "[SEP]"]  # fmt: skip
    assert row["target_id"] == vocab.index(line["one_prefix_word_good"])
    assert row["token_texts"][row["position"]] == "[MASK]"
    top = sbp.MaxProduct()
    res, score = _direct(out / "model", row["input_ids"], row["position"], row["target_id"],
                         row["foil_id"], [top, sbp.Entropy(), sbp.PathCount()])  # fmt: skip
    assert row["score"] == pytest.approx(score, abs=1e-5)
    # the embeddings' entropy in entropy.csv: a mean over tokens and hidden units
    place = "bert.embeddings.word_embeddings"
    h = res.at(place, sbp.Entropy()).entropy.double()
    entropy = pd.read_csv(out / "entropy.csv").set_index("example")
    assert entropy.loc[2, "entropy"] == pytest.approx(float(h.mean()), rel=1e-5)
    groups = {"subject": row["subject_tokens"], "attractor": row["attractor_tokens"],
              "all": list(range(len(row["input_ids"])))}  # fmt: skip
    tables = load_results(out / "runner")
    values = sva_report.group_values(tables["branches"], tables["tokens"])
    values = values[values["example_id"] == "2"]
    recorded = {(r.semiring, r.aggregation, r.layer, r.sublayer, r.branch, r.token_group):
                r.value for r in values.itertuples()}  # fmt: skip
    checked = 0
    for agg in ("oplus", "bucket_sum"):
        table = res.layer_table(semirings=[top, sbp.Entropy()], aggregate=agg, by="role")
        mp = table[table.semiring == top.name]
        dead = {(r.layer, r.sublayer, r.branch, r.token)
                for r in mp.itertuples() if r.value == -math.inf}  # fmt: skip
        for (sr, layer, sub, branch) in table[["semiring", "layer", "sublayer", "branch"]] \
                .drop_duplicates().itertuples(index=False):  # fmt: skip
            for group, tokens in groups.items():
                if not tokens:
                    continue
                expected = _group_mean(table, sr, layer, sub, branch, tokens,
                                       dead if agg == "oplus" else set())  # fmt: skip
                got = recorded[(sr, agg, layer, sub, branch, group)]
                if expected is None:
                    assert math.isnan(got)
                else:
                    assert got == pytest.approx(expected, rel=1e-4, abs=1e-12)
                checked += 1
    assert checked == len(recorded) > 0


def _values(out):
    from semiring_backprop.runner import load_results

    tables = load_results(out / "runner")
    return sva_report.group_values(tables["branches"], tables["tokens"])


def test_sva_branches_csv_is_the_mean_of_the_records(synthetic_run):
    out, _ = synthetic_run
    values = _values(out)
    branches = pd.read_csv(out / "branches.csv")
    assert branches.loc[branches["n"] == 0, "value"].isna().all()  # never a path: no value
    live = branches[branches["n"] > 0]
    assert len(live) > 0
    keys = ["semiring", "aggregation", "layer", "sublayer", "branch", "token_group"]
    for r in live.sample(8, random_state=0).itertuples():
        mine = values[(values[keys] == [getattr(r, k) for k in keys]).all(axis=1)]
        vals = mine["value"].dropna().tolist()
        assert r.n == len(vals)
        assert r.value == pytest.approx(np.mean(vals))


def test_sva_spearman_equals_scipy_on_the_csv(synthetic_run):
    from semiring_backprop.runner import load_results

    out, result = synthetic_run
    entropy = pd.read_csv(out / "entropy.csv")
    tokens = load_results(out / "runner")["tokens"]
    per_example = tokens.groupby("example_id")["entropy_unit_mean"].mean()
    assert entropy["entropy"].tolist() == pytest.approx(
        [per_example[str(k)] for k in entropy["example"]], rel=1e-12
    )
    found = 0
    for label, stats in result["summary"]["attractors"].items():
        part = entropy[entropy["length_bin"] == label]
        assert stats["n"] == len(part)
        if stats["spearman_rho"] is None:
            assert len(part) < 3 or part["attractors"].nunique() < 2
            continue
        expected = scipy_stats.spearmanr(part["attractors"], part["entropy"])
        assert stats["spearman_rho"] == pytest.approx(expected.statistic)
        assert stats["p"] == pytest.approx(expected.pvalue)
        found += 1
    assert found >= 1


# -- the runner underneath: resuming after a kill, Ray workers ----------------------------


def _same_tables(a, b, rtol=1e-5):
    """branches.csv, entropy.csv (but the data file's path) and summary.json of two runs."""
    pd.testing.assert_frame_equal(pd.read_csv(a / "branches.csv"), pd.read_csv(b / "branches.csv"),
                                  check_exact=False, rtol=rtol, atol=1e-9)  # fmt: skip
    ea, eb = (pd.read_csv(d / "entropy.csv").drop(columns="source") for d in (a, b))
    pd.testing.assert_frame_equal(ea, eb, check_exact=False, rtol=rtol, atol=1e-9)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert _close(sa, sb, rtol), (sa, sb)


def _close(x, y, rtol) -> bool:
    if isinstance(x, dict):
        return set(x) == set(y) and all(_close(x[k], y[k], rtol) for k in x)
    if isinstance(x, list):
        return len(x) == len(y) and all(_close(a, b, rtol) for a, b in zip(x, y))
    if isinstance(x, float) and isinstance(y, float):
        return x == pytest.approx(y, rel=rtol, abs=1e-12)
    return x == y


class Killed(BaseException):
    """Stands for a kill: nothing in the runner or the experiment catches it."""


def test_sva_killed_mid_run_resumes_without_losing_or_duplicating(synthetic_run, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """Killed after the second batch's shards were written but before the line that
    commits them: the rerun explains the rest (not the first batch again), and every
    table equals the uninterrupted run's."""
    from semiring_backprop.runner import driver, load_results

    real, calls = driver._commit, []

    class Dying:
        def __init__(self, records):
            self.rows = records.rows

        def add(self, row):
            raise Killed

    def commit(out, records, group, tables):
        calls.append(len(group))
        real(out, Dying(records) if len(calls) == 2 else records, group, tables)

    monkeypatch.setattr(driver, "_commit", commit)
    config = replace(SVA, batch_size=2)
    with pytest.raises(Killed):
        sva.run(tmp_path, config, progress=False)
    assert not (tmp_path / "summary.json").exists()
    monkeypatch.setattr(driver, "_commit", real)
    sva.run(tmp_path, config, progress=False)
    this_run = json.loads((tmp_path / "runner" / "summary.json").read_text())["this_run"]
    assert this_run["explained"] == SVA.limit - calls[0]  # the first batch was kept
    ids = load_results(tmp_path / "runner")["examples"]["example_id"]
    assert len(ids) == SVA.limit and not ids.duplicated().any()
    _same_tables(tmp_path, synthetic_run[0])


def test_sva_with_two_ray_workers_equals_the_serial_run(synthetic_run, tmp_path):
    pytest.importorskip("ray")
    sva.run(tmp_path, replace(SVA, workers=2), progress=False)
    _same_tables(tmp_path, synthetic_run[0])


def test_sva_workers_without_ray_say_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(sbp.InputError, match=r'pip install "semiring-backprop\[ray\]"'):
        sva.run(tmp_path, replace(SVA, workers=2), progress=False)
    assert not (tmp_path / "model").exists()  # refused before any work


# "hasn't" / "haven't" split into three pieces each, "barks" / "woofs" into two (both
# differ), "woo" is one: verbs of several tokens
WORDS = (
    "the dog ##s near key cabinet cabinets of is are here hasn haven ' t bar ##ks woo ##fs".split()
)


def _save_bert(d, model_cls):
    """A random ``model_cls`` (BERT) whose vocabulary splits "dogs" into "dog ##s" and
    lacks "run", saved to ``d`` with its tokenizer (which has [MASK]); see WORDS."""
    (d / "vocab.txt").write_text("\n".join(list(entropy_sanity.SPECIAL) + WORDS) + "\n")
    transformers.BertTokenizer(str(d / "vocab.txt")).save_pretrained(d)
    cfg = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def word_piece_model(tmp_path_factory, _offline_quiet):
    return _save_bert(tmp_path_factory.mktemp("bert"), transformers.BertForMaskedLM)


@pytest.fixture(scope="module")
def headless_model(tmp_path_factory, _offline_quiet):
    """The encoder alone (``BertModel``): a checkpoint without the masked-LM head."""
    return _save_bert(tmp_path_factory.mktemp("bert_headless"), transformers.BertModel)


def _blimp(prefix, good, bad, rest, subject, attractors) -> str:
    return json.dumps({
        "sentence_good": f"{prefix} {good} {rest}", "sentence_bad": f"{prefix} {bad} {rest}",
        "one_prefix_prefix": prefix, "one_prefix_word_good": good, "one_prefix_word_bad": bad,
        "subject": subject, "attractors": attractors,
    })  # fmt: skip


def test_sva_on_a_blimp_file_maps_words_to_pieces_and_skips(word_piece_model, tmp_path):
    data = tmp_path / "agreement.jsonl"
    data.write_text("\n".join([
        _blimp("the dogs near the key", "are", "is", "here", 1, [4]),
        _blimp("the dog near the cabinets", "run", "runs", "here", 1, [4]),  # not in vocab
        _blimp("the key of the cabinets", "is", "are", "here", 1, [4]),
    ]) + "\n")  # fmt: skip
    out = tmp_path / "out"
    result = experiments.run("sva", out, model=str(word_piece_model), data=str(data),
                             aggregation=("oplus",), progress=False)  # fmt: skip
    summary = result["summary"]
    assert summary["skipped"] == 1 and summary["explained"] == 2 and "note" not in summary
    (reason,) = summary["skip_reasons"]
    assert "'run'" in reason and "vocabulary" in reason
    from semiring_backprop.runner import skipped_examples

    assert skipped_examples(out / "runner") == {"2": reason}
    # [CLS] the dog ##s near the key [MASK] here [SEP]
    first, third = _example(out, "1"), _example(out, "3")
    assert first["subject_tokens"] == [2, 3] and first["attractor_tokens"] == [6]
    assert first["position"] == 7 and third["subject_tokens"] == [2]
    assert pd.read_csv(out / "entropy.csv")["example"].tolist() == [1, 3]


def test_sva_refuses_a_file_without_examples_and_a_run_that_explains_none(
    word_piece_model, tmp_path
):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(sbp.InputError, match="empty.jsonl: no examples"):
        experiments.run("sva", tmp_path / "a", model=str(word_piece_model), data=str(empty),
                        progress=False)  # fmt: skip
    none = tmp_path / "none.jsonl"  # every verb is out of the vocabulary: each is skipped
    none.write_text(_blimp("the dog near the cabinets", "run", "runs", "here", 1, [4]) + "\n")
    why = r"none of the 1 examples .*'run'.*runner/summary.json"
    with pytest.raises(sbp.InputError, match=why):
        experiments.run("sva", tmp_path / "b", model=str(word_piece_model), data=str(none),
                        aggregation=("oplus",), progress=False)  # fmt: skip


class _SlowTokenizer:
    """A tokenizer seen as slow: ``word_pieces`` must tokenize word by word."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_word_pieces_fast_and_word_by_word(word_piece_model):
    tok = transformers.AutoTokenizer.from_pretrained(word_piece_model)
    words = ["the", "dogs", tok.mask_token, "here"]
    ids = tok.convert_tokens_to_ids(["[CLS]", "the", "dog", "##s", "[MASK]", "here", "[SEP]"])
    expected = (ids, [[1], [2, 3], [4], [5]])
    assert sva_inputs.word_pieces(tok, words) == expected
    assert sva_inputs.word_pieces(_SlowTokenizer(tok), words) == expected


def test_sva_linzen_without_positions_needs_spacy(tmp_path, monkeypatch):
    data = tmp_path / "agreement.tsv"
    data.write_text("1\tthe keys to the cabinet are here\tthe keys to the cabinet ***mask*** "
                    "here\tare\tis\n")  # fmt: skip
    monkeypatch.setitem(sys.modules, "spacy", None)  # import spacy -> ImportError
    with pytest.raises(sbp.InputError, match="spaCy"):
        experiments.run("sva", tmp_path / "out", data=str(data), progress=False)
    assert not (tmp_path / "out" / "model").exists()  # failed before building a model


def test_cli_sva_takes_the_spacy_pipeline_as_an_option(tmp_path, capsys):
    pytest.importorskip("spacy")
    from semiring_backprop import cli

    data = tmp_path / "agreement.tsv"
    data.write_text("1\tthe keys to the cabinet are here\tthe keys to the cabinet ***mask*** "
                    "here\tare\tis\n")  # fmt: skip
    argv = ["experiment", "sva", "--out", str(tmp_path / "out"), "--set", f"data={data}",
            "nlp=no_such_pipeline_here"]  # fmt: skip
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: spaCy is installed but its pipeline 'no_such_pipeline_here'")
    assert "Traceback" not in err and out == "" and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "model").exists()


# -- verbs of several tokens, subjects the parser cannot find, malformed lines ----------


def _flat_parse(text):
    """A parse that gives no word a subject (as when a verb is tagged as a noun)."""
    from types import SimpleNamespace

    toks, at = [], 0
    for i, w in enumerate(text.split(" ")):
        toks.append(SimpleNamespace(i=i, text=w, idx=at, tag_="NN", dep_="dep"))
        at += len(w) + 1
    for t in toks:
        t.head = t
    return toks


MULTI = [
    _blimp("the dog near the cabinets", "is", "are", "here", 1, [4]),
    _blimp("the dog near the cabinets", "hasn't", "haven't", "here", 1, [4]),  # 3 masks, 1 read
    _blimp("the dog near the cabinets", "barks", "woofs", "here", 1, [4]),  # 2 masks, 2 read
    _blimp("the dog near the cabinets", "barks", "woo", "here", 1, [4]),  # 2 pieces against 1
    json.dumps({"sentence_good": "the dogs near the key are here",
                "sentence_bad": "the dogs near the key is here",
                "one_prefix_prefix": "the dogs near the key", "one_prefix_word_good": "are",
                "one_prefix_word_bad": "is"}),  # no positions: the parser finds no subject
    "{not json",
]  # fmt: skip


@pytest.fixture(scope="module")
def multi_runs(word_piece_model, tmp_path_factory, _offline_quiet):
    from semiring_backprop.data import agreement

    d = tmp_path_factory.mktemp("multi")
    data = d / "agreement.jsonl"
    data.write_text("\n".join(MULTI) + "\n")
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(agreement, "_parser", lambda nlp: _flat_parse)
        for multi in (False, True):
            out = d / f"multi-{multi}"
            result = experiments.run("sva", out, model=str(word_piece_model), data=str(data),
                                     aggregation=("oplus",), multi_token=multi,
                                     progress=False)  # fmt: skip
            runs[multi] = (out, result["summary"])
    return data, runs


def test_sva_counts_what_it_skips(multi_runs):
    data, runs = multi_runs
    _, summary = runs[False]
    assert summary["explained"] == 1 and summary["skipped"] == 4
    assert summary["skipped_by_kind"] == {"multi_token_verb": 3, "no_subject": 1}
    assert summary["multi_token_verbs"]["skipped"] == 3
    assert summary["multi_token_verbs"]["explained"] == 0
    note = summary["multi_token_verbs"]["note"]
    assert note.startswith("3 examples were skipped because a verb splits into several tokens")
    assert summary["skip_reasons"]["no subject: the parse gives the verb (tagged NN, dep dep) "
                                   "no nsubj"] == 1  # fmt: skip
    assert summary["malformed_lines"] == 1
    assert summary["malformed"] == [f"{data}:6: not valid JSON (Expecting property name "
                                    "enclosed in double quotes, column 2)"]  # fmt: skip
    _, summary = runs[True]
    assert summary["explained"] == 3 and summary["skipped"] == 2
    assert summary["skipped_by_kind"] == {"multi_token_lengths": 1, "no_subject": 1}
    assert summary["multi_token_verbs"] == {
        "multi_token": True, "explained": 2, "skipped": 1,
        "note": "1 examples were skipped because the two verbs split into different numbers "
                "of tokens"}  # fmt: skip


def _plain_logp(model_dir, ids):
    model = transformers.BertForMaskedLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)


PIECES = [(1, ["hasn", "'", "t"], ["haven", "'", "t"]), (2, ["bar", "##ks"], ["woo", "##fs"])]


@pytest.mark.parametrize(("key", "good", "bad"), PIECES)
def test_sva_multi_token_score_equals_the_model_forward(multi_runs, word_piece_model, key,
                                                        good, bad):  # fmt: skip
    _, runs = multi_runs
    out, _ = runs[True]
    vocab = _vocab(word_piece_model)
    row = _example(out, str(key + 1))  # the data's line number
    row["input_ids"] = [vocab.index(t) for t in row["token_texts"]]
    k = len(good)
    # [CLS] the dog near the cabinets [MASK] x k here [SEP], worked out by hand
    tokens = ["[CLS]", "the", "dog", "near", "the", "cabinets", *["[MASK]"] * k, "here", "[SEP]"]
    assert row["input_ids"] == [vocab.index(t) for t in tokens]
    assert row["verb_tokens"] == k and row["subject_tokens"] == [2]
    assert row["attractor_tokens"] == [5]
    # the score is the sum over the masks of log p(good piece) - log p(bad piece),
    # from the model's own forward (shared pieces included: they cancel)
    logp = _plain_logp(word_piece_model, row["input_ids"])
    expected = sum(float(logp[6 + j, vocab.index(g)] - logp[6 + j, vocab.index(b)])
                   for j, (g, b) in enumerate(zip(good, bad)))  # fmt: skip
    assert row["score"] == pytest.approx(expected, abs=1e-5)
    differ = [6 + j for j, (g, b) in enumerate(zip(good, bad)) if g != b]
    assert row["mask_positions"] == differ
    # the explained function is that sum over the differing pieces: the embedding entropy
    # of a direct pass on the plain model with constant indices
    model = transformers.BertForMaskedLM.from_pretrained(word_piece_model).eval()
    pairs = [(6 + j, vocab.index(g), vocab.index(b)) for j, (g, b) in enumerate(zip(good, bad))
             if g != b]  # fmt: skip

    def score(o):
        lp = o.logits[0].log_softmax(-1)
        return sum(lp[p, g] - lp[p, b] for p, g, b in pairs)

    ids = torch.tensor([row["input_ids"]])
    res = sbp.backprop(model, kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                       output=score, semirings=[sbp.Entropy()])  # fmt: skip
    h = res.at("bert.embeddings.word_embeddings", sbp.Entropy()).entropy.double()
    entropy = pd.read_csv(out / "entropy.csv").set_index("example")
    assert entropy.loc[key + 1, "entropy"] == pytest.approx(float(h.mean()), rel=1e-5)


def test_sva_refuses_to_mix_settings(synthetic_run):
    out, _ = synthetic_run
    with pytest.raises(sbp.InputError, match="granularity"):
        sva.run(out, replace(SVA, granularity="tensor"), progress=False)


def test_sva_config_errors(tmp_path):
    with pytest.raises(sbp.InputError, match="aggregation"):
        experiments.run("sva", tmp_path, aggregation=("sum",), progress=False)
    with pytest.raises(sbp.InputError, match="length_bins"):
        experiments.run("sva", tmp_path, length_bins=(10, 5), progress=False)
    with pytest.raises(sbp.InputError, match="nlp must name a spaCy pipeline"):
        experiments.run("sva", tmp_path, nlp=" ", progress=False)


# -- a checkpoint without the masked-LM head --------------------------------------------

# BertForMaskedLM's head, by hand: what a BertModel checkpoint lacks (the decoder's weight
# is tied to the word embeddings, which it has)
BERT_HEAD = ["cls.predictions.bias", "cls.predictions.transform.dense.weight",
             "cls.predictions.transform.LayerNorm.weight"]  # fmt: skip


def _check_refusal(message, model_dir):
    for name in BERT_HEAD:
        assert name in message, f"{name} not named in: {message}"
    assert "cls.predictions.decoder.weight" not in message
    assert "BertForMaskedLM.save_pretrained" in message and str(model_dir) in message


@pytest.mark.parametrize("name", ["entropy-sanity", "sva"])
def test_experiments_refuse_a_model_without_head(name, headless_model, tmp_path):
    with pytest.raises(sbp.InputError) as info:
        experiments.run(name, tmp_path / "out", quick=True, model=str(headless_model),
                        progress=False)  # fmt: skip
    _check_refusal(str(info.value), headless_model)
    out = tmp_path / "out"
    assert not (out / "summary.json").exists()
    for records in ("length.jsonl", "examples.jsonl"):  # no example was explained
        assert not (out / records).exists() or not (out / records).read_text().strip()


def test_cli_experiment_refuses_a_model_without_head(headless_model, tmp_path, capsys):
    from semiring_backprop import cli

    argv = ["experiment", "sva", "--quick", "--out", str(tmp_path / "out"),
            "--set", f"model={headless_model}"]  # fmt: skip
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error:") and "Traceback" not in err and out == ""
    _check_refusal(err, headless_model)
