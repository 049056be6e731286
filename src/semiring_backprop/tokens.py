"""Tokens as people read them.

A byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM2) writes each byte of the text as a
printable character: ``ĠMary`` is `` Mary`` (``Ġ``: a space), ``Ċ`` a newline, ``ĉ`` a
tab, and ``Ã©`` the two bytes of ``é``. SentencePiece writes a space as ``▁``
(``▁Mary``) and an odd byte as ``<0x0A>``. :func:`readable` turns such a token into
its text, with a newline shown as ``↵`` and a tab as ``⇥`` (other control characters
as their Unicode pictures, ``␍``; a token holding part of a character's bytes, a
character split over tokens, shows those bytes: ``\\xc3``), so that every view, table,
figure and export shows `` Mary``; the raw token stays where a program reads it
(``token_raw`` columns, the ``raw_tokens`` field of an explanation's JSON, vocabulary
ids).

How a token is read depends on its tokenizer (:func:`scheme`): ``"byte-level"``,
``"sentencepiece"`` or ``"plain"`` (WordPiece and the rest: ``##ing`` and ``[CLS]``
stay as they are). Where the tokenizer is known, it decides (the type of its decoder
and pre-tokenizer; a slow tokenizer's byte table or SentencePiece model). Where it is
not (a list of strings given to a view), the list as a whole is looked at
(:func:`guess`): byte-level only when every character of every token is one of the 256
characters of the byte table, at least one token holds a character that stands for a
space or control byte (``Ġ``, ``Ċ``...), and the bytes of the tokens together are valid
UTF-8; SentencePiece when a token holds ``▁``; else plain, unchanged. A text of a plain
tokenizer that holds such characters itself (a Maltese ``Ġ`` among ASCII) could be
taken for bytes: pass the tokenizer (or its scheme) where it is known. Text already
readable is left as it is (it holds spaces or ``↵``, which the byte table has not).

Examples:
    >>> readable_tokens(["When", "ĠMary", "Ġand", "Ċ", "cafÃ©"])
    ['When', ' Mary', ' and', '↵', 'café']
    >>> readable_tokens(["▁When", "▁Mary", "<0x0A>"])
    [' When', ' Mary', '↵']
    >>> readable_tokens(["[CLS]", "play", "##ing", "[SEP]"])
    ['[CLS]', 'play', '##ing', '[SEP]']
    >>> readable("ĠMary", "byte-level")
    ' Mary'
"""

from __future__ import annotations

import functools
import json
import re

from .errors import InputError

__all__ = ["SCHEMES", "guess", "readable", "readable_column", "readable_rows", "readable_tokens",
           "scheme", "text_of", "token_line"]  # fmt: skip

BYTE_LEVEL, SENTENCEPIECE, PLAIN = "byte-level", "sentencepiece", "plain"
#: the ways a tokenizer writes text into its tokens
SCHEMES = (BYTE_LEVEL, SENTENCEPIECE, PLAIN)
#: how a newline and a tab are shown
NEWLINE, TAB = "↵", "⇥"
_SPACE_MARK = "▁"
_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_table() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the character a byte-level tokenizer writes
    for each byte -> the byte. The printable bytes stand for themselves; the other 68
    (controls, space, 127-160, the soft hyphen) are written as ``chr(256 + n)`` in order
    (space: ``Ġ``, newline: ``Ċ``, tab: ``ĉ``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in chars.items()}


def _shown(text: str) -> str:
    """Newline as ``↵``, tab as ``⇥``, other control characters as their pictures."""
    if text.isprintable() and "\n" not in text:
        return text
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\n":
            out.append(NEWLINE)
        elif ch == "\t":
            out.append(TAB)
        elif o < 0x20:
            out.append(chr(0x2400 + o))
        elif o == 0x7F:
            out.append("\u2421")
        else:
            out.append(ch)
    return "".join(out)


def _from_bytes(token: str) -> str:
    table = byte_table()
    raw = b"".join(bytes([table[c]]) if c in table else c.encode() for c in token)
    # a piece of a character split over tokens shows as its bytes (\xc3)
    return _shown(raw.decode("utf-8", errors="backslashreplace"))


def _from_sentencepiece(token: str) -> str:
    def byte(m):
        b = int(m.group(1), 16)
        return chr(b) if b < 0x80 else m.group(0)

    return _shown(_FALLBACK.sub(byte, token.replace(_SPACE_MARK, " ")))


def _state_types(part) -> list:
    """The ``type`` names in a tokenizers component's JSON (a Sequence's members too)."""
    if part is None:
        return []
    try:
        spec = json.loads(part.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return [type(part).__name__]
    found, todo = [], [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            found.append(str(d.get("type", "")))
            if d.get("type") == "Replace" and _SPACE_MARK in json.dumps(d, ensure_ascii=False):
                found.append("Metaspace")
            todo += [v for v in d.values() if isinstance(v, dict | list)]
        elif isinstance(d, list):
            todo += d
    return found


def scheme(tokenizer) -> str:
    """How ``tokenizer`` writes text into its tokens: ``"byte-level"``,
    ``"sentencepiece"`` or ``"plain"``, from its decoder and pre-tokenizer (a fast
    tokenizer), or its byte table or SentencePiece model (a slow one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        types = _state_types(getattr(backend, "decoder", None))
        types += _state_types(getattr(backend, "pre_tokenizer", None))
        if "ByteLevel" in types:
            return BYTE_LEVEL
        if "Metaspace" in types or "ByteFallback" in types:
            return SENTENCEPIECE
        return PLAIN
    if getattr(tokenizer, "byte_decoder", None) is not None:
        return BYTE_LEVEL
    if getattr(tokenizer, "sp_model", None) is not None:
        return SENTENCEPIECE
    return PLAIN


def guess(tokens) -> str:
    """The scheme of a list of tokens whose tokenizer is not known (see the module)."""
    toks = [str(t) for t in tokens]
    if any(_SPACE_MARK in t for t in toks):
        return SENTENCEPIECE
    table = byte_table()
    chars = set().union(*map(set, toks)) if toks else set()
    if not any(256 <= ord(c) < 256 + 68 for c in chars) or not chars <= table.keys():
        return PLAIN
    data = b"".join(bytes(table[c] for c in t) for t in toks)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return PLAIN
    return BYTE_LEVEL


def _scheme_of(how, tokens) -> str:
    if how is None:
        return guess(tokens)
    if isinstance(how, str):
        if how not in SCHEMES:
            raise InputError(f"token scheme {how!r}: use one of {', '.join(SCHEMES)}, a "
                             "tokenizer, or None to guess from the tokens")  # fmt: skip
        return how
    return scheme(how)


def readable(token: str, how=None) -> str:
    """``token`` as a person reads it (`` Mary`` for ``ĠMary`` or ``▁Mary``, ``↵`` for a
    newline). ``how``: the tokenizer, its :func:`scheme`, or None (guessed from this
    token alone; for a list use :func:`readable_tokens`, which guesses from all)."""
    return readable_tokens([token], how)[0]


def readable_tokens(tokens, how=None) -> list[str]:
    """Each of ``tokens`` as a person reads it (see :func:`readable`); ``how`` None:
    the scheme guessed from the whole list."""
    toks = [str(t) for t in tokens]
    kind = _scheme_of(how, toks)
    if kind == BYTE_LEVEL:
        return [_from_bytes(t) for t in toks]
    if kind == SENTENCEPIECE:
        return [_from_sentencepiece(t) for t in toks]
    return toks


def readable_rows(rows, how=None) -> list[list[str]]:
    """:func:`readable_tokens` of each example's tokens (``how`` None: guessed from
    all examples together, so that they read alike)."""
    rows = [[str(t) for t in row] for row in rows]
    kind = _scheme_of(how, [t for row in rows for t in row])
    return [readable_tokens(row, kind) for row in rows]


def readable_column(table, column: str = "token_text") -> list[str]:
    """``table[column]`` (a token per row; ``token``: its position, ``example``: its
    example, where there are several) as people read the tokens (`` Mary`` for
    ``ĠMary``: :func:`readable_rows`, on each example's tokens
    in the order of their positions, all examples at once)."""
    examples = table["example"].tolist() if "example" in table.columns else [0] * len(table)
    at = dict(zip(zip(examples, table["token"].tolist()), map(str, table[column])))
    keys = sorted(at, key=lambda k: (str(k[0]), k[1]))
    rows: dict = {}
    for k in keys:
        rows.setdefault(k[0], []).append(k)
    shown = readable_rows([[at[k] for k in ks] for ks in rows.values()])
    new = {k: t for ks, ts in zip(rows.values(), shown) for k, t in zip(ks, ts)}
    return [new[k] for k in zip(examples, table["token"].tolist())]


def text_of(tokens) -> str:
    """Readable tokens put together as the text they make: joined as they are where
    they carry their own spaces (byte-level, SentencePiece), else with a space between
    (WordPiece's words)."""
    toks = [str(t) for t in tokens]
    if any(t[:1].isspace() for t in toks):
        return "".join(toks).strip()
    return " ".join(toks)


def token_line(tokens) -> str:
    """Readable tokens on one line, their bounds visible: ``When| Mary| and`` where they
    carry their own spaces, else ``[CLS] the keys``."""
    toks = [str(t) for t in tokens]
    return ("|" if any(t[:1].isspace() for t in toks) else " ").join(toks)
