"""End to end: ``explain(...)`` and ``semiring-backprop explain`` on tiny saved models.

Models are tiny random BERT / GPT-2 / Llama configs saved with ``save_pretrained`` next to
a tokenizer built from a small vocabulary (nothing is downloaded; the hub is switched to
offline mode for the whole module). Oracles are independent of the code under test: the
score is recomputed from the model's own logits, gradients from ``torch.autograd`` with
hooks, entropies are bounded by ``log #paths``; the files are read back with ``json`` and
``pandas``.

Tracing dominates the runtime (several seconds per explained call), so each explained
call runs once, in a module-scoped fixture, and is shared by the tests that read it:

* ``bert_run``: the CLI on the masked LM with the default semirings (max + entropy);
* ``bert_real_run``: the CLI with ``--semiring real --dtype float64``;
* ``gpt2_run``: the CLI on the causal LM with ``--granularity tensor``;
* ``llama_run``: ``explain(model, ..., tokenizer=tok)`` with an already-loaded Llama.

The CLI runs wrap ``semiring_backprop.hf.explain.explain`` to keep the ``Explanation`` that
the command printed and wrote (the CLI imports it from the module at call time).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path as FilePath

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pd = pytest.importorskip("pandas")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import Whitespace  # noqa: E402

from semiring_backprop import cli  # noqa: E402
from semiring_backprop.analysis.paths import Path  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402
from semiring_backprop.hf import explain as explain_mod  # noqa: E402
from semiring_backprop.hf.explain import Explanation, explain  # noqa: E402
from semiring_backprop.semirings import Entropy, MaxProduct, Real  # noqa: E402

WORDS = "the keys to cabinet is are on table a dog cat".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MASKED_TEXT = "the keys to the cabinet [MASK] on the table"
CAUSAL_TEXT = "the keys to the cabinet"
MASK_POSITION = 6  # [CLS] the keys to the cabinet [MASK] ...
PNG = b"\x89PNG\r\n\x1a\n"
BRANCHES = {"attention": {"skip", "query", "key", "value"}, "mlp": {"skip", "mlp"}}
FIGURES = [
    "branches_attention.png",
    "branches_mlp.png",
    "token_heatmap.png",
    "entropy.png",
    "top_path.png",
]


# -- environment ----------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest


# -- models ---------------------------------------------------------------------------


def _save_bert(d, model_cls) -> str:
    """A tiny random ``model_cls`` (BERT) and its tokenizer, with [MASK], saved to ``d``."""
    # "dogs" is not in the vocabulary but "dog" and "##s" are: it splits into two pieces
    vocab = SPECIAL + WORDS + ["##s"]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizer(str(d / "vocab.txt"))
    tok.save_pretrained(d)
    cfg = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, _offline_quiet):
    return _save_bert(tmp_path_factory.mktemp("bert"), transformers.BertForMaskedLM)


@pytest.fixture(scope="module")
def headless_bert_dir(tmp_path_factory, _offline_quiet):
    """The encoder alone (``BertModel``): no masked-LM head, a tokenizer with [MASK]."""
    return _save_bert(tmp_path_factory.mktemp("bert_headless"), transformers.BertModel)


def _word_level_tokenizer():
    vocab = {w: i for i, w in enumerate(["[UNK]"] + WORDS)}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]"), vocab


def _gpt2_config(vocab):
    return transformers.GPT2Config(
        vocab_size=len(vocab),
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, _offline_quiet):
    d = tmp_path_factory.mktemp("gpt2")
    tok, vocab = _word_level_tokenizer()
    tok.save_pretrained(d)
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(_gpt2_config(vocab)).save_pretrained(d)
    return str(d)


def _llama_config(vocab):
    return transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, _offline_quiet):
    d = tmp_path_factory.mktemp("llama")
    tok, vocab = _word_level_tokenizer()
    tok.save_pretrained(d)
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(_llama_config(vocab)).save_pretrained(d)
    return str(d)


# -- running the CLI ------------------------------------------------------------------


@dataclass
class CliRun:
    rc: int
    out: str
    err: str
    ex: Explanation | None
    dir: FilePath | None


def run_cli(argv, out_dir=None) -> CliRun:
    """``cli.main(argv)`` with stdout/stderr captured and the Explanation it made kept."""
    made = []
    real = explain_mod.explain

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    argv = list(argv) + (["--out", str(out_dir)] if out_dir is not None else [])
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(explain_mod, "explain", spy)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    return CliRun(rc, out.getvalue(), err.getvalue(), made[0] if made else None, out_dir)


def _explain_argv(model, text, target, foil, *extra):
    return ["explain", str(model), "--text", text, "--target", target, "--foil", foil, *extra]


@pytest.fixture(scope="module")
def bert_run(bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_out")
    run = run_cli(_explain_argv(bert_dir, MASKED_TEXT, "are", "is"), out)
    assert run.rc == 0, run.err
    return run


@pytest.fixture(scope="module")
def bert_real_run(bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_real_out")
    argv = _explain_argv(
        bert_dir, MASKED_TEXT, "are", "is", "--semiring", "real", "--dtype", "float64"
    )
    run = run_cli(argv, out)
    assert run.rc == 0, run.err
    return run


@pytest.fixture(scope="module")
def gpt2_run(gpt2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2_out")
    run = run_cli(_explain_argv(gpt2_dir, CAUSAL_TEXT, "are", "is", "--granularity", "tensor"), out)
    assert run.rc == 0, run.err
    return run


@pytest.fixture(scope="module")
def llama_run(llama_dir):
    """An already-loaded model and tokenizer; logits are taken before and after."""
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    enc = tok(CAUSAL_TEXT, return_tensors="pt")
    with torch.no_grad():
        before = model(**enc).logits.clone()
    ex = explain(model, CAUSAL_TEXT, "are", "is", tokenizer=tok)
    with torch.no_grad():
        after = model(**enc).logits.clone()
    return model, tok, enc, before, after, ex


# -- oracles --------------------------------------------------------------------------


def _reference(model_cls, model_dir, text, dtype=torch.float32):
    """The model's own log-probabilities and ids, straight from transformers."""
    model = model_cls.from_pretrained(model_dir, dtype=dtype).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        logp = model(**enc).logits[0].log_softmax(-1)
    return model, tok, enc, logp


def _vocab_id(tok, word):
    i = tok.convert_tokens_to_ids(word)
    assert i != tok.unk_token_id
    return i


def _first_float(args, kwargs):
    items = list(args) + list(kwargs.values())
    return next(x for x in items if isinstance(x, torch.Tensor) and x.is_floating_point())


def _autograd(model, enc, pos, t_id, f_id, inputs=(), outputs=()):
    """d score / d tensor by autograd at module inputs (pre-hooks) and outputs (hooks)."""
    kept, handles = {}, []

    def pre(name):
        def hook(mod, args, kwargs):
            x = _first_float(args, kwargs)
            x.retain_grad()
            kept[name] = x

        return hook

    def post(name):
        def hook(mod, args, out):
            out.retain_grad()
            kept[name] = out

        return hook

    modules = dict(model.named_modules())
    for name in inputs:
        handles.append(modules[name].register_forward_pre_hook(pre(name), with_kwargs=True))
    for name in outputs:
        handles.append(modules[name].register_forward_hook(post(name)))
    try:
        kwargs = {k: v for k, v in enc.items() if k != "token_type_ids"}
        logp = model(**kwargs).logits[0, pos].log_softmax(-1)
        (logp[t_id] - logp[f_id]).backward()
    finally:
        for h in handles:
            h.remove()
    return {name: t.grad.detach() for name, t in kept.items()}


def _no_constants(text):
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name} in the output")

    return json.loads(text, parse_constant=refuse)


def _check_layers(ex, n_tokens):
    layers = ex.layers
    assert set(layers.layer) == {0, 1}
    assert set(layers.sublayer) == set(BRANCHES)
    for sub, names in BRANCHES.items():
        assert set(layers[layers.sublayer == sub].branch) == names, sub
    assert set(layers.token) == set(range(n_tokens))
    assert list(layers.token_text) == [ex.tokens[t] for t in layers.token]
    # one winner per (layer, sublayer, token, semiring) where some branch has a path, none
    # where no path leaves the token (log #paths = -inf in every branch: PathCount rows)
    groups = layers.groupby(["layer", "sublayer", "token", "semiring"])
    wins = groups.winner.sum()
    counts = layers[layers.semiring == "PathCount"].groupby(["layer", "sublayer", "token"])
    has_path = counts.value.apply(lambda v: bool((v > -math.inf).any()))
    reach = pd.Series([bool(has_path[key[:3]]) for key in wins.index], index=wins.index, dtype=bool)
    assert (wins[reach] == 1).all()
    assert (wins[~reach] == 0).all()
    won = layers[layers.winner].set_index(["layer", "sublayer", "token", "semiring"]).value
    assert (won == groups.value.max().reindex(won.index)).all()  # the winner is the max


def _check_last_layer_structure(ex, semiring):
    """Only the explained position's last-layer MLP input (and its query / residual at the
    last attention block) reaches the output: elsewhere no path, the MaxProduct zero."""
    t = ex.layers[(ex.layers.semiring == semiring) & (ex.layers.layer == 1)]
    n = len(ex.tokens)
    mlp = t[t.sublayer == "mlp"]
    assert set(mlp.token) == set(range(n))
    assert (mlp[mlp.token != ex.position].value == -math.inf).all()
    assert mlp[mlp.token == ex.position].value.map(math.isfinite).all()
    att = t[(t.sublayer == "attention") & t.branch.isin(["query", "skip"])]
    assert set(att.token) == set(range(n))
    assert (att[att.token != ex.position].value == -math.inf).all()
    assert att[att.token == ex.position].value.map(math.isfinite).all()
    kv = t[(t.sublayer == "attention") & t.branch.isin(["key", "value"])]
    assert set(kv.token) == set(range(n))
    assert kv.value.map(math.isfinite).all()  # every token is attended to


def _check_entropy(ex):
    h = ex.entropy
    assert len(h) == len(ex.tokens)
    assert list(h.token) == list(range(len(ex.tokens)))
    assert list(h.token_text) == ex.tokens
    assert (h.entropy >= -1e-6).all()
    assert (h.log_paths > 0).all()
    # H <= log N for any distribution over N paths
    assert (h.entropy <= h.log_paths * (1 + 1e-5) + 1e-6).all()
    assert ((h.normalized >= 0) & (h.normalized <= 1 + 1e-6)).all()
    assert h.normalized.to_numpy() == pytest.approx((h.entropy / h.log_paths).to_numpy(), rel=1e-5)
    agg = ex.result.aggregate(ex.source, Entropy()).entropy[0].double()
    assert h.entropy.to_numpy() == pytest.approx(agg.numpy(), rel=1e-6, abs=1e-9)


def _check_neuron_path(ex, embedding_module):
    path = ex.path
    assert isinstance(path, Path)
    assert ex.source == embedding_module
    assert path.steps[0].module == embedding_module
    assert path.steps[0].running == 1.0 and path.steps[0].edge_weight is None
    running = 1.0
    for step in path.steps[1:]:
        running *= step.edge_weight
        assert step.running == pytest.approx(running, rel=1e-9)
    assert path.steps[-1].running == pytest.approx(path.value, rel=1e-4)
    best = float(ex.result.at(ex.source, MaxProduct()).hi.max())
    assert path.value == pytest.approx(best, rel=1e-6)
    assert path.value > 0


def _check_png(path: FilePath):
    data = path.read_bytes()
    assert data.startswith(PNG), path
    assert len(data) > 1000, path


# -- 1. the masked LM, default semirings ------------------------------------------------


@pytest.fixture(scope="module")
def bert_ref(bert_dir):
    return _reference(transformers.BertForMaskedLM, bert_dir, MASKED_TEXT)


def test_masked_score_is_the_models_log_ratio(bert_run, bert_ref):
    _, tok, _, logp = bert_ref
    ex = bert_run.ex
    assert ex.kind == "masked"
    pos = MASK_POSITION
    want = float(logp[pos, _vocab_id(tok, "are")] - logp[pos, _vocab_id(tok, "is")])
    assert ex.score == pytest.approx(want, abs=1e-5)


def test_masked_position_and_tokens(bert_run, bert_ref, bert_dir):
    _, tok, enc, _ = bert_ref
    ids = enc["input_ids"][0].tolist()
    ex = bert_run.ex
    assert ex.position == ids.index(tok.mask_token_id) == MASK_POSITION
    assert ex.tokens == tok.convert_ids_to_tokens(ids)
    assert ex.tokens[0] == "[CLS]" and ex.tokens[-1] == "[SEP]"
    assert ex.model_id == bert_dir and ex.target == "are" and ex.foil == "is"


def test_masked_layer_table(bert_run):
    ex = bert_run.ex
    _check_layers(ex, len(ex.tokens))
    assert set(ex.layers.semiring) <= {"MaxProduct(neuron)", "Entropy", "PathCount"}
    assert "MaxProduct(neuron)" in set(ex.layers.semiring)
    _check_last_layer_structure(ex, "MaxProduct(neuron)")


def test_masked_top_path(bert_run):
    _check_neuron_path(bert_run.ex, "bert.embeddings.word_embeddings")


def test_masked_entropy(bert_run):
    _check_entropy(bert_run.ex)


# -- 3. the CLI's report and files ------------------------------------------------------


def test_cli_report(bert_run):
    assert bert_run.rc == 0
    out = bert_run.out
    for text in ("explained:", "layer 0 attention", "layer 1 mlp", "top gradient path"):
        assert text in out
    assert "entropy" in out
    assert "[MASK]" in out
    assert f"{bert_run.ex.score:.4f}" in out
    assert "Traceback" not in bert_run.err


def test_cli_writes_json(bert_run):
    ex = bert_run.ex
    data = _no_constants((bert_run.dir / "explanation.json").read_text())
    assert {"model", "score", "layers", "top_path", "entropy"} <= set(data)
    assert data["model"] == ex.model_id
    assert data["score"] == pytest.approx(ex.score)
    assert data["position"] == ex.position and data["tokens"] == ex.tokens
    assert len(data["layers"]) == len(ex.layers)
    assert len(data["entropy"]) == len(ex.tokens)
    assert data["top_path"]["value"] == pytest.approx(ex.path.value)
    assert len(data["top_path"]["steps"]) == len(ex.path)


def test_cli_writes_csv_and_png(bert_run):
    ex, out = bert_run.ex, bert_run.dir
    layers = pd.read_csv(out / "layers.csv")
    assert len(layers) == len(ex.layers)
    assert list(layers.columns) == list(ex.layers.columns)
    entropy = pd.read_csv(out / "entropy.csv")
    assert len(entropy) == len(ex.tokens)
    assert entropy.entropy.to_numpy() == pytest.approx(ex.entropy.entropy.to_numpy())
    top = pd.read_csv(out / "top_path.csv")
    assert len(top) == len(ex.path)
    for name in FIGURES:
        _check_png(out / name)
    assert f"wrote {4 + len(FIGURES)} files" in bert_run.out


# -- --semiring real --dtype float64 ----------------------------------------------------


def test_real_float64_score_and_gradients(bert_real_run, bert_dir):
    ex = bert_real_run.ex
    assert ex.path is None and ex.entropy is None
    assert ex.result.values[ex.result.graph.output_node].dtype == torch.float64
    model, tok, enc, logp = _reference(
        transformers.BertForMaskedLM, bert_dir, MASKED_TEXT, torch.float64
    )
    t_id, f_id = _vocab_id(tok, "are"), _vocab_id(tok, "is")
    pos = MASK_POSITION
    assert ex.score == pytest.approx(float(logp[pos, t_id] - logp[pos, f_id]), abs=1e-10)

    emb = "bert.embeddings.word_embeddings"
    layers = [f"bert.encoder.layer.{i}" for i in (0, 1)]
    mlps = [f"{name}.intermediate" for name in layers]
    grads = _autograd(model, enc, pos, t_id, f_id, inputs=layers + mlps, outputs=[emb])
    torch.testing.assert_close(ex.result.at(emb, Real()), grads[emb], rtol=1e-9, atol=1e-12)

    # the branches at each fan-out point split its gradient: they add up to it (per token)
    t = ex.layers
    assert set(t.semiring) == {"Real"}
    for i in (0, 1):
        for sub, name in (("attention", layers[i]), ("mlp", mlps[i])):
            part = t[(t.layer == i) & (t.sublayer == sub)]
            total = part.groupby("token").value.sum().sort_index().to_numpy()
            want = grads[name][0].sum(-1).numpy()
            assert total == pytest.approx(want, rel=1e-7, abs=1e-12), (i, sub)


def test_real_only_cli_output(bert_real_run):
    run = bert_real_run
    assert "explained:" in run.out and "layer 0 attention" in run.out
    assert "top gradient path" not in run.out
    assert "per-token path entropy" not in run.out
    data = _no_constants((run.dir / "explanation.json").read_text())
    assert data["top_path"] is None and data["entropy"] is None
    assert len(pd.read_csv(run.dir / "layers.csv")) == len(run.ex.layers)
    for name in ("top_path.csv", "entropy.csv", "entropy.png", "top_path.png"):
        assert not (run.dir / name).exists(), name
    for name in ("branches_attention.png", "branches_mlp.png", "token_heatmap.png"):
        _check_png(run.dir / name)


# -- 2. causal LMs ----------------------------------------------------------------------


def test_causal_score_at_last_position(gpt2_run, gpt2_dir):
    ex = gpt2_run.ex
    _, tok, enc, logp = _reference(transformers.GPT2LMHeadModel, gpt2_dir, CAUSAL_TEXT)
    ids = enc["input_ids"][0].tolist()
    assert ex.kind == "causal"
    assert ex.position == len(ids) - 1 == 4
    assert ex.tokens == tok.convert_ids_to_tokens(ids) == CAUSAL_TEXT.split()
    want = float(logp[-1, _vocab_id(tok, "are")] - logp[-1, _vocab_id(tok, "is")])
    assert ex.score == pytest.approx(want, abs=1e-5)


def test_causal_tensor_granularity(gpt2_run):
    ex = gpt2_run.ex
    _check_layers(ex, len(ex.tokens))
    assert "MaxProduct(tensor)" in set(ex.layers.semiring)
    _check_entropy(ex)
    path = ex.path
    assert isinstance(path, Path)
    assert ex.source == "transformer.wte"
    assert path.steps[0].module == "transformer.wte"
    assert all(s.index is None for s in path.steps)  # a sequence of ops
    best = float(ex.result.at(ex.source, MaxProduct("tensor")).hi.max())
    assert path.value == pytest.approx(best, rel=1e-6)
    assert "top gradient path" in gpt2_run.out
    for name in FIGURES:
        _check_png(gpt2_run.dir / name)
    assert len(pd.read_csv(gpt2_run.dir / "top_path.csv")) == len(path)


# -- 5. an already-loaded model -------------------------------------------------------


def test_loaded_model_with_tokenizer(llama_run, llama_dir):
    model, tok, enc, before, after, ex = llama_run
    ids = enc["input_ids"][0].tolist()
    assert ex.kind == "causal"
    assert ex.model_id == llama_dir  # config._name_or_path
    assert ex.position == len(ids) - 1
    assert ex.tokens == tok.convert_ids_to_tokens(ids)
    logp = before[0, -1].log_softmax(-1)
    want = float(logp[_vocab_id(tok, "are")] - logp[_vocab_id(tok, "is")])
    assert ex.score == pytest.approx(want, abs=1e-5)
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # the model is left as it was
    _check_layers(ex, len(ids))
    _check_last_layer_structure(ex, "MaxProduct(neuron)")
    _check_neuron_path(ex, "model.embed_tokens")
    _check_entropy(ex)


def test_loaded_model_needs_tokenizer(llama_run):
    model = llama_run[0]
    with pytest.raises(InputError, match="tokenizer"):
        explain(model, CAUSAL_TEXT, "are", "is")


def test_in_memory_causal_model_with_mask_token_tokenizer(bert_dir):
    tok = transformers.AutoTokenizer.from_pretrained(bert_dir)  # has [MASK]
    cfg = transformers.GPT2Config(
        vocab_size=len(tok),
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()  # config.architectures is None
    ex = explain(model, CAUSAL_TEXT, "are", "is", tokenizer=tok, semirings=("real",))
    assert ex.kind == "causal"
    assert ex.position == len(ex.tokens) - 1


def test_report_adds_real_values_of_one_branch():
    rows = [
        dict(layer=0, sublayer="mlp", token=t, token_text=text, consumer=c, branch=b,
             value=v, winner=b == "skip", semiring="Real")
        for t, text in enumerate(["a", "b"])
        for c, b, v in [("layers.0", "skip", 0.6), ("mlp.gate_proj", "mlp", 0.5),
                        ("mlp.up_proj", "mlp", 0.25)]
    ]  # fmt: skip
    ex = Explanation("m", "causal", "a b", "x", "y", ["a", "b"], 1, 0.0, None)
    ex.layers = pd.DataFrame(rows)
    lines = ex.report().splitlines()
    columns = ["token", "mlp", "skip", "winner"]
    header = next(i for i, ln in enumerate(lines) if ln.split() == columns)
    assert lines[header + 1].split()[:3] == ["a", "0.75", "0.6"]


# -- 4. errors through the CLI ----------------------------------------------------------

LONG_TEXT = " ".join(["the"] * 7 + ["[MASK]"] + ["the"] * 7)  # 15 words + [CLS] [SEP] = 17


@pytest.mark.parametrize(
    ("text", "target", "foil", "message"),
    [
        (MASKED_TEXT, "zebra", "is", "'zebra' is not in the model's vocabulary"),
        (MASKED_TEXT, "are", "zebra", "'zebra' is not in the model's vocabulary"),
        ("the keys to the cabinet are on the table", "are", "is", "has no [MASK]"),
        ("the keys [MASK] the cabinet [MASK] on the table", "are", "is", "has 2 [MASK]"),
        (LONG_TEXT, "are", "is", "17 tokens long; the model takes at most 16"),
        (MASKED_TEXT, "are", "are", "are the same token"),
    ],
    ids=["target-oov", "foil-oov", "no-mask", "two-masks", "too-long", "same"],
)
def test_cli_input_errors(bert_dir, text, target, foil, message, capsys):
    rc = cli.main(_explain_argv(bert_dir, text, target, foil))
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("error:"), err
    assert message in err
    assert "Traceback" not in err and out == ""


def test_cli_empty_causal_text(gpt2_dir, capsys):
    assert cli.main(_explain_argv(gpt2_dir, "", "are", "is")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "gives no tokens" in err


def test_cli_causal_oov(gpt2_dir, capsys):
    assert cli.main(_explain_argv(gpt2_dir, CAUSAL_TEXT, "are", "zebra")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "not in the model's vocabulary" in err


@pytest.mark.parametrize("where", ["missing", "empty", "hub"])
def test_cli_load_errors(where, tmp_path, capsys):
    model = {
        "missing": str(tmp_path / "no-such-dir"),
        "empty": str(tmp_path),
        "hub": "no-such-org/no-such-model",
    }[where]
    rc = cli.main(_explain_argv(model, MASKED_TEXT, "are", "is"))
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith(f"error: could not load {model!r}"), err
    assert "local directory" in err and "save_pretrained" in err
    assert "Traceback" not in err and out == ""


def test_cli_refuses_a_model_directory_with_code_of_its_own(tmp_path, capsys, monkeypatch):
    """No code from the directory runs and no prompt appears (stdin closed)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "my-custom", "architectures": ["XForMaskedLM"],
        "auto_map": {"AutoConfig": "configuration_x.XConfig",
                     "AutoModelForMaskedLM": "modeling_x.XModel"},
    }))  # fmt: skip
    (tmp_path / "configuration_x.py").write_text("raise SystemExit('the code ran')\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    rc = cli.main(_explain_argv(str(tmp_path), MASKED_TEXT, "are", "is"))
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith(f"error: could not load {str(tmp_path)!r}"), err
    assert "code of its own" in err and "trust_remote_code=True" in err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("loader", ["load", "load_task", "load_tokenizer"])
def test_a_config_that_is_not_an_object_is_a_load_error(loader, tmp_path):
    """Each way a checkpoint is loaded by name refuses a config.json holding a JSON list
    with the file named (some transformers versions fail on it with a TypeError)."""
    from semiring_backprop.errors import LoadError
    from semiring_backprop.hf import loading, tasks
    from semiring_backprop.runner import driver

    (tmp_path / "config.json").write_text("[1, 2, 3]")
    call = {
        "load": lambda: loading.load(str(tmp_path)),
        "load_task": lambda: tasks.load_task(str(tmp_path), "classification"),
        "load_tokenizer": lambda: driver.load_tokenizer(str(tmp_path)),
    }[loader]
    with pytest.raises(LoadError, match=r"its config\.json holds a JSON list, not an object"):
        call()


# -- 6. checkpoints without the LM head ---------------------------------------------------

# the head of BertForMaskedLM, written out by hand: every weight a BertModel checkpoint
# lacks; the decoder's weight is tied to the word embeddings, which the checkpoint has
BERT_HEAD = [
    "cls.predictions.bias",
    "cls.predictions.decoder.bias",
    "cls.predictions.transform.dense.weight",
    "cls.predictions.transform.dense.bias",
    "cls.predictions.transform.LayerNorm.weight",
    "cls.predictions.transform.LayerNorm.bias",
]


def _check_names_head(message, head, tied=()):
    for name in head:
        assert name in message, f"{name} not named in: {message}"
    for name in tied:
        assert name not in message, f"the tied {name} is named in: {message}"


def test_explain_refuses_an_encoder_without_head(headless_bert_dir):
    with pytest.raises(InputError) as info:
        explain(headless_bert_dir, MASKED_TEXT, "are", "is", semirings=("real",))
    message = str(info.value)
    _check_names_head(message, BERT_HEAD, tied=["cls.predictions.decoder.weight"])
    assert "bert.encoder" not in message and "embeddings" not in message  # those loaded
    assert "BertForMaskedLM.save_pretrained" in message and "masked-LM head" in message
    assert headless_bert_dir in message


def test_cli_refuses_an_encoder_without_head(headless_bert_dir):
    run = run_cli(_explain_argv(headless_bert_dir, MASKED_TEXT, "are", "is"))
    assert run.rc == 2 and run.ex is None
    assert run.err.startswith("error:"), run.err
    _check_names_head(run.err, BERT_HEAD)
    assert "BertForMaskedLM.save_pretrained" in run.err
    assert "Traceback" not in run.err and run.out == ""  # no report at all


def test_explain_refuses_a_causal_model_without_head(tmp_path):
    """Llama's LM head is its own weight (not tied): a LlamaModel checkpoint lacks it."""
    tok, vocab = _word_level_tokenizer()
    tok.save_pretrained(tmp_path)
    cfg = _llama_config(vocab)
    assert not cfg.tie_word_embeddings
    transformers.LlamaModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(InputError) as info:
        explain(str(tmp_path), CAUSAL_TEXT, "are", "is", semirings=("real",))
    message = str(info.value)
    _check_names_head(message, ["lm_head.weight"])
    assert "LlamaForCausalLM.save_pretrained" in message and "causal-LM head" in message


def test_tied_head_of_a_bare_gpt2_is_its_embeddings(tmp_path):
    """GPT-2's LM head is its word embeddings: a GPT2Model checkpoint is the whole LM and
    loads; its logits are the last hidden states times the embeddings."""
    tok, vocab = _word_level_tokenizer()
    tok.save_pretrained(tmp_path)
    torch.manual_seed(3)
    transformers.GPT2Model(_gpt2_config(vocab)).save_pretrained(tmp_path)
    model, tok, kind = explain_mod.load(str(tmp_path))
    assert kind == "causal"
    bare = transformers.GPT2Model.from_pretrained(tmp_path).eval()
    ids = tok(CAUSAL_TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = bare(ids).last_hidden_state @ bare.wte.weight.T
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-6)


def test_masked_lm_checkpoint_loads_every_weight(bert_dir):
    """A BertForMaskedLM checkpoint: every weight comes from the file (the decoder's are
    the word embeddings and the head's bias), none is initialized afresh."""
    from safetensors.torch import load_file

    saved = load_file(FilePath(bert_dir) / "model.safetensors")
    model, _, kind = explain_mod.load(bert_dir)
    assert kind == "masked"
    state = model.state_dict()
    tied = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }
    for name, value in state.items():
        source = name if name in saved else tied.get(name)
        assert source in saved, f"{name} is not in the checkpoint"
        torch.testing.assert_close(value, saved[source], rtol=0, atol=0)


def test_a_masked_lm_is_not_run_as_a_causal_one(bert_dir):
    """--kind causal on a BertForMaskedLM checkpoint would load BertLMHeadModel and read
    the bidirectional model left to right: refused, saying what to do."""
    with pytest.raises(InputError, match="masked LM .*BertForMaskedLM.*Leave --kind out"):
        explain_mod.load(bert_dir, kind="causal")
    r = run_cli(_explain_argv(bert_dir, "the cat [MASK] here", "sat", "is", "--kind", "causal"))
    assert r.rc == 2 and r.err.startswith("error:") and "masked LM" in r.err
