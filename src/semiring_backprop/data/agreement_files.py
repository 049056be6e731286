"""Readers for subject-verb agreement files, two formats, one example type
(:class:`~.agreement.AgreementExample`):

- BLiMP JSON lines (the official files: one object per line with ``sentence_good``,
  ``sentence_bad``, ``one_prefix_prefix``, ``one_prefix_word_good`` and
  ``one_prefix_word_bad``, among others); optional ``subject`` (a word index) and
  ``attractors`` (a list of word indices). The two "words" may be phrases ("works with" /
  "work with"): the one word in which they differ is the verb.
- Linzen/Goldberg TSV, 5 tab-separated columns: number of attractors, sentence, the
  sentence with ``***mask***`` at the verb, correct verb, incorrect verb.

A malformed line does not reject its file: it is skipped and listed, with its
``file:line`` and what is wrong, in the result's ``skipped`` (``strict=True`` raises at
the first one instead). A file with lines but no usable example is an error.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from pathlib import Path

from ..errors import InputError
from .agreement import MASK, AgreementData, AgreementExample, Malformed

__all__ = ["read_agreement", "read_blimp", "read_linzen"]

_BLIMP_KEYS = (
    "sentence_good",
    "sentence_bad",
    "one_prefix_prefix",
    "one_prefix_word_good",
    "one_prefix_word_bad",
)
_TWO_PREFIX_KEYS = ("two_prefix_prefix_good", "two_prefix_prefix_bad", "two_prefix_word")
_LINZEN_COLUMNS = "number of attractors, sentence, masked sentence, correct verb, incorrect verb"


def read_blimp(path, strict: bool = False) -> AgreementData:
    """Examples from a BLiMP JSON-lines file; blank lines are skipped, and so are
    malformed ones (listed in ``.skipped``; with ``strict``, the first is an error).

    The masked sentence is the prefix, MASK, then the rest of ``sentence_good``.
    Punctuation stuck to the verb (``bark.``) becomes a word of its own. Where the two
    "words" are phrases ("works with" / "work with"), the words before the one that
    differs join the prefix and those after it the rest.

    Examples:
        >>> import json
        >>> row = {"sentence_good": "The dogs bark.", "sentence_bad": "The dogs barks.",
        ...        "one_prefix_prefix": "The dogs", "one_prefix_word_good": "bark",
        ...        "one_prefix_word_bad": "barks"}
        >>> with open("api-blimp.jsonl", "w") as f:
        ...     _ = f.write(json.dumps(row) + "\\n")
        >>> ex = sbp.data.read_blimp("api-blimp.jsonl")[0]
        >>> ex.words, ex.good, ex.bad
        (('The', 'dogs', '***mask***', '.'), 'bark', 'barks')
    """
    return _read(path, _blimp_example, strict)


def read_linzen(path, strict: bool = False) -> AgreementData:
    """Examples from a Linzen/Goldberg 5-column TSV file (no header; blank lines
    skipped; malformed lines listed in ``.skipped``, or an error with ``strict``).

    The columns: number of attractors, sentence, the sentence with ``***mask***`` at the
    verb, correct verb, incorrect verb.

    Examples:
        >>> with open("api-linzen.tsv", "w") as f:
        ...     _ = f.write("1\\tthe keys to the cabinet are here\\t"
        ...                 "the keys to the cabinet ***mask*** here\\tare\\tis\\n")
        >>> ex = sbp.data.read_linzen("api-linzen.tsv")[0]
        >>> ex.mask_index, ex.good, ex.bad, ex.attractors, ex.source
        (5, 'are', 'is', 1, 'api-linzen.tsv:1')
    """
    return _read(path, _linzen_example, strict)


def read_agreement(path, strict: bool = False) -> AgreementData:
    """``read_blimp`` for .jsonl/.json files, ``read_linzen`` for .tsv/.txt files.

    Examples:
        >>> with open("api-linzen.txt", "w") as f:
        ...     _ = f.write("0\\tthe dog barks\\tthe dog ***mask***\\tbarks\\tbark\\n")
        >>> sbp.data.read_agreement("api-linzen.txt")[0].sentence()
        'the dog barks'
    """
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_blimp(path, strict)
    if suffix in (".tsv", ".txt"):
        return read_linzen(path, strict)
    raise InputError(
        f"cannot tell the format of {str(path)!r} from its extension {suffix!r}: name it "
        ".jsonl/.json (BLiMP) or .tsv/.txt (Linzen/Goldberg), or call read_blimp/read_linzen"
    )


# ---------------------------------------------------------------------------------------
# Reading


def _read(path, parse, strict: bool) -> AgreementData:
    examples, skipped = [], []
    for where, raw in _lines(path):
        try:
            examples.append(parse(where, _text(where, raw)))
        except InputError as e:
            if strict:
                raise
            skipped.append(Malformed(where, str(e).removeprefix(f"{where}: ")))
    if skipped and not examples:
        first = "; ".join(f"{m.source}: {m.reason}" for m in skipped[:3])
        more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
        raise InputError(
            f"{path}: none of its {len(skipped)} non-blank lines is a usable example: {first}{more}"
        )
    return AgreementData(examples, skipped)


def _lines(path) -> Iterator[tuple[str, bytes]]:
    """("path:line", raw bytes) for each non-blank line."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"agreement data file {str(path)!r} does not exist or is not a file")
    with p.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1:  # a byte-order mark (files saved by Excel, Notepad) is no data
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if raw.strip():
                yield f"{p}:{number}", raw


def _text(where: str, raw: bytes) -> str:
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
            "agreement data must be UTF-8 JSON lines or TSV"
        ) from None
    if "\x00" in line:
        raise InputError(f"{where}: holds a NUL byte: binary data, not text")
    return line


def _blimp_example(where: str, line: str) -> AgreementExample:
    row = _blimp_row(where, line)
    good, bad, prefix, after = _phrases(row, where)
    rest = _after(row["sentence_good"], prefix, [good, *after], where, "good")
    if _after(row["sentence_bad"], prefix, [bad, *after], where, "bad") != rest:
        raise InputError(
            f"{where}: sentence_good and sentence_bad differ after the verb "
            f"({row['sentence_good']!r} / {row['sentence_bad']!r}); a pair differs in the "
            "verb only"
        )
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
        positions = _attractor_list(positions, words, verb, subject, where)
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


def _blimp_row(where: str, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply for a BLiMP line") from None
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object, found {type(row).__name__}")
    missing = [k for k in _BLIMP_KEYS if not isinstance(row.get(k), str)]
    if missing and all(isinstance(row.get(k), str) for k in _TWO_PREFIX_KEYS):
        raise InputError(
            f"{where}: a two-prefix pair (the sentences differ before the shared word "
            f"{row['two_prefix_word']!r}: {row['two_prefix_prefix_good']!r} / "
            f"{row['two_prefix_prefix_bad']!r}), not a choice between two verbs; give a "
            "one-prefix file (with one_prefix_prefix, one_prefix_word_good/_bad)"
        )
    if missing:
        raise InputError(
            f"{where}: missing or non-string {', '.join(missing)} "
            f"(a BLiMP line needs {', '.join(_BLIMP_KEYS)})"
        )
    return row


def _phrases(row: dict, where: str) -> tuple[str, str, list[str], list[str]]:
    """(good verb, bad verb, prefix words, words after the verb within the phrases):
    the one_prefix words may be phrases that differ in exactly one word."""
    good, bad = row["one_prefix_word_good"].split(), row["one_prefix_word_bad"].split()
    for name, words in (("good", good), ("bad", bad)):
        if not words:
            raise InputError(f"{where}: one_prefix_word_{name} is empty")
    differ = [k for k, (g, b) in enumerate(zip(good, bad)) if g != b]
    if len(good) != len(bad) or len(differ) != 1:
        raise InputError(
            f"{where}: one_prefix_word_good {row['one_prefix_word_good']!r} and "
            f"one_prefix_word_bad {row['one_prefix_word_bad']!r} must differ in exactly one "
            "word (the verb)"
        )
    k = differ[0]
    return good[k], bad[k], [*row["one_prefix_prefix"].split(), *good[:k]], good[k + 1 :]


def _after(sentence: str, prefix: list[str], phrase: list[str], where: str, which: str):
    """The words of ``sentence`` after ``prefix`` and the verb (``phrase[0]``, followed by
    the rest of the phrase); an error if it does not start so."""
    words = sentence.split()
    n, m = len(prefix), len(phrase)
    if words[:n] == prefix and len(words) >= n + m and words[n : n + m - 1] == phrase[:-1]:
        last = words[n + m - 1]
        tail = last[len(phrase[-1]) :]
        if last.startswith(phrase[-1]) and all(c in string.punctuation for c in tail):
            if m > 1:
                return words[n + 1 :]
            return [tail, *words[n + 1 :]] if tail else words[n + 1 :]
    expected = " ".join([*prefix, *phrase])
    raise InputError(
        f"{where}: sentence_{which} {sentence!r} does not start with one_prefix_prefix + "
        f"one_prefix_word_{which} ({expected!r})"
    )


def _attractor_list(positions, words, verb: int, subject, where: str) -> tuple[int, ...]:
    if not isinstance(positions, list):
        raise InputError(f"{where}: attractors must be a list of word indices, got {positions!r}")
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
        raise InputError(f"{where}: attractor {clash[0]} is {what}; an attractor is another noun")
    return tuple(positions)


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
