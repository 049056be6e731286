"""Agreement pairs made by rule: a subject, 0-4 attractors, a verb pair, and the pair's
counterpart (the same sentence with a subject of the other number).

Each sentence is "[PREAMBLE ,] The (ADJ) N1 FRAME* VERB TAIL": a frame adds one noun
between the subject and the verb, by a preposition ("near the old houses") or a
relative clause ("that the boys saw", "who met the girls"); a noun of the other number
than the subject is an attractor. The relative clauses' verbs are in the past tense, so
no verb but the explained one agrees with anything. Verbs: is/are, was/were, has/have,
does/do. Positions of the subject and the attractors are known by construction and
written as BLiMP JSON lines (``subject``, ``attractors``), which
:func:`~semiring_backprop.data.read_blimp` reads.

:func:`agreement_pairs` is deterministic: one ``seed``, the same lines, on every
machine (NumPy's ``default_rng``). The attractor counts cycle through ``attractors`` so
that each count holds as many sentences. :func:`counterpart` gives any agreement
example (a file's too) its other-number sentence where the subject is a noun of the
vocabulary (:func:`other_number`).

Examples:
    >>> from semiring_backprop.data import agreement_pairs
    >>> lines = agreement_pairs.agreement_pairs(5, seed=0)
    >>> [line["attractors"] for line in lines]
    [[], [13], [9, 14], [4, 8, 11], [5, 8, 14, 18]]
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

#: (singular, plural) of nouns that can see, meet and help (the relative clauses' agents);
#: irregular plurals among them
PEOPLE = (
    ("dog", "dogs"), ("author", "authors"), ("teacher", "teachers"), ("friend", "friends"),
    ("boy", "boys"), ("girl", "girls"), ("doctor", "doctors"), ("student", "students"),
    ("farmer", "farmers"), ("pilot", "pilots"), ("singer", "singers"), ("driver", "drivers"),
    ("lawyer", "lawyers"), ("bird", "birds"), ("horse", "horses"), ("king", "kings"),
    ("player", "players"), ("officer", "officers"), ("nurse", "nurses"),
    ("neighbor", "neighbors"), ("manager", "managers"), ("worker", "workers"),
    ("baby", "babies"), ("lady", "ladies"), ("man", "men"), ("woman", "women"),
    ("child", "children"), ("mouse", "mice"), ("wolf", "wolves"), ("goose", "geese"),
    ("wife", "wives"),
)  # fmt: skip
#: (singular, plural) of the other nouns
THINGS = (
    ("key", "keys"), ("cabinet", "cabinets"), ("car", "cars"), ("house", "houses"),
    ("painting", "paintings"), ("letter", "letters"), ("book", "books"), ("table", "tables"),
    ("window", "windows"), ("bottle", "bottles"), ("road", "roads"), ("river", "rivers"),
    ("tree", "trees"), ("garden", "gardens"), ("machine", "machines"),
    ("picture", "pictures"), ("computer", "computers"), ("chair", "chairs"),
    ("door", "doors"), ("box", "boxes"), ("church", "churches"), ("bus", "buses"),
    ("city", "cities"), ("story", "stories"), ("foot", "feet"), ("tooth", "teeth"),
    ("knife", "knives"), ("leaf", "leaves"), ("shelf", "shelves"),
)  # fmt: skip
NOUNS = PEOPLE + THINGS
ADJECTIVES = ("old", "small", "red", "new", "big", "famous", "young", "tall", "quiet",
              "strange", "happy", "busy", "dark", "bright", "heavy", "little")  # fmt: skip
PREPOSITIONS = ("of", "near", "behind", "beside", "with", "from", "for", "under", "by",
                "above", "next to", "close to", "in front of")  # fmt: skip
#: past-tense verbs of the relative clauses (they agree with nothing)
CLAUSE_VERBS = ("saw", "liked", "met", "admired", "helped", "called", "visited", "knew",
                "followed", "painted", "found", "trusted")  # fmt: skip
#: (singular, plural, what follows)
VERBS = (("is", "are", "here ."), ("was", "were", "there ."), ("has", "have", "gone ."),
         ("does", "do", "not matter ."))  # fmt: skip
#: clauses before the subject, to make sentences longer (preceding it, their nouns are
#: no attractors)
PREAMBLES = (
    "In the spring of that year ,", "After a long and difficult meeting at the town hall ,",
    "According to the report that the office published last week ,",
    "As everyone in the small village had expected for a long time ,",
    "On a cold morning in the middle of winter ,", "Despite the heavy rain that fell all night ,",
    "For the first time since the old bridge opened ,", "Without any warning ,",
    "In the end ,", "Late in the evening ,", "Just as the sun rose over the green hills ,",
    "Once again ,", "To the surprise of the whole family ,", "Every single day ,",
    "Long before the war between the two kingdoms began ,",
)  # fmt: skip
TEMPLATE = "[PREAMBLE ,] The (ADJ) N1 [PREP the (ADJ) N | that the N VERBED | who VERBED the N]*"

_OTHER = {**{s: p for s, p in NOUNS}, **{p: s for s, p in NOUNS}}
_PEOPLE = {w for pair in PEOPLE for w in pair}
_PLURAL = {p for _, p in NOUNS}


def other_number(word: str) -> str | None:
    """The noun's form of the other number ("keys" -> "key", "Child" -> "Children"), or
    None where the word is no noun of :data:`NOUNS`."""
    other = _OTHER.get(word.lower())
    if other is None:
        return None
    return other.capitalize() if word[:1].isupper() else other


def agreement_pairs(n: int, seed: int = 0, attractors=(0, 1, 2, 3, 4), max_nouns: int = 4,
                    words: tuple[int, int] | None = None) -> list[dict]:  # fmt: skip
    """``n`` sentences as BLiMP JSON objects, with ``subject`` and ``attractors`` (word
    indices) and the extra fields ``plural`` (the subject's number), ``template`` and
    ``frames``. The attractor counts cycle through ``attractors``; each sentence has
    between its count and ``max_nouns`` nouns between subject and verb (the others of
    the subject's number). ``words``: ``(low, high)``, a length in words drawn per
    sentence, reached (about) by preambles before the subject."""
    if not attractors or min(attractors) < 0 or max(attractors) > max_nouns:
        raise ValueError(f"attractors must be counts between 0 and max_nouns={max_nouns}")
    rng = np.random.default_rng(seed)
    pick = lambda items: items[int(rng.integers(len(items)))]
    return [_sentence(rng, pick, attractors[i % len(attractors)], max_nouns, words)
            for i in range(n)]  # fmt: skip


def _sentence(rng, pick, k: int, max_nouns: int, length) -> dict:
    plural = bool(rng.integers(2))
    adjective = lambda: [pick(ADJECTIVES)] if rng.random() < 0.3 else []
    m = int(rng.integers(k, max_nouns + 1))
    others = set(rng.choice(m, size=k, replace=False).tolist()) if k else set()
    words = ["the", *adjective()]
    subject = len(words)
    words.append(pick(NOUNS)[plural])
    head = words[-1]  # the noun the next frame modifies
    positions, frames = [], []
    for j in range(m):
        number = plural != (j in others)
        kind = int(rng.integers(4))
        if kind == 2:  # an object relative clause, a person its agent: "that the boys saw"
            words += ["that", "the"]
            at = len(words)
            words += [pick(PEOPLE)[number], pick(CLAUSE_VERBS)]
            frames.append("object_clause")
        elif kind == 3 and head in _PEOPLE:  # a subject relative clause: "who met the girls"
            words += ["who", pick(CLAUSE_VERBS), "the", *adjective()]
            at = len(words)
            words.append(pick(NOUNS)[number])
            frames.append("subject_clause")
        else:  # a prepositional phrase (half of the frames)
            words += [*pick(PREPOSITIONS).split(), "the", *adjective()]
            at = len(words)
            words.append(pick(NOUNS)[number])
            frames.append("prep")
        head = words[at]
        if j in others:
            positions.append(at)
    pre: list[str] = []
    if length is not None:
        target = int(rng.integers(length[0], length[1] + 1))
        while len(pre) + len(words) + 1 < target:
            clause = pick(PREAMBLES)
            pre += (clause[0].lower() + clause[1:] if pre else clause).split()
    if not pre:
        words[0] = "The"
    shift = len(pre)
    words = pre + words
    singular, plural_verb, tail = pick(VERBS)
    good, bad = (plural_verb, singular) if plural else (singular, plural_verb)
    prefix = " ".join(words)
    return {
        "sentence_good": f"{prefix} {good} {tail}",
        "sentence_bad": f"{prefix} {bad} {tail}",
        "one_prefix_prefix": prefix,
        "one_prefix_word_good": good,
        "one_prefix_word_bad": bad,
        "subject": subject + shift,
        "attractors": [p + shift for p in positions],
        "plural": plural,
        "frames": frames,
        "template": TEMPLATE,
    }


def write_agreement_pairs(path, n: int, seed: int = 0, **kwargs):
    """:func:`agreement_pairs` written to ``path`` as JSON lines (atomically); the path."""
    from .._files import atomic_write

    text = "".join(json.dumps(line) + "\n" for line in agreement_pairs(n, seed, **kwargs))
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def counterpart(ex):
    """The example with its subject of the other number and the verbs swapped (an
    :class:`~semiring_backprop.data.AgreementExample`), or None where the subject is
    unknown or no noun of :data:`NOUNS`."""
    if ex.subject is None:
        return None
    other = other_number(ex.words[ex.subject])
    if other is None:
        return None
    words = list(ex.words)
    words[ex.subject] = other
    # the attractors of the original are of the counterpart's number: none are listed
    return replace(
        ex, words=tuple(words), good=ex.bad, bad=ex.good, attractors=None, attractor_positions=None
    )


def is_plural(word: str) -> bool | None:
    """Whether the noun is a plural of :data:`NOUNS` (None: not one of them)."""
    w = word.lower()
    return (w in _PLURAL) if w in _OTHER else None
