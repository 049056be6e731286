"""Readers for subject-verb agreement data, and where the subject and attractors are.

Two formats, one example type:

- BLiMP-style JSON lines, one object per line with ``sentence_good``, ``sentence_bad``,
  ``one_prefix_prefix``, ``one_prefix_word_good`` and ``one_prefix_word_bad``; optional
  ``subject`` (a word index) and ``attractors`` (a list of word indices).
- Linzen/Goldberg TSV, 5 tab-separated columns: number of attractors, sentence, the
  sentence with ``***mask***`` at the verb, correct verb, incorrect verb.

>>> ex = read_agreement("lgd_dataset.tsv")[0]
>>> ex.masked("[MASK]"), ex.good, ex.bad
('the keys to the cabinet [MASK] here', 'are', 'is')
>>> locate([ex])[0].subject  # needs spaCy and en_core_web_sm unless the data gives it
1
"""

from __future__ import annotations

import bisect
import itertools
import json
import string
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import InputError

MASK = "***mask***"

_BLIMP_KEYS = (
    "sentence_good",
    "sentence_bad",
    "one_prefix_prefix",
    "one_prefix_word_good",
    "one_prefix_word_bad",
)
_LINZEN_COLUMNS = "number of attractors, sentence, masked sentence, correct verb, incorrect verb"


@dataclass(frozen=True)
class AgreementExample:
    """One agreement item: a sentence with ``MASK`` at the verb and the two verb forms."""

    words: tuple[str, ...]  #: the sentence split on whitespace, MASK at the verb
    mask_index: int  #: word index of MASK
    good: str  #: correct verb
    bad: str  #: incorrect verb
    attractors: int | None  #: number of attractors, if the data gives it
    subject: int | None  #: word index of the subject's head noun, if known
    attractor_positions: tuple[int, ...] | None  #: word indices of the attractors, if known
    source: str  #: "path:line"

    def masked(self, mask_token: str) -> str:
        """The sentence with the model's mask token at the verb."""
        return self._with(mask_token)

    def sentence(self, good: bool = True) -> str:
        """The sentence with the correct (or, with ``good=False``, the incorrect) verb."""
        return self._with(self.good if good else self.bad)

    def _with(self, verb: str) -> str:
        words = list(self.words)
        words[self.mask_index] = verb
        return " ".join(words)


def read_blimp(path) -> list[AgreementExample]:
    """Examples from a BLiMP-style JSON-lines file; blank lines are skipped.

    The masked sentence is the prefix, MASK, then the rest of ``sentence_good``.
    Punctuation stuck to the verb (``bark.``) becomes a word of its own.
    """
    return [_blimp_example(where, line) for where, line in _lines(path)]


def read_linzen(path) -> list[AgreementExample]:
    """Examples from a Linzen/Goldberg 5-column TSV file (no header; blank lines skipped)."""
    return [_linzen_example(where, line) for where, line in _lines(path)]


def read_agreement(path) -> list[AgreementExample]:
    """``read_blimp`` for .jsonl/.json files, ``read_linzen`` for .tsv/.txt files."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_blimp(path)
    if suffix in (".tsv", ".txt"):
        return read_linzen(path)
    raise InputError(
        f"cannot tell the format of {str(path)!r} from its extension {suffix!r}: name it "
        ".jsonl/.json (BLiMP) or .tsv/.txt (Linzen/Goldberg), or call read_blimp/read_linzen"
    )


def locate(examples: Iterable[AgreementExample], nlp=None) -> list[AgreementExample]:
    """Fill in ``subject`` and ``attractor_positions`` where the data did not give them.

    Examples that have both are returned unchanged. The others are parsed with ``nlp``
    (default: spaCy's ``en_core_web_sm``), on the good sentence:

    - subject: the ``nsubj``/``nsubjpass`` of the verb (or, for an auxiliary, of its
      head). If the parser finds none, the nearest noun before the verb that agrees in
      number with the verb (VBZ/"was" singular, VBP/"were" plural; any noun if the
      verb's number is unknown). If there is no such noun, ``subject`` stays None.
    - attractors: nouns strictly between subject and verb whose number (NN/NNP singular,
      NNS/NNPS plural) differs from the subject's (the verb's, if the subject is no noun).

    Token positions are mapped back to whitespace words by character offset.
    """
    out = []
    for ex in examples:
        if ex.subject is None or ex.attractor_positions is None:
            nlp = _load_spacy() if nlp is None else nlp
            ex = _locate(ex, nlp)
        out.append(ex)
    return out


# ---------------------------------------------------------------------------------------
# Reading


def _lines(path) -> Iterator[tuple[str, str]]:
    """("path:line", text) for each non-blank line."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"agreement data file {str(path)!r} does not exist or is not a file")
    with p.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise InputError(
                    f"{p}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1}); agreement data must be UTF-8 JSON lines or TSV"
                ) from None
            if "\x00" in line:
                raise InputError(f"{p}:{number}: holds a NUL byte: a binary file, not text")
            if line.strip():
                yield f"{p}:{number}", line


def _blimp_example(where: str, line: str) -> AgreementExample:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply for a BLiMP line") from None
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object, found {type(row).__name__}")
    missing = [k for k in _BLIMP_KEYS if not isinstance(row.get(k), str)]
    if missing:
        raise InputError(
            f"{where}: missing or non-string {', '.join(missing)} "
            f"(a BLiMP line needs {', '.join(_BLIMP_KEYS)})"
        )
    good = _verb(row["one_prefix_word_good"], where, "one_prefix_word_good")
    bad = _verb(row["one_prefix_word_bad"], where, "one_prefix_word_bad")
    prefix = row["one_prefix_prefix"].split()
    rest = _after(row["sentence_good"], prefix, good, where, "good")
    _after(row["sentence_bad"], prefix, bad, where, "bad")
    words = (*prefix, MASK, *rest)
    verb = len(prefix)
    subject = row.get("subject")
    if subject is not None:
        _check_index(subject, words, where, "subject")
        if subject == verb:
            raise InputError(
                f"{where}: subject {subject} is the verb's own position (word {verb}, "
                f"{good!r} / {bad!r}); give the index of the subject's head noun"
            )
    positions = row.get("attractors")
    if positions is not None:
        if not isinstance(positions, list):
            raise InputError(
                f"{where}: attractors must be a list of word indices, got {positions!r}"
            )
        for i in positions:
            _check_index(i, words, where, "attractors")
        twice = sorted({i for i in positions if positions.count(i) > 1})
        if twice:
            raise InputError(
                f"{where}: attractors list word {twice[0]} more than once ({positions!r}); "
                "each attractor counts once"
            )
        clash = [i for i in positions if i in (verb, subject)]
        if clash:
            what = "the verb's position" if clash[0] == verb else "the subject"
            raise InputError(
                f"{where}: attractor {clash[0]} is {what}; an attractor is another noun"
            )
        positions = tuple(positions)
    return AgreementExample(
        words=words,
        mask_index=verb,
        good=good,
        bad=bad,
        attractors=None if positions is None else len(positions),
        subject=subject,
        attractor_positions=positions,
        source=where,
    )


def _after(sentence: str, prefix: list[str], verb: str, where: str, which: str) -> list[str]:
    """The words of ``sentence`` after ``prefix`` and ``verb``; error if it does not start so."""
    words = sentence.split()
    n = len(prefix)
    if words[:n] == prefix and len(words) > n and words[n].startswith(verb):
        tail = words[n][len(verb) :]
        if all(c in string.punctuation for c in tail):
            return [tail, *words[n + 1 :]] if tail else words[n + 1 :]
    expected = " ".join([*prefix, verb])
    raise InputError(
        f"{where}: sentence_{which} {sentence!r} does not start with one_prefix_prefix + "
        f"one_prefix_word_{which} ({expected!r})"
    )


def _linzen_example(where: str, line: str) -> AgreementExample:
    cols = line.split("\t")
    if len(cols) != 5:
        raise InputError(
            f"{where}: expected 5 tab-separated columns ({_LINZEN_COLUMNS}), found {len(cols)}"
        )
    count, sentence, masked, good, bad = (c.strip() for c in cols)
    if not count.isdigit():
        raise InputError(
            f"{where}: column 1 (number of attractors) must be a non-negative integer, "
            f"found {count!r}"
        )
    words = tuple(masked.split())
    if masked.count(MASK) != 1 or words.count(MASK) != 1:
        raise InputError(
            f"{where}: column 3 must contain {MASK} exactly once, as a word of its own; "
            f"found {masked!r}"
        )
    i = words.index(MASK)
    plain = sentence.split()
    differ = len(plain) != len(words) or any(
        a != b for j, (a, b) in enumerate(zip(plain, words)) if j != i
    )
    if differ:
        raise InputError(
            f"{where}: columns 2 and 3 differ outside the mask; column 3 must be column 2 "
            f"with the verb replaced by {MASK} (got {sentence!r} and {masked!r})"
        )
    return AgreementExample(
        words=words,
        mask_index=i,
        good=_verb(good, where, "column 4 (correct verb)"),
        bad=_verb(bad, where, "column 5 (incorrect verb)"),
        attractors=int(count),
        subject=None,
        attractor_positions=None,
        source=where,
    )


def _verb(text: str, where: str, field: str) -> str:
    words = text.split()
    if len(words) != 1:
        raise InputError(f"{where}: {field} must be one word, got {text!r}")
    return words[0]


def _check_index(i, words, where: str, field: str) -> None:
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(words):
        raise InputError(
            f"{where}: {field} must hold word indices in 0..{len(words) - 1}, got {i!r}"
        )


# ---------------------------------------------------------------------------------------
# Locating subjects and attractors

_NOUN_NUMBER = {"NN": "sg", "NNP": "sg", "NNS": "pl", "NNPS": "pl"}
_VERB_NUMBER = {"VBZ": "sg", "VBP": "pl"}
_VERB_WORD_NUMBER = {"was": "sg", "were": "pl"}  # VBD, which has no number


def _load_spacy():
    how = "or give `subject` and `attractors` in the data (BLiMP JSON lines)"
    try:
        import spacy
    except ImportError:
        raise InputError(
            "locating subjects and attractors needs spaCy, which is not installed: "
            f"pip install spacy && python -m spacy download en_core_web_sm, {how}"
        ) from None
    try:
        return spacy.load("en_core_web_sm")
    except OSError:
        raise InputError(
            "spaCy is installed but its English model en_core_web_sm is not: "
            f"python -m spacy download en_core_web_sm, {how}"
        ) from None


def _locate(ex: AgreementExample, nlp) -> AgreementExample:
    words = list(ex.words)
    words[ex.mask_index] = ex.good
    starts = list(itertools.accumulate((len(w) + 1 for w in words[:-1]), initial=0))
    tokens = list(nlp(" ".join(words)))
    word = {t.i: bisect.bisect_right(starts, t.idx) - 1 for t in tokens}
    verb = next((t for t in tokens if word[t.i] == ex.mask_index), None)
    if verb is None:
        raise InputError(f"{ex.source}: the parser returned no token for the verb {ex.good!r}")
    number = _VERB_NUMBER.get(verb.tag_) or _VERB_WORD_NUMBER.get(verb.text.lower())
    subject = ex.subject
    if subject is None:
        subject = _subject(tokens, verb, number, word)
    positions = ex.attractor_positions
    if positions is None and subject is not None:
        positions = _attractors(tokens, subject, ex.mask_index, number, word)
    count = ex.attractors if ex.attractors is not None or positions is None else len(positions)
    return replace(ex, subject=subject, attractor_positions=positions, attractors=count)


def _attractors(tokens, subject, verb, number, word) -> tuple[int, ...]:
    """Words strictly between subject and verb holding a noun of the other number."""
    nouns = [t for t in tokens if t.tag_ in _NOUN_NUMBER]
    own = [_NOUN_NUMBER[t.tag_] for t in nouns if word[t.i] == subject]
    number = own[-1] if own else number  # a subject that is no noun: the verb's number
    if number is None:
        return ()
    lo, hi = sorted((subject, verb))
    found = {word[t.i] for t in nouns if lo < word[t.i] < hi and _NOUN_NUMBER[t.tag_] != number}
    return tuple(sorted(found))


def _subject(tokens, verb, number, word) -> int | None:
    """Word index of the verb's subject: its nsubj, else the nearest agreeing noun before."""
    governors = {verb.i}
    if verb.dep_ in ("aux", "auxpass"):  # "the dogs are barking": nsubj hangs off "barking"
        governors.add(verb.head.i)
    for t in tokens:
        if t.dep_ in ("nsubj", "nsubjpass") and t.head.i in governors:
            return word[t.i]
    before = [
        t
        for t in tokens
        if word[t.i] < word[verb.i]
        and t.tag_ in _NOUN_NUMBER
        and (number is None or _NOUN_NUMBER[t.tag_] == number)
    ]
    return word[before[-1].i] if before else None
