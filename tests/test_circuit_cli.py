"""``semiring-backprop circuit --task``: the circuit of every task ``explain`` explains,
on tiny saved models (BERT with a sequence-classification, a token-classification and
no head; GPT-2) and a word-level vocabulary written here.

Oracles: the circuit's target under Real with seed "x" (the ``logits`` node of the
EAP-IG file the command writes) equals the gradient × input summed over the embeddings
of the inputs (word and token type; the position embeddings are looked up from a
buffer, a constant) by torch.autograd, for the classification task; the
other tasks' files are read back (EAP-IG's complete graph, one node per component) and
their target's ``what`` checked against the task; the refusals name what to give.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from semiring_backprop import cli

pytestmark = pytest.mark.usefixtures("_offline_quiet")

WORDS = "the keys to cabinet is are on table a dog cat".split()
TEXT = "the keys to the cabinet"


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, _offline_quiet):
    T = pytest.importorskip("transformers")
    pytest.importorskip("pandas")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    cfg = dict(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=16, max_position_embeddings=16)  # fmt: skip
    out = {}
    for task, cls, extra in [
        ("classification", T.BertForSequenceClassification,
         {"id2label": {0: "neg", 1: "pos"}, "label2id": {"neg": 0, "pos": 1}}),
        ("token", T.BertForTokenClassification,
         {"id2label": {0: "O", 1: "B", 2: "I"}, "label2id": {"O": 0, "B": 1, "I": 2}}),
        ("similarity", T.BertModel, {}),
    ]:  # fmt: skip
        where = tmp_path_factory.mktemp(task)
        T.BertTokenizer(str(vocab)).save_pretrained(where)
        torch.manual_seed(0)
        cls(T.BertConfig(**cfg, **extra)).save_pretrained(where)
        out[task] = str(where)
    gpt2 = tmp_path_factory.mktemp("gpt2")
    ids = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tok = tokenizers.Tokenizer(WordLevel(ids, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(gpt2)
    torch.manual_seed(0)
    T.GPT2LMHeadModel(T.GPT2Config(vocab_size=len(ids), n_embd=8, n_layer=1, n_head=2,
                                   n_positions=16, bos_token_id=0,
                                   eos_token_id=0)).save_pretrained(gpt2)  # fmt: skip
    out["lm"] = str(gpt2)
    return out


def _eap(file):
    d = json.loads(file.read_text())
    assert d["cfg"]["n_layers"] == 1 and d["cfg"]["n_heads"] == 2
    assert list(d["nodes"]) == ["input", "a0.h0", "a0.h1", "m0", "logits"]
    return d


def _grad_times_input(where, text, label, structural=False) -> float:
    """The classification target's Real value with seed "x", by torch.autograd: the
    gradient × input of the embeddings of the inputs (input_ids, token_type_ids); with
    ``structural``, the seed one at every element: the gradient summed."""
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(where)
    model = T.AutoModelForSequenceClassification.from_pretrained(where).double().eval()
    enc = tok(text, return_tensors="pt")
    outs = []
    mods = [model.bert.embeddings.word_embeddings, model.bert.embeddings.token_type_embeddings]

    def keep(_m, _i, out):
        out.retain_grad()
        outs.append(out)

    handles = [m.register_forward_hook(keep) for m in mods]
    try:
        logit = model(**enc).logits[0, label]
    finally:
        for h in handles:
            h.remove()
    logit.backward()
    return sum(float((o.grad * (1 if structural else o)).sum().detach()) for o in outs)


def test_classification_circuit_target_is_grad_times_input(saved, tmp_path):
    where = saved["classification"]
    rc, text, err = _run(["circuit", where, "--task", "classification", "--text", TEXT,
                          "--label", "pos", "--dtype", "float64", "--top-n", "2",
                          "--json", str(tmp_path / "c.json")])  # fmt: skip
    assert rc == 0, err
    assert "logit(pos)" in text
    d = _eap(tmp_path / "c.json")
    want = _grad_times_input(where, TEXT, 1)
    assert math.isclose(d["nodes"]["logits"]["score"], want, rel_tol=1e-9, abs_tol=1e-12)
    assert sum(n["in_graph"] for n in d["nodes"].values()) == 2 + 2


def test_classification_margin_pair_and_baseline(saved, tmp_path):
    rc, text, err = _run(["circuit", saved["classification"], "--task", "classification",
                          "--text", "the keys", "--text-pair", "a dog", "--label", "pos",
                          "--foil", "neg", "--baseline-text", "the cat", "--json",
                          str(tmp_path / "c.json")])  # fmt: skip
    assert rc == 0, err
    assert "logit(pos) - logit(neg)" in text
    _eap(tmp_path / "c.json")


def test_token_circuit(saved, tmp_path):
    rc, text, err = _run(["circuit", saved["token"], "--task", "token", "--text", TEXT,
                          "--position", "2", "--label", "B", "--neuronpedia",
                          str(tmp_path / "np")])  # fmt: skip
    assert rc == 0, err
    assert "logit(B) at position 2 ('keys')" in text
    graph = json.loads((tmp_path / "np" / next(
        p.name for p in (tmp_path / "np").iterdir() if p.name != "graph-metadata.json"
    )).read_text())  # fmt: skip
    assert graph["metadata"]["prompt_tokens"][2] == "keys"
    rc, _, err = _run(["circuit", saved["token"], "--task", "token", "--text", TEXT])
    assert rc == 2 and "--position N" in err


def test_similarity_circuit_of_one_dimension(saved, tmp_path):
    rc, text, err = _run(["circuit", saved["similarity"], "--task", "similarity", "--text", TEXT,
                          "--dim", "3", "--pooling", "mean", "--json",
                          str(tmp_path / "s.json")])  # fmt: skip
    assert rc == 0, err
    assert "dimension 3 of the embedding, mean pooling" in text
    _eap(tmp_path / "s.json")
    rc, _, err = _run(["circuit", saved["similarity"], "--task", "similarity", "--text", TEXT,
                       "--text-pair", "a dog", "--pooling", "mean"])  # fmt: skip
    assert rc == 2 and "a batch of two" in err and "--dim N" in err


def test_lm_task_and_refusals(saved, tmp_path):
    rc, text, err = _run(["circuit", saved["lm"], "--task", "lm", "--text", "the keys to the",
                          "--target", "cabinet", "--foil", "table", "--json",
                          str(tmp_path / "g.json")])  # fmt: skip
    assert rc == 0, err
    assert "log p(cabinet) - log p(table)" in text
    _eap(tmp_path / "g.json")
    # a bare encoder has no classification head; a label of no such name; an option of
    # another task
    rc, _, err = _run(["circuit", saved["similarity"], "--task", "classification",
                       "--text", TEXT])  # fmt: skip
    assert rc == 2 and "error:" in err
    rc, _, err = _run(["circuit", saved["classification"], "--task", "classification",
                       "--text", TEXT, "--label", "maybe"])  # fmt: skip
    assert rc == 2 and "'maybe' is not one of the model's 2 labels" in err
    rc, _, err = _run(["circuit", saved["classification"], "--task", "classification",
                       "--text", TEXT, "--position", "1"])  # fmt: skip
    assert rc == 2 and "--position does not apply to the classification task" in err
    rc, _, err = _run(["circuit", saved["lm"], "--task", "lm", "--text", "the keys"])
    assert rc == 2 and "give --target WORD" in err


def test_loaded_model_of_another_head_is_refused(saved):
    import transformers as T

    from semiring_backprop.circuits.hf import circuit_of_text
    from semiring_backprop.errors import InputError

    where = saved["similarity"]
    model, tok = T.AutoModel.from_pretrained(where), T.AutoTokenizer.from_pretrained(where)
    with pytest.raises(InputError, match="AutoModelForSequenceClassification"):
        circuit_of_text(model, TEXT, task="classification", tokenizer=tok)
    with pytest.raises(InputError, match="choose one of"):
        circuit_of_text(model, TEXT, task="summary", tokenizer=tok)


# -- --seed, --ig-steps, --ig-method ------------------------------------------------------

BASE = "a dog to the table"  # as many tokens as TEXT


def _sites(file) -> dict:
    """``{(layer, head or "mlp", position): influence}`` of a Neuronpedia file's heads and
    MLPs (the node ids are ``{layer}_{head}_{position}``, an MLP's head index is 2)."""
    graph = json.loads(file.read_text())
    out = {}
    for n in graph["nodes"]:
        if n["feature_type"] in ("attention head", "mlp"):
            layer, head, pos = (int(x) for x in n["node_id"].split("_"))
            out[(layer, "mlp" if head == 2 else head, pos)] = n["influence"]
    return out


def _api_sites(c) -> dict:
    return {(int(r["layer"]), "mlp" if r["role"] == "mlp" else int(r["head_index"]),
             int(r["position"])): r["Real"] for r in c.components().to_dict("records")}  # fmt: skip


def _classification_cli(saved, tmp_path, *flags):
    rc, text, err = _run(["circuit", saved["classification"], "--task", "classification",
                          "--text", TEXT, "--label", "pos", "--dtype", "float64", *flags,
                          "--json", str(tmp_path / "c.json"),
                          "--neuronpedia", str(tmp_path / "np")])  # fmt: skip
    assert rc == 0, err
    files = list((tmp_path / "np").glob("*-circuit.json"))
    assert len(files) == 1
    return text, _eap(tmp_path / "c.json"), files[0]


def _api(saved, **kw):
    from semiring_backprop.circuits.hf import circuit_of_text

    return circuit_of_text(saved["classification"], TEXT, "pos", task="classification",
                           dtype=torch.float64, **kw)  # fmt: skip


def test_seed_structural_gives_the_apis_sites(saved, tmp_path):
    """Under Real the structural seed moves every embedding element by the same amount,
    which the embeddings' LayerNorm takes away: the target is the gradient summed (0 up
    to rounding, by torch.autograd; the seed x gives about -1e-6) and so is every site."""
    text, d, np_file = _classification_cli(saved, tmp_path, "--seed", "structural")
    want = _grad_times_input(saved["classification"], TEXT, 1, structural=True)
    assert math.isclose(d["nodes"]["logits"]["score"], want, rel_tol=1e-9, abs_tol=1e-15)
    want = _api(saved, seed="structural")
    assert want.seed == "structural"
    got = _sites(np_file)
    assert set(got) == set(_api_sites(want)) and len(got) == 7 * 3  # [CLS] 5 words [SEP]
    for key, value in _api_sites(want).items():
        assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-12), key
    assert (d["cfg"]["seed"], d["cfg"]["ig_steps"], d["cfg"]["ig_method"]) == ("structural", 0, "")
    assert "seed structural" in text.splitlines()[0]
    logit = next(n for n in json.loads(np_file.read_text())["nodes"] if n["is_target_logit"])
    assert "seed structural" in logit["clerp"]


def _captum_ig(where, text, base, label, steps, method="gausslegendre") -> float:
    """Captum's integrated gradients of the label's logit at the word embeddings, from
    the baseline text's to the text's, summed: the target's value with IG steps."""
    import transformers as T

    captum_attr = pytest.importorskip("captum.attr")
    tok = T.AutoTokenizer.from_pretrained(where)
    model = T.AutoModelForSequenceClassification.from_pretrained(where).double().eval()
    enc, other = tok(text, return_tensors="pt"), tok(base, return_tensors="pt")
    rest = {k: v for k, v in enc.items() if k != "input_ids"}

    def logit(ids):
        n = ids.shape[0]
        return model(ids, **{k: v.expand(n, -1) for k, v in rest.items()}).logits[:, label]

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # Captum's points and weights
    try:
        lig = captum_attr.LayerIntegratedGradients(logit, model.bert.embeddings.word_embeddings)
        attr = lig.attribute(enc["input_ids"], other["input_ids"], n_steps=steps,
                             method=method)  # fmt: skip
    finally:
        torch.set_default_dtype(old)
    return float(attr.sum())


def test_a_baseline_reads_the_relevance_graph_unless_told(saved, tmp_path):
    """With --baseline-text and no --ig-steps the CLI uses the recommended weights
    (relevance: docs/faithfulness.md) and says so in the caption and the export;
    --weights gradient gives attribution patching, the API's default."""
    for flags, weights in (([], "relevance"), (["--weights", "gradient"], "gradient")):
        out = tmp_path / weights
        text, d, np_file = _classification_cli(saved, out, "--baseline-text", BASE, *flags)
        want = _api(saved, baseline_text=BASE, weights=weights)
        assert want.weights == weights and d["cfg"]["weights"] == weights
        got = _sites(np_file)
        assert set(got) == set(_api_sites(want))
        for key, value in _api_sites(want).items():
            assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-12), key
        assert ("relevance weights" in text.splitlines()[0]) == (weights == "relevance")
    other = _api(saved, baseline_text=BASE)  # (the API's default: the gradient)
    assert other.weights == "gradient"
    assert _api_sites(other) != _api_sites(_api(saved, baseline_text=BASE, weights="relevance"))


def test_ig_steps_give_the_apis_real_column_and_captums_total(saved, tmp_path):
    text, d, np_file = _classification_cli(saved, tmp_path, "--baseline-text", BASE,
                                           "--ig-steps", "4")  # fmt: skip
    want = _api(saved, baseline_text=BASE, ig_steps=4)
    got = _sites(np_file)
    assert set(got) == set(_api_sites(want))
    for key, value in _api_sites(want).items():
        assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-12), key
    total = _captum_ig(saved["classification"], TEXT, BASE, 1, 4)
    assert math.isclose(d["nodes"]["logits"]["score"], total, rel_tol=1e-9, abs_tol=1e-12)
    assert (d["cfg"]["seed"], d["cfg"]["ig_steps"], d["cfg"]["ig_method"]) == (
        "x - x'", 4, "gausslegendre")  # fmt: skip
    said = "seed x - x' (baseline), 4 IG steps (gausslegendre; Real only)"
    assert said in text.splitlines()[0]
    logit = next(n for n in json.loads(np_file.read_text())["nodes"] if n["is_target_logit"])
    assert said in logit["clerp"]
    small = want.prune(top_n=2)  # a new Circuit: the record stays
    assert (small.seed, small.ig_steps, small.ig_method) == ("x - x'", 4, "gausslegendre")
    assert small.to_eap_json()["cfg"]["ig_steps"] == 4
    html = small.view()._repr_html_()
    assert "4 IG steps (gausslegendre; Real only)" in html and "conductance" in html


def test_ig_method_is_passed_on(saved, tmp_path):
    flags = ["--baseline-text", BASE, "--ig-steps", "3", "--ig-method", "riemann_left"]
    _, d, _ = _classification_cli(saved, tmp_path, *flags)
    total = _captum_ig(saved["classification"], TEXT, BASE, 1, 3, "riemann_left")
    assert math.isclose(d["nodes"]["logits"]["score"], total, rel_tol=1e-9, abs_tol=1e-12)
    assert (d["cfg"]["ig_steps"], d["cfg"]["ig_method"]) == (3, "riemann_left")


def test_default_seed_is_recorded(saved, tmp_path):
    text, d, np_file = _classification_cli(saved, tmp_path, "--top-n", "2")
    assert (d["cfg"]["seed"], d["cfg"]["ig_steps"], d["cfg"]["ig_method"]) == ("x", 0, "")
    assert "seed" not in text.splitlines()[0]
    logit = next(n for n in json.loads(np_file.read_text())["nodes"] if n["is_target_logit"])
    assert "seed" not in logit["clerp"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--ig-steps", "-1", "--baseline-text", BASE], "--ig-steps"),
        (["--ig-steps", "4"], "--baseline-text"),
        (["--ig-steps", "1", "--ig-method", "riemann_trapezoid", "--baseline-text", BASE],
         "--ig-method"),
        (["--seed", "structural", "--baseline-text", BASE], "--seed"),
        (["--seed", "structural", "--ig-steps", "4", "--baseline-text", BASE], "--seed"),
    ],
)  # fmt: skip
def test_seed_and_steps_refused_before_the_model_loads(flags, message, tmp_path):
    # a model that does not exist: the refusal comes first
    rc, _, err = _run(["circuit", str(tmp_path / "no-model"), "--task", "classification",
                       "--text", TEXT, *flags])  # fmt: skip
    assert rc == 2 and message in err, err
    assert "no-model" not in err


def test_bad_seed_and_method_names_are_refused_by_the_parser():
    for flags in (["--seed", "zero"], ["--ig-method", "simpson"], ["--ig-steps", "two"]):
        with pytest.raises(SystemExit) as e:
            _run(["circuit", "m", "--text", TEXT, *flags])
        assert e.value.code == 2
