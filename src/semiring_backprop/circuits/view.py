"""A circuit drawn: layers (rows, the embeddings at the bottom, the target at the top) by
positions (columns, under their tokens). Per layer and position, the attention heads
side by side (a small box each) and above them the MLP; a box's colour is its value
(red positive, blue negative, on a diverging scale centred at zero) and its size
grows with |value|, with its sign (+ or −) written in it. Edges are lines, their width
by |value| and their colour by sign; a head's attention from one position to another
is a dashed curve. A head is kept at the position where it writes; where a kept head
reads keys and values without being kept, a hollow dashed box (a read site) ends the
edges into its key and value inputs and starts its attention curve. Edges of value 0
or of no path are not drawn. One inline SVG, no script; padding has no column. Reads a
``Circuit`` (``semiring_backprop.circuits``) and computes nothing."""

from __future__ import annotations

import math

from ..tokens import readable_tokens
from ..views import View
from ..views import html as _html
from ..views.colors import NO_VALUE, Scale
from . import sites
from .exports import read_sites

ROW_H = 34
HEAD_W = 14
LEFT = 150


def _int(x):
    try:
        if x is None or x != x:
            return None
    except TypeError:
        return None
    try:
        import pandas as pd

        if x is pd.NA:
            return None
    except ImportError:
        pass
    return int(x)


def _site(role, layer, head, position) -> str:
    names = {"embedding": "input", "target": "logits"}
    if role == "head":
        name = f"a{_int(layer)}.h{_int(head)}"
    elif role == "mlp":
        name = f"m{_int(layer)}"
    else:
        name = names.get(role, f"r{_int(layer)}")
    return name if role == "target" else f"{name}@{_int(position)}"


def _sign(v) -> str:
    if v is None or not math.isfinite(v):
        return "none"
    return "+" if v > 0 else "-" if v < 0 else "0"


class _Layout:
    """Where each site's box is: columns by position, rows by layer and sublayer."""

    def __init__(self, circuit):
        full = circuit.full.nodes
        emb = full[full.role == "embedding"].sort_values("position")
        self.positions = [int(p) for p in emb.position]
        self.labels = readable_tokens([str(t) for t in emb.token])
        self.token = dict(zip(self.positions, self.labels))  #: position -> readable token
        self.n_layers, self.n_heads = circuit.n_layers, max(circuit.n_heads, 1)
        self.col = {p: j for j, p in enumerate(self.positions)}
        self.cw = max(self.n_heads * (HEAD_W + 2) + 8, 56)
        self.rows = 2 + 2 * self.n_layers
        longest = min(max((len(t) for t in self.labels), default=1), 14)
        self.top = 30
        self.bottom = 14 + 7 * longest
        self.width = LEFT + self.cw * max(len(self.positions), 1) + 16
        self.height = self.top + ROW_H * self.rows + self.bottom

    def row_y(self, r: int) -> float:
        """The top of row ``r`` counted from the bottom (0: the embeddings)."""
        return self.top + ROW_H * (self.rows - 1 - r)

    def row_of(self, role, layer) -> int:
        if role == "embedding":
            return 0
        if role == "target":
            return self.rows - 1
        return 1 + 2 * int(layer) + (1 if role == "mlp" else 0)

    def box(self, role, layer, head, position) -> tuple[float, float, float, float]:
        """``(x, y, width, height)`` of a site's slot."""
        y = self.row_y(self.row_of(role, layer)) + 5
        h = ROW_H - 10
        if role == "target":
            w = min(160, self.cw * max(len(self.positions), 1) - 8)
            x = LEFT + (self.cw * max(len(self.positions), 1) - w) / 2
            return x, y, w, h
        x0 = LEFT + self.cw * self.col[int(position)] + 4
        if role == "head":
            return x0 + int(head) * (HEAD_W + 2), y, HEAD_W, h
        return x0, y, self.cw - 8, h

    def row_names(self) -> list[tuple[int, str]]:
        out = [(0, "embeddings"), (self.rows - 1, "target")]
        for layer in range(self.n_layers):
            out += [(1 + 2 * layer, f"layer {layer} heads"), (2 + 2 * layer, f"layer {layer} MLP")]
        return out


def circuit_svg(circuit, semiring=None, max_edges: int = 300) -> tuple[str, dict]:
    """The SVG, and what it drew (``components``, ``reads`` (read sites), ``edges``,
    ``edges_total``)."""
    col = circuit.column(semiring)
    lay = _Layout(circuit)
    nodes = circuit.nodes[circuit.nodes.role != "residual"]
    nodes = nodes[(nodes.role == "target") | nodes.position.isin(lay.positions)]
    scale = _scale(circuit, col)
    bound = scale.bound or 1.0
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="circuit" width="{lay.width:g}" '
        f'height="{lay.height:g}" viewBox="0 0 {lay.width:g} {lay.height:g}" font-size="11">'
    ]
    for r, name in lay.row_names():
        y = lay.row_y(r) + ROW_H / 2 + 4
        out.append(f'<text x="4" y="{y:g}">{_html.esc(name)}</text>')
    base = lay.row_y(0) + ROW_H + 4
    for j, t in enumerate(lay.labels):
        x = LEFT + lay.cw * j + lay.cw / 2 + 4
        short = t if len(t) <= 14 else t[:13] + "…"
        out.append(  # (white-space: pre: a token's leading space stays)
            f'<text class="token" transform="translate({x:g},{base:g}) rotate(-90)" '
            f'text-anchor="end" style="white-space:pre" xml:space="preserve">'
            f"<title>{_html.esc(repr(t))} (position {lay.positions[j]})</title>"
            f"{_html.esc(short)}</text>"
        )
    full = circuit.full.nodes
    for row in full[full.role.isin(("head", "mlp"))].to_dict("records"):
        if _int(row["position"]) in lay.col:
            x, y, w, h = lay.box(row["role"], row["layer"], row["head_index"], row["position"])
            out.append(f'<rect class="slot" x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" '
                       'fill="none" stroke="#ddd"/>')  # fmt: skip
    centers, drawn = {}, 0  # site code -> (x, top, bottom, name)
    boxes = []
    for code, row in zip(sites.node_codes(nodes).tolist(), nodes.to_dict("records")):
        v = float(row[col])
        sid = _site(row["role"], row["layer"], row["head_index"], row["position"])
        x, y, w, h = lay.box(row["role"], row["layer"], row["head_index"], row["position"])
        centers[code] = (x + w / 2, y, y + h, sid)
        f = (
            1.0
            if row["role"] == "target" or not math.isfinite(v)
            else max(0.2, math.sqrt(min(abs(v) / bound, 1.0)))
        )
        bw, bh = w * f, h * f
        color = scale.color(v) if math.isfinite(v) else NO_VALUE
        p = _int(row["position"])
        where = "" if row["role"] == "target" else f" at {lay.token.get(p, row['token'])!r} ({p})"
        tip = f"{sid}{where}: {col} {_html.fmt(v)}"
        boxes.append(
            f'<rect class="comp" data-id="{_html.esc(sid)}" data-role="{row["role"]}" '
            f'data-sign="{_sign(v)}" data-value="{v!r}" x="{x + (w - bw) / 2:.1f}" '
            f'y="{y + (h - bh) / 2:.1f}" width="{bw:.1f}" height="{bh:.1f}" rx="2" '
            f'fill="{color}" stroke="#555" stroke-width="0.6">'
            f"<title>{_html.esc(tip)}</title></rect>"
        )
        if math.isfinite(v) and v != 0:
            glyph = "+" if v > 0 else "−"
            gx = x + w - 9 if w >= 20 else x + w / 2 - 3
            boxes.append(f'<text x="{gx:g}" y="{y + h / 2 + 4:g}" class="sign" '
                         f'data-id="{_html.esc(sid)}" font-size="10">{glyph}</text>')  # fmt: skip
        drawn += 1
    reads = 0
    for site in read_sites(circuit):
        if site["position"] not in lay.col:
            continue
        reads += 1
        x, y, w, h = lay.box("head", site["layer"], site["head_index"], site["position"])
        code = sites.head_codes([site["layer"]], [site["head_index"]], [site["position"]])
        centers[int(code[0])] = (x + w / 2, y, y + h, site["id"])
        by = ", ".join(str(p) for p in site["read_by"])
        token = lay.token.get(site["position"], site["token"])
        tip = (f"{site['id']} at {token!r} ({site['position']}): read (keys, values) "
               f"by the head kept at position {by}")  # fmt: skip
        boxes.append(
            f'<rect class="read" data-id="{_html.esc(site["id"])}" data-role="read" '
            f'x="{x + 1:g}" y="{y + 1:g}" width="{w - 2:g}" height="{h - 2:g}" rx="2" '
            f'fill="#fff" stroke="#333" stroke-width="0.8" stroke-dasharray="2 1.5">'
            f"<title>{_html.esc(tip)}</title></rect>"
        )
    lines, total = _edges(circuit, col, centers, lay, max_edges)
    out += lines + boxes + ["</svg>"]
    return "".join(out), {"components": drawn, "reads": reads, "edges": len(lines),
                          "edges_total": total}  # fmt: skip


def _edges(circuit, col, centers, lay, max_edges) -> tuple[list[str], int]:
    """The lines of the ``max_edges`` strongest edges between drawn boxes (of value
    neither 0 nor of no path), strongest first; and how many such edges there are. Only
    those drawn are formatted."""
    import numpy as np

    e = sites.edge_arrays(circuit)
    v = e.value(col)
    drawn = np.fromiter(centers, dtype=np.int64, count=len(centers))
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(v) & (v != 0) & ~(e.attention & (e.src == e.dst))
    ok &= sites.member(e.src, drawn) & sites.member(e.dst, drawn)
    at = np.flatnonzero(ok)
    size = np.abs(v[at])
    if len(at) > max_edges > 0:  # the strongest, ties in row order (as a stable sort)
        cut = np.partition(size, len(size) - max_edges)[len(size) - max_edges]
        near = size >= cut
        at, size = at[near], size[near]
    order = np.lexsort((at, -size))[: max(max_edges, 0)]
    top = float(size.max()) if len(size) else 1.0
    lines = []
    for i in at[order].tolist():
        src, dst, kind, value = int(e.src[i]), int(e.dst[i]), e.keys[e.entry[i]], float(v[i])
        lines.append(_line(centers, lay, col, src, dst, kind, value, top))
    return lines, int(ok.sum())


def _line(centers, lay, col, src, dst, kind, v, top) -> str:
    (x1, t1, _, sname), (x2, t2, b2, dname) = centers[src], centers[dst]
    width = 0.4 + 3.6 * abs(v) / top
    color = "#B2182B" if v > 0 else "#2166AC" if v < 0 else "#999"
    tip = f"<title>{_html.esc(f'{sname} → {dname} ({kind}): {col} {_html.fmt(v)}')}</title>"
    data = (f'data-src="{_html.esc(sname)}" data-dst="{_html.esc(dname)}" data-input="{kind}" '
            f'data-sign="{_sign(v)}" data-value="{v!r}"')  # fmt: skip
    if kind == "attention":
        lift = 10 + 4 * abs(lay.col.get(_pos(dname), 0) - lay.col.get(_pos(sname), 0))
        return (
            f'<path class="attn" {data} d="M{x1:.1f} {t1:.1f} Q{(x1 + x2) / 2:.1f} '
            f'{t1 - lift:.1f} {x2:.1f} {t2:.1f}" fill="none" stroke="{color}" '
            f'stroke-width="{width:.2f}" stroke-dasharray="3 2" opacity="0.6">{tip}</path>'
        )
    return (
        f'<line class="edge" {data} x1="{x1:.1f}" y1="{t1:.1f}" x2="{x2:.1f}" '
        f'y2="{b2:.1f}" stroke="{color}" stroke-width="{width:.2f}" '
        f'opacity="0.55">{tip}</line>'
    )


def _scale(circuit, col) -> Scale:
    """Colours and sizes on the scale of the heads and MLPs (the embeddings and the
    target, whose values are larger, take the scale's ends)."""
    comps = [float(v) for v in circuit.full.components()[col]]
    if not any(math.isfinite(v) and v != 0 for v in comps):
        comps = [float(v) for v in circuit.full.nodes[col]]
    return Scale(comps, signed=True)


def _pos(sid: str) -> int:
    return int(sid.rsplit("@", 1)[1]) if "@" in sid else -1


def circuit_view(circuit, semiring=None, max_edges: int = 300) -> View:
    """The circuit as a :class:`~semiring_backprop.views.View`: the drawing, a caption
    naming the example, the seed (where not ``x``), the integrated-gradients steps (where
    any) and the semiring, a colour bar and a legend."""
    col = circuit.column(semiring)
    svg, drawn = circuit_svg(circuit, semiring, max_edges)
    comps = circuit.components()
    every = circuit.full.components()
    text = circuit.prompt
    scale = _scale(circuit, col)
    said = f"; explained: {circuit.what}" if circuit.what else ""
    said += f"; {circuit.seeding}" if circuit.seeding else ""
    kept = (f"{len(comps)} of {len(every)} head/MLP sites kept"
            if len(comps) < len(every) else f"all {len(every)} head/MLP sites")  # fmt: skip
    shown = f"{drawn['edges']} of {drawn['edges_total']} non-zero edges drawn (the strongest)"
    caption = (
        f"<h3>Circuit of “{_html.esc(text)}”</h3><div class=note>"
        f"{_html.esc(said[2:] + '; ' if said else '')}values under {_html.esc(col)} "
        f"({_html.esc(_meaning(col, circuit.ig_steps))}); {kept}; {shown}.</div>"
    )
    legend = (
        "<div class=note>Rows: the embeddings (bottom), per layer the attention heads "
        "(small boxes, head 0 first) and the MLP, the target (top); columns: positions. "
        "A box's colour is its value (red raises the output, blue lowers it; + or − "
        "in each box) and its size grows with |value|, on the scale of the heads and "
        "MLPs (the embeddings and the target, larger, take its ends); grey outlines are sites left "
        "out; a hollow dashed box is a position where a kept head reads its keys and values "
        "without being kept there. Lines: edges through the residual stream (width by "
        "|value|, colour by sign); dashed curves: a head's attention from the position it "
        "reads to the position it writes.</div>"
    )
    body = caption + _html.color_bar(scale, col) + f'<div class="scroll">{svg}</div>' + legend

    emb = circuit.full.nodes[circuit.full.nodes.role == "embedding"]
    token_at = dict(zip((int(p) for p in emb.position),
                     readable_tokens([str(t) for t in emb.token])))  # fmt: skip

    def as_text(color=False):
        order = sorted(comps.to_dict("records"), key=lambda r: -abs(float(r[col]))
                       if math.isfinite(float(r[col])) else 0)  # fmt: skip
        lines = [f"circuit of {text!r}{said}", f"values under {col}; {kept}; {shown}"]
        for r in order[:15]:
            sid = _site(r["role"], r["layer"], r["head_index"], r["position"])
            token = repr(token_at.get(_int(r["position"]), r["token"]))
            lines.append(f"  {sid:14} {token:14} {_html.fmt(r[col])}")
        reads = [f"{s['id']} (for {', '.join(map(str, s['read_by']))})"
                 for s in read_sites(circuit)]  # fmt: skip
        if reads:
            lines.append("read without being kept there: " + "; ".join(reads[:15])
                         + ("; ..." if len(reads) > 15 else ""))  # fmt: skip
        return "\n".join(lines)

    return View(body, as_text, "circuit")


def _meaning(col: str, ig_steps: int = 0) -> str:
    if col == "Real" and ig_steps:
        return "each site's conductance: its flow summed over the steps from the baseline"
    if col == "Real":
        return "the total flow through each site: its share of the output"
    if col.startswith("MaxProduct"):
        return "the product of the best path through each site, signed"
    return "the ⊕ of the paths through each site"
