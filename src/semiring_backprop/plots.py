"""Matplotlib figures of a pass: branch shares per layer, token heatmaps, path diagrams.

matplotlib is an optional extra (``pip install "semiring-backprop[plots]"``) and is
imported only when a function here is called. Every function builds a
``matplotlib.figure.Figure`` without touching pyplot's global state (safe under Agg, in
threads and in notebooks) and returns it; pass ``ax=`` to draw into an existing axes.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import TYPE_CHECKING, Any

from .errors import InputError
from .tokens import readable_tokens
from .views.colors import NORM_COLOR, ROLE_COLORS, ROLES

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .analysis.paths import Path

#: branch roles in stacking order, and their colors: the views' palette (one colour per
#: role in figures and HTML alike), with layer norms, which path figures colour too
COLORS = {**ROLE_COLORS, "norm": NORM_COLOR}


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    try:
        import matplotlib.figure  # noqa: F401

        from ._figure import ReportFigure
    except ImportError:
        raise InputError(
            'plots need matplotlib, an optional extra: pip install "semiring-backprop[plots]"'
        ) from None
    if ax is not None:
        return ax.figure, ax
    fig = ReportFigure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _columns(frame, needed, hint: str) -> None:
    """A frame without a column a figure reads is refused by name, not by a KeyError."""
    missing = [c for c in needed if c not in getattr(frame, "columns", ())]
    if missing:
        have = list(getattr(frame, "columns", []))
        raise InputError(f"the table has no column {missing} (it has {have}); {hint}")


def _select(table: pd.DataFrame, sublayer: str, semiring: Any) -> pd.DataFrame:
    """Rows of one sublayer and one semiring; several semirings need ``semiring=``."""
    _columns(table, ("layer", "sublayer", "token", "branch", "value"),
             "pass a table from Result.layer_table() or Explanation.layers")  # fmt: skip
    if "semiring" in table.columns:
        have = sorted(map(str, table["semiring"].unique()))
        if semiring is None and len(have) > 1:
            raise InputError(
                f"the table holds several semirings {have}; pick one with semiring=..."
            )
        if semiring is not None:
            names = {str(semiring), getattr(semiring, "name", str(semiring))}
            pick = next((n for n in have if n in names), None)
            if pick is None:
                raise InputError(f"semiring {semiring} is not in the table (it has {have})")
            table = table[table["semiring"].astype(str) == pick]
    rows = table[table["sublayer"] == sublayer]
    if rows.empty:
        have = sorted(map(str, table["sublayer"].unique()))
        raise InputError(f"no rows with sublayer={sublayer!r} (the table has {have})")
    return rows


def branch_bars(
    table: pd.DataFrame,
    *,
    value: str = "value",
    sublayer: str = "attention",
    normalize: bool = True,
    semiring: Any = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """Stacked bars per layer of each branch's share, as in Figs. 2 and 4 of Du et al. 2023.

    ``normalize=True``: the fraction of tokens whose top path takes each branch (rows with
    ``winner`` True; a tie splits the token evenly). ``normalize=False``: the sum of
    ``value`` per (layer, branch). Branches outside ``ROLES`` count as ``"other"``.

    Examples:
        One token in eleven (the mask) has its top path through the skip branch of
        the attention block, the ten others through its value branch:

        >>> from semiring_backprop import plots
        >>> table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=tokens)
        >>> fig = plots.branch_bars(table, sublayer="attention", semiring="MaxProduct(neuron)")
        >>> {c.get_label(): round(float(c[0].get_height()), 3) for c in fig.axes[0].containers}
        {'skip': 0.091, 'value': 0.909}
    """
    rows = _select(table, sublayer, semiring).copy()
    rows["role"] = rows["branch"].where(rows["branch"].isin(ROLES), "other")
    if normalize:
        win = rows[rows["winner"].astype(bool)].copy()
        win["w"] = 1.0 / win.groupby(["layer", "token"])["role"].transform("size")
        per = win.groupby(["layer", "role"])["w"].sum()
        tokens = rows.groupby("layer")["token"].nunique()
        heights = per / tokens.reindex(per.index.get_level_values("layer")).to_numpy()
        # tokens with no path through the sublayer (after the explained position, say)
        missing = 1.0 - heights.groupby(level="layer").sum().reindex(tokens.index).fillna(0.0)
        missing = missing[missing > 1e-9]
        if len(missing):
            import pandas as pd

            extra = pd.Series(missing.to_numpy(), index=pd.MultiIndex.from_arrays(
                [missing.index, ["no path"] * len(missing)], names=["layer", "role"]))  # fmt: skip
            heights = pd.concat([heights, extra])
        ylabel = "share of tokens (top path)"
    else:
        heights = rows.groupby(["layer", "role"])[value].sum()
        ylabel = f"sum of {value}"
    layers = sorted(rows["layer"].unique())
    grid = heights.unstack("role").reindex(index=layers).fillna(0.0)
    fig, ax = _new_axes(ax, (max(4.0, 0.45 * len(layers) + 2.5), 3.6))
    up = [0.0] * len(layers)
    down = [0.0] * len(layers)
    for role in (r for r in (*ROLES, "no path") if r in grid.columns):
        h = grid[role].tolist()
        bottom = [d if v < 0 else u for v, u, d in zip(h, up, down)]
        style = {"color": COLORS[role]} if role in COLORS else {
            "facecolor": "white", "edgecolor": "#999999", "hatch": "///"}  # fmt: skip
        ax.bar(layers, h, bottom=bottom, label=role, width=0.8, **style)
        up = [u + max(v, 0.0) for u, v in zip(up, h)]
        down = [d + min(v, 0.0) for d, v in zip(down, h)]
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel, fontsize=8)
    if normalize:
        ax.set_ylim(0, 1)
    if ax.containers:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title or f"top-path branch per layer ({sublayer})")
    return fig


def token_heatmap(
    table: pd.DataFrame,
    *,
    value: str = "value",
    branch: str | None = None,
    sublayer: str = "attention",
    semiring: Any = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """Layers (rows) × tokens (columns), colored by ``value``: one branch's value, or for
    ``branch=None`` the max over branches. Diverging colors centered at 0 for signed
    quantities (Real, MaxProduct, TopK values, or any table with both signs).

    Examples:
        >>> from semiring_backprop import plots
        >>> table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=tokens)
        >>> ax = plots.token_heatmap(table, branch="skip").axes[0]
        >>> [t.get_text() for t in ax.get_xticklabels()][:4]
        ['[CLS]', 'the', 'keys', 'to']
    """
    import numpy as np

    rows = _select(table, sublayer, semiring)
    if branch is not None:
        if branch not in set(rows["branch"]):
            have = sorted(map(str, rows["branch"].unique()))
            raise InputError(f"no rows with branch={branch!r} (the table has {have})")
        rows = rows[rows["branch"] == branch]
    grid = rows.pivot_table(index="layer", columns="token", values=value, aggfunc="max")
    grid = grid.sort_index().sort_index(axis=1)
    texts = rows.drop_duplicates("token").set_index("token")["token_text"]
    data = np.ma.masked_invalid(grid.to_numpy(dtype=float))
    fig, ax = _new_axes(ax, (max(4.0, 0.4 * grid.shape[1] + 2.5), max(2.5, 0.3 * len(grid) + 1.5)))
    lo, hi = (float(data.min()), float(data.max())) if data.count() else (0.0, 0.0)
    names = set(map(str, rows["semiring"])) if "semiring" in rows.columns else set()
    signed = any(n.startswith(_SIGNED) for n in names)  # values of either sign, in general
    if lo < 0 < hi or signed:  # diverging (colour-blind safe), centred at zero
        m = max(-lo, hi, 0.0) or 1.0
        image = ax.imshow(data, aspect="auto", cmap="RdBu_r", vmin=-m, vmax=m)
    else:
        image = ax.imshow(data, aspect="auto", cmap="viridis")
    shown = readable_tokens([str(texts[t]) for t in grid.columns])  # ' Mary', not 'ĠMary'
    ax.set_xticks(range(grid.shape[1]), shown, rotation=90)
    ax.set_yticks(range(len(grid)), [str(i) for i in grid.index])
    ax.set_xlabel("token")
    ax.set_ylabel("layer")
    what = "max over branches" if branch is None else f"branch {branch}"
    ax.figure.colorbar(image, ax=ax, label=f"{value} ({what})")
    ax.set_title(title or f"{sublayer}: {what}")
    return fig


#: semirings whose readouts are signed (a gradient, a path product)
_SIGNED = ("Real", "MaxProduct", "TopK")


def token_bars(
    frame: pd.DataFrame,
    *,
    value: str = "entropy",
    label: str = "token_text",
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """One bar per token of a per-token column, e.g. path entropy. ``frame`` has a
    ``token`` column (the position, for the order), the ``label`` column and ``value``.

    Examples:
        >>> import pandas as pd
        >>> from semiring_backprop import plots
        >>> entropy = res.aggregate("bert.embeddings.word_embeddings", sbp.Entropy()).entropy
        >>> frame = pd.DataFrame({"token": range(len(tokens[0])), "token_text": tokens[0],
        ...                       "entropy": entropy[0].tolist()})
        >>> fig = plots.token_bars(frame, value="entropy")
        >>> len(fig.axes[0].patches)        # one bar per token
        11
    """
    _columns(frame, ("token", label, value),
             "give a frame with the position in 'token', label= and value= columns")  # fmt: skip
    frame = frame.sort_values("token")
    fig, ax = _new_axes(ax, (max(4.0, 0.35 * len(frame) + 1.5), 3.0))
    xs = range(len(frame))
    heights = frame[value].tolist()
    ax.bar(xs, heights, color=COLORS["query"])
    shown = readable_tokens([str(t) for t in frame[label]])  # ' Mary', not 'ĠMary'
    ax.set_xticks(xs, shown, rotation=90 if len(frame) > 8 else 0)
    ax.set_ylabel(value)
    finite = [h for h in heights if math.isfinite(h)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    if lo > 0 and hi - lo < 0.5 * hi:  # bars near one height: the axis starts where they differ
        pad = 0.15 * (hi - lo) or 0.01 * hi
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_ylabel(f"{value} (axis from {lo - pad:.4g})")
    ax.set_title(title or f"{value} per token")
    return fig


def role_of(module: str | None) -> str:
    """Guess a module's role from its path: query/key/value/skip/mlp/norm/other.

    >>> from semiring_backprop.plots import role_of
    >>> role_of("bert.encoder.layer.0.attention.self.query")
    'query'
    """
    if not module:
        return "other"
    parts = module.lower().split(".")
    last = parts[-1]
    if "norm" in last or last.startswith("ln"):
        return "norm"
    for role, names in _ROLE_NAMES.items():
        if last in names:
            return role
    # ops directly in a block (GPT-2 `h.3`) or in a BERT `*.output` are the residual adds
    if last.isdigit() or last in ("output", "residual", "skip"):
        return "skip"
    if any(p in _MLP_NAMES for p in parts) or (
        len(parts) >= 3 and parts[-2] == "output" and parts[-3].isdigit()  # BERT FFN out
    ):
        return "mlp"
    return "other"


_ROLE_NAMES = {
    "query": {"query", "q_proj", "q", "wq", "q_lin"},
    "key": {"key", "k_proj", "k", "wk", "k_lin"},
    "value": {"value", "v_proj", "v", "wv", "v_lin"},
}
_MARK = "semiring_backprop.mark.default"
_MLP_NAMES = {"mlp", "intermediate", "ffn", "ff", "feed_forward", "feedforward", "c_fc", "fc1",
              "fc2", "block_sparse_moe", "moe"}  # fmt: skip


def path_diagram(
    path: Path, *, marks: bool = False, ax: Axes | None = None, title: str | None = None
) -> Figure:
    """Boxes for the runs of a path's steps inside one module, top to bottom, with arrows.

    Each box shows the module (common prefix dropped, last 3 components), the number of
    ops and the running product at the end of the run (tensor-granularity paths have
    none). Long paths wrap into columns of at most 40 boxes. Runs made only of
    module-boundary marks (identity steps) are left out unless ``marks=True``.

    Examples:
        >>> from semiring_backprop import plots
        >>> fig = plots.path_diagram(res.top_path(("bert.embeddings.word_embeddings", (0, 2))))
        >>> [t.get_text().splitlines() for t in fig.axes[0].texts][:3]
        [['bert.embeddings.word_embeddings', 'product 1'],
         ['bert.embeddings  (2 ops)', 'product 1'],
         ['bert.embeddings.LayerNorm  (6 ops)', 'product 32.4']]
    """
    from matplotlib.patches import FancyBboxPatch, Patch

    runs = [(m, list(s)) for m, s in itertools.groupby(path.steps, key=lambda s: s.module)]
    if not marks:  # runs of module-boundary marks only (identity steps) say nothing new
        runs = [
            r
            for i, r in enumerate(runs)
            if i in (0, len(runs) - 1) or any(s.op != _MARK for s in r[1])
        ]
    labels = _run_labels(runs)
    per_col = min(len(runs), 40) or 1
    ncols = math.ceil(len(runs) / per_col)
    fig, ax = _new_axes(ax, (3.4 * ncols + 1.2, 0.42 * per_col + 1.0))
    fontsize = 7 if per_col > 15 else 8
    centers = []
    for i, ((module, steps), label) in enumerate(zip(runs, labels)):
        col, row = divmod(i, per_col)
        role = role_of(module)
        box = FancyBboxPatch(
            (col + 0.06, row + 0.12),
            0.88,
            0.76,
            boxstyle="round,pad=0,rounding_size=0.08",
            facecolor=COLORS[role],
            edgecolor=COLORS[role],
            alpha=0.35,
        )
        ax.add_patch(box)
        running = steps[-1].running
        text = label + (f"\nproduct {running:.3g}" if running is not None else "")
        ax.text(col + 0.5, row + 0.5, text, ha="center", va="center", fontsize=fontsize)
        centers.append((col + 0.5, row))
    arrow = {"arrowstyle": "->", "lw": 0.8}
    for (x0, r0), (x1, r1) in itertools.pairwise(centers):
        if x0 == x1:
            ax.annotate("", xy=(x1, r1 + 0.12), xytext=(x0, r0 + 0.88), arrowprops=arrow)
        else:  # wrap to the next column through the gap between columns
            gap = x0 + 0.5
            ax.plot([x0 + 0.44, gap, gap], [r0 + 0.5, r0 + 0.5, r1 + 0.5], "k-", lw=0.8)
            ax.annotate("", xy=(x1 - 0.44, r1 + 0.5), xytext=(gap, r1 + 0.5), arrowprops=arrow)
    ax.set_xlim(0, ncols)
    ax.set_ylim(per_col, 0)
    ax.axis("off")
    roles = [r for r in (*ROLES, "norm") if r in {role_of(m) for m, _ in runs}]
    ax.legend(
        handles=[Patch(color=COLORS[r], alpha=0.5, label=r) for r in roles],
        fontsize=fontsize,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        frameon=False,
    )
    granularity = "tensor" if path.source.index is None else "neuron"
    name = path.semiring if granularity in path.semiring else f"{path.semiring} ({granularity})"
    ax.set_title(title or f"top path, {name}: {path.value:.4g}", fontsize=9)
    return fig


def _run_labels(runs) -> list[str]:
    """Module paths without their common prefix, last 3 components, plus op counts."""
    split = [m.split(".") for m, _ in runs if m]
    keep = min((len(p) for p in split), default=1) - 1  # leave at least one component
    prefix = 0
    while prefix < keep and len({tuple(p[: prefix + 1]) for p in split}) == 1:
        prefix += 1
    out = []
    for i, (module, steps) in enumerate(runs):
        if steps[0].op == "input":
            name = f"input {steps[0].node}"
        elif module is None:
            name = "model output" if i == len(runs) - 1 else "(top level)"
        else:
            name = _with_layer(module) or ".".join(module.split(".")[prefix:][-3:])
        out.append(name + (f"  ({len(steps)} ops)" if len(steps) > 1 else ""))
    return out


def _with_layer(module: str) -> str | None:
    """``layer 3 attention.output.LayerNorm`` for a module inside a numbered layer."""
    from .analysis.branches import layer_of

    layer = layer_of(module)
    if not layer:
        return None
    rest = module[len(layer) :].lstrip(".")
    number = layer.rsplit(".", 1)[-1]
    return f"layer {number} " + (".".join(rest.split(".")[-3:]) or "(block)")


FORMATS = ("png", "svg", "pdf")


def save(fig: Figure, path: str | os.PathLike) -> str | os.PathLike:
    """Write ``fig`` in the format its suffix names (``.png`` at 120 dpi, ``.svg``,
    ``.pdf``; no suffix: PNG), creating parent folders; returns ``path``.

    Examples:
        >>> from semiring_backprop import plots
        >>> table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=tokens)
        >>> plots.save(plots.branch_bars(table), "api-figures/branches.svg")
        'api-figures/branches.svg'
    """
    suffix = os.path.splitext(os.fspath(path))[1].lstrip(".").lower() or "png"
    if suffix not in FORMATS:
        raise InputError(f"cannot save a figure as {suffix!r}: use .png, .svg or .pdf")
    import matplotlib

    from ._files import atomic_write  # whole or not at all, never through a link

    with matplotlib.rc_context({"svg.fonttype": "none", "pdf.fonttype": 42}):  # text stays text
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format=suffix))
    return path


def caption(fig: Figure, text: str) -> Figure:
    """Name what the figure shows above it (the text, the target, the semiring): a
    figure read apart from its report still says what it is about. The caption is
    wrapped to the figure's width, never cut.

    Examples:
        >>> from semiring_backprop import plots
        >>> table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=tokens)
        >>> fig = plots.caption(plots.branch_bars(table),
        ...                     "the keys to the cabinet [MASK] on the table; "
        ...                     "log p(are) - log p(is); MaxProduct")
        >>> fig.texts[0].get_text().splitlines()     # wrapped to the 4-inch figure's width
        ['the keys to the cabinet [MASK] on the table; log p(are) - log', 'p(is); MaxProduct']
    """
    import textwrap

    # wrapped to the figure's width (never cut): about 0.6 em per character at 7 pt
    chars = max(30, int(fig.get_figwidth() * 72 / (0.6 * 7)) - 4)
    lines = [textwrap.fill(line, chars, break_long_words=True) for line in text.splitlines()]
    fig.suptitle("\n".join(lines), fontsize=7, color="#444444")
    return fig
