"""The runner's ``aggregation`` setting (the branch table read with ⊕ and with bucket sums)
and the per-token means over hidden units in the tokens table.

Oracles: a direct pass of ``sbp.backprop`` on the plain Hugging Face model, one example
at a time with constant indices (the runner batches examples and traces a wrapper with
tensor indices); entropies are bounded by ``log #paths``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop.data import MASK  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402
from semiring_backprop.runner import Example, Explainer, load_results, prepare, run  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

WORDS = "the keys to cabinet is are on table a dog cat".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = [f"the keys to the cabinet {MASK} on the table", f"a dog to the cabinet {MASK} on a table"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory, _offline_quiet):
    d = tmp_path_factory.mktemp("bert")
    vocab = SPECIAL + WORDS
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(d / "vocab.txt")).save_pretrained(d)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(d)
    model = transformers.BertForMaskedLM.from_pretrained(d).eval()
    return d, model, transformers.AutoTokenizer.from_pretrained(d)


def _direct(model, item, semirings):
    ids = torch.tensor([item.ids])

    def score(out):
        logp = out.logits[0, item.position].log_softmax(-1)
        return logp[item.target] - logp[item.foil]

    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return sbp.backprop(model, kwargs=kwargs, output=score, semirings=semirings)


def test_aggregations_and_unit_means_equal_a_direct_pass(bert):
    _, model, tok = bert
    items = [prepare(Example(str(k), t, "are", "is"), tok, model.config, "masked")
             for k, t in enumerate(TEXTS)]  # fmt: skip
    assert len(items[0].ids) == len(items[1].ids)  # one batch of two
    srs = [sbp.MaxProduct(), sbp.Entropy(), sbp.PathCount()]
    tables = Explainer(model, tok, srs, aggregation=("oplus", "bucket_sum"))(items)
    b, t = tables["branches"], tables["tokens"]
    # bucket sums exist for the selective semiring only
    assert set(b.loc[b.aggregation == "bucket_sum", "semiring"]) == {srs[0].name}
    assert set(b.loc[b.aggregation == "oplus", "semiring"]) == {s.name for s in srs}
    keys = ["semiring", "layer", "sublayer", "token", "branch"]
    place = "bert.embeddings.word_embeddings"
    for k, it in enumerate(items):
        res = _direct(model, it, srs)
        for agg in ("oplus", "bucket_sum"):
            want = res.layer_table(semirings=srs[:1] if agg == "bucket_sum" else srs,
                                   aggregate=agg, by="role")  # fmt: skip
            got = b[(b.example_id == str(k)) & (b.aggregation == agg)]
            got, want = (f.sort_values(keys).reset_index(drop=True) for f in (got, want))
            assert len(got) == len(want) > 0
            assert (got[keys] == want[keys]).all().all()
            assert (got["path"] == want["path"]).all() and (got["winner"] == want["winner"]).all()
            torch.testing.assert_close(torch.tensor(got["value"].to_numpy()),
                                       torch.tensor(want["value"].to_numpy()),
                                       rtol=1e-4, atol=1e-6)  # fmt: skip
        h = res.at(place, sbp.Entropy()).entropy[0].double()  # (tokens, hidden)
        n = res.at(place, sbp.PathCount()).log_count[0].double()
        mine = t[t.example_id == str(k)].sort_values("token")
        for col, want in (("entropy_unit_mean", h.mean(-1)), ("log_paths_unit_mean", n.mean(-1)),
                          ("normalized_entropy_unit_mean", (h / n).mean(-1))):  # fmt: skip
            torch.testing.assert_close(torch.tensor(mine[col].to_numpy()), want,
                                       rtol=1e-4, atol=1e-6)  # fmt: skip
        assert (mine["entropy_unit_mean"] <= mine["log_paths_unit_mean"] + 1e-9).all()


def test_aggregation_is_a_setting_of_the_run(bert, tmp_path):
    d, _, _ = bert
    examples = [{"id": str(k), "text": t, "target": "are", "foil": "is"}
                for k, t in enumerate(TEXTS)]  # fmt: skip
    kw = dict(examples=examples, semirings=("max",), progress=False, figures=False)
    r = run(str(d), out=tmp_path, aggregation=("oplus", "bucket_sum"), **kw)
    assert r["explained"] == 2
    b = load_results(tmp_path)["branches"]
    assert set(b["aggregation"]) == {"oplus", "bucket_sum"}
    name = sbp.MaxProduct().name
    assert set(r["summary"]["branches"]) == {name, f"{name}, bucket_sum"}
    with pytest.raises(InputError, match=r"other settings \(aggregation\)"):
        run(str(d), out=tmp_path, aggregation="oplus", **kw)
    with pytest.raises(InputError, match="aggregation must be some of oplus, bucket_sum"):
        run(str(d), out=tmp_path / "b", aggregation=("sum",), **kw)
    with pytest.raises(InputError, match="bucket_sum.*selective semiring"):
        run(str(d), out=tmp_path / "c", aggregation=("bucket_sum",),
            **{**kw, "semirings": ("real",)})  # fmt: skip


def test_cli_run_takes_the_aggregation(bert, tmp_path, capsys):
    import json

    from semiring_backprop import cli

    d, _, _ = bert
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t, "target": "are", "foil": "is"}) + "\n"
                            for t in TEXTS))  # fmt: skip
    argv = ["run", str(d), "--data", str(data), "--out", str(tmp_path / "out"), "--semiring",
            "max", "--aggregation", "oplus", "bucket_sum", "--no-figures"]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert set(load_results(tmp_path / "out")["branches"]["aggregation"]) == {"oplus", "bucket_sum"}
    assert cli.main([*argv[:-4], "--no-figures"]) == 2  # only oplus now: other settings
    assert "other settings (aggregation)" in capsys.readouterr().err
