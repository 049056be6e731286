"""Terminal text of the views: readable without colour; coloured (24-bit ANSI) only
where the stream is a terminal and ``NO_COLOR`` is not set."""

from __future__ import annotations

import os
import shutil

from ..analysis.readouts import module_label
from .colors import ROLE_COLORS, ROLES, Scale, rgb, text_color
from .html import PADDING_NOTE, SELECTIVE, SKIP_NOTE, fmt, level_name, path_kind

_RESET = "\x1b[0m"


def use_color(stream) -> bool:
    """Colour on ``stream``: a terminal (``isatty``), ``NO_COLOR`` unset, ``TERM`` not dumb."""
    if os.environ.get("NO_COLOR", "") != "" or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _paint(text: str, background: str) -> str:
    r, g, b = rgb(background)
    fg = "30" if text_color(background) == "#000" else "97"
    return f"\x1b[48;2;{r};{g};{b}m\x1b[{fg}m{text}{_RESET}"


def _width() -> int:
    return max(60, min(120, shutil.get_terminal_size((100, 24)).columns))


def strips(tv, color: bool = False, title: str | None = None) -> str:
    """Tokens with their values, wrapped to the terminal's width."""
    scale = Scale([v for row in tv.values for v in row], signed=tv.signed or None)
    lines = [f"{title or tv.quantity.replace('_', ' ')} ({tv.description}; at {tv.source})"]
    if tv.warning:
        lines.append(f"  note: {tv.warning}")
    width = _width()
    for i, (vals, toks) in enumerate(zip(tv.values, tv.tokens)):
        if len(tv.values) > 1:
            lines.append(f" example {i}:")
        line, used = "  ", 2
        for j, (v, t) in enumerate(zip(vals, toks)):
            mark = "*" if tv.marks.get((i, tv.position(i, j))) else ""
            cell = f"{mark}{t} {fmt(v) if v is not None else 'no-path'}"
            if used + len(cell) + 2 > width and used > 2:
                lines.append(line.rstrip())
                line, used = "  ", 2
            shown = _paint(f" {cell} ", scale.color(v)) if color else f" {cell} "
            line += shown + " "
            used += len(cell) + 3
        lines.append(line.rstrip())
    if tv.positions is not None:
        lines.append(f"  ({PADDING_NOTE})")
    if any(tv.marks.values()):
        why = next(m for m in tv.marks.values() if m)
        lines.append(f"  (* {why})")
    return "\n".join(lines)


def path(p, runs, color: bool = False) -> str:
    """One line per module run: steps, layer, branch, module, edge product, running."""
    src = p.steps[0]
    where = f"[{','.join(map(str, src.index))}]" if src.index is not None else ""
    kind = path_kind(p)
    lines = [
        f"{p.semiring} {kind}, product {fmt(p.value)}, {len(p)} steps, from "
        f"{src.module or src.node}{where}:",
        f"  {'steps':>9} {'layer':>5} {'branch':<7} {'edge prod':>10} {'running':>10}  module",
    ]
    width = _width()
    heads = any(r.heads for r in runs)
    for k, r in enumerate(runs):
        name = module_label(r.module, r.steps[0], k == len(runs) - 1)
        if heads and r.heads:
            name += f" (head {', '.join(map(str, r.heads))})"
        span = f"{r.first}" if len(r.steps) == 1 else f"{r.first}-{r.first + len(r.steps) - 1}"
        room = width - 49
        if len(name) > room:
            name = "…" + name[-(room - 1) :]
        role = f"{r.role:<7}"
        if color and r.role:
            role = _paint(role, ROLE_COLORS.get(r.role, "#dddddd"))
        layer = "" if r.layer is None else r.layer
        lines.append(
            f"  {span:>9} {layer:>5} {role} {fmt(r.product):>10} {fmt(r.running):>10}  {name}"
        )
    return "\n".join(lines)


def paths(ps, runs_of, color: bool = False) -> str:
    return "\n\n".join(f"{i + 1}. " + path(p, runs_of(p), color) for i, p in enumerate(ps))


def heatmap(rows, semiring: str, color: bool = False) -> str:
    """Per layer and token, the winning branch (its first letter) and its share."""
    lines = [f"winning branch per layer and token ({semiring}; share of the token's total)"]
    letters = {r: r[0].upper() for r in ROLES}
    letters["mlp"] = "M"
    lines.append("  " + "  ".join(f"{letters[r]}={r}" for r in ROLES))
    for ex in sorted(rows["example"].unique()):
        part = rows[rows["example"] == ex]
        if rows["example"].nunique() > 1:
            lines.append(f" example {ex}:")
        toks = part.drop_duplicates("token").sort_values("token")
        w = max(6, min(12, max(len(str(t)) for t in toks["token_text"]) + 1))
        lines.append(" " * 22 + "".join(f"{str(t)[: w - 1]:<{w}}" for t in toks["token_text"]))
        keys = part[["layer", "sublayer"]].drop_duplicates().sort_values(["layer", "sublayer"])
        for layer, sub in zip(keys["layer"], keys["sublayer"]):
            cells = part[(part["layer"] == layer) & (part["sublayer"] == sub)]
            line = f"  {level_name(layer, sub):<20}"
            for _, grp in cells.groupby("token", sort=True):
                won = grp[grp["winner"].astype(bool)]
                best = (won if len(won) else grp.sort_values("share", ascending=False)).iloc[0]
                if best["share"] != best["share"]:
                    cell = "-"
                else:
                    cell = f"{letters.get(best['branch'], '?')} {100 * best['share']:.0f}%"
                shown = f"{cell:<{w}}"
                if color and cell != "-":
                    c = ROLE_COLORS.get(best["branch"], ROLE_COLORS["other"])
                    shown = _paint(cell, c) + " " * (w - len(cell))
                line += shown
            lines.append(line.rstrip())
    if str(semiring).startswith(SELECTIVE):
        lines += _wrap(SKIP_NOTE)
    return "\n".join(lines)


def _wrap(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, _width() - 2, initial_indent="  ", subsequent_indent="  ")
