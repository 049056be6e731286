"""What is explained is what was asked for, and what cannot be is refused clearly (issue
29): checkpoints without tokenizer files, the scalar of one-output, multi-label and
end-token heads, weights that cannot be read, semiring names, Captum's options, and a
checkpoint loaded once for several ``explain`` calls.

Models are tiny random BERT / Llama configs saved with ``save_pretrained`` beside
tokenizers built from a small vocabulary. Oracles: the model's own logits, recomputed
here with transformers; ``torch.autograd``; Captum's own ``Saliency``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop import cli
from semiring_backprop.errors import InputError, LoadError
from semiring_backprop.hf import explain as explain_mod
from semiring_backprop.hf import loading
from semiring_backprop.hf.explain import explain, semirings_for

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the keys to cabinet is are on table a dog cat".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MASKED_TEXT = "the keys to the cabinet [MASK] on the table"


def _save_bert(d: Path, cls, tokenizer: bool = True, **config) -> str:
    d.mkdir(parents=True, exist_ok=True)
    vocab = SPECIAL + WORDS + ["##s"]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizer(str(d / "vocab.txt"))
    if tokenizer:
        tok.save_pretrained(d)
    else:
        (d / "vocab.txt").unlink()
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, **config)  # fmt: skip
    torch.manual_seed(0)
    cls(cfg).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def root(tmp_path_factory, _offline_quiet):
    return tmp_path_factory.mktemp("targets")


def _cli(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(argv, capsys, *phrases):
    rc, out, err = _cli(argv, capsys)
    assert rc == 2, (out, err)
    assert err.startswith("error:") and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in err, err
    return err


# -- 1. a checkpoint directory without tokenizer files -----------------------------------


@pytest.mark.parametrize("task", ["classification", "similarity"])
def test_a_checkpoint_without_tokenizer_files_is_refused(root, task, capsys):
    cls = transformers.BertForSequenceClassification if task == "classification" else (
        transformers.BertModel)  # fmt: skip
    d = _save_bert(root / f"notok-{task}", cls, tokenizer=False)
    # the oracle: transformers really builds a tokenizer that reads every word as unknown
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = tok("the keys are here")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["[CLS]", "[UNK]", "[UNK]", "[UNK]", "[UNK]", "[SEP]"]
    argv = ["explain", d, "--task", task, "--text", "the keys are here"]
    if task == "similarity":
        argv += ["--text-pair", "a dog", "--pooling", "mean"]
    _refused(argv, capsys, "has no tokenizer vocabulary", "no tokenizer files",
             "tokenizer.save_pretrained")  # fmt: skip


def test_run_refuses_it_in_the_same_words(root, tmp_path):
    d = _save_bert(root / "notok-mlm", transformers.BertForMaskedLM, tokenizer=False)
    with pytest.raises(LoadError, match="has no tokenizer vocabulary"):
        sbp.run(d, examples=[{"text": MASKED_TEXT, "target": "are", "foil": "is"}],
                out=tmp_path / "out", figures=False, progress=False)  # fmt: skip


def test_a_tokenizer_that_knows_no_word_of_the_text_is_refused(root):
    """A loaded model with another model's tokenizer: every word reads as unknown."""
    d = _save_bert(root / "cls", transformers.BertForSequenceClassification)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(d)
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "zebra": 3}
    wl = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    wl.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    other = transformers.PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]",
                                                 cls_token="[CLS]", sep_token="[SEP]")  # fmt: skip
    assert set(other("the keys are here")["input_ids"]) == {0}  # the oracle: all unknown
    with pytest.raises(InputError, match=r"no word of the text is in the tokenizer's vocabulary"):
        explain(model, "the keys are here", task="classification", tokenizer=other)


# -- 2. the explained scalar is the one asked for --------------------------------------


def test_logprob_of_a_one_output_head_is_refused(root, capsys):
    d = _save_bert(root / "one", transformers.BertForSequenceClassification, num_labels=1)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(d).eval()
    enc = transformers.AutoTokenizer.from_pretrained(d)("the keys", return_tensors="pt")
    with torch.no_grad():  # the oracle: log_softmax of its one output is identically 0
        assert model(**enc).logits.log_softmax(-1).abs().max() == 0
    _refused(["explain", d, "--task", "classification", "--text", "the keys", "--score",
              "logprob"], capsys, "head with one output", "--score logit")  # fmt: skip
    with pytest.raises(InputError, match="head with one output"):
        sbp.ClassLabel(0, score="logprob")(torch.randn(1, 1))


def test_a_multi_label_head_explains_log_sigmoid(root):
    d = _save_bert(root / "multi", transformers.BertForSequenceClassification, num_labels=3,
                   problem_type="multi_label_classification")  # fmt: skip
    model = transformers.AutoModelForSequenceClassification.from_pretrained(d).eval()
    enc = transformers.AutoTokenizer.from_pretrained(d)("the keys are here", return_tensors="pt")
    with torch.no_grad():
        logsig = torch.nn.functional.logsigmoid(model(**enc).logits[0].double())
    one = explain(d, "the keys are here", "1", task="classification", score="logprob",
                  semirings=["real"])  # fmt: skip
    assert one.score == pytest.approx(float(logsig[1]), abs=1e-5)
    assert "sigmoid" in one.what
    two = explain(d, "the keys are here", "1", "2", task="classification", score="logprob",
                  semirings=["real"])  # fmt: skip
    assert two.score == pytest.approx(float(logsig[1] - logsig[2]), abs=1e-5)


def test_multi_label_gradient_is_autograds():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    x = torch.randn(1, 4, dtype=torch.float64)
    target = sbp.ClassLabel(1, foil=2, score="logprob", multi_label=True)
    res = sbp.backprop(mlp, (x,), output=target, semirings=[sbp.Real()])
    xg = x.clone().requires_grad_()
    ls = torch.nn.functional.logsigmoid(mlp(xg)[0])
    (want,) = torch.autograd.grad(ls[1] - ls[2], xg)
    torch.testing.assert_close(res.at(0, sbp.Real()), want)


def _llama_with_end_token(d: Path) -> str:
    """A causal LM whose tokenizer adds ``<s>`` before and ``</s>`` after every text."""
    from tokenizers.processors import TemplateProcessing

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>"] + WORDS)}
    wl = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    wl.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    wl.post_processor = TemplateProcessing(single="<s> $A </s>",
                                           special_tokens=[("<s>", 1), ("</s>", 2)])  # fmt: skip
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]",
                                               bos_token="<s>", eos_token="</s>")  # fmt: skip
    tok.save_pretrained(d)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return str(d)


def test_a_causal_lm_is_explained_after_the_text_not_after_its_end_token(root):
    d = _llama_with_end_token(root / "llama-eos")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = "the keys to the cabinet"
    assert tok.convert_ids_to_tokens(tok(text)["input_ids"])[-1] == "</s>"
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.tensor([[1] + tok(text, add_special_tokens=False)["input_ids"]])  # <s> text
    with torch.no_grad():  # the oracle: the next word after the text's last word
        logp = model(input_ids=ids).logits[0, -1].double().log_softmax(-1)
    want = float(logp[tok.convert_tokens_to_ids("are")] - logp[tok.convert_tokens_to_ids("is")])
    ex = explain(d, text, "are", "is", semirings=["real"])
    assert ex.tokens == ["<s>", *text.split()]
    assert ex.position == len(ex.tokens) - 1
    assert ex.score == pytest.approx(want, abs=1e-5)


def test_only_the_end_tokens_the_tokenizer_added_are_dropped(root):
    """An end token typed in the text stays (it is the text); the appended one goes."""
    d = _llama_with_end_token(root / "llama-eos-typed")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    for text, want in [("the keys", ["<s>", "the", "keys"]),
                       ("the keys </s>", ["<s>", "the", "keys", "</s>"])]:  # fmt: skip
        enc = loading._drop_end_tokens(tok, text, tok(text, return_tensors="pt"))
        assert tok.convert_ids_to_tokens(enc["input_ids"][0].tolist()) == want
        assert enc["attention_mask"].shape == enc["input_ids"].shape


# -- 3. errors that say what to do ---------------------------------------------------------


def test_a_vocabulary_size_edited_in_config_json_is_a_clear_error(root, capsys):
    d = Path(_save_bert(root / "vocab-edited", transformers.BertForMaskedLM))
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 40
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(["explain", str(d), "--text", MASKED_TEXT, "--target", "are", "--foil", "is"],
             capsys, "do not have the shapes its config.json gives", "vocab_size=40",
             "17 rows")  # fmt: skip


class _Planted:
    """Pickled, it calls ``open(path, "w")``: the file appears only if it ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_weights_are_refused_without_running_them(root, tmp_path, capsys):
    from safetensors.torch import load_file

    src = Path(_save_bert(root / "to-pickle", transformers.BertForMaskedLM))
    d = tmp_path / "pickled"
    d.mkdir()
    for p in src.iterdir():
        if p.suffix != ".safetensors":
            (d / p.name).write_bytes(p.read_bytes())
    weights = dict(load_file(src / "model.safetensors"))
    weights["planted"] = _Planted(tmp_path / "ran")
    torch.save(weights, d / "pytorch_model.bin")
    _refused(["explain", str(d), "--text", MASKED_TEXT, "--target", "are", "--foil", "is"],
             capsys, "holds pickled code", "use safetensors", "save_pretrained")  # fmt: skip
    assert not (tmp_path / "ran").exists()


def test_one_semiring_name_is_a_name_not_its_letters(tmp_path):
    assert semirings_for("max") == semirings_for(["max"])
    with pytest.raises(InputError, match=r"letters of 'max'.*semirings=\['max'\]"):
        semirings_for(("m", "a", "x"))
    # run takes one name too: the same tables as the list of that one name
    d = _save_bert(tmp_path / "mlm", transformers.BertForMaskedLM)
    examples = [{"text": MASKED_TEXT, "target": "are", "foil": "is"}]
    tables = []
    for name, given in (("one", "max"), ("list", ["max"])):
        sbp.run(d, examples=examples, out=tmp_path / name, semirings=given, progress=False)
        tables.append(sbp.load_results(tmp_path / name)["tokens"])
    assert any("max" in c for c in tables[0].columns), list(tables[0].columns)
    assert not any("entropy" in c for c in tables[0].columns), list(tables[0].columns)
    pd = pytest.importorskip("pandas")
    pd.testing.assert_frame_equal(tables[0], tables[1])


def test_explain_takes_one_semiring_name(root):
    d = _save_bert(root / "mlm", transformers.BertForMaskedLM)
    one = explain(d, MASKED_TEXT, "are", "is", semirings="real")
    assert [s.name for s in one.result.semirings] == ["Real"]
    model = transformers.AutoModelForMaskedLM.from_pretrained(d).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    enc = tok(MASKED_TEXT, return_tensors="pt")
    enc.pop("token_type_ids")
    with torch.no_grad():
        logp = model(**enc).logits[0, 6].double().log_softmax(-1)
    assert one.score == pytest.approx(float(logp[tok.vocab["are"]] - logp[tok.vocab["is"]]),
                                      abs=1e-5)  # fmt: skip


# -- 3b. Captum: baselines= and NoiseTunnel ---------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double().eval()


def test_captum_baselines_are_a_clear_error():
    pytest.importorskip("captum.attr")
    from semiring_backprop.captum import SemiringAttribution

    x = torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(InputError, match=r"no baselines=.*IntegratedGradients"):
        SemiringAttribution(_mlp()).attribute(x, target=1, baselines=torch.zeros_like(x))
    with pytest.raises(InputError, match=r"not abs=: drop it"):
        SemiringAttribution(_mlp()).attribute(x, target=1, abs=False)


@pytest.mark.parametrize("nt_type", ["smoothgrad", "smoothgrad_sq", "vargrad"])
def test_noise_tunnel_around_real_is_noise_tunnel_around_saliency(nt_type):
    attr = pytest.importorskip("captum.attr")
    from semiring_backprop.captum import SemiringAttribution

    mlp = _mlp()
    x = torch.randn(2, 4, dtype=torch.float64)
    torch.manual_seed(5)
    got = attr.NoiseTunnel(SemiringAttribution(mlp)).attribute(
        x, nt_type=nt_type, nt_samples=4, stdevs=0.1, target=1)  # fmt: skip
    torch.manual_seed(5)
    want = attr.NoiseTunnel(attr.Saliency(mlp)).attribute(
        x, nt_type=nt_type, nt_samples=4, stdevs=0.1, target=1, abs=False)  # fmt: skip
    torch.testing.assert_close(got, want)


# -- 4. a newcomer's first hour -------------------------------------------------------------


def test_the_readmes_first_command_installs_what_the_demo_needs_only():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]  # fmt: skip
    readme = (ROOT / "README.md").read_text()
    first, second = [ln for ln in readme.splitlines() if ln.startswith("pip install")][:2]
    assert "torch==2.13.0" in first and "torch==2.13.0" in second
    assert "semiring-backprop demo" in first and "pytest" in second
    first_extras = first.split('"')[1].removeprefix("-e ").strip(".[]").split(",")
    assert "test" not in first_extras
    installed = {d.split(">")[0].split("<")[0].split("[")[0] for e in first_extras
                 for d in extras[e]}  # fmt: skip
    for needed in ("transformers", "pandas", "matplotlib", "tqdm"):
        assert needed in installed, needed
    for heavy in ("ray", "spacy", "transformer-lens", "mkdocs-material", "pytest"):
        assert heavy not in installed, heavy


def test_the_demo_says_what_its_block_titles_mean():
    from semiring_backprop.experiments import first_token

    for word in ("oplus", "bucket_sum", "neuron", "tensor", "granularity"):
        assert word in first_token.LEGEND
    assert set(first_token.AGGREGATIONS) <= set(first_token.LEGEND.split())


def test_a_checkpoint_explained_twice_is_loaded_once_and_again_when_saved_again(root, monkeypatch):
    d = Path(_save_bert(root / "kept", transformers.BertForMaskedLM))
    explain_mod.clear_loaded()
    loads = []
    real = explain_mod.load
    monkeypatch.setattr(explain_mod, "load", lambda *a, **k: loads.append(a) or real(*a, **k))
    first = explain(d, MASKED_TEXT, "are", "is", semirings=["real"])
    second = explain(d, MASKED_TEXT, "are", "is", semirings=["real"])
    assert len(loads) == 1 and second.score == first.score
    # saved again with other weights: loaded again, and the score is the new model's
    torch.manual_seed(7)
    cfg = transformers.BertConfig.from_pretrained(d)
    new = transformers.BertForMaskedLM(cfg).eval()
    new.save_pretrained(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    enc = tok(MASKED_TEXT, return_tensors="pt")
    enc.pop("token_type_ids")
    with torch.no_grad():
        logp = new(**enc).logits[0, 6].double().log_softmax(-1)
    third = explain(d, MASKED_TEXT, "are", "is", semirings=["real"])
    assert len(loads) == 2
    assert third.score == pytest.approx(float(logp[tok.vocab["are"]] - logp[tok.vocab["is"]]),
                                        abs=1e-5)  # fmt: skip
    assert third.score != pytest.approx(first.score, abs=1e-4)
    explain_mod.clear_loaded()
