"""Token labels per example, checked against the positions they label."""

from __future__ import annotations

from ..errors import InputError


def per_example(tokens, examples: int, positions: int, what: str = "tokens") -> list[list[str]]:
    """``tokens`` as one list of strings per example, each as long as the positions.

    A flat list labels a single example; a batch needs a list of lists (one per
    example). Anything else is refused, naming both lengths: a label on the wrong
    position is a wrong answer.

    >>> per_example([["[CLS]", "a"], ["[CLS]", "b"]], examples=2, positions=2)
    [['[CLS]', 'a'], ['[CLS]', 'b']]
    """
    if isinstance(tokens, str) or not hasattr(tokens, "__len__"):
        raise InputError(
            f"{what} must be a list of token strings (one list per example for a batch), "
            f"got {type(tokens).__name__}"
        )
    tokens = list(tokens)
    nested = bool(tokens) and all(
        isinstance(t, list | tuple) and not isinstance(t, str) for t in tokens
    )
    if not nested:
        if any(isinstance(t, list | tuple) for t in tokens):
            raise InputError(
                f"{what} mixes strings and lists; give one list of strings per example"
            )
        if examples != 1:
            raise InputError(
                f"{what} is one flat list of {len(tokens)} strings, but the values hold "
                f"{examples} examples of {positions} positions each: give one list per "
                f"example ({examples} lists of {positions})"
            )
        tokens = [tokens]
    if len(tokens) != examples:
        raise InputError(
            f"{what} has {len(tokens)} lists (examples), but the values hold {examples} "
            f"examples: give one list of {positions} tokens per example"
        )
    for i, row in enumerate(tokens):
        if len(row) != positions:
            at = f" (example {i})" if examples > 1 else ""
            raise InputError(
                f"{what}{at} has {len(row)} tokens, but the values have {positions} "
                "positions: give exactly one token string per position"
            )
    return [[str(t) for t in row] for row in tokens]


def token_texts(tokens, table) -> list[str]:
    """The ``token_text`` column of a branch table: ``tokens`` (one list per example for
    a batch, whose rows carry an ``example`` column) checked against the table's positions,
    as people read them (`` Mary`` for ``ĠMary``: ``semiring_backprop.tokens``)."""
    from ..tokens import readable_rows

    positions = int(table["token"].max()) + 1 if len(table) else 0
    batched = "example" in table.columns
    examples = int(table["example"].max()) + 1 if batched and len(table) else 1
    labels = readable_rows(per_example(tokens, examples, positions))
    rows = table["example"] if batched else [0] * len(table)
    return [labels[e][t] for e, t in zip(rows, table["token"])]
