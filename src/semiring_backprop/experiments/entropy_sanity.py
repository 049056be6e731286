"""Paper Appendix B.1, Fig. 6: two sanity checks of the path entropy.

- **Sentence length.** A masked LM explains ``log p(target) - log p(foil)`` at the
  ``[MASK]`` of sentences of random vocabulary words; the mean path entropy of the word
  embeddings' elements (and the entropy normalized by ``log #paths``) is recorded per
  sentence. Longer sentences have more paths through attention, so the entropy should
  grow with length (Spearman's ρ is reported).
- **Hidden size.** MLPs of growing width learn the 4-feature task (label: x0 > 0.5);
  the entropy at the input of the gold-class logit, per feature and averaged over the
  validation set, compares the relevant feature (0) with the irrelevant ones (1..3).

With ``model=None`` the masked LM is a random small BERT whose WordPiece vocabulary is
generated (seeded) and saved, with the model, in the output directory.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from .._backprop import Backprop
from .._threads import threads
from ..errors import InputError
from ..runner.records import Records, same_settings, write_json
from ..semirings import Entropy, PathCount
from .common import GoldLogit, spearman, train, trained, write_csv

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_WORD = re.compile(r"^[a-z]{2,}$")  # whole lowercase words of a WordPiece vocabulary
_WORD_ANY = re.compile(r"^(Ġ|▁)?[A-Za-z]{2,}$")  # word-initial pieces of BPE/SentencePiece


@dataclass(frozen=True)
class Config:
    model: str | None = None  #: hub id or local directory; None: a random small BERT
    lengths: tuple[int, ...] = tuple(range(5, 65, 5))  #: words per sentence, [MASK] included
    per_length: int = 10  #: sentences per length
    target: str = "are"  #: explained: log p(target) - log p(foil) at [MASK]
    foil: str = "is"
    vocab_words: int = 200  #: generated vocabulary of the random BERT
    bert_hidden: int = 64  #: sizes of the random BERT
    bert_layers: int = 2
    bert_heads: int = 2
    bert_intermediate: int = 128
    hidden_sizes: tuple[int, ...] = (4, 8, 16, 32, 64, 128)  #: MLP widths
    n: int = 1000  #: points of the 4-feature data (70/10/20 split)
    epochs: int = 50
    lr: float = 1e-2
    batch_size: int = 32
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return replace(cls(), lengths=(5, 10, 20, 40), per_length=2, hidden_sizes=(4, 16, 64),
                       n=500, epochs=20)  # fmt: skip


# -- shared with sva: settings, the random masked LM and the explained score -----------


@contextlib.contextmanager
def quiet(progress: bool):
    """Without ``progress``, no transformers progress bars (loading, saving) either."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    if not progress:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not progress:
            logging.enable_progress_bar()


def lm_threads(config):
    """The thread count around ``config``'s masked LM: the library's (one thread, or
    ``SEMIRING_BACKPROP_THREADS``) for the random small BERT, the caller's for a given
    model (``config.model``), which may be large."""
    return threads(None if config.model is None else 0)


def random_masked_lm(path, words, *, hidden=64, layers=2, heads=2, intermediate=128, seed=0):
    """``(model, tokenizer)``: a random ``BertForMaskedLM`` whose vocabulary is BERT's
    special tokens plus ``words``, saved to directory ``path`` (reloaded from there on a
    rerun; a directory holding another vocabulary is an error)."""
    from ..hf.loading import load

    path = Path(path)
    vocab = list(SPECIAL) + sorted(set(words) - set(SPECIAL))
    text = "\n".join(vocab) + "\n"
    vocab_file = path / "vocab.txt"
    if (path / "config.json").exists() and vocab_file.exists():
        if vocab_file.read_text() != text:
            raise InputError(
                f"{path} holds a random model with another vocabulary (other data or "
                "settings); delete it or write into a new output directory"
            )
    else:
        from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

        path.mkdir(parents=True, exist_ok=True)
        vocab_file.write_text(text)
        BertTokenizerFast(str(vocab_file)).save_pretrained(path)
        config = BertConfig(
            vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, intermediate_size=intermediate,
            max_position_embeddings=512, type_vocab_size=1, pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(seed)
        BertForMaskedLM(config).save_pretrained(path)
    model, tokenizer, _ = load(str(path.resolve()), "masked")
    return model, tokenizer


def masked_lm(model_id: str):
    """``(model, tokenizer)`` for a hub id or directory; it must be a masked LM."""
    from ..hf.loading import load

    model, tokenizer, kind = load(model_id)
    if kind != "masked" or tokenizer.mask_token is None:
        raise InputError(
            f"{model_id!r} is a {kind} LM; this experiment explains the prediction at "
            "[MASK]: give a masked LM (BERT, RoBERTa, ...)"
        )
    return model, tokenizer


def language_model(config, out: Path, words, progress: bool = True):
    """``config.model`` loaded, or the random small BERT over ``words`` in ``out/model``
    (``config`` has ``model``, ``seed`` and the ``bert_*`` sizes)."""
    with quiet(progress):
        if config.model is not None:
            return masked_lm(config.model)
        return random_masked_lm(
            out / "model", words, hidden=config.bert_hidden, layers=config.bert_layers,
            heads=config.bert_heads, intermediate=config.bert_intermediate, seed=config.seed,
        )  # fmt: skip


class MaskedScore(torch.nn.Module):
    """``log p(good) - log p(bad)`` at ``position``; the position and the two token ids
    are tensor inputs, so one trace serves every sentence."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position, good, bad):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[0]
        logp = logits.index_select(0, position)[0].log_softmax(-1)
        return logp.index_select(0, good)[0] - logp.index_select(0, bad)[0]


def score_inputs(ids, position: int, good: int, bad: int) -> dict:
    """Keyword inputs of :class:`MaskedScore` for one sentence of token ids."""
    ids = torch.as_tensor(ids, dtype=torch.long)[None]
    one = lambda i: torch.tensor([i], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "position": one(position), "good": one(good), "bad": one(bad)}  # fmt: skip


def embedding_place(wrapper) -> str:
    """Module path (in ``wrapper``) of the model's word embeddings."""
    emb = wrapper.model.get_input_embeddings()
    return next(n for n, m in wrapper.named_modules() if m is emb)


def embedding_entropy(res, place: str) -> dict:
    """Mean over tokens and hidden units of the per-element path entropy at ``place``,
    of ``log #paths`` and of the normalized entropy ``H / log #paths``."""
    h = res.at(place, Entropy()).entropy.double()
    log_n = res.at(place, PathCount()).log_count.double()
    norm = torch.where(log_n > 0, h / log_n, torch.zeros_like(h))
    return {"entropy": float(h.mean()), "log_paths": float(log_n.mean()),
            "normalized": float(norm.mean())}  # fmt: skip


# -- part A: entropy vs sentence length -------------------------------------------------


def pseudo_words(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct made-up lowercase words (two or three consonant-vowel syllables)."""
    rng = np.random.default_rng(seed)
    cons, vows = "bdfgklmnprstvz", "aeiou"
    out: set[str] = set()
    while len(out) < n:
        k = int(rng.integers(2, 4))
        out.add("".join(cons[rng.integers(len(cons))] + vows[rng.integers(len(vows))]
                        for _ in range(k)))  # fmt: skip
    return sorted(out)


def _candidates(tokenizer) -> list[int]:
    """Token ids of whole words to build sentences from (no special tokens)."""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    for pattern in (_WORD, _WORD_ANY):
        ids = sorted(i for t, i in vocab.items() if pattern.match(t) and i not in special)
        if len(ids) >= 10:
            return ids
    raise InputError("found fewer than 10 whole-word tokens in the vocabulary to build sentences")


def sentence(tokenizer, candidates, length: int, index: int, seed: int):
    """Token ids of sentence ``index`` of ``length`` words (one of them [MASK]) with the
    model's special tokens, and the [MASK] position; depends only on its arguments."""
    rng = np.random.default_rng([seed, length, index])
    words = [candidates[i] for i in rng.integers(len(candidates), size=length - 1)]
    at = int(rng.integers(length))
    ids = with_special_tokens(tokenizer, [*words[:at], tokenizer.mask_token_id, *words[at:]])
    return ids, ids.index(tokenizer.mask_token_id)


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` wrapped in the special tokens the tokenizer adds around a text ([CLS] ...
    [SEP] for BERT, <s> ... </s> for RoBERTa), read off how it encodes its mask token."""
    mask = tokenizer.mask_token_id
    around = tokenizer(tokenizer.mask_token)["input_ids"]
    at = around.index(mask)
    return [*around[:at], *ids, *around[at + 1 :]]


def lengths(out: Path, config: Config, progress: bool = True) -> list[dict]:
    """One record per sentence (written as it is computed; a rerun resumes)."""
    from tqdm.auto import tqdm

    from ..hf.loading import word_id

    records = Records(out / "length.jsonl")
    todo = [(n, i) for n in config.lengths for i in range(config.per_length)]
    todo = [(n, i) for n, i in todo if not records.has(f"{n}-{i}")]
    with lm_threads(config):
        if todo:
            words = pseudo_words(config.vocab_words, config.seed) + [config.target, config.foil]
            model, tok = language_model(config, out, words, progress)
            limit = getattr(model.config, "max_position_embeddings", None)
            longest = max(config.lengths) + len(with_special_tokens(tok, []))
            if limit and longest > limit:
                raise InputError(
                    f"lengths go up to {longest} tokens with the special tokens; the model "
                    f"takes at most {limit}: use shorter lengths"
                )
            good = word_id(tok, config.target, "masked")
            bad = word_id(tok, config.foil, "masked")
            wrapper = MaskedScore(model).eval()
            place = embedding_place(wrapper)
            bp = Backprop(
                wrapper, output=lambda y: y, semirings=[Entropy(), PathCount()], dynamic=True
            )  # sentences of many lengths: one symbolic trace
            candidates = _candidates(tok)
        for n, i in tqdm(todo, desc="sentences", disable=not progress, leave=False):
            ids, pos = sentence(tok, candidates, n, i, config.seed)
            res = bp(kwargs=score_inputs(ids, pos, good, bad))
            records.add({"key": f"{n}-{i}", "length": n, "index": i, "tokens": len(ids),
                         "position": pos, "input_ids": ids,
                         "score": float(res.values[res.graph.output_node]),
                         **embedding_entropy(res, place)})  # fmt: skip
    wanted = {f"{n}-{i}" for n in config.lengths for i in range(config.per_length)}
    return [r for r in records.rows if r["key"] in wanted]


# -- part B: entropy vs MLP width -------------------------------------------------------


def mlp(hidden: int, features: int = 4) -> torch.nn.Module:
    """``features -> hidden -> 2`` with ReLU."""
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
    )


@threads()
def widths(out: Path, config: Config, progress: bool = True) -> list[dict]:
    """One record per hidden size: per-feature entropy at the input, per example and mean."""
    from tqdm.auto import tqdm

    from ..data import first_feature

    records = Records(out / "hidden.jsonl")
    todo = [h for h in config.hidden_sizes if not records.has(h)]
    task = first_feature(config.n, seed=config.seed) if todo else None
    for h in tqdm(todo, desc="MLP widths", disable=not progress, leave=False):
        torch.manual_seed(config.seed)
        model, history = trained(mlp(h), out / f"mlp-{h}", lambda m, h=h: train(
            m, task.train, task.val, epochs=config.epochs, lr=config.lr,
            batch_size=config.batch_size, seed=config.seed, desc=f"train h={h}",
            progress=progress,
        ))  # fmt: skip
        bp = Backprop(GoldLogit(model).eval(), output=lambda y: y,
                      semirings=[Entropy(), PathCount()], per_example=True)  # fmt: skip
        res = bp((task.val.x, task.val.y))
        ent = res.at(0, Entropy()).entropy.double()  # (examples, features)
        log_n = res.at(0, PathCount()).log_count.double()
        norm = torch.where(log_n > 0, ent / log_n, torch.zeros_like(ent))
        feature, nfeature = ent.mean(0), norm.mean(0)
        records.add({"key": h, "hidden": h, "val_accuracy": history[-1]["val_accuracy"],
                     "epochs": len(history), "per_feature": feature.tolist(),
                     "relevant": float(feature[0]), "irrelevant": float(feature[1:].mean()),
                     "normalized_relevant": float(nfeature[0]),
                     "normalized_irrelevant": float(nfeature[1:].mean()),
                     "per_example": ent.tolist()})  # fmt: skip
    return [r for r in records.rows if r["key"] in set(config.hidden_sizes)]


# -- the experiment ---------------------------------------------------------------------


def run(out, config: Config | None = None, progress: bool = True) -> dict:
    """Both parts; writes ``length.csv``, ``hidden.csv``, ``summary.json``, ``figure.png``."""
    import pandas as pd

    config = config or Config()
    if min(config.lengths, default=0) < 1 or config.per_length < 1:
        raise InputError("lengths must be positive and per_length at least 1")
    out = Path(out)
    same_settings(out, config, free=("lengths", "per_length", "hidden_sizes"))
    by_sentence = pd.DataFrame(lengths(out, config, progress)).drop(columns="input_ids")
    by_width = pd.DataFrame(widths(out, config, progress)).drop(columns="per_example")
    by_width[[f"feature_{j}" for j in range(4)]] = by_width.pop("per_feature").tolist()
    write_csv(by_sentence.drop(columns="key"), out / "length.csv")
    write_csv(by_width.drop(columns="key"), out / "hidden.csv")
    summary = _summary(by_sentence, by_width, config)
    write_json(out / "summary.json", summary)
    files = [str(out / f) for f in ("length.csv", "hidden.csv", "summary.json")]
    try:
        files.append(figure(by_sentence, by_width, out / "figure.png"))
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"summary": summary, "files": files}


def _summary(by_sentence, by_width, config: Config) -> dict:
    means = by_sentence.groupby("length")[["entropy", "normalized"]].mean()
    length = spearman(by_sentence["length"], by_sentence["entropy"])
    normalized = spearman(by_sentence["length"], by_sentence["normalized"])
    length["normalized_spearman_rho"] = normalized["spearman_rho"]
    length["by_length"] = {int(n): {"entropy": r.entropy, "normalized": r.normalized}
                           for n, r in means.iterrows()}  # fmt: skip
    hidden = {int(r.hidden): {"relevant": r.relevant, "irrelevant": r.irrelevant,
                              "normalized_relevant": r.normalized_relevant,
                              "normalized_irrelevant": r.normalized_irrelevant,
                              "val_accuracy": r.val_accuracy}
              for r in by_width.sort_values("hidden").itertuples()}  # fmt: skip
    lower = sum(v["relevant"] < v["irrelevant"] for v in hidden.values())
    return {
        "model": config.model or "random small BERT (generated vocabulary)",
        "length": length,
        "hidden": hidden,
        "relevant_lower": f"{lower} of {len(hidden)} widths",
    }


def figure(by_sentence, by_width, path) -> str:
    """Fig. 6: entropy vs sentence length (left), vs MLP width per feature kind (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.scatter(by_sentence["length"], by_sentence["entropy"], s=10, alpha=0.5)
    means = by_sentence.groupby("length")["entropy"].mean()
    left.plot(means.index, means.values, marker="o", label="mean")
    left.set_xlabel("sentence length (words)")
    left.set_ylabel("mean path entropy of the word embeddings (nats)")
    left.set_title("masked LM: entropy vs length")
    left.legend()
    w = by_width.sort_values("hidden")
    right.plot(w["hidden"], w["relevant"], marker="o", label="relevant feature (x0)")
    right.plot(w["hidden"], w["irrelevant"], marker="s", label="irrelevant (mean of x1..x3)")
    right.set_xscale("log", base=2)
    right.set_xlabel("MLP hidden size")
    right.set_ylabel("path entropy at the input (nats)")
    right.set_title("MLP on the 4-feature task")
    right.legend()
    fig.tight_layout()
    from .._files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))
    plt.close(fig)
    return str(path)
