"""Views of results: HTML for notebooks (``_repr_html_``) and files, text for terminals.

Each function reads a result, a path or a table (it runs no pass) and returns a
[View][semiring_backprop.views.View]: shown as HTML in Jupyter, as text by ``print``,
written to one self-contained file by ``View.to_html`` (inline CSS and SVG, no script,
nothing from the network: it opens offline). ``QUANTITIES`` names the per-token
quantities a token strip can show, with what each is and whether it is signed.

Examples:
    >>> from semiring_backprop import views
    >>> sorted(views.QUANTITIES)
    ['entropy', 'gradient', 'normalized_entropy', 'top_path']
    >>> views.tokens(res, "top_path", tokens=tokens)          # a token strip
    <View 'tokens': ... characters of HTML>
    >>> p = res.top_path("bert.embeddings.word_embeddings")
    >>> views.path(p, res=res).to_html("api-path-view.html")  # a readable chain, as a file
    'api-path-view.html'
"""

from __future__ import annotations

import sys

from ..analysis.readouts import (
    QUANTITIES,
    TokenValues,
    available,
    entry_roles,
    head_columns,
    path_runs,
    shares,
    token_values,
)
from ..errors import InputError, SemiringBackpropError
from ..tokens import readable_rows, text_of
from . import html as _html
from . import text as _text

__all__ = ["QUANTITIES", "View", "branches", "explanation", "path", "paths", "result", "tokens"]


class View:
    """Something to look at: ``_repr_html_`` for notebooks, ``str`` for terminals,
    ``to_html`` for a file, ``show`` to print (coloured on a terminal).

    Examples:
        >>> v = res.view("top_path", tokens=tokens)
        >>> v.html()[:15]                      # a whole page
        '<!DOCTYPE html>'
        >>> v.to_html("api-view.html")
        'api-view.html'
        >>> v.show()                           # plain text where stdout is no terminal
        Result: 182 nodes; Real, MaxProduct(neuron), TopK(2), Entropy, PathCount
        <BLANKLINE>
        top path ...
    """

    def __init__(self, body: str, text, title: str):
        self.body = body  #: the HTML fragment, without the style sheet
        self._text = text  #: color -> terminal text
        self.title = title

    def _repr_html_(self) -> str:
        return _html.fragment(self.body)

    def html(self) -> str:
        """The whole self-contained page."""
        return _html.document(self.body, self.title)

    def to_html(self, file) -> str:
        """Write the page to ``file`` (folders made as needed); returns the path."""
        return _html.write_document(file, self.html())

    def text(self, color: bool = False) -> str:
        """The terminal text (``color``: with ANSI colours)."""
        return self._text(color)

    def show(self, file=None) -> None:
        """Print the text, coloured where ``file`` (stdout) is a terminal without NO_COLOR."""
        file = sys.stdout if file is None else file
        print(self.text(_text.use_color(file)), file=file)

    def __str__(self) -> str:
        return self.text(False)

    def __repr__(self) -> str:
        return f"<View {self.title!r}: {len(self.body)} characters of HTML>"


#: what ``Explanation.paper_layers`` holds, as its view names it
PAPER_QUANTITY = (
    "the paper's quantity: brunoflow's values, winner-take-all per token "
    "(the token's best hidden unit, to the branch it came from; others 0)"
)


def _concat(views: list[View], title: str) -> View:
    return View(
        "".join(v.body for v in views),
        lambda color: "\n\n".join(v.text(color) for v in views),
        title,
    )


def tokens(res, quantity: str | None = None, *, source=None, tokens=None, mask=None) -> View:
    """Token strips coloured by a per-token ``quantity`` (``"gradient"``, ``"top_path"``,
    ``"entropy"``, ``"normalized_entropy"``; None: every one the result has), read at
    ``source`` (default: the model's float input or its word embeddings). ``tokens``:
    the token strings, one list per example for a batch. Signed quantities use a
    diverging colour map centred at zero; the value shows on hover and under each token.
    The top path is the heaviest path product with its sign (MaxProduct's ``hi`` or
    ``lo``, whichever is larger in size; both on hover): red raises the output, blue
    lowers it. Padding (``mask``, default the call's attention mask, 0) is left out.

    Examples:
        Every token's heaviest path lowers this output (its most negative path outweighs
        its most positive one: at the mask, -0.6758 against 0.5744):

        >>> print(sbp.views.tokens(res, "top_path", tokens=tokens))
        top path (the heaviest path product from the token, with its sign: ... blue: it
        lowers it; at bert.embeddings.word_embeddings)
           [CLS] -0.0001229   the -8.856e-05   keys -0.0001202   to -9.657e-05   the -9.424e-05
           cabinet -0.0001008   [MASK] -0.6758   on -9.074e-05   the -9.554e-05
           table -0.0001061   [SEP] -0.0001167
    """
    return _token_view(res, quantity, source, tokens, mask=mask)


def _token_view(res, quantity, source, labels, marks=None, mask=None) -> View:
    names = available(res) if quantity is None else [quantity]
    if not names:
        raise InputError(
            f"this result has no per-token quantity to show (computed: "
            f"{', '.join(s.name for s in res.semirings)}); pass Real(), MaxProduct() or "
            "Entropy() and PathCount() to backprop"
        )
    views = []
    for q in names:
        tv = token_values(res, q, source, labels, mask)
        tv.marks.update(marks or {})
        views.append(_strip(tv))
    return _concat(views, "tokens")


def _strip(tv: TokenValues, title: str | None = None) -> View:
    return View(_html.strips(tv, title), lambda color: _text.strips(tv, color, title), tv.quantity)


def _known(res, ps=()) -> dict:
    """What the result tells about paths: branch entries and head columns. Without
    ``res``, the result the paths were read from, while it is alive (a path read from a
    model whose blocks cannot be found falls back to module names)."""
    explicit = res is not None
    if not explicit:
        origins = {id(o): o for p in ps if (o := getattr(p, "origin", lambda: None)())}
        res = next(iter(origins.values())) if len(origins) == 1 else None
    if res is None:
        return {}
    try:
        return {"roles": entry_roles(res), "heads": head_columns(res)}
    except SemiringBackpropError:
        if explicit:
            raise
        return {}


def path(p, title: str = "top gradient path", res=None) -> View:
    """A path as a chain from its source to the output: per module, the layer, the
    branch (skip / query / key / value / mlp), the head where the path names one, the
    product of the edge weights and the running product; each row opens to its steps.
    With ``res`` (the result the path was read from) the branches are those
    ``Result.branches`` finds (fused projections too) and a query / key / value branch
    names its head where the model gives the head count; else branches come from module
    names.

    Examples:
        >>> p = res.top_path(("bert.embeddings.word_embeddings", (0, 2)))
        >>> print(sbp.views.path(p, res=res))
        MaxProduct(neuron) top path, product 0.0001151, 95 steps, from
        bert.embeddings.word_embeddings[0,2,6]:
              steps layer branch   edge prod    running  module
                  0                        –          1  bert.embeddings.word_embeddings
        ...
              17-21     0 value      0.04392      1.421  ...attention.self.value (head 1)
        ...
              80-84                  0.02835  0.0001151  cls.predictions.decoder
              87-94                        1  0.0001151  output
    """
    runs = path_runs(p, **_known(res, [p]))
    return View(_html.path_block(p, runs, title), lambda color: _text.path(p, runs, color), title)


def paths(ps, title: str = "top paths", res=None) -> View:
    """Several paths (``Result.top_paths``) as a list, heaviest first (``res``: as for
    [path][semiring_backprop.views.path]).

    Examples:
        >>> ps = res.top_paths("bert.embeddings.word_embeddings", 2)
        >>> print(sbp.views.paths(ps, res=res))
        1. TopK(2) path (ranked by |product|), product -0.6758, 70 steps, from
        bert.embeddings.word_embeddings[0,6,6]:
        ...
        2. TopK(2) path (ranked by |product|), product 0.5744, 70 steps, from
        bert.embeddings.word_embeddings[0,6,6]:
        ...
    """
    ps = list(ps)
    if not ps:
        raise InputError("no paths to show: give the list Result.top_paths(...) returned")
    known = _known(res, ps)
    runs_of = lambda p: path_runs(p, **known)  # noqa: E731
    return View(
        _html.path_list(ps, runs_of, title),
        lambda color: _text.paths(ps, runs_of, color),
        title,
    )


def branches(table, semiring=None, title: str = "branches per layer and token",
             mask=None, quantity: str | None = None) -> View:  # fmt: skip
    """A layer table (``Result.layer_table``; ``Result.branches``: one row) as a layer x
    token heatmap of the branches' shares of each token's total; per-head rows (a
    ``head_index`` column) show on hover. Rows at padding (``mask``, default the
    table's attention mask, 0) are left out of the cells and the shares. Under a
    selective semiring the skip branch wins almost by construction (the note says why).
    ``quantity`` names what the values are where the semiring alone does not say it
    (e.g. the paper's winner-take-all table in paper mode); it is shown beside the
    semiring in the heading of the text and of the page.

    Examples:
        Tokens 4 to 7 of the sentence: at the mask, the residual (skip) branch carries
        the best path; the other tokens reach the output only through attention (their
        best path through its value branch), so they have no MLP row.

        >>> table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=tokens)
        >>> print(sbp.views.branches(table[table.token.between(4, 7)]))
        winning branch per layer and token (MaxProduct(neuron); share of the token's total)
          S=skip  Q=query  K=key  V=value  M=mlp  O=other
                              the     cabinet [MASK]  on
          layer 0 attention   V 100%  V 100%  S 100%  V 100%
          layer 0 mlp         -       -       S 100%  -
          A skip win is close to built in: ...
    """
    rows, name, heads = shares(table, semiring, mask)
    if not len(rows):
        raise InputError("the table has no rows to show")
    if quantity:
        name = f"{name}; {quantity}"
    body = f"<h3>{_html.esc(title)}</h3>" + _html.heatmap(rows, heads, name)
    return View(body, lambda color: _text.heatmap(rows, name, color), title)


def result(res, quantity: str | None = None, *, source=None, tokens=None) -> View:
    """What ``Result`` shows in a notebook: which semirings it holds, and token strips
    of every per-token quantity it has (see [tokens][semiring_backprop.views.tokens]).

    Examples:
        >>> print(sbp.views.result(res, "entropy", tokens=tokens))
        Result: 182 nodes; Real, MaxProduct(neuron), TopK(2), Entropy, PathCount
        <BLANKLINE>
        entropy (path entropy in nats (Entropy, ⊕ over the token's units); at
        bert.embeddings.word_embeddings)
           [CLS] 28.74   the 28.7   keys 28.74   to 28.45   the 28.75   cabinet 28.7   [MASK] 23.73
           on 28.71   the 28.66   table 28.81   [SEP] 28.54
    """
    names = ", ".join(s.name for s in res.semirings)
    head = (
        f"<h3>semiring backprop result</h3><div class=note>{len(res._store)} nodes; "
        f"semirings: {_html.esc(names)}</div>"
    )
    parts = [View(head, lambda color: f"Result: {len(res._store)} nodes; {names}", "result")]
    if available(res) or quantity is not None:
        parts.append(_token_view(res, quantity, source, tokens))
    return _concat(parts, "semiring backprop result")


def _has_shares(semiring: str) -> bool:
    return not str(semiring).startswith(("Entropy", "PathCount"))


def explanation(ex, quantity: str | None = None) -> View:
    """The report of ``semiring_backprop.hf.explain.explain``: what was explained,
    per-token strips, the top path, the branch heatmap.

    Examples:
        >>> from semiring_backprop.hf.explain import explain
        >>> ex = explain(model, "the keys to the cabinet [MASK] on the table", "are", "is",
        ...              tokenizer=tok)
        >>> print(sbp.views.explanation(ex, "top_path"))
        the keys to the cabinet [MASK] on the table
        model BertForMaskedLM (masked LM); log p(are) - log p(is) at position 6 ([MASK]) = 0.1618
        <BLANKLINE>
        top path ...
           cabinet -0.0001008   *[MASK] -0.6758   on -9.074e-05   the -9.554e-05   table -0.0001061
        ...
          (* the explained position)
        ...
        winning branch per layer and token (MaxProduct(neuron); share of the token's total)
        ...
    """
    res = ex.result
    task = getattr(ex, "task", "lm")
    if task != "lm" or ex.foil is None:  # another target (semiring_backprop.targets)
        return _other_target(ex, quantity, task)
    top = (
        f"<h2>log p({_html.esc(ex.target)}) − log p({_html.esc(ex.foil)}): what the "
        f"{_html.esc(ex.kind)} LM's choice flows from</h2><dl class=card>"
        f'<dt>text</dt><dd class="text">{_html.esc(ex.text)}</dd>'
        f"<dt>model</dt><dd>{_html.esc(ex.model_id)} ({_html.esc(ex.kind)} LM)</dd>"
        f"<dt>explained</dt><dd>log p({_html.esc(ex.target)}) − log p({_html.esc(ex.foil)}) "
        f"at position {ex.position} ({_html.esc(ex.tokens[ex.position])}) = "
        f"<b>{_html.fmt(ex.score)}</b></dd>"
        f"<dt>semirings</dt><dd>{_html.esc(', '.join(s.name for s in res.semirings))}</dd>"
        f"<dt>tokens from</dt><dd>{_html.esc(ex.source)}</dd></dl>"
    )
    lines = [
        f"{ex.text}",
        f"model {ex.model_id} ({ex.kind} LM); log p({ex.target}) - log p({ex.foil}) at "
        f"position {ex.position} ({ex.tokens[ex.position]}) = {_html.fmt(ex.score)}",
    ]
    parts = [View(top, lambda color: "\n".join(lines), "explanation")]
    rows = getattr(ex, "examples", None) or [ex.tokens]
    marks = {(0, ex.position): "the explained position"}
    parts.append(_token_view(res, quantity, ex.source, rows, marks, getattr(ex, "mask", None)))
    return _explanation_rest(ex, parts, rows)


def start_of(p, rows, mask=None) -> str:
    """Where a path starts, in words: ``from 'guitar' (position 6 of example 0: a man is
    playing a guitar) at embeddings.word_embeddings``; ``rows``: each example's tokens."""
    src = p.steps[0]
    where = src.module or src.node
    idx = src.index
    if idx is None or len(idx) < 2 or not rows:
        return f"from {where}"
    e, t = (int(idx[0]), int(idx[1])) if len(rows) > 1 or len(idx) > 2 else (0, int(idx[0]))
    if e >= len(rows) or t >= len(rows[e]):
        return f"from {where}"
    shown = readable_rows(rows)
    real = [tok for j, tok in enumerate(shown[e]) if mask is None or mask[e][j]]
    which = f" of example {e}: {text_of(real)}" if len(rows) > 1 else ""
    return f"from {shown[e][t]!r} (position {t}{which}) at {where}"


def _other_target(ex, quantity, task) -> View:
    """The report of a class label, token label, similarity or one-word LM target."""
    res = ex.result
    rows = getattr(ex, "examples", None) or [ex.tokens]
    said = ex._said().replace(" - ", " − ")
    whose = "LM" if task == "lm" else f"{task} model"
    pair = "" if ex.text_pair is None else (
        f'<dt>text pair</dt><dd class="text">{_html.esc(ex.text_pair)}</dd>'
    )  # fmt: skip
    top = (
        f"<h2>{_html.esc(said)}: what the {_html.esc(whose)}'s output flows from</h2>"
        f'<dl class=card><dt>text</dt><dd class="text">{_html.esc(ex.text)}</dd>{pair}'
        f"<dt>model</dt><dd>{_html.esc(ex.model_id)} ({_html.esc(task)})</dd>"
        f"<dt>explained</dt><dd>{_html.esc(said)} = <b>{_html.fmt(ex.score)}</b></dd>"
        f"<dt>semirings</dt><dd>{_html.esc(', '.join(s.name for s in res.semirings))}</dd>"
        f"<dt>tokens from</dt><dd>{_html.esc(ex.source)}</dd></dl>"
    )
    lines = [ex.text, *([] if ex.text_pair is None else [ex.text_pair]),
             f"model {ex.model_id} ({task}); {ex._said()} = {_html.fmt(ex.score)}"]  # fmt: skip
    parts = [View(top, lambda color: "\n".join(lines), "explanation")]
    marks = {} if ex.position is None else {(0, ex.position): "the explained position"}
    parts.append(_token_view(res, quantity, ex.source, rows, marks, getattr(ex, "mask", None)))
    return _explanation_rest(ex, parts, rows)


def _explanation_rest(ex, parts, rows) -> View:
    res = ex.result
    paths = getattr(ex, "paths", None) or ([ex.path] if ex.path is not None else [])
    mask = getattr(ex, "mask", None)
    for p in paths:
        parts.append(path(p, f"top gradient path {start_of(p, rows, mask)}", res))
    layers = ex.layers
    paper = getattr(ex, "paper_layers", None)
    if layers is not None and len(layers) and any(map(_has_shares, layers["semiring"].unique())):
        ours = "ours: ⊕ over each branch's hidden units" if paper is not None else None
        title = "branches per layer and token" + (" (ours)" if ours else "")
        parts.append(branches(layers, title=title, mask=mask, quantity=ours))
    if paper is not None and len(paper):  # paper mode: the paper's quantity beside ours
        parts.append(branches(paper, title="branches per layer and token (the paper's quantity)",
                              mask=mask, quantity=PAPER_QUANTITY))  # fmt: skip
    return _concat(parts, f"explanation: {ex.text}")
