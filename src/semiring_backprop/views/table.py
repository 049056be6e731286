"""Branch tables that show themselves: a DataFrame whose notebook rendering leads with the
layer x token heatmap of branch shares (``views.branches``), then the rows.

Only the table as returned renders this way; anything pandas derives from it (a filter, a
groupby, a copy) is a plain DataFrame, whose rows may no longer make a heatmap.
"""

from __future__ import annotations

import html

import pandas as pd

from ..errors import SemiringBackpropError


class BranchTable(pd.DataFrame):
    """A tidy branch table (``Result.layer_table``, ``Result.branches``): a DataFrame in
    every way; in a notebook, the heatmap of branch shares above the rows, where the table
    has a semiring whose branches compete (``Result.branches``: one row). ``.view()``
    gives that heatmap as a :class:`~semiring_backprop.views.View` (``.to_html(file)``
    writes it); rows at padding (``attrs["attention_mask"]`` 0) are left out."""

    @property
    def _constructor(self):
        return pd.DataFrame

    def view(self, semiring=None):
        """The heatmap of branch shares (see ``semiring_backprop.views.branches``)."""
        from . import branches

        frame = pd.DataFrame(self)
        frame.attrs = dict(self.attrs)  # the attention mask: padding is left out
        return branches(frame, semiring)

    def _repr_html_(self) -> str:
        rows = pd.DataFrame(self)._repr_html_()
        try:
            heat = self.view()._repr_html_()
        except SemiringBackpropError as e:  # e.g. only Entropy rows: say why, show rows
            heat = f"<div><i>no heatmap: {html.escape(str(e))}</i></div>"
        return heat + rows


def branch_table(frame: pd.DataFrame) -> BranchTable:
    """``frame`` as a :class:`BranchTable` (same rows, columns and index)."""
    return BranchTable(frame)
