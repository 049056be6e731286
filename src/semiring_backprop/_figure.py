"""The figure class of :mod:`semiring_backprop.plots` (imports matplotlib: imported only
when a figure is made)."""

from __future__ import annotations

import io

from matplotlib.figure import Figure


class ReportFigure(Figure):
    """A ``Figure`` that a notebook shows as a PNG with no ``%matplotlib inline``: the
    figures of :mod:`~semiring_backprop.plots` are not pyplot's, so no backend shows them."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()
