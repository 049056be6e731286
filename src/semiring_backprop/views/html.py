"""HTML of the views: one self-contained fragment each (inline CSS and SVG, no script,
no font or image from the network), and a document that holds several."""

from __future__ import annotations

import html
import math

from ..analysis.readouts import module_label
from .colors import ROLE_COLORS, ROLES, Scale, text_color

CSS = """
.sbp{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
 font-size:14px;color:#222;line-height:1.4;max-width:100%}
.sbp h2{font-size:18px;margin:18px 0 6px}
.sbp h3{font-size:15px;margin:14px 0 4px}
.sbp .note{color:#555;font-size:12.5px;margin:2px 0 8px}
.sbp .card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;margin:6px 0 12px;
 background:#fafafa}
.sbp .card dt{float:left;clear:left;width:110px;color:#666}
.sbp .card dd{margin:0 0 2px 118px;overflow-wrap:anywhere}
.sbp .card dd.text{max-height:6.5em;overflow-y:auto}
.sbp .warn{font-size:12.5px;margin:2px 0 6px;padding:3px 8px;border-left:3px solid #E69F00;
 background:#FFF8E6}
.sbp .strip{display:flex;flex-wrap:wrap;gap:3px;margin:4px 0 6px}
.sbp .tok{display:inline-flex;flex-direction:column;align-items:center;padding:2px 5px;
 border-radius:4px;border:1px solid rgba(0,0,0,.08);min-width:18px}
.sbp .tok b{font-weight:600;white-space:pre;font-family:ui-monospace,Menlo,Consolas,monospace;
 font-size:13px}
.sbp .tok i{font-style:normal;font-size:10px;opacity:.85}
.sbp .tok.mark{outline:2px solid #000;outline-offset:1px}
.sbp .nopath{background:repeating-linear-gradient(45deg,#eee,#eee 4px,#fff 4px,#fff 8px)}
.sbp .bar{display:flex;align-items:center;gap:6px;font-size:11px;color:#444;margin:2px 0 10px}
.sbp .bar span.g{display:inline-block;width:160px;height:10px;border-radius:2px}
.sbp table.chain{border-collapse:collapse;font-size:12.5px;margin:4px 0 10px}
.sbp table.chain th{background:#f0f0f0;text-align:left;padding:3px 8px;
 border-bottom:1px solid #ccc}
.sbp table.chain td{padding:3px 8px;border-bottom:1px solid #eee;vertical-align:top}
.sbp table.chain td.n{text-align:right;font-variant-numeric:tabular-nums;
 font-family:ui-monospace,Menlo,Consolas,monospace}
.sbp .mod{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;
 overflow-wrap:anywhere}
.sbp .role{display:inline-block;padding:0 6px;border-radius:8px;font-size:11.5px}
.sbp details summary{cursor:pointer;color:#333}
.sbp table.steps{border-collapse:collapse;font-size:11.5px;margin:4px 0}
.sbp table.steps td,.sbp table.steps th{padding:1px 6px;border-bottom:1px solid #f0f0f0;
 text-align:left}
.sbp .legend{display:flex;flex-wrap:wrap;gap:10px;font-size:12px;margin:2px 0 6px}
.sbp .legend span.c{display:inline-block;width:12px;height:12px;border-radius:2px;
 margin-right:4px;vertical-align:-2px}
.sbp .scroll{overflow-x:auto;max-width:100%}
.sbp ol.paths>li{margin:4px 0 10px}
.sbp svg .hov{fill:#fff;fill-opacity:0}
.sbp svg .hov:hover{fill:#000;fill-opacity:.08}
.sbp svg text{font-family:ui-monospace,Menlo,Consolas,monospace;fill:#222}
"""


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def fmt(v) -> str:
    if v is None:
        return "–"
    v = float(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def document(body: str, title: str) -> str:
    """A whole page: opens offline (everything it needs is in the file)."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>body{{margin:16px 24px;background:#fff}}"
        f"{CSS}</style></head>\n<body>{fragment(body, style=False)}</body></html>\n"
    )


def write_document(file, page: str) -> str:
    """Write ``page`` to ``file`` (folders made as needed), whole or not at all; returns
    the path. The page goes into a temporary file made anew in a private directory beside
    ``file`` and is renamed over it, so no link planted there (``report.html.part``, or
    ``report.html`` itself) is written through."""
    import os

    from .._files import atomic_write
    from ..errors import InputError

    file = os.fspath(file)
    if os.path.isdir(file):
        raise InputError(f"{file!r} is a directory; give a file name such as report.html")
    try:
        atomic_write(file, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    except OSError as e:
        raise InputError(
            f"cannot write {file!r}: {e.strerror or e}; give a file in a folder you can write to"
        ) from None
    return file


def fragment(body: str, style: bool = True) -> str:
    """``body`` in the scoped container (with the style sheet, for notebooks)."""
    css = f"<style>{CSS}</style>" if style else ""
    return f'{css}<div class="sbp">{body}</div>'


def role_chip(role: str) -> str:
    if not role:
        return ""
    color = ROLE_COLORS.get(role, "#dddddd")
    return (
        f'<span class="role" style="background:{color};color:{text_color(color)}">'
        f"{esc(role)}</span>"
    )


def color_bar(scale: Scale, what: str) -> str:
    lo, hi = scale.ends()
    mid = " · 0 in the middle" if scale.signed else ""
    if scale.signed and what == "top path":
        mid = " · blue: the heaviest path is negative (lowers the output), red: positive"
    return (
        f'<div class="bar"><span>{fmt(lo)}</span><span class="g" '
        f'style="background:{scale.gradient()}"></span><span>{fmt(hi)}</span>'
        f"<span>{esc(what)}{mid}</span></div>"
    )


# -- token strips ---------------------------------------------------------------------


def strips(tv, title: str | None = None) -> str:
    """One strip of coloured tokens per example; the value on hover and under each."""
    scale = Scale([v for row in tv.values for v in row], signed=tv.signed or None)
    out = [f"<h3>{esc(title or tv.quantity.replace('_', ' '))}</h3>"]
    out.append(f'<div class="note">{esc(tv.description)}; read at {esc(tv.source)}</div>')
    if tv.warning:
        out.append(f'<div class="warn">{esc(tv.warning)}</div>')
    for i, (vals, toks) in enumerate(zip(tv.values, tv.tokens)):
        if len(tv.values) > 1:
            out.append(f'<div class="note">example {i}</div>')
        spans = []
        for j, (v, t) in enumerate(zip(vals, toks)):
            at = tv.position(i, j)
            mark = tv.marks.get((i, at))
            cls = "tok" + (" mark" if mark else "")
            hover = f"{t!r} (position {at}): {tv.quantity} = {fmt(v)}"
            if tv.notes is not None:
                hover += f" ({tv.notes[i][j]})"
            if mark:
                hover += f" ({mark})"
            if v is None:
                spans.append(
                    f'<span class="{cls} nopath" title="{esc(hover + " (no path)")}">'
                    f"<b>{esc(t)}</b><i>no path</i></span>"
                )
                continue
            bg = scale.color(v)
            spans.append(
                f'<span class="{cls}" style="background:{bg};color:{text_color(bg)}" '
                f'title="{esc(hover)}"><b>{esc(t)}</b><i>{fmt(v)}</i></span>'
            )
        out.append(f'<div class="strip">{"".join(spans)}</div>')
    out.append(color_bar(scale, tv.quantity.replace("_", " ")))
    if tv.positions is not None:
        out.append(f'<div class="note">{esc(PADDING_NOTE)}</div>')
    return "".join(out)


#: semirings whose branch value is one heaviest path (the winner is that path's branch)
SELECTIVE = ("MaxProduct", "MaxAbs", "TopK")
#: said wherever a selective semiring's winning branch is shown
SKIP_NOTE = (
    "A skip win is close to built in: the residual (skip) edge has weight 1, while a path "
    "through attention or the MLP is multiplied by several weights, mostly well below 1 in "
    "size, so a token's single heaviest path keeps to the skip branch wherever it can; a "
    "win says which one path is heaviest, not how much each branch carries in all (Real "
    "and LogAbs sum over every path)."
)
#: said under a strip or table that left padding out
PADDING_NOTE = (
    "padding (positions where the attention mask is 0) is not shown: it is no token, "
    "and no share or scale counts it"
)


# -- paths ----------------------------------------------------------------------------


def path_kind(path) -> str:
    if path.semiring.startswith("TopK"):
        return "path (ranked by |product|)"
    return "most negative path" if path.sign == "-" else "top path"


def path_header(path) -> str:
    src = path.steps[0]
    where = f"[{','.join(map(str, src.index))}]" if src.index is not None else ""
    return (
        f"{esc(path.semiring)} {path_kind(path)}, "
        f"product <b>{fmt(path.value)}</b>, {len(path)} steps, from "
        f'<span class="mod">{esc(src.module or src.node)}{esc(where)}</span> to the output'
    )


def chain(path, runs) -> str:
    """The path as a table, one row per module run: layer, module, branch role, head,
    the product of its edge weights and the running product after it; each row opens
    to its steps (op, element, edge weight, running product)."""
    heads = any(r.heads for r in runs)
    head_th = "<th>head</th>" if heads else ""
    rows = [
        "<table class=chain><tr><th>steps</th><th>layer</th><th>module</th><th>branch</th>"
        f"{head_th}<th>edge product</th><th>running product</th></tr>"
    ]
    for k, r in enumerate(runs):
        first = r.steps[0]
        name = module_label(r.module, first, k == len(runs) - 1)
        span = f"{r.first}" if len(r.steps) == 1 else f"{r.first}–{r.first + len(r.steps) - 1}"
        where = f"[{','.join(map(str, first.index))}]" if first.index is not None else ""
        ops = ", ".join(dict.fromkeys(r.ops)) or "module boundary"
        start = r.first - len(r.before)
        steps = "".join(
            f"<tr><td>{start + i}</td><td>{esc(s.node)}</td><td>{esc(s.op)}</td>"
            f"<td>{esc('' if s.index is None else list(s.index))}</td>"
            f"<td>{'' if s.slot is None else s.slot}</td>"
            f"<td>{fmt(s.edge_weight)}</td><td>{fmt(s.running)}</td>"
            f'<td class="mod">{esc(s.module or "")}</td></tr>'
            for i, s in enumerate([*r.before, *r.steps])
        )
        head_td = f"<td>{esc(', '.join(map(str, r.heads)))}</td>" if heads else ""
        layer = "" if r.layer is None else r.layer
        rows.append(
            f"<tr><td class=n>{span}</td><td class=n>{layer}</td>"
            f'<td><details><summary><span class="mod">{esc(name)}{esc(where)}</span> '
            f"<small>({len(r.steps)} step{'s' if len(r.steps) > 1 else ''}: {esc(ops)})"
            f"</small></summary><table class=steps><tr><th>step</th><th>node</th><th>op</th>"
            f"<th>element</th><th>slot</th><th>edge weight</th><th>running</th><th>module</th>"
            f"</tr>{steps}"
            f"</table></details></td><td>{role_chip(r.role)}</td>{head_td}"
            f"<td class=n>{fmt(r.product)}</td><td class=n>{fmt(r.running)}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def path_block(path, runs, title: str = "top gradient path") -> str:
    return (
        f"<h3>{esc(title)}</h3><div class=note>{path_header(path)}. One row per module; "
        "open a row for its steps (edge weight: ∂ output element / ∂ input element; running: "
        "the product from the source).</div>"
        + _role_legend({r.role for r in runs})
        + chain(path, runs)
    )


def path_list(paths, runs_of, title: str = "top paths") -> str:
    items = []
    for p in paths:
        runs = runs_of(p)
        trail = " → ".join(
            _trail_item(r, i == len(runs) - 1)
            for i, r in enumerate(runs)
            if i in (0, len(runs) - 1) or r.role
        )
        items.append(
            f"<li>{path_header(p)}<div class=note>{trail}</div>"
            f"<details><summary>the chain</summary>{chain(p, runs)}</details></li>"
        )
    return f"<h3>{esc(title)}</h3><ol class=paths>{''.join(items)}</ol>"


def _trail_item(r, last: bool) -> str:
    name = module_label(r.module, r.steps[0], last)
    if r.layer is not None and r.module:
        _, _, tail = r.module.partition(f".{r.layer}.")
        name = f"layer {r.layer} {tail or r.module.rsplit('.', 1)[-1]}"
    return f'<span class="mod">{esc(name)}</span>' + (f" {role_chip(r.role)}" if r.role else "")


def _role_legend(roles) -> str:
    chips = [
        f'<span><span class="c" style="background:{ROLE_COLORS[r]}"></span>{r}</span>'
        for r in ROLES
        if r in roles
    ]
    return f'<div class="legend">{"".join(chips)}</div>' if chips else ""


# -- branch heatmaps ------------------------------------------------------------------


def heatmap(rows, heads, semiring: str) -> str:
    """Layers (rows) x tokens (columns); each cell a stacked bar of the branches' shares
    of the token's total, the winning branch outlined; numbers on hover."""
    out = [_role_legend(set(rows["branch"]).intersection(ROLES) | {"other"} & set(rows["branch"]))]
    examples = sorted(rows["example"].unique())
    for ex in examples:
        part = rows[rows["example"] == ex]
        if len(examples) > 1:
            out.append(f"<div class=note>example {ex}</div>")
        out.append(f'<div class="scroll">{_heatmap_svg(part, heads, ex)}</div>')
    note = (
        f"Each cell: the branches' shares of the token's total under {esc(semiring)} "
        "(|value| / Σ |value|"
    )
    note += (
        "; exp(value) / Σ exp(value) for log-space values)"
        if semiring.startswith(("LogAbs", "PathCount"))
        else ")"
    )
    note += (
        "; the winning branch is outlined (← in the hover text); hover a token's column for "
        "its shares in every layer (the values are in the table)."
    )
    if semiring.startswith(SELECTIVE):
        note += " " + SKIP_NOTE
    if semiring == "Real":
        note += (
            " Real values are sums of signed gradients over a token's hidden units: they can "
            "cancel (after a LayerNorm they nearly do), so the shares of a tiny total say little."
        )
    out.append(f"<div class=note>{note}</div>")
    return "".join(out)


def _heatmap_svg(part, heads, example) -> str:
    """One SVG: per (layer, sublayer) row and role, one path of the bars of every token
    (small files for long inputs); over each cell a transparent rect with the numbers."""
    cols = ["layer", "sublayer", "token", "token_text", "branch", "value", "share", "winner"]
    cells: dict = {}
    texts: dict = {}
    for layer, sub, tok, text, b, v, share, won in zip(*(part[c].tolist() for c in cols)):
        cells.setdefault((layer, _sub_order(sub), sub), {}).setdefault(tok, []).append(
            (ROLES.index(b) if b in ROLES else len(ROLES), b, v, share, bool(won))
        )
        texts[tok] = str(text)
    order = sorted(texts)
    index = {t: j for j, t in enumerate(order)}
    labels = [texts[t] for t in order]
    levels = sorted(cells)
    names = [level_name(layer, sub) for layer, _, sub in levels]
    n = len(labels)
    cw = max(12, min(40, 900 // max(n, 1)))
    ch, left = 26, 12 + 7 * max(map(len, names), default=8)
    longest = min(max((len(t) for t in labels), default=1), 14)
    top = 10 + 7 * longest
    width, height = left + cw * n + 10, top + ch * len(levels) + 6
    head_text = _head_text(heads, example)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-size="11">'
    ]
    for j, t in enumerate(labels):
        x = left + cw * j + cw / 2 + 4
        short = t if len(t) <= 14 else t[:13] + "…"
        out.append(  # (white-space: pre: a token's leading space stays)
            f'<text transform="translate({x:g},{top - 4}) rotate(-90)" style="white-space:pre" '
            f'xml:space="preserve"><title>{esc(repr(t))} (position {order[j]})</title>'
            f"{esc(short)}</text>"
        )
    h = ch - 4
    tips = {tok: [f"{texts[tok]!r} (position {tok}): share of each branch"] for tok in order}
    for i, key in enumerate(levels):
        layer, _, sub = key
        y = top + ch * i
        out.append(f'<text x="4" y="{y + ch / 2 + 4:g}">{esc(names[i])}</text>')
        bars: dict = {}  # role -> path data of its bars in this row
        empty, wins = [], []
        for tok, entries in sorted(cells[key].items()):
            x = left + cw * index[tok]
            entries.sort()
            y0, parts = y + 2.0, []
            for _, b, _v, share, won in entries:
                if share != share or share <= 0:
                    continue
                if share >= 0.005 or won:  # a share that rounds to 0% is left out
                    parts.append(f"{b} {100 * share:.0f}%" + (" ←" if won else ""))
                hh = h * share
                if hh >= 0.2:  # thinner bars do not show
                    bars.setdefault(b, []).append(f"M{x + 1} {y0:.1f}h{cw - 2}v{hh:.1f}h-{cw - 2}z")
                if won:
                    wins.append(f"M{x + 1.5} {y0 + 0.5:.1f}h{cw - 3}v{max(hh - 1, 0.5):.1f}"
                                f"h-{cw - 3}z")  # fmt: skip
                y0 += hh
            if not parts:
                empty.append(f"M{x + 1} {y + 2}h{cw - 2}v{h}h-{cw - 2}z")
            line = ", ".join(parts) or "no path"
            tips[tok].append(f"{names[i]}: {line}{head_text.get((layer, sub, tok), '')}")
        for b, d in bars.items():
            color = ROLE_COLORS.get(b, ROLE_COLORS["other"])
            out.append(f'<path class="bar" data-role="{esc(b)}" fill="{color}" d="{"".join(d)}"/>')
        if empty:
            out.append(f'<path fill="#eee" d="{"".join(empty)}"/>')
        if wins:
            out.append(f'<path fill="none" stroke="#000" d="{"".join(wins)}"/>')
    rows_h = ch * len(levels)
    for tok in order:  # hover a token's column: its shares in every layer
        out.append(
            f'<rect class="hov" x="{left + cw * index[tok]}" y="{top}" width="{cw}" '
            f'height="{rows_h}"><title>{esc(chr(10).join(tips[tok]))}</title></rect>'
        )
    out.append("</svg>")
    return "".join(out)


def level_name(layer, sub) -> str:
    """A heatmap row's name: ``layer 3 attention``, or the sublayer of a layer-less table."""
    return f"layer {layer} {sub}" if layer != "" else str(sub)


def _sub_order(s):
    return {"attention": 0, "mlp": 1}.get(s, 2)


def _head_text(heads, example) -> dict:
    if heads is None or not len(heads):
        return {}
    if "example" in heads.columns:
        heads = heads[heads["example"] == example]
    out: dict = {}
    cols = ["layer", "sublayer", "token", "branch", "head_index", "value"]
    for layer, sub, tok, b, head, v in zip(*(heads[c].tolist() for c in cols)):
        out[(layer, sub, tok)] = out.get((layer, sub, tok), "") + f"; {b} head {head}: {fmt(v)}"
    return out
