"""The runner's score over several masks (a word in pieces, each piece at its own mask):
``sum_j log p(target_j) - log p(foil_j)``, one example per row of a batch.

Oracles are independent of the code under test: the score is recomputed from the model's
own logits, the Real readout per token is ``torch.autograd``'s gradient of that score at
the word embeddings (summed over hidden units), entropies are bounded by ``log #paths``.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")

from semiring_backprop.data import MASK  # noqa: E402
from semiring_backprop.runner import Example, Explainer, Item, batches, prepare  # noqa: E402
from semiring_backprop.semirings import Entropy, MaxProduct, PathCount, Real  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")  # see conftest

WORDS = "the keys to cabinet is are on table a dog cat has have n t '".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory, _offline_quiet):
    d = tmp_path_factory.mktemp("bert")
    vocab = SPECIAL + WORDS
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizerFast(str(d / "vocab.txt"))
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).double().eval(), tok


def _two_masks(tok, id_: str, text: str) -> Item:
    """``text`` with MASK at the verb, scored as "hasn't" against "haven't" in three
    pieces at three masks (the shared pieces "'" and "t" left out: two masks kept)."""
    ex = Example(id_, text, "has", "have", {}, {}, f"test:{id_}")
    item = prepare(ex, tok, None, "masked")
    assert isinstance(item, Item)
    k = item.position
    ids = [*item.ids[:k], *[tok.mask_token_id] * 3, *item.ids[k + 1 :]]
    words = [*item.words[:k], *[item.words[k]] * 3, *item.words[k + 1 :]]
    has, have, n = (tok.convert_tokens_to_ids(w) for w in ("has", "have", "n"))
    dog = tok.convert_tokens_to_ids("dog")
    # the second mask's pieces differ too ("n" against "dog"): a sum of two real terms
    return Item(ex, ids, k, has, have, words, masks=((k + 1, n, dog),))


def _direct(model, item: Item):
    """The score from the model's logits and autograd's gradient at the embeddings."""
    ids = torch.tensor([item.ids])
    seen = []
    emb = model.get_input_embeddings()
    hook = emb.register_forward_hook(lambda m, i, o: seen.append(o) or o.retain_grad())
    logp = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].log_softmax(-1)
    hook.remove()
    masks = [(item.position, item.target, item.foil), *item.masks]
    score = sum(logp[p, t] - logp[p, f] for p, t, f in masks)
    score.backward()
    return float(score.detach()), seen[0].grad[0].sum(-1)


def test_several_masks_score_and_gradient_equal_the_models(bert):
    model, tok = bert
    one = prepare(Example("1", f"the keys to the cabinet {MASK} on the table", "are", "is",
                          {}, {}, "test:1"), tok, None, "masked")  # fmt: skip
    items = [one, _two_masks(tok, "2", f"the dog {MASK} on the table"),
             _two_masks(tok, "3", f"a cat {MASK} on a table")]  # fmt: skip
    # same length, other number of masks: never in one batch
    groups = batches(items, 8)
    assert sorted(len(g[0].masks) for g in groups) == [0, 1]
    assert sorted(len(g) for g in groups) == [1, 2]
    explainer = Explainer(model, tok, [Real(), MaxProduct(), Entropy(), PathCount()])
    for group in groups:
        tables = explainer(group)
        e, t = tables["examples"], tables["tokens"]
        assert e["example_id"].tolist() == [it.example.id for it in group]
        for it, row in zip(group, e.itertuples()):
            score, grad = _direct(model, it)
            assert row.score == pytest.approx(score, rel=1e-9, abs=1e-12)
            assert len(json.loads(row.masks)) == 1 + len(it.masks)
            mine = t[t["example_id"] == it.example.id].sort_values("token")
            assert torch.allclose(torch.tensor(mine["real"].to_numpy()), grad, atol=1e-10)
            assert (mine["entropy"] <= mine["log_paths"] + 1e-9).all()
            assert (mine["entropy"] >= -1e-9).all()


def test_run_with_a_prepare_of_its_own_writes_resumes_and_skips(bert, tmp_path):
    """``run(prepare=...)``: the hook's items (two masks) are explained, written to the
    shards and committed; its reasons skip; a rerun explains nothing again; a hook that
    returns neither an item nor a reason is a clear error."""
    from semiring_backprop.errors import InputError
    from semiring_backprop.runner import load_results, run

    model, tok = bert
    texts = {"1": f"the dog {MASK} on the table", "2": f"a cat {MASK} on a table",
             "3": f"the keys {MASK} here"}  # fmt: skip
    calls = []

    def hook(ex, tokenizer, config, kind):
        calls.append(ex.id)
        return "no verb here" if ex.id == "3" else _two_masks(tokenizer, ex.id, ex.text)

    examples = [{"id": k, "text": t, "target": "has", "foil": "have"} for k, t in texts.items()]
    kw = dict(out=tmp_path, tokenizer=tok, semirings=("real",), dtype="float64",
              progress=False, figures=False, prepare=hook)  # fmt: skip
    r = run(model, examples=examples, **kw)
    assert r["explained"] == 2 and r["skipped"] == 1
    e = load_results(tmp_path)["examples"].set_index("example_id")
    for k in ("1", "2"):
        item = _two_masks(tok, k, texts[k])
        assert e.loc[k, "score"] == pytest.approx(_direct(model, item)[0], rel=1e-9, abs=1e-12)
        assert json.loads(e.loc[k, "masks"]) == [[item.position, item.target, item.foil],
                                                  list(item.masks[0])]  # fmt: skip
    calls.clear()
    assert run(model, examples=examples, **kw)["explained"] == 2 and calls == []
    with pytest.raises(InputError, match=r"prepare= gave a dict for example '1'.*runner\.Item"):
        run(model, examples=examples, **{**kw, "out": tmp_path / "b", "prepare": lambda *a: {}})
