"""Subject-verb agreement examples, and where their subject and attractors are.

An :class:`AgreementExample` is a sentence with ``MASK`` at the verb and the two verb
forms; files of them are read by :mod:`.agreement_files` (BLiMP JSON lines,
Linzen/Goldberg TSV) into an :class:`AgreementData`, which lists the malformed lines it
skipped (:class:`Malformed`). :func:`locate` fills in the subject and the attractors
where the data does not give them, from a dependency parse of the good sentence.

For example (every reader's own docstring has an example that runs)::

    data = read_agreement("lgd_dataset.tsv")
    ex = data[0]
    ex.masked("[MASK]"), ex.good, ex.bad  # ('the keys to the cabinet [MASK] here', 'are', 'is')
    data.skipped  # the malformed lines: Malformed(source='lgd_dataset.tsv:17', reason=...)
    locate([ex])[0].subject  # needs spaCy and en_core_web_sm unless the data gives it
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import InputError

MASK = "***mask***"
DEFAULT_NLP = "en_core_web_sm"


@dataclass(frozen=True)
class AgreementExample:
    """One agreement item: a sentence with ``MASK`` at the verb and the two verb forms.

    Examples:
        >>> ex = sbp.data.AgreementExample(
        ...     words=("the", "keys", "to", "the", "cabinet", sbp.data.MASK, "here"),
        ...     mask_index=5, good="are", bad="is", attractors=1, subject=1,
        ...     attractor_positions=(4,), source="by hand")
        >>> ex.masked("[MASK]")
        'the keys to the cabinet [MASK] here'
        >>> ex.sentence(good=False)
        'the keys to the cabinet is here'
    """

    words: tuple[str, ...]  #: the sentence split on whitespace, MASK at the verb
    mask_index: int  #: word index of MASK
    good: str  #: correct verb
    bad: str  #: incorrect verb
    attractors: int | None  #: number of attractors, if the data gives it
    subject: int | None  #: word index of the subject's head noun, if known
    attractor_positions: tuple[int, ...] | None  #: word indices of the attractors, if known
    source: str  #: "path:line"
    unlocated: str | None = None  #: why ``locate`` gave no subject (None: it did)

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


@dataclass(frozen=True)
class Malformed:
    """A line that was skipped: where it is and what is wrong with it.

    Examples:
        >>> with open("api-bad.tsv", "w") as f:
        ...     _ = f.write("0\\tthe dog barks\\tthe dog ***mask***\\tbarks\\tbark\\n")
        ...     _ = f.write("0\\tthe dog barks\\n")
        >>> sbp.data.read_linzen("api-bad.tsv").skipped
        [Malformed(source='api-bad.tsv:2', reason='expected 5 tab-separated columns (number
        of attractors, sentence, masked sentence, correct verb, incorrect verb), found 2')]
    """

    source: str  #: "path:line"
    reason: str


class AgreementData(list):
    """The examples of a file (a list), with the malformed lines skipped on the way.

    Examples:
        >>> with open("api-two.tsv", "w") as f:
        ...     _ = f.write("0\\tthe dog barks\\tthe dog ***mask***\\tbarks\\tbark\\n")
        ...     _ = f.write("a line that is no example\\n")
        >>> d = sbp.data.read_linzen("api-two.tsv")
        >>> len(d), d[0].good, [m.source for m in d.skipped]
        (1, 'barks', ['api-two.tsv:2'])
    """

    def __init__(self, examples: Iterable[AgreementExample] = (), skipped=()):
        super().__init__(examples)
        self.skipped: list[Malformed] = list(skipped)


def locate(
    examples: Iterable[AgreementExample],
    nlp: str | Callable | None = None,
    progress: bool = False,
) -> list[AgreementExample]:
    """Fill in ``subject`` and ``attractor_positions`` where the data did not give them.

    Examples that have both are returned unchanged. The others are parsed, on the good
    sentence, with ``nlp``: a spaCy pipeline's name or directory (default
    ``en_core_web_sm``), or a callable from text to tokens with spaCy's ``i``, ``idx``,
    ``text``, ``tag_``, ``dep_`` and ``head``.

    - subject: the ``nsubj``/``nsubjpass`` of the token at the verb's position (or, where
      that token is an auxiliary or copula, of its head). Where the parse has no token
      there, gives that verb no subject (e.g. it tagged the verb as a noun), several, or one
      whose number contradicts the verb's (VBZ/"was" singular, VBP/"were" plural against
      NN/NNP singular, NNS/NNPS plural), ``subject`` stays None and ``unlocated`` says
      why: no answer rather than a guess, which in agreement data is most often the
      attractor.
    - attractors: nouns strictly between subject and verb whose number differs from the
      subject's (the verb's, if the subject is no noun).

    Token positions are mapped back to whitespace words by character offset. With
    ``progress``, a tqdm bar counts the parsed sentences.

    Examples:
        A parser written by hand for one sentence, its tokens with the attributes of
        spaCy's: "keys" is the verb's subject, "cabinet" a noun of the other number
        between them, an attractor.

        >>> from types import SimpleNamespace
        >>> def parse(text):
        ...     tags = "DT NNS IN DT NN VBP RB".split()
        ...     deps = "det nsubj prep det pobj ROOT advmod".split()
        ...     tokens, start = [], 0
        ...     for i, (word, tag, dep) in enumerate(zip(text.split(), tags, deps)):
        ...         start = text.index(word, start)
        ...         tokens.append(SimpleNamespace(i=i, idx=start, text=word, tag_=tag, dep_=dep))
        ...     for token, head in zip(tokens, [1, 5, 1, 4, 2, 5, 5]):
        ...         token.head = tokens[head]
        ...     return tokens
        >>> ex = sbp.data.AgreementExample(
        ...     words=("the", "keys", "to", "the", "cabinet", sbp.data.MASK, "here"),
        ...     mask_index=5, good="are", bad="is", attractors=None, subject=None,
        ...     attractor_positions=None, source="by hand")
        >>> found = sbp.data.locate([ex], nlp=parse)[0]
        >>> found.subject, found.attractor_positions, found.unlocated
        (1, (4,), None)
    """
    examples = list(examples)
    todo = [
        k for k, ex in enumerate(examples) if ex.subject is None or ex.attractor_positions is None
    ]
    if not todo:
        return examples
    parse = _parser(nlp)
    texts = [examples[k].sentence() for k in todo]
    pipe = getattr(parse, "pipe", None)
    docs = pipe(texts) if callable(pipe) else map(parse, texts)
    if progress:
        from tqdm.auto import tqdm

        docs = tqdm(docs, total=len(todo), desc="parsing", leave=False)
    out = list(examples)
    for k, doc in zip(todo, docs):
        out[k] = _locate(examples[k], list(doc))
    return out


# ---------------------------------------------------------------------------------------
# Locating subjects and attractors

_NOUN_NUMBER = {"NN": "sg", "NNP": "sg", "NNS": "pl", "NNPS": "pl"}
_VERB_NUMBER = {"VBZ": "sg", "VBP": "pl"}
_VERB_WORD_NUMBER = {"was": "sg", "were": "pl"}  # VBD, which has no number
_SUBJECT = ("nsubj", "nsubjpass", "nsubj:pass")
_HEADED = ("aux", "auxpass", "aux:pass", "cop")  # the subject hangs off the head
_NUMBER = {"sg": "singular", "pl": "plural"}


def _parser(nlp):
    if nlp is not None and not isinstance(nlp, str | Path):
        return nlp
    name = DEFAULT_NLP if nlp is None else str(nlp)
    if not name.strip():
        raise InputError(
            f"nlp={nlp!r}: name a spaCy pipeline (e.g. {DEFAULT_NLP}) or its directory"
        )
    how = "or give `subject` and `attractors` in the data (BLiMP JSON lines)"
    try:
        import spacy
    except ImportError:
        raise InputError(
            "locating subjects and attractors needs spaCy, which is not installed: "
            f"pip install spacy && python -m spacy download {name}, {how}"
        ) from None
    try:
        return spacy.load(name)
    except OSError:
        raise InputError(
            f"spaCy is installed but its pipeline {name!r} is not (no such package or "
            f"directory): python -m spacy download {name}, or name another pipeline "
            f"(nlp=NAME_OR_DIR), {how}"
        ) from None


def _locate(ex: AgreementExample, tokens: list) -> AgreementExample:
    if tokens and not any(t.dep_ for t in tokens):
        raise InputError(
            f"{ex.source}: the parser gave no dependency labels: locating subjects needs a "
            f"pipeline with a dependency parser (e.g. {DEFAULT_NLP})"
        )
    words = ex.sentence().split(" ")
    starts = list(itertools.accumulate((len(w) + 1 for w in words[:-1]), initial=0))
    word = {t.i: bisect.bisect_right(starts, t.idx) - 1 for t in tokens}
    verb = next((t for t in tokens if word[t.i] == ex.mask_index), None)
    if verb is None:
        return replace(ex, unlocated="no subject: the parse has no token at the verb")
    number = _VERB_NUMBER.get(verb.tag_) or _VERB_WORD_NUMBER.get(verb.text.lower())
    subject, why = ex.subject, None
    if subject is None:
        subject, why = _subject(tokens, verb, number, word)
    positions = ex.attractor_positions
    if positions is None and subject is not None:
        positions = _attractors(tokens, subject, ex.mask_index, number, word)
    count = ex.attractors if ex.attractors is not None or positions is None else len(positions)
    return replace(
        ex, subject=subject, attractor_positions=positions, attractors=count, unlocated=why
    )


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


def _subject(tokens, verb, number, word) -> tuple[int | None, str | None]:
    """(word index of the verb's subject, None), or (None, why there is no answer).

    Only the parse's own subject of the token at the verb's position counts: guessing
    the nearest noun before the verb picks the attractor exactly where the parser went
    wrong (a verb tagged as a noun)."""
    governors = {verb.i}
    if verb.dep_ in _HEADED:  # "the dogs are barking": nsubj hangs off "barking"
        governors.add(verb.head.i)
    found = [t for t in tokens if t.dep_ in _SUBJECT and t.head.i in governors]
    what = f"(tagged {verb.tag_ or verb.pos_ or '?'}, dep {verb.dep_ or '?'})"
    if not found:
        return None, f"no subject: the parse gives the verb {what} no nsubj"
    if len({word[t.i] for t in found}) > 1:
        return None, f"no subject: the parse gives the verb {what} several subjects"
    subject = found[0]
    if word[subject.i] == word[verb.i]:
        return None, "no subject: the parse's subject is the verb's own word"
    own = _NOUN_NUMBER.get(subject.tag_)
    if own and number and own != number:
        return None, (
            f"no subject: the parse's subject ({subject.tag_}, {_NUMBER[own]}) does not "
            f"agree with the verb ({_NUMBER[number]})"
        )
    return word[subject.i], None
