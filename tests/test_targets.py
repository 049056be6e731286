"""The targets people ask for: ``explain --task lm|classification|similarity|token`` and
the target objects of :mod:`semiring_backprop.targets` used as ``output=``.

Tiny random models of the matching Hugging Face classes are saved with
``save_pretrained`` next to a tokenizer written from a small vocabulary (nothing is
downloaded; the hub is offline for the module). Oracles are independent of the code
under test: each score is recomputed with the model's own forward (classification and
token logits, masked and causal LM log-probabilities written out by hand with the masks
and the teacher-forced pieces in the text, pooled embeddings pooled in the test from
each text run alone), the Real semiring against ``torch.autograd``, and the CLI's
``explanation.json`` read back. Each traced run happens once, in a module fixture.
"""

from __future__ import annotations

import contextlib
import io
import json
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pd = pytest.importorskip("pandas")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from semiring_backprop import backprop, cli  # noqa: E402
from semiring_backprop.errors import InputError, LoadError  # noqa: E402
from semiring_backprop.hf import explain as explain_mod  # noqa: E402
from semiring_backprop.hf.explain import explain  # noqa: E402
from semiring_backprop.hf.tasks import label_index, read_pooling  # noqa: E402
from semiring_backprop.semirings import MaxProduct, Real  # noqa: E402
from semiring_backprop.targets import ClassLabel, EmbeddingDim, Similarity  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = "the keys to cabinet is are on table a dog cat".split()
VOCAB = SPECIAL + WORDS + ["##s"]  # "dogs" = dog + ##s, "cats" = cat + ##s
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TAGS = {0: "O", 1: "B-THING", 2: "I-THING"}
EMB = "bert.embeddings.word_embeddings"
TEXT_A = "the dog is on the table"
TEXT_B = "a cat is on the cabinet table"  # longer: the batch is padded; the pair is 16 long
MASKED = "the keys to the [MASK] are on the table"


def _config(**kw):
    return transformers.BertConfig(
        vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, **kw,
    )  # fmt: skip


def _save(d, model, seed=0):
    (d / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    transformers.BertTokenizer(str(d / "vocab.txt")).save_pretrained(d)
    model.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, _offline_quiet):
    """Saved checkpoints: a sequence and a token classifier, a masked LM, a bare encoder
    as a sentence-transformers directory (mean pooling, Normalize) and without one."""
    mk = tmp_path_factory.mktemp
    torch.manual_seed(0)
    out = types.SimpleNamespace()
    out.cls = _save(
        mk("cls"),
        transformers.BertForSequenceClassification(
            _config(num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
        ),
    )
    out.tok = _save(
        mk("tok"),
        transformers.BertForTokenClassification(
            _config(num_labels=3, id2label=TAGS, label2id={v: k for k, v in TAGS.items()})
        ),
    )
    out.mlm = _save(mk("mlm"), transformers.BertForMaskedLM(_config()))
    st = mk("st")
    out.st = _save(st, transformers.BertModel(_config()))
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 16, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }))  # fmt: skip
    (st / "2_Normalize").mkdir()
    out.bare = _save(mk("bare"), transformers.BertModel(_config()))
    return out


def run_cli(argv, out_dir=None):
    """``cli.main(argv)`` with output captured and the Explanation it made kept."""
    made, real = [], explain_mod.explain
    argv = list(argv) + (["--out", str(out_dir)] if out_dir is not None else [])
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(explain_mod, "explain", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    run = types.SimpleNamespace(rc=rc, out=out.getvalue(), err=err.getvalue(), dir=out_dir,
                                ex=made[0] if made else None)  # fmt: skip
    assert rc == 0, run.err
    if out_dir is not None:
        run.json = json.loads((out_dir / "explanation.json").read_text())
    return run


def _embedding_grad(model, loss_fn, **inputs):
    """d loss / d (word-embedding output) by autograd."""
    kept = {}

    def hook(mod, args, out):
        out.retain_grad()
        kept["x"] = out

    h = model.get_input_embeddings().register_forward_hook(hook)
    try:
        loss_fn(model(**inputs)).backward()
    finally:
        h.remove()
    return kept["x"].grad.detach()


def _tok(d):
    return transformers.AutoTokenizer.from_pretrained(d)


# -- classification (a sentence pair) ---------------------------------------------------


@pytest.fixture(scope="module")
def cls_run(dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("cls_out")
    argv = ["explain", dirs.cls, "--task", "classification", "--text", TEXT_A, "--text-pair",
            TEXT_B, "--label", "positive", "--foil", "0", "--semiring", "max", "real",
            "--html", str(out / "report.html")]  # fmt: skip
    return run_cli(argv, out)


def test_classification_pair_score_and_gradient(cls_run, dirs):
    model = transformers.BertForSequenceClassification.from_pretrained(dirs.cls).eval()
    enc = _tok(dirs.cls)(TEXT_A, TEXT_B, return_tensors="pt")
    assert enc["token_type_ids"].max() == 1  # a real pair: the second segment counts
    with torch.no_grad():
        logits = model(**enc).logits[0]
    ex = cls_run.ex
    assert ex.score == pytest.approx(float(logits[2] - logits[0]), abs=1e-5)
    assert cls_run.json["score"] == pytest.approx(ex.score)
    assert cls_run.json["task"] == "classification"
    assert cls_run.json["explained"] == "logit(positive) - logit(negative)"
    assert ex.tokens == _tok(dirs.cls).convert_ids_to_tokens(enc["input_ids"][0])
    assert "explained: logit(positive) - logit(negative) = " in cls_run.out
    grad = _embedding_grad(model, lambda o: o.logits[0, 2] - o.logits[0, 0], **enc)
    torch.testing.assert_close(ex.result.at(EMB, Real()), grad, rtol=1e-4, atol=1e-6)
    assert ex.path.value == pytest.approx(float(ex.result.at(EMB, MaxProduct()).hi.max()))
    assert (cls_run.dir / "top_path.csv").exists()
    page = (cls_run.dir / "report.html").read_text()
    assert "logit(positive) − logit(negative)" in page and TEXT_B in page


# -- token classification ------------------------------------------------------------


@pytest.fixture(scope="module")
def token_run(dirs, tmp_path_factory):
    argv = ["explain", dirs.tok, "--task", "token", "--text", TEXT_A, "--position", "2",
            "--label", "B-THING", "--score", "logprob", "--semiring", "real"]  # fmt: skip
    return run_cli(argv, tmp_path_factory.mktemp("tok_out"))


def test_token_label_score_and_gradient(token_run, dirs):
    model = transformers.BertForTokenClassification.from_pretrained(dirs.tok).eval()
    enc = _tok(dirs.tok)(TEXT_A, return_tensors="pt")
    with torch.no_grad():
        want = float(model(**enc).logits[0, 2].log_softmax(-1)[1])
    ex = token_run.ex
    assert ex.position == 2 and ex.tokens[2] == "dog"
    assert ex.score == pytest.approx(want, abs=1e-5)
    assert token_run.json["score"] == pytest.approx(want, abs=1e-5)
    assert token_run.json["explained"] == "log p(B-THING) at position 2 ('dog')"
    grad = _embedding_grad(model, lambda o: o.logits[0, 2].log_softmax(-1)[1], **enc)
    torch.testing.assert_close(ex.result.at(EMB, Real()), grad, rtol=1e-4, atol=1e-6)


# -- similarity of two texts (a sentence-transformers directory) -----------------------


def _pooled(model, tok, text, pooling="mean", normalize=True):
    """The text's embedding, run alone (no padding), pooled here."""
    enc = tok(text, return_tensors="pt")
    h = model(**enc).last_hidden_state[0]
    v = {"mean": h.mean(0), "cls": h[0], "max": h.max(0).values}[pooling]
    return v / v.norm() if normalize else v


@pytest.fixture(scope="module")
def sim_run(dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("sim_out")
    argv = ["explain", dirs.st, "--task", "similarity", "--text", TEXT_A, "--text-pair",
            TEXT_B, "--semiring", "max", "real", "--html", str(out / "report.html")]  # fmt: skip
    return run_cli(argv, out)


def test_similarity_score_from_the_checkpoints_pooling(sim_run, dirs):
    model, tok = transformers.BertModel.from_pretrained(dirs.st).eval(), _tok(dirs.st)
    with torch.no_grad():
        a, b = _pooled(model, tok, TEXT_A), _pooled(model, tok, TEXT_B)
    want = float(a @ b)  # both unit length
    ex = sim_run.ex
    assert ex.score == pytest.approx(want, abs=1e-5)
    assert sim_run.json["score"] == pytest.approx(want, abs=1e-5)
    assert sim_run.json["explained"] == "cos(text, text pair), mean pooling, normalized"


def test_similarity_gradient_and_both_texts_reported(sim_run, dirs):
    model, tok = transformers.BertModel.from_pretrained(dirs.st).eval(), _tok(dirs.st)
    enc = tok([TEXT_A, TEXT_B], padding=True, return_tensors="pt")
    mask = enc["attention_mask"]
    assert mask[0].sum() < mask[1].sum()  # the first text is padded

    def cosine(out):
        h = out.last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        p = (h * m).sum(1) / m.sum(1)  # masked mean, written the other way
        return torch.nn.functional.cosine_similarity(p[0], p[1], dim=0)

    ex = sim_run.ex
    grad = _embedding_grad(model, cosine, **enc)
    torch.testing.assert_close(ex.result.at("embeddings.word_embeddings", Real()), grad,
                               rtol=1e-4, atol=1e-6)  # fmt: skip
    rows = [tok.convert_ids_to_tokens(r) for r in enc["input_ids"]]
    assert ex.examples == rows and sim_run.json["examples"] == rows
    assert set(ex.layers.example) == {0, 1}
    hi = ex.result.at("embeddings.word_embeddings", MaxProduct()).hi
    assert len(ex.paths) == 2 and len(sim_run.json["top_paths"]) == 2
    for e, path in enumerate(ex.paths):
        assert path.steps[0].index[0] == e  # each text's own top path
        assert path.value == pytest.approx(float(hi[e].max()), rel=1e-6)
    assert "tokens of example 1:" in sim_run.out
    assert (sim_run.dir / "top_path_1.png").exists()
    back = pd.read_csv(sim_run.dir / "top_path_1.csv")
    assert back.running.iloc[-1] == pytest.approx(ex.paths[1].value, rel=1e-5)
    page = (sim_run.dir / "report.html").read_text()
    assert "cos(text, text pair)" in page and "example 1" in page and "cabinet" in page


def test_similarity_max_pooling_as_output(dirs):
    """``Similarity`` given to ``backprop`` directly, max pooling over a padded batch."""
    model, tok = transformers.BertModel.from_pretrained(dirs.bare).eval(), _tok(dirs.bare)
    enc = tok([TEXT_B, TEXT_A], padding=True, return_tensors="pt")
    target = Similarity(enc["attention_mask"], pooling="max")
    res = backprop(model, kwargs=dict(enc), output=target, semirings=[Real()])
    with torch.no_grad():
        a = _pooled(model, tok, TEXT_B, "max", normalize=False)
        b = _pooled(model, tok, TEXT_A, "max", normalize=False)
    want = float(a @ b / (a.norm() * b.norm()))
    assert float(res.values[res.graph.output_node]) == pytest.approx(want, abs=1e-5)


def test_embedding_dimension_as_output(dirs):
    model, tok = transformers.BertModel.from_pretrained(dirs.st).eval(), _tok(dirs.st)
    enc = tok(TEXT_A, return_tensors="pt")
    target = EmbeddingDim(enc["attention_mask"], 5, pooling="cls", normalize=True)
    res = backprop(model, kwargs=dict(enc), output=target, semirings=[Real()])
    with torch.no_grad():
        want = float(_pooled(model, tok, TEXT_A, "cls")[5])
    assert float(res.values[res.graph.output_node]) == pytest.approx(want, abs=1e-6)
    grad = _embedding_grad(model, lambda o: _unit(o.last_hidden_state[0, 0])[5], **enc)
    torch.testing.assert_close(res.at("embeddings.word_embeddings", Real()), grad,
                               rtol=1e-4, atol=1e-6)  # fmt: skip


def _unit(v):
    return v / v.norm()


def test_read_pooling(dirs, tmp_path):
    got = read_pooling(dirs.st)
    assert got.modes == ("mean",) and got.normalize and got.transformer == ""
    assert read_pooling(dirs.bare) is None
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]))  # fmt: skip
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    with pytest.raises(LoadError, match="Dense"):
        read_pooling(str(tmp_path))


# -- language models: words of several tokens -------------------------------------------


@pytest.fixture(scope="module")
def mlm_run(dirs, tmp_path_factory):
    argv = ["explain", dirs.mlm, "--text", MASKED, "--target", "dogs", "--foil", "cat",
            "--semiring", "real"]  # fmt: skip
    return run_cli(argv, tmp_path_factory.mktemp("mlm_out"))


def test_masked_lm_word_of_two_pieces(mlm_run, dirs):
    model, tok = transformers.BertForMaskedLM.from_pretrained(dirs.mlm).eval(), _tok(dirs.mlm)
    two = tok(MASKED.replace("[MASK]", "[MASK] [MASK]"), return_tensors="pt")
    one = tok(MASKED, return_tensors="pt")
    pos = 5  # [CLS] the keys to the [MASK]
    dog, s, cat = (tok.convert_tokens_to_ids(w) for w in ("dog", "##s", "cat"))
    with torch.no_grad():
        lp2 = model(**two).logits[0].log_softmax(-1)
        lp1 = model(**one).logits[0].log_softmax(-1)
    want = float(lp2[pos, dog] + lp2[pos + 1, s] - lp1[pos, cat])
    ex = mlm_run.ex
    assert ex.score == pytest.approx(want, abs=1e-5)
    assert mlm_run.json["score"] == pytest.approx(want, abs=1e-5)
    assert len(ex.examples) == 2  # two masks, one mask: a padded batch of two
    assert "'dog' + '##s'" in mlm_run.out

    def oracle_two(out):
        lp = out.logits[0].log_softmax(-1)
        return lp[pos, dog] + lp[pos + 1, s]

    grad = _embedding_grad(model, oracle_two, **two)[0]
    got = ex.result.at(EMB, Real())[0, : grad.shape[0]]
    torch.testing.assert_close(got, grad, rtol=1e-4, atol=1e-6)


def test_causal_lm_words_of_two_pieces(dirs):
    """Teacher forcing: "dogs" is log p(dog | text) + log p(##s | text dog)."""
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS, "##s"])}
    wp = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    wp.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]")
    cfg = transformers.GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=2, n_head=2,
                                  n_positions=16, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()
    text = "the keys to the"
    ex = explain(model, text, "dogs", "cats", tokenizer=tok, semirings=("real",))
    ids = tok(text)["input_ids"]
    n = len(ids)
    dog, s, cat = vocab["dog"], vocab["##s"], vocab["cat"]
    with torch.no_grad():
        a = model(torch.tensor([ids + [dog]])).logits[0].log_softmax(-1)
        b = model(torch.tensor([ids + [cat]])).logits[0].log_softmax(-1)
    want = float(a[n - 1, dog] + a[n, s] - b[n - 1, cat] - b[n, s])
    assert ex.score == pytest.approx(want, abs=1e-5)
    assert ex.position == n - 1 and ex.task == "lm"


# -- errors -------------------------------------------------------------------------------


def _error(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith("error:") and "Traceback" not in err, err
    assert err.count("\n") == 1  # one line
    return err


def test_label_not_in_id2label_lists_the_labels(dirs, capsys):
    err = _error(["explain", dirs.cls, "--task", "classification", "--text", TEXT_A,
                  "--label", "happy"], capsys)  # fmt: skip
    assert "'happy'" in err and "0: negative, 1: neutral, 2: positive" in err


def test_too_long_input_names_both_numbers(dirs, capsys):
    long = " ".join(["the"] * 15)  # 15 + [CLS] + [SEP] = 17 > 16
    err = _error(["explain", dirs.cls, "--task", "classification", "--text", long], capsys)
    assert "17 tokens long" in err and "at most 16" in err
    err = _error(["explain", dirs.st, "--task", "similarity", "--text", TEXT_A,
                  "--text-pair", long], capsys)  # fmt: skip
    assert "text pair is 17 tokens long" in err and "at most 16" in err
    # "dogs" as two masks makes a 16-token text 17 long
    text = " ".join(["the"] * 13 + ["[MASK]"])
    err = _error(["explain", dirs.mlm, "--text", text, "--target", "dogs"], capsys)
    assert "17 tokens long" in err and "at most 16" in err


def test_similarity_without_pooling_says_how_to_give_it(dirs, capsys):
    err = _error(["explain", dirs.bare, "--task", "similarity", "--text", TEXT_A,
                  "--text-pair", TEXT_B], capsys)  # fmt: skip
    assert "--pooling" in err and "modules.json" in err


def test_classification_on_a_bare_encoder_is_refused(dirs):
    with pytest.raises(LoadError, match="classifier.weight"):
        explain(dirs.st, TEXT_A, "positive", task="classification")


def test_token_task_needs_a_position(dirs, capsys):
    err = _error(["explain", dirs.tok, "--task", "token", "--text", TEXT_A], capsys)
    assert "--position" in err and "2:dog" in err


def test_label_index():
    cfg = transformers.BertConfig(num_labels=3, id2label=LABELS)
    assert label_index(cfg, "positive") == 2 and label_index(cfg, "1") == 1
    assert label_index(cfg, -1) == 2
    with pytest.raises(InputError, match="0: negative"):
        label_index(cfg, 3)
    with pytest.raises(InputError, match="score"):
        ClassLabel(0, score="prob")


# -- trace reuse ------------------------------------------------------------------------


def test_backprop_reuses_a_trace_for_an_equal_target_only():
    """``backprop`` keys a target object by its value: an equal one reuses the trace, a
    different one (another label, another embedding dimension) is traced anew and is
    right (against autograd)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).eval()
    x = torch.randn(1, 4)
    first = backprop(net, (x,), output=ClassLabel(1, foil=2), semirings=[Real()])
    again = backprop(net, (x,), output=ClassLabel(1, foil=2), semirings=[Real()])
    other = backprop(net, (x,), output=ClassLabel(0), semirings=[Real()])
    assert again.graph is first.graph and other.graph is not first.graph
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(net(xg)[0, 0], xg)
    torch.testing.assert_close(other.at(0, Real()), grad)

    def hidden(x):  # a stand-in encoder: (batch, tokens, hidden)
        return net(x).unsqueeze(0)

    mask = torch.ones(1, 1)
    a = backprop(hidden, (x,), output=EmbeddingDim(mask, 0), semirings=[Real()])
    b = backprop(hidden, (x,), output=EmbeddingDim(mask, 2), semirings=[Real()])
    assert b.graph is not a.graph
    with torch.no_grad():
        want = float(net(x)[0, 2])
    assert float(b.values[b.graph.output_node]) == pytest.approx(want)


def test_an_option_of_another_task_is_refused(dirs, capsys):
    err = _error(["explain", dirs.cls, "--task", "classification", "--text", TEXT_A,
                  "--pooling", "mean"], capsys)  # fmt: skip
    assert "--pooling does not apply to the classification task" in err
    err = _error(["explain", dirs.mlm, "--text", MASKED, "--target", "dogs",
                  "--text-pair", TEXT_B], capsys)  # fmt: skip
    assert "--text-pair does not apply to the lm task" in err
