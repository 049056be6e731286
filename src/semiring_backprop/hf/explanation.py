"""What :func:`~semiring_backprop.hf.explain.explain` returns: an
:class:`Explanation` (the explained scalar, the tokens, the branch tables, the per-token
entropy and the top gradient paths), reported as text, shown as a view, and written as
JSON, CSV and figures."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path as FilePath

import torch

from .._files import json_safe
from ..errors import InputError
from ..tokens import text_of, token_line

__all__ = ["PAPER_NOTE", "Explanation", "model_name"]


#: what paper mode's report says it computed
PAPER_NOTE = (
    "paper mode: traced as the paper's library (brunoflow) built its graph, tensor "
    "granularity; two branch tables follow: ours, then the paper's quantity"
)


@dataclass
class Explanation:
    """Everything ``explain`` computed, with tables as pandas DataFrames."""

    model_id: str
    kind: str
    text: str
    target: str
    foil: str
    tokens: list  #: the text's tokens (a sentence pair: both, as one input; similarity: the first)
    position: int | None  #: the explained position (None: a whole text)
    score: float  #: the explained scalar (lm: log p(target) - log p(foil))
    result: object = field(repr=False)
    layers: object = field(repr=False, default=None)  #: layer_table DataFrame
    entropy: object = field(repr=False, default=None)  #: per-token entropy DataFrame
    path: object = field(repr=False, default=None)  #: top gradient Path
    source: str = ""  #: module whose output the tokens' values are read at
    task: str = "lm"  #: lm, classification, similarity or token (targets.TASKS)
    text_pair: str | None = None  #: the second text (a sentence pair, or similarity)
    what: str = ""  #: the explained scalar in words
    examples: list | None = None  #: tokens of each example of the batch explained
    paths: list | None = None  #: the top gradient path from each example's tokens
    #: the text pair's tokens (similarity: the second text's; a sentence pair: its second
    #: segment's), padding left out; None without a pair
    pair_tokens: list | None = None
    #: per example, 1 where a position is a token and 0 at padding (the attention mask);
    #: None where every position is a token. Tables, views and figures leave padding out
    mask: list | None = None
    #: paper mode (``explain(..., paper=True)``): traced as the paper's library built its
    #: graph, at tensor granularity; ``paper_layers`` holds the paper's quantity beside
    #: ``layers`` (ours)
    paper: bool = False
    #: the paper's per-token branch table (``layer_table(aggregate="paper")``: brunoflow's
    #: values, winner-take-all per token, zeros kept); None outside paper mode
    paper_layers: object = field(repr=False, default=None)
    #: each example's tokens as the tokenizer wrote them (``ĠMary``; ``tokens`` and
    #: ``examples`` are as people read them: `` Mary``); None where not known
    raw_tokens: list | None = None

    def _said(self) -> str:
        if self.what:
            return self.what
        return (
            f"log p({self.target}) - log p({self.foil}) at position {self.position} "
            f"({self.tokens[self.position]!r})"
        )

    def real_tokens(self, e: int) -> list:
        """Example ``e``'s tokens, padding left out."""
        row = (self.examples or [self.tokens])[e]
        if self.mask is None:
            return list(row)
        return [t for t, m in zip(row, self.mask[e]) if m]

    def report(self) -> str:
        rows = self.examples or [self.tokens]
        lines = [
            f"model: {self.model_id} ({self.kind} LM)"
            if self.task == "lm"
            else f"model: {self.model_id} ({self.task})",
            *(
                [f"tokens: {token_line(self.tokens)}"]
                if len(rows) == 1
                else [
                    f"tokens of example {e}: {token_line(self.real_tokens(e))}"
                    for e in range(len(rows))
                ]
            ),
            f"explained: {self._said()} = {self.score:.4f}",
        ]
        if self.mask is not None:
            lines.append("(padding, where the attention mask is 0, is no token: left out below)")
        if self.paper:
            lines.append(PAPER_NOTE)
        if self.layers is not None and len(self.layers):
            lines += ["", _branch_text(self.layers, ours=self.paper)]
        if self.paper_layers is not None and len(self.paper_layers):
            lines += ["", _branch_text(self.paper_layers, paper=True)]
        from ..views import start_of

        for path in self.paths or ([self.path] if self.path is not None else []):
            lines += ["", f"top gradient path {start_of(path, rows, self.mask)}:"]
            lines += ["  " + ln for ln in str(path).splitlines()]
        if self.entropy is not None:
            lines += ["", "per-token path entropy (nats; normalized = H / log #paths):"]
            lines += ["  " + ln for ln in self.entropy.to_string(index=False).splitlines()]
        return "\n".join(lines)

    def view(self, quantity: str | None = None):
        """The report as a :class:`~semiring_backprop.views.View` (HTML and text)."""
        from .. import views

        return views.explanation(self, quantity)

    def _repr_html_(self) -> str:
        return self.view()._repr_html_()

    def to_html(self, file, quantity: str | None = None) -> str:
        """Write the report to one self-contained HTML file; returns its path."""
        return self.view(quantity).to_html(file)

    def to_dict(self) -> dict:
        return {
            "model": self.model_id,
            "kind": self.kind,
            "text": self.text,
            "target": self.target,
            "foil": self.foil,
            "tokens": self.tokens,
            "position": self.position,
            "score": self.score,
            "task": self.task,
            "text_pair": self.text_pair,
            "explained": self._said(),
            "examples": self.examples or [self.tokens],
            "raw_tokens": self.raw_tokens,
            "pair_tokens": self.pair_tokens,
            "mask": self.mask,
            "source": self.source,
            "layers": None if self.layers is None else self.layers.to_dict("records"),
            "paper": self.paper,
            "paper_layers": None
            if self.paper_layers is None
            else self.paper_layers.to_dict("records"),
            "entropy": None if self.entropy is None else self.entropy.to_dict("records"),
            "top_path": None if self.path is None else self.path.to_dict(),
            "top_paths": [p.to_dict() for p in self.paths or ([self.path] if self.path else [])],
        }

    def write(self, out, format: str = "png") -> list[str]:
        """JSON, CSV and figure files (``format``: png, svg or pdf) under ``out``;
        returns their paths."""
        if format not in ("png", "svg", "pdf"):
            raise InputError(f"figure format {format!r}: choose png, svg or pdf")
        out = FilePath(out)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        from .._files import atomic_write  # whole or not at all, never through a link

        page = json.dumps(json_safe(self.to_dict(), "name", plain=False), indent=2)
        files = {"explanation.json": lambda tmp: tmp.write_text(page)}
        top = None if self.path is None else self.path.to_frame()
        for name, table in (("layers.csv", self.layers), ("entropy.csv", self.entropy),
                            ("top_path.csv", top),
                            ("paper_layers.csv", self.paper_layers)):  # fmt: skip
            if table is not None:
                files[name] = lambda tmp, t=table: t.to_csv(tmp, index=False)
        for e, path in enumerate(self.paths or []):  # a batch: each example's own, too
            if len(self.paths) > 1:
                files[f"top_path_{e}.csv"] = lambda tmp, p=path: p.to_frame().to_csv(
                    tmp, index=False
                )
        for name, write in files.items():
            written.append(str(atomic_write(out / name, write)))
        written += self._figures(out, format)
        return written

    def _figures(self, out, format: str = "png") -> list[str]:
        from .. import plots
        from ..views import start_of
        from ..views.html import SKIP_NOTE

        files = []
        n = len(self.examples or [self.tokens])
        said = f"{self._said().replace(' - ', ' − ')} = {self.score:.4g}"

        def save(fig, name, semiring, e, note=""):
            head = f"{self._example_text(e, n)}\n{said}; {semiring}; {model_name(self.model_id)}"
            plots.caption(fig, head + (f"\n{note}" if note else ""))
            files.append(str(plots.save(fig, out / f"{name}.{format}")))

        rows = self.examples or [self.tokens]
        for e in range(n):  # a batch (two texts): the figures of each example
            end = f"_{e}" if n > 1 else ""
            layers, entropy = _one_example(self.layers, e), _one_example(self.entropy, e)
            path = (self.paths or [self.path])[e] if self.path is not None else None
            if layers is not None and len(layers):
                max_rows = layers[layers.semiring.str.startswith("MaxProduct")]
                table = max_rows if len(max_rows) else layers
                sr = table.semiring.iloc[0]
                skip = SKIP_NOTE if str(sr).startswith(("MaxProduct", "MaxAbs", "TopK")) else ""
                for sub in sorted(set(table.sublayer)):
                    fig = plots.branch_bars(table, sublayer=sub, semiring=sr)
                    save(fig, f"branches_{sub}{end}", sr, e, skip)
                save(plots.token_heatmap(table, semiring=sr), f"token_heatmap{end}", sr, e)
            if entropy is not None:
                fig = plots.token_bars(entropy, value="entropy", title="path entropy per token")
                save(fig, f"entropy{end}", "Entropy", e)
            if path is not None:
                start = start_of(path, rows, self.mask).split(" (position")[0]
                title = f"top path {start}, {path.semiring}: {path.value:.4g}"
                save(plots.path_diagram(path, title=title), f"top_path{end}", path.semiring, e)
        return files

    def _example_text(self, e: int, n: int) -> str:
        """What example ``e`` of ``n`` is, in words: its own text, quoted."""
        if n == 1:
            return f'"{self.text}"'
        if self.task == "similarity" and self.text_pair is not None and n == 2:
            return f'"{(self.text, self.text_pair)[e]}" (text {"AB"[e]} of the pair)'
        return f'"{text_of(self.real_tokens(e))}" (example {e} of "{self.text}")'


def model_name(model_id: str) -> str:
    """A model's name for a caption: a local directory's (or file's) last part, else the
    hub id; ``smol``: SmolLM2-135M-Instruct."""
    from .gguf import SMOL

    if model_id == SMOL:
        return "SmolLM2-135M-Instruct"
    where = os.path.expanduser(str(model_id))
    if os.path.isdir(where) or where.startswith(("/", "./", "../")):
        return os.path.basename(os.path.normpath(where)) or str(model_id)
    return str(model_id)


def _one_example(table, e: int):
    """The rows of example ``e`` of a batch's table (the table itself for one example)."""
    if table is None or "example" not in table.columns:
        return table
    return table[table.example == e].drop(columns="example").reset_index(drop=True)


def _branch_text(layers, ours: bool = False, paper: bool = False) -> str:
    """The branch table as text. ``ours`` (paper mode): the heading says it is ours;
    ``paper``: the table is ``aggregate="paper"``'s, and the heading says so."""
    from ..views.html import SELECTIVE, SKIP_NOTE

    table = layers[layers.semiring.str.startswith("MaxProduct")]
    if not len(table):
        table = layers[layers.semiring == layers.semiring.iloc[0]]
    sr = table.semiring.iloc[0]
    if paper:
        head = (
            f"the paper's quantity, branches per layer ({sr} in paper mode: brunoflow's "
            "computation; winner-take-all per token: the token's best hidden unit gives its "
            "value to the branch that wins that unit, every other branch has 0, zeros kept)"
        )
    else:
        head = (
            ("ours, " if ours else "")
            + f"branches per layer ({sr}, ⊕ over each token's hidden units; winner: the branch "
            "holding the token's best value)"
        )
    out = [head]
    keys = ["token", "token_text"]
    if "example" in table.columns:  # a batch: one row per example and token
        keys = ["example", *keys]
    if "head_index" in table.columns:  # per head: query head 0 is its own column, "query.0"
        heads = table["head_index"]
        label = table["branch"].where(heads.isna(), table["branch"] + "." + heads.astype(str))
        table = table.assign(branch=label)
    for (layer, sub), part in table.groupby(["layer", "sublayer"], sort=True):
        wide = part.pivot_table(index=keys, columns="branch", values="value", aggfunc=_oplus(sr))
        win = part[part.winner].set_index(keys)["branch"]
        wide["winner"] = win.reindex(wide.index).fillna("")
        wide = wide.reset_index().drop(columns="token").rename(columns={"token_text": "token"})
        wide = wide.replace([-math.inf, math.inf], math.nan)  # the semiring zero: no path
        out.append(f"layer {layer} {sub}:")
        text = wide.to_string(index=False, float_format="%.3g", na_rep="-")
        out += ["  " + ln for ln in text.splitlines()]
    out.append("(- : no path through that branch reaches the output)")
    if str(sr).startswith(SELECTIVE) and not paper:
        import textwrap

        out += textwrap.wrap(SKIP_NOTE, 100)
    return "\n".join(out)


def _oplus(name: str):
    """⊕ on readouts, for rows of one role in a table made per consumer."""
    if name == "Real":
        return "sum"
    if name in ("LogAbs", "PathCount"):
        return lambda v: float(torch.logsumexp(torch.tensor(list(v), dtype=torch.float64), 0))
    if name.startswith(("MaxProduct", "MaxAbs", "TopK")):
        return "max"
    return "first"  # the explain tables are made per role: one row each
