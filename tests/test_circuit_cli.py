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


def _grad_times_input(where, text, label) -> float:
    """The classification target's Real value with seed "x", by torch.autograd: the
    gradient × input of the embeddings of the inputs (input_ids, token_type_ids)."""
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
    return sum(float((o.grad * o).sum().detach()) for o in outs)


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
