"""Colour maps of the views: diverging (signed values, centred at zero) and sequential,
both from Paul Tol's colour-blind-safe schemes, and one colour per branch role
(Okabe & Ito's palette): the one role palette, of HTML views and figures alike."""

from __future__ import annotations

import math

#: Tol's BuRd: blue for negative, red for positive, near-white at zero
DIVERGING = (
    "#2166AC", "#4393C3", "#92C5DE", "#D1E5F0", "#F7F7F7",
    "#FDDBC7", "#F4A582", "#D6604D", "#B2182B",
)  # fmt: skip
#: Tol's YlOrBr: low values pale, high values dark
SEQUENTIAL = (
    "#FFFFE5", "#FFF7BC", "#FEE391", "#FEC44F", "#FB9A29",
    "#EC7014", "#CC4C02", "#993404", "#662506",
)  # fmt: skip
#: branch roles, in stacking order, and their colours (Okabe-Ito; skip a neutral grey)
ROLES = ("skip", "query", "key", "value", "mlp", "other")
ROLE_COLORS = {
    "skip": "#BBBBBB",
    "query": "#0072B2",
    "key": "#E69F00",
    "value": "#009E73",
    "mlp": "#D55E00",
    "other": "#CC79A7",
}
#: layer norms, which only the figures of paths colour (``plots.COLORS``)
NORM_COLOR = "#BCBD22"
NO_VALUE = "#E8E8E8"


def rgb(hex_color: str) -> tuple[int, int, int]:
    h = hex_color.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def _interpolate(scheme, t: float) -> str:
    t = min(1.0, max(0.0, t)) * (len(scheme) - 1)
    i = min(int(t), len(scheme) - 2)
    a, b = rgb(scheme[i]), rgb(scheme[i + 1])
    f = t - i
    return "#" + "".join(f"{round(x + (y - x) * f):02X}" for x, y in zip(a, b))


class Scale:
    """Values to colours: diverging and centred at zero where values are signed (both
    signs present, or ``signed=True``), else sequential from the smallest value to the
    largest (so that values that differ look different)."""

    def __init__(self, values, signed: bool | None = None):
        finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        self.lo = min(finite, default=0.0)
        self.hi = max(finite, default=0.0)
        self.signed = (self.lo < 0 < self.hi) if signed is None else signed
        self.bound = max(abs(self.lo), abs(self.hi))

    def color(self, v) -> str:
        if v is None or not math.isfinite(float(v)):
            return NO_VALUE
        v = float(v)
        if self.signed:
            t = 0.5 if self.bound == 0 else 0.5 + 0.5 * v / self.bound
            return _interpolate(DIVERGING, t)
        span = self.hi - self.lo
        return _interpolate(SEQUENTIAL, 0.5 if span == 0 else (v - self.lo) / span)

    def ends(self) -> tuple[float, float]:
        """The values at the two ends of the colour bar."""
        return (-self.bound, self.bound) if self.signed else (self.lo, self.hi)

    def gradient(self) -> str:
        """CSS ``linear-gradient`` of the colour bar, low to high."""
        scheme = DIVERGING if self.signed else SEQUENTIAL
        return f"linear-gradient(to right, {', '.join(scheme)})"


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (relative luminance)."""
    r, g, b = (c / 255 for c in rgb(background))
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#000" if lum > 0.45 else "#fff"
