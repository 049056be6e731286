"""``explain(..., paper=True)`` and ``semiring-backprop explain --paper`` (issue 30).

Oracles: an independent ``sbp.backprop(model, ..., paper=True)`` on the same saved model
and the same input, with the explained scalar recomputed from the model's own logits; the
paper's winner-take-all rule checked from that pass's values at the attention input (the
best hidden unit's value, once per token); the printed words of the report.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import cli  # noqa: E402
from semiring_backprop.hf.explain import explain  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

WORDS = "the keys to cabinet is are on table a dog cat".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXT = "the keys to the cabinet [MASK] on the table"
MASK = 6  # [CLS] the keys to the cabinet [MASK] ...
EMBEDDINGS = "bert.embeddings.LayerNorm"  # layer 0's attention input


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, _offline_quiet):
    d = tmp_path_factory.mktemp("bert_paper")
    (d / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    transformers.BertTokenizer(str(d / "vocab.txt")).save_pretrained(d)
    cfg = transformers.BertConfig(vocab_size=len(SPECIAL + WORDS), hidden_size=16,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def paper_run(bert_dir):
    return explain(bert_dir, TEXT, "are", "is", semirings=["max"], paper=True)


@pytest.fixture(scope="module")
def oracle(bert_dir):
    """The same scalar, by a plain ``sbp.backprop(paper=True)`` on the same model."""
    tok = transformers.BertTokenizer.from_pretrained(bert_dir)
    model = transformers.BertForMaskedLM.from_pretrained(bert_dir).eval()
    enc = tok(TEXT, return_tensors="pt")
    t, f = tok.convert_tokens_to_ids(["are", "is"])
    assert tok.convert_ids_to_tokens(enc["input_ids"][0])[MASK] == "[MASK]"

    def score(out):  # the paper's analysis (analyze_kvq.py): logits[good] - logits[bad]
        return out.logits[0, MASK, t] - out.logits[0, MASK, f]

    with torch.no_grad():  # the number asked for: the margin of log-probabilities
        logp = torch.log_softmax(model(**enc).logits[0, MASK], -1)
        want = float(logp[t] - logp[f])
    kwargs = {k: v for k, v in enc.items()}
    sr = sbp.MaxProduct("tensor")
    res = sbp.backprop(model, kwargs=kwargs, output=score, semirings=[sr], paper=True)
    plain = sbp.backprop(model, kwargs=kwargs, output=score, semirings=[sr])
    return res, plain, want, sr


def test_paper_mode_values_equal_backprop_paper(paper_run, oracle):
    res, plain, want, sr = oracle
    ex = paper_run
    assert ex.paper and ex.result.graph.paper
    assert ex.score == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert ex.result.semirings == [sr]  # tensor granularity
    got, ref = ex.result.at(EMBEDDINGS, sr), res.at(EMBEDDINGS, sr)
    torch.testing.assert_close(got.hi, ref.hi, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.lo, ref.lo, rtol=1e-5, atol=1e-7)
    # the switch changes the graph: without paper mode the values differ
    assert not torch.allclose(plain.at(EMBEDDINGS, sr).hi, ref.hi, rtol=1e-3)


def test_both_branch_tables_equal_the_independent_pass(paper_run, oracle):
    res, _, _, sr = oracle
    ex = paper_run
    keys = ["layer", "sublayer", "token", "branch"]
    for table, agg in ((ex.layers, "oplus"), (ex.paper_layers, "paper")):
        want = res.layer_table(semirings=[sr], aggregate=agg, by="role")
        got = pd.DataFrame(table).sort_values(keys).reset_index(drop=True)
        want = want.sort_values(keys).reset_index(drop=True)
        assert got[keys].values.tolist() == want[keys].values.tolist()
        assert got["value"].tolist() == pytest.approx(want["value"].tolist(), rel=1e-5, abs=1e-7)
        assert got["winner"].tolist() == want["winner"].tolist()


def test_paper_table_is_winner_take_all_at_the_best_unit(paper_run, oracle):
    """Layer 0's attention: per token one branch holds the token's best hidden unit's
    value (the max of the pass's hi over the attention input's units), the others 0."""
    res, _, _, sr = oracle
    best = res.at(EMBEDDINGS, sr).hi[0].max(-1).values
    table = paper_run.paper_layers
    first = table[(table.sublayer == "attention") & (table.layer == table.layer.min())]
    assert set(first.branch) == {"skip", "query", "key", "value"}
    for token, rows in first.groupby("token"):
        assert (rows["value"] != 0).sum() <= 1
        assert rows["value"].sum() == pytest.approx(float(best[token]), rel=1e-5, abs=1e-7)
        assert rows["winner"].sum() == 1


def test_report_and_files_say_which_quantity(paper_run, tmp_path):
    text = paper_run.report()
    assert "paper mode: traced as the paper's library (brunoflow)" in text
    assert "ours, branches per layer (MaxProduct(tensor), ⊕ over each token's hidden" in text
    assert "the paper's quantity, branches per layer" in text
    assert "winner-take-all per token" in text and "zeros kept" in text
    assert text.index("ours, branches") < text.index("the paper's quantity, branches")
    files = paper_run.write(tmp_path)
    assert str(tmp_path / "paper_layers.csv") in files
    page = json.loads((tmp_path / "explanation.json").read_text())
    assert page["paper"] is True and len(page["paper_layers"]) == len(paper_run.paper_layers)


def test_default_is_not_paper_mode(bert_dir):
    ex = explain(bert_dir, TEXT, "are", "is", semirings=["max"])
    assert not ex.paper and ex.paper_layers is None and not ex.result.graph.paper
    assert ex.result.semirings == [sbp.MaxProduct("neuron")]
    text = ex.report()
    assert "paper mode" not in text and "the paper's quantity" not in text


def test_paper_refuses_neuron_granularity(bert_dir):
    with pytest.raises(sbp.InputError, match="tensor granularity"):
        explain(bert_dir, TEXT, "are", "is", semirings=["max"], paper=True, granularity="neuron")


def _cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_paper_flag(bert_dir, paper_run):
    argv = ["explain", bert_dir, "--text", TEXT, "--target", "are", "--foil", "is",
            "--semiring", "max"]  # fmt: skip
    rc, out, err = _cli([*argv, "--paper"])
    assert rc == 0, err
    assert out == paper_run.report() + "\n"
    rc, _, err = _cli([*argv, "--paper", "--granularity", "neuron"])
    assert rc == 2 and "tensor granularity" in err


def test_view_shows_both_tables_each_named(paper_run):
    """The notebook / HTML view and its text show ours and the paper's table, each under a
    heading naming its quantity; every cell of the paper's heatmap is the letter of the
    branch that won that token's best unit (the table, checked against the oracle above)."""
    view = paper_run.view()
    text, page = view.text(), view.html()
    assert "branches per layer and token (ours)" in page
    assert "branches per layer and token (the paper&#x27;s quantity)" in page or (
        "branches per layer and token (the paper's quantity)" in page
    )
    heads = [line for line in text.splitlines() if line.startswith("winning branch per layer")]
    assert len(heads) == 2 and "ours" in heads[0] and "the paper's quantity" in heads[1]
    block = text.split(heads[1])[1].splitlines()
    letters = {"skip": "S", "query": "Q", "key": "K", "value": "V", "mlp": "M"}
    table = paper_run.paper_layers
    names = {(0, "attention"): "layer 0 attention", (0, "mlp"): "layer 0 mlp",
             (1, "attention"): "layer 1 attention", (1, "mlp"): "layer 1 mlp"}  # fmt: skip
    for (layer, sub), label in names.items():
        line = next(s for s in block if s.strip().startswith(label))
        cells = line[22:].split()
        won = table[(table.layer == layer) & (table.sublayer == sub) & table.winner]
        # a winner of value 0 (brunoflow's unselected elements keep edges of weight 0) has
        # no share to show: "-", as where no path leaves the token
        want = {int(t): letters[b] for t, b, v in zip(won.token, won.branch, won.value) if v}
        got = [c for c in cells if not c.endswith("%")]
        tokens = sorted(table.token.unique())
        assert len(got) == len(tokens)
        for tok, cell in zip(tokens, got):
            assert cell == want.get(int(tok), "-"), (label, tok, cell)


def test_paper_mode_reads_the_margin_from_the_logits(paper_run, bert_dir):
    """As the paper's analysis did: the same number as log p(are) - log p(is) (checked
    above against the model's log-softmax), from a graph without the log-softmax; the
    report says so. Without a foil the log-probability stays (a logit is another number),
    and WordChoice(logits=True) refuses terms whose signs do not cancel."""
    assert paper_run.what.startswith("logit(are) - logit(is)")
    assert "as the paper did" in paper_run.what
    alone = explain(bert_dir, TEXT, "are", semirings=["max"], paper=True)
    assert alone.what.startswith("log p(are)")
    tok = transformers.BertTokenizer.from_pretrained(bert_dir)
    model = transformers.BertForMaskedLM.from_pretrained(bert_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(**tok(TEXT, return_tensors="pt")).logits[0, MASK], -1)
    assert alone.score == pytest.approx(float(logp[tok.vocab["are"]]), rel=1e-5)
    with pytest.raises(sbp.InputError, match="signs cancel"):
        sbp.WordChoice(((0, MASK, 5, 1),), logits=True)
    one = sbp.WordChoice(((0, MASK, 5, 1), (0, MASK, 6, -1)), logits=True)
    out = model(**tok(TEXT, return_tensors="pt"))
    assert torch.allclose(one(out), out.logits[0, MASK, 5] - out.logits[0, MASK, 6])
