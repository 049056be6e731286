"""Clean / corrupted prompt pairs for a causal LM, as circuit-discovery work uses them
(the faithfulness benchmark on a real model, :mod:`..experiments.faithfulness_lm`).

Each task makes pairs of prompts of **equal token length** under the given tokenizer
(patching compares them position by position) and names two candidate next tokens, the
answer and the foil; the scalar explained is ``logit(answer) - logit(foil)`` at the last
position of the clean prompt. The corrupted prompt changes what the answer depends on:

- ``ioi`` (indirect object): "When Mary and John went to the store, John gave a drink
  to" -> " Mary" vs " John"; corrupted: three other names ("When Alice and Bob ...,
  Carl gave a drink to");
- ``sva`` (subject-verb agreement): "The keys to the cabinet" -> " are" vs " is";
  corrupted: the subject's number flipped ("The key to the cabinet");
- ``induction``: a run of random words, then its first words again -> the next word of
  the run vs a word absent from it; corrupted: the first run replaced by other words;
- ``fact``: "The capital of France is" -> " Paris" vs the corrupted country's capital;
  corrupted: another country ("The capital of Japan is");
- ``pronoun`` (gendered pronoun): "So Mary is a good friend, isn't" -> " she" vs
  " he"; corrupted: a name of the other gender.

Every word list is built in. Words are used where the tokenizer reads them, with their
leading space, as one token; the others are left out, and a task with too few left
(or an answer or foil in pieces) is an :class:`~semiring_backprop.errors.InputError`.
A pair whose two prompts differ in length is dropped and another drawn (``dropped``
counts them). The same seed gives the same pairs.

Examples::

    pairs = lm_pairs("ioi", tokenizer, n=16, seed=0)
    p = pairs.pairs[0]
    p.clean, p.answer, p.foil            # 'When Mary and John ...', ' Mary', ' John'
    p.kwargs()                           # {'input_ids': tensor of shape (1, T)}
    p.kwargs(corrupted=True)             # the corrupted prompt, also (1, T)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..errors import InputError

__all__ = ["TASKS", "LMPair", "LMPairs", "lm_pairs", "single_token", "words_of"]

NAMES_F = ("Mary", "Alice", "Sarah", "Emma", "Anna", "Laura", "Lisa", "Kate", "Rachel",
           "Linda", "Susan", "Julia", "Helen", "Amy", "Grace", "Rose", "Jane", "Emily",
           "Sophie", "Lucy")  # fmt: skip
NAMES_M = ("John", "Bob", "Carl", "David", "James", "Michael", "Tom", "Paul", "Mark",
           "Peter", "George", "Daniel", "Jack", "Steven", "Kevin", "Frank", "Sam", "Mike",
           "Robert", "Brian")  # fmt: skip
NAMES = NAMES_F + NAMES_M

IOI_TEMPLATES = (
    "When {A} and {B} went to the store, {C} gave a drink to",
    "When {A} and {B} went to the park, {C} gave a ball to",
    "After {A} and {B} went to the office, {C} gave a letter to",
    "Then, {A} and {B} had a long argument, and afterwards {C} said to",
    "While {A} and {B} were working at the school, {C} gave a book to",
)
#: (singular, plural) subjects; the verb's number follows them
SVA_NOUNS = (("key", "keys"), ("dog", "dogs"), ("cat", "cats"), ("book", "books"),
             ("car", "cars"), ("house", "houses"), ("girl", "girls"), ("boy", "boys"),
             ("friend", "friends"), ("teacher", "teachers"), ("student", "students"),
             ("tree", "trees"), ("bird", "birds"), ("doctor", "doctors"),
             ("player", "players"), ("window", "windows"))  # fmt: skip
SVA_TEMPLATES = ("The {S} to the cabinet", "The {S} near the table", "The {S} behind the door",
                 "The {S} of the old man", "The {S} in the garden")  # fmt: skip
SVA_VERBS = (("is", "are"), ("was", "were"), ("has", "have"))
#: (country, capital)
CAPITALS = (("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"),
            ("Spain", "Madrid"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("China", "Beijing"),
            ("England", "London"), ("Greece", "Athens"), ("Canada", "Ottawa"),
            ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"), ("Austria", "Vienna"),
            ("Poland", "Warsaw"), ("Ireland", "Dublin"), ("Norway", "Oslo"),
            ("Sweden", "Stockholm"), ("Portugal", "Lisbon"), ("Turkey", "Ankara"),
            ("Thailand", "Bangkok"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
            ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("Denmark", "Copenhagen"),
            ("Finland", "Helsinki"), ("Chile", "Santiago"), ("Australia", "Canberra"))  # fmt: skip
FACT_TEMPLATES = ("The capital of {X} is", "The capital city of {X} is",
                  "{X}'s capital city is called")  # fmt: skip
PRONOUN_TEMPLATES = ("So {N} is a really good friend, isn't", "{N} was late for work because",
                     "When {N} woke up this morning,", "Everyone knows that {N} said that",
                     "Yesterday {N} went home early because")  # fmt: skip
#: the induction task's words: common nouns and verbs, drawn at random into runs
RUN_WORDS = ("apple", "river", "chair", "music", "garden", "window", "paper", "money",
             "water", "table", "light", "stone", "cloud", "horse", "bread", "glass", "phone",
             "ship", "road", "plant", "field", "train", "coffee", "metal", "forest", "island",
             "market", "engine", "letter", "picture", "wall", "door", "floor", "river",
             "bottle", "camera", "doctor", "silver", "winter", "summer", "orange", "rabbit",
             "pencil", "butter", "castle", "dragon", "jacket", "ladder", "mirror", "needle",
             "pocket", "rocket", "saddle", "tunnel", "valley", "wagon", "yellow", "zebra",
             "tiger", "lemon", "onion", "piano", "robot", "shirt", "sugar", "towel", "violin",
             "wheel", "basket", "candle", "carpet", "cheese", "desert", "feather", "guitar",
             "hammer", "kitten", "magnet", "monkey", "office", "planet", "ribbon", "spider",
             "theater", "button", "circle", "finger", "flower", "hunter", "lizard")  # fmt: skip


def words_of() -> dict:
    """Every built-in word list by name (tests train their tokenizers on them)."""
    return {"names": NAMES, "ioi": IOI_TEMPLATES, "sva_nouns": SVA_NOUNS,
            "sva_templates": SVA_TEMPLATES, "sva_verbs": SVA_VERBS, "capitals": CAPITALS,
            "fact": FACT_TEMPLATES, "pronoun": PRONOUN_TEMPLATES,
            "run_words": RUN_WORDS}  # fmt: skip


@dataclass(frozen=True)
class LMPair:
    """One clean / corrupted pair: the prompts, their token ids (as the model takes them,
    special tokens included; equal lengths), the answer and the foil (one token each,
    with its leading space) and their ids."""

    clean: str
    corrupted: str
    answer: str
    foil: str
    clean_ids: tuple
    corrupted_ids: tuple
    answer_id: int
    foil_id: int

    def kwargs(self, corrupted: bool = False) -> dict:
        import torch

        ids = self.corrupted_ids if corrupted else self.clean_ids
        return {"input_ids": torch.tensor([ids])}


@dataclass
class LMPairs:
    """A task's pairs; ``dropped``: pairs drawn whose prompts differed in length;
    ``left_out``: built-in words the tokenizer splits (not used)."""

    task: str
    pairs: list
    dropped: int = 0
    left_out: list = field(default_factory=list)


def _ids(tokenizer, text: str, special: bool = True) -> list:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def single_token(tokenizer, word: str) -> int:
    """The id of ``word`` (with its leading space: ``" Mary"``) where the tokenizer reads
    it as one token; else an InputError naming its pieces."""
    ids = _ids(tokenizer, word, special=False)
    unk = getattr(tokenizer, "unk_token_id", None)
    if len(ids) != 1 or (unk is not None and ids[0] == unk):
        pieces = [tokenizer.decode([i]) for i in ids]
        raise InputError(
            f"the answer {word!r} is {len(ids)} tokens under this tokenizer ({pieces}), or "
            "unknown to it: the explained logit difference needs answers of one token each; "
            "pick words the tokenizer holds whole"
        )
    return ids[0]


def _whole(tokenizer, words, task: str, need: int, left_out: list) -> list:
    """The words (each a str, or a tuple of strs that must all be whole) the tokenizer
    reads as one token with a leading space; at least ``need`` of them."""
    keep = []
    for w in words:
        group = (w,) if isinstance(w, str) else tuple(w)
        try:
            for g in group:
                single_token(tokenizer, " " + g)
        except InputError:
            left_out.append(w if isinstance(w, str) else "/".join(w))
            continue
        keep.append(w)
    if len(keep) < need:
        raise InputError(
            f"lm task {task!r}: the tokenizer reads only {len(keep)} of its built-in words as "
            f"one token (it needs {need}; split: {left_out[:8]}): use a tokenizer with a "
            "larger vocabulary, or another task"
        )
    return keep


def _ioi(rng, tok, left_out):
    names = _whole(tok, NAMES, "ioi", 5, left_out)

    def draw():
        io, s, c, d, e = rng.sample(names, 5)
        t = rng.choice(IOI_TEMPLATES)
        first, second = (io, s) if rng.random() < 0.5 else (s, io)  # ABB or BAB
        return t.format(A=first, B=second, C=s), t.format(A=c, B=d, C=e), " " + io, " " + s

    return draw


def _sva(rng, tok, left_out):
    nouns = _whole(tok, SVA_NOUNS, "sva", 2, left_out)
    verbs = _whole(tok, SVA_VERBS, "sva", 1, left_out)

    def draw():
        sg, pl = rng.choice(nouns)
        one, many = rng.choice(verbs)
        t = rng.choice(SVA_TEMPLATES)
        if rng.random() < 0.5:
            return t.format(S=pl), t.format(S=sg), " " + many, " " + one
        return t.format(S=sg), t.format(S=pl), " " + one, " " + many

    return draw


def _fact(rng, tok, left_out):
    pairs = _whole(tok, CAPITALS, "fact", 2, left_out)

    def draw():
        (x, cap), (y, other) = rng.sample(pairs, 2)
        t = rng.choice(FACT_TEMPLATES)
        return t.format(X=x), t.format(X=y), " " + cap, " " + other

    return draw


def _pronoun(rng, tok, left_out):
    for w in ("he", "she"):
        single_token(tok, " " + w)
    women = _whole(tok, NAMES_F, "pronoun", 1, left_out)
    men = _whole(tok, NAMES_M, "pronoun", 1, left_out)

    def draw():
        t = rng.choice(PRONOUN_TEMPLATES)
        w, m = rng.choice(women), rng.choice(men)
        if rng.random() < 0.5:
            return t.format(N=w), t.format(N=m), " she", " he"
        return t.format(N=m), t.format(N=w), " he", " she"

    return draw


def _induction(rng, tok, left_out, half: int):
    pool = sorted(set(_whole(tok, RUN_WORDS, "induction", 2 * half + 1, left_out)))

    def draw():
        chosen = rng.sample(pool, 2 * half + 1)
        run, other, foil = chosen[:half], chosen[half : 2 * half], chosen[-1]
        k = half - 1  # the repeat stops before its last word, which is the answer
        # a leading space: the first word is a token as the others are (" apple")
        clean = " " + " ".join(run + run[:k])
        corrupted = " " + " ".join(other + run[:k])
        return clean, corrupted, " " + run[k], " " + foil

    return draw


TASKS = {"ioi": _ioi, "sva": _sva, "induction": _induction, "fact": _fact,
         "pronoun": _pronoun}  # fmt: skip


def lm_pairs(task: str, tokenizer, n: int = 16, seed: int = 0, half: int = 8,
             tries: int = 50) -> LMPairs:  # fmt: skip
    """``n`` pairs of ``task`` (one of :data:`TASKS`) under ``tokenizer`` (a transformers
    tokenizer), drawn with ``seed``; ``half``: the induction run's length. A pair whose
    prompts differ in token length is dropped and another drawn, up to ``tries * n``
    draws; no pair is drawn twice."""
    if task not in TASKS:
        raise InputError(f"lm task {task!r}: give one of {', '.join(TASKS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"lm_pairs: n={n!r}; give a whole number of pairs, 1 or more")
    if isinstance(half, bool) or not isinstance(half, int) or half < 2:
        raise InputError(f"lm_pairs: half={half!r}; give an induction run of 2 words or more")
    rng = random.Random(f"{task}:{seed}")
    left_out: list = []
    make = TASKS[task]
    draw = make(rng, tokenizer, left_out, half) if task == "induction" else make(
        rng, tokenizer, left_out)  # fmt: skip
    out, seen, dropped = [], set(), 0
    for _ in range(tries * n):
        if len(out) == n:
            break
        clean, corrupted, answer, foil = draw()
        if (clean, corrupted, answer) in seen:
            continue
        seen.add((clean, corrupted, answer))
        a, b = _ids(tokenizer, clean), _ids(tokenizer, corrupted)
        if len(a) != len(b):
            dropped += 1
            continue
        ids = single_token(tokenizer, answer), single_token(tokenizer, foil)
        out.append(LMPair(clean, corrupted, answer, foil, tuple(a), tuple(b), *ids))
    if len(out) < n:
        raise InputError(
            f"lm task {task!r}: only {len(out)} of {n} pairs found in {tries * n} draws "
            f"({dropped} dropped for unequal token lengths, the rest repeats): ask for fewer "
            "pairs"
        )
    return LMPairs(task, out, dropped, sorted(set(left_out)))
