"""Views (``semiring_backprop.views``): token strips, path chains, branch heatmaps, path
lists, terminal text, ``--html``, and the batch token labels of ``layer_table``.

Oracles are independent of the views: gradients from ``torch.autograd``, each run's
edge product from the path's own steps, shares recomputed here from the table's values,
token labels from the lists the test gives. HTML is read back with ``html.parser``.
One tiny BERT is explained once per module (tracing dominates the time).
"""

from __future__ import annotations

import contextlib
import functools
import html
import html.parser
import inspect
import io
import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import cli, views  # noqa: E402
from semiring_backprop.analysis.paths import Path, Step  # noqa: E402
from semiring_backprop.analysis.readouts import path_runs  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402
from semiring_backprop.views.colors import DIVERGING, ROLES  # noqa: E402
from views_models import TEXT  # noqa: E402 (fixtures views_bert, views_ex: conftest)

pytestmark = pytest.mark.usefixtures("_offline_quiet")
SOURCE = "bert.embeddings.word_embeddings"
BATCH_TOKENS = [
    ["[CLS]", "the", "keys", "[MASK]", "on", "[SEP]"],
    ["[CLS]", "a", "dog", "[MASK]", "cat", "[SEP]"],
]


@pytest.fixture(scope="module")
def batch(views_bert):
    """A batch of two sentences, each explained at its own [MASK] (position 3)."""
    bert = views_bert
    model, tok = bert
    ids = torch.tensor([tok.convert_tokens_to_ids(t) for t in BATCH_TOKENS])

    def margin(out):
        lp = out.logits[:, 3].log_softmax(-1)
        are, is_ = tok.convert_tokens_to_ids(["are", "is"])
        return (lp[:, are] - lp[:, is_]).sum()

    res = sbp.backprop(model, kwargs={"input_ids": ids}, output=margin,
                       semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip
    return ids, margin, res


class _Spans(html.parser.HTMLParser):
    """The token spans of a page: (title, background colour, token text, value text)."""

    def __init__(self):
        super().__init__()
        self.spans, self._in, self._tag = [], None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "tok" in (a.get("class") or "").split():
            style = a.get("style") or ""
            bg = re.search(r"background:(#[0-9A-Fa-f]{6})", style)
            self._in = [a.get("title"), bg.group(1) if bg else None, "", ""]
        elif self._in is not None and tag in ("b", "i"):
            self._tag = tag

    def handle_endtag(self, tag):
        if tag in ("b", "i"):
            self._tag = None
        elif tag == "span" and self._in is not None:
            self.spans.append(tuple(self._in))
            self._in = None

    def handle_data(self, data):
        if self._in is not None and self._tag:
            self._in[2 if self._tag == "b" else 3] += data


def spans_of(page: str):
    p = _Spans()
    p.feed(page)
    return p.spans


def _value(title: str) -> float:
    """The value a token's hover text gives (``'the' (position 1): entropy = 3.2 (...)``)."""
    return float(title.rsplit("= ", 1)[1].split(" ")[0])


def strip_section(page: str, heading: str) -> str:
    """The part of a page from ``<h3>heading</h3>`` to the next ``<h3>``."""
    start = page.index(f"<h3>{heading}</h3>")
    end = page.find("<h3>", start + 1)
    return page[start : end if end > 0 else None]


def assert_self_contained(page: str):
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    low = page.lower()
    assert "<script" not in low and "@import" not in low and "url(" not in low
    assert "<link" not in low and "<img" not in low and "@font-face" not in low
    # the only address is the SVG namespace (an identifier, never fetched)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}


# -- token strips ---------------------------------------------------------------------


def test_gradient_strip_equals_autograd_summed_over_units(views_ex):
    """Read where the sum over units does not cancel (the MLP's hidden layer; at the
    embeddings, a LayerNorm makes every token's sum 0 up to rounding)."""
    ex = views_ex
    model, tok = ex.result_model, ex.result_tokenizer
    place = "bert.encoder.layer.0.intermediate.dense"
    enc = tok(TEXT, return_tensors="pt")
    kept = {}
    module = model.get_submodule(place)
    handle = module.register_forward_hook(lambda m, a, o: kept.setdefault("h", o))
    try:
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        lp = out.logits[0, ex.position].log_softmax(-1)
        are, is_ = tok.convert_tokens_to_ids(["are", "is"])
        (grad,) = torch.autograd.grad(lp[are] - lp[is_], kept["h"])
    finally:
        handle.remove()
    want = grad[0].sum(-1)
    page = ex.result.view("gradient", source=place, tokens=[ex.tokens]).html()
    spans = spans_of(page)
    assert [s[2] for s in spans] == ex.tokens
    big = want.abs().max().item()
    assert big > 1e-6
    for (title, bg, _, shown), w in zip(spans, want.tolist()):
        got = _value(title)
        assert math.isclose(got, w, rel_tol=1e-3, abs_tol=1e-9 * big), (title, w)
        assert shown == title.rsplit("= ", 1)[1].split(" ")[0]  # the value under the token
        # diverging colours centred at zero: blue below, red above, white at 0
        if abs(w) > 0.2 * big:
            assert (_reddish if w > 0 else _bluish)(bg), (bg, w)
    assert_self_contained(page)


def test_gradient_strip_warns_where_the_sums_cancel(views_ex):
    """After a LayerNorm the sum of a token's gradients over its units is 0 (the norm's
    output does not change when its input shifts by a constant): autograd shows it here,
    and the strip says so instead of colouring rounding noise as if it were signal."""
    ex = views_ex
    model, tok = ex.result_model, ex.result_tokenizer
    enc = tok(TEXT, return_tensors="pt")
    emb = model.get_input_embeddings()(enc["input_ids"]).detach().requires_grad_()
    out = model(inputs_embeds=emb, attention_mask=enc["attention_mask"])
    lp = out.logits[0, ex.position].log_softmax(-1)
    are, is_ = tok.convert_tokens_to_ids(["are", "is"])
    (g,) = torch.autograd.grad(lp[are] - lp[is_], emb)
    assert (g[0].sum(-1).abs() <= 1e-9 * g[0].abs().sum(-1)).all()  # they cancel
    page = ex.result.view("gradient", tokens=[ex.tokens]).html()
    assert 'class="warn"' in page and "cancel" in page
    assert "cancel" in str(ex.result.view("gradient", tokens=[ex.tokens]))
    inner = ex.result.view("gradient", source="bert.encoder.layer.0.intermediate.dense")
    assert 'class="warn"' not in inner.html()  # sums that do not cancel: no warning


def _reddish(c):
    r, b = int(c[1:3], 16), int(c[5:7], 16)
    return r > b


def _bluish(c):
    r, b = int(c[1:3], 16), int(c[5:7], 16)
    return b > r


def test_explanation_strips_hold_every_quantity(views_ex):
    ex = views_ex
    page = ex.view().html()
    top = spans_of(strip_section(page, "top path"))
    ro = ex.result.aggregate(ex.source, sbp.MaxProduct())
    hi, lo = ro.hi[0], ro.lo[0]  # the heavier extreme, with its sign
    path_value = torch.where(hi.abs() >= lo.abs(), hi, lo)
    assert [s[2] for s in top] == ex.tokens
    for (title, *_), v in zip(top, path_value.tolist()):
        assert math.isclose(_value(title), v, rel_tol=1e-3)
    # the explained position is marked, and says so on hover
    assert "explained position" in top[ex.position][0]
    ent = spans_of(strip_section(page, "entropy"))
    for (title, *_), h in zip(ent, ex.entropy["entropy"]):
        assert math.isclose(_value(title), h, rel_tol=1e-3)
    norm = spans_of(strip_section(page, "normalized entropy"))
    for (title, *_), h in zip(norm, ex.entropy["normalized"]):
        assert math.isclose(_value(title), h, rel_tol=1e-3, abs_tol=1e-9)
        assert 0 <= h <= 1
    # entropy is unsigned: a sequential scale from its smallest to its largest value
    colors = {bg for _, bg, _, _ in ent}
    assert len(colors) > 1 and not colors & set(DIVERGING)


def test_unknown_or_missing_quantity_is_refused(views_ex, batch):
    ex = views_ex
    with pytest.raises(InputError, match="quantity must be one of"):
        ex.result.view("loudness")
    with pytest.raises(InputError, match=r"needs sbp\.Entropy\(\).*semirings="):
        batch[2].view("entropy")


# -- batches --------------------------------------------------------------------------


def test_layer_table_labels_each_example_with_its_own_tokens(batch):
    _, _, res = batch
    table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=BATCH_TOKENS)
    assert set(table["example"]) == {0, 1}
    for e, t, text in zip(table["example"], table["token"], table["token_text"]):
        assert text == BATCH_TOKENS[e][t]


def test_mismatched_tokens_are_refused_naming_both_lengths(batch):
    _, _, res = batch
    flat = BATCH_TOKENS[0] + BATCH_TOKENS[1]
    with pytest.raises(InputError, match=r"12 strings.*2 examples of 6 positions"):
        res.layer_table(semirings=[sbp.MaxProduct()], tokens=flat)
    with pytest.raises(InputError, match=r"example 1\) has 5 tokens.*6 positions"):
        res.layer_table(tokens=[BATCH_TOKENS[0], BATCH_TOKENS[1][:5]])
    with pytest.raises(InputError, match=r"3 lists.*2 examples"):
        res.view(tokens=[*BATCH_TOKENS, BATCH_TOKENS[0]])
    with pytest.raises(InputError, match=r"6 strings.*2 examples"):
        res.view("gradient", tokens=BATCH_TOKENS[0])


def test_batch_strips_and_heatmaps_use_each_examples_tokens(batch):
    ids, margin, res = batch
    page = res.view("gradient", tokens=BATCH_TOKENS).html()
    spans = spans_of(page)
    assert [s[2] for s in spans] == BATCH_TOKENS[0] + BATCH_TOKENS[1]
    table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=BATCH_TOKENS)
    svg = views.branches(table).html()
    for toks in BATCH_TOKENS:
        for t in toks:
            assert f">{t}</text>" in svg


# -- paths ----------------------------------------------------------------------------


def test_path_chain_holds_every_step_and_its_products(views_ex):
    ex = views_ex
    path = ex.path
    page = path.view().html()
    for s in path.steps:
        assert f"<td>{s.node}</td>" in page
    runs = path_runs(path)
    assert sum(len(r.before) + len(r.steps) for r in runs) == len(path)
    for r in runs:
        ws = [s.edge_weight for s in r.steps if s.edge_weight is not None]
        if ws:
            assert math.isclose(r.product, math.prod(ws), rel_tol=1e-12)
    assert math.isclose(runs[-1].running, path.value, rel_tol=1e-9)
    # every layer the path passes is named, with a branch
    layers = {
        int(m.group(1)) for s in path.steps if (m := re.search(r"layer\.(\d)\.", s.module or ""))
    }
    assert layers == {r.layer for r in runs if r.layer is not None}
    assert all(r.role for r in runs if r.steps[0].op == "aten.add.Tensor" and r.layer is not None)


def _step(i, module, op, w=1.0):
    return Step(f"n{i}", module, op, (0, i), None if i == 0 else w, 1.0)


def test_roles_of_a_hand_made_path():
    """skip: a residual add with no contraction since the last; query: the path enters
    the query projection and comes back at the next residual add."""
    mods = [
        ("enc.layer.0", "input"),
        ("enc.layer.0.attention.output", "aten.add.Tensor"),  # straight to the add: skip
        ("enc.layer.1.attention.self.query", "aten.addmm.default"),
        ("enc.layer.1.attention.self", "aten.bmm.default"),
        ("enc.layer.1.attention.output.dense", "aten.addmm.default"),
        ("enc.layer.1.attention.output", "aten.add.Tensor"),  # back from the query branch
        ("enc.layer.1.intermediate.dense", "aten.addmm.default"),
        ("enc.layer.1.output.dense", "aten.addmm.default"),
        ("enc.layer.1.output", "aten.add.Tensor"),
        (None, "aten.sum.default"),
    ]
    steps = tuple(_step(i, m, op, 0.5) for i, (m, op) in enumerate(mods))
    path = Path(steps, 0.5 ** (len(steps) - 1), "MaxProduct(neuron)")
    runs = path_runs(path)
    roles = [(r.module, r.layer, r.role) for r in runs]
    assert roles == [
        ("enc.layer.0", 0, ""),
        ("enc.layer.0.attention.output", 0, "skip"),
        ("enc.layer.1.attention.self.query", 1, "query"),
        ("enc.layer.1.attention.self", 1, "query"),
        ("enc.layer.1.attention.output.dense", 1, "query"),
        ("enc.layer.1.attention.output", 1, "query"),
        ("enc.layer.1.intermediate.dense", 1, "mlp"),
        ("enc.layer.1.output.dense", 1, "mlp"),
        ("enc.layer.1.output", 1, "mlp"),
        (None, None, ""),
    ]
    text = str(path)
    assert len(text.splitlines()) == len(runs) + 2
    assert all(len(line) <= 120 for line in text.splitlines())
    assert "query" in text and "skip" in text


@functools.cache
def _tel_result():
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    return sbp.backprop(layer.double().eval(), args=(x,),
                        output=lambda y: y[0, -1, 1] - y[0, 0, 0],
                        semirings=[sbp.MaxProduct()])  # fmt: skip


@pytest.mark.parametrize("token", range(5))
def test_path_branch_is_the_winning_branch_of_its_token(token):
    """From a fan-out point itself, the top path of a token takes the branch that wins
    that token in ``Result.branches`` (a pass restricted to each branch): the branches
    the view names for the path (``res=``) must be those. nn.MultiheadAttention's fused
    projection: query, key and value from the columns each part takes."""
    res = _tel_result()
    table = res.branches(0, sbp.MaxProduct())
    won = table[(table["token"] == token) & table["winner"]]
    assert len(won) == 1
    path = res.top_path((0, (0, token)))
    runs = path_runs(path, roles=views.entry_roles(res))
    first = next(r.role for r in runs if r.role)
    assert first == won["role"].iloc[0]
    text = str(views.path(path, res=res)).splitlines()[2:]
    shown = [w for line in text for w in line.split() if w in ROLES]
    assert shown[0] == first


@pytest.mark.parametrize("token", range(5))
def test_path_head_is_the_winning_head_of_its_token(token):
    """The top path from a token at a fan-out point is the heaviest of all its paths, so
    its branch and head are those of the largest row of the per-head branch table (a
    pass restricted to each head's columns)."""
    res = _tel_result()
    if "per_head" not in inspect.signature(res.branches).parameters:
        pytest.skip("this version has no per-head tables")
    table = res.branches(0, sbp.MaxProduct(), per_head=True)
    rows = table[table["token"] == token]
    best = rows.loc[rows["value"].idxmax()]
    path = res.top_path((0, (0, token)))
    runs = path_runs(path, roles=views.entry_roles(res),
                                heads=views.head_columns(res))  # fmt: skip
    first = next(r for r in runs if r.role)
    assert first.role == best["role"]
    if best["role"] in ("query", "key", "value"):
        assert first.heads == (int(best["head_index"]),)
        assert f"(head {int(best['head_index'])})" in str(views.path(path, res=res))
    else:
        assert first.heads == ()


def test_path_text_and_repr_are_short(views_ex):
    ex = views_ex
    path = ex.path
    assert len(repr(path)) < 120 and str(len(path)) in repr(path)
    lines = str(path).splitlines()
    assert 2 < len(lines) < len(path)  # one line per module run, not per step
    assert all(len(line) <= 120 for line in lines)
    assert f"{path.value:.4g}" in lines[0]


def test_top_paths_list(views_ex):
    ex = views_ex
    ps = ex.result.top_paths(ex.source, 3)
    page = views.paths(ps).html()
    assert page.count("<li>") == 3
    for p in ps:
        assert f"<b>{p.value:.4g}</b>" in page
        for s in p.steps:
            assert f"<td>{s.node}</td>" in page
    assert str(views.paths(ps)).startswith("1. ")


# -- branch heatmaps ------------------------------------------------------------------


def _column_tips(page: str) -> dict:
    """Token position -> {row name: text} from the hover text of each token's column."""
    out = {}
    for title in re.findall(r'<rect class="hov"[^>]*><title>(.*?)</title></rect>', page, re.S):
        head, *lines = html.unescape(title).split("\n")
        pos = int(re.search(r"\(position (\d+)\)", head).group(1))
        out[pos] = dict(line.split(": ", 1) for line in lines)
    return out


def _bars(page: str) -> dict:
    """(x, row) -> total bar height, from the path of each role (rows 26 px high)."""
    top = float(re.search(r'<rect class="hov" x="\d+" y="(\d+)"', page).group(1))
    heights: dict = {}
    for d in re.findall(r'<path class="bar" data-role="\w+" fill="#[0-9A-F]{6}" d="([^"]*)"', page):
        for x, y, h in re.findall(r"M([\d.]+) ([\d.]+)h[\d.]+v([\d.]+)h-[\d.]+z", d):
            key = (float(x), (float(y) - top) // 26)
            heights[key] = heights.get(key, 0.0) + float(h)
    return heights


def test_heatmap_shares_are_each_branchs_part_of_the_token_total(views_ex):
    ex = views_ex
    table = ex.layers[ex.layers["semiring"] == "MaxProduct(neuron)"]
    page = views.branches(table).html()
    tips = _column_tips(page)
    assert sorted(tips) == list(range(len(ex.tokens)))
    for (layer, sub, tok), grp in table.groupby(["layer", "sublayer", "token"]):
        live = grp[grp["path"]]
        total = live["value"].abs().sum()
        line = tips[tok][f"layer {layer} {sub}"]
        if not len(live):
            assert line == "no path"
            continue
        for b, v, won in zip(live["branch"], live["value"], live["winner"]):
            share = abs(v) / total
            if share >= 0.005 or won:
                assert f"{b} {100 * share:.0f}%" + (" ←" if won else "") in line, (line, b)
        assert line.count("←") == int(grp["winner"].sum())
    # the stacked bars of a cell fill it (heights in proportion to the shares)
    heights = _bars(page)
    assert heights and all(math.isclose(h, 26 - 4, abs_tol=0.5) for h in heights.values())


def test_heatmap_shows_heads_where_the_table_has_them(views_ex):
    ex = views_ex
    table = ex.layers[ex.layers["semiring"] == "MaxProduct(neuron)"].copy()
    table["head_index"] = pd.NA
    extra = table[table["branch"] == "query"].copy()
    extra = pd.concat([extra.assign(head_index=0, value=extra["value"] * 0.5),
                       extra.assign(head_index=1, value=extra["value"])])  # fmt: skip
    both = pd.concat([table, extra], ignore_index=True)
    page = views.branches(both).html()
    assert "query head 0: " in page and "query head 1: " in page
    plain = views.branches(table.drop(columns="head_index")).html()
    strip = lambda s: re.sub(r"; query head \d: [^;\n<]*", "", s)  # noqa: E731
    assert strip(page) == plain  # the shares are the branch rows', heads only on hover


@pytest.mark.parametrize("semiring", ["MaxProduct(neuron)", "Real", "TopK(3)"])
def test_per_head_table_gives_the_branch_shares(views_ex, semiring):
    """A per-head table (query/key/value rows per head, no whole-branch row) shows the
    shares of the branch table: the ⊕ of a branch's heads is the branch (for TopK, the
    value of largest |value|), and its heads are named on hover."""
    ex = views_ex
    res = ex.result
    if "per_head" not in inspect.signature(res.layer_table).parameters:
        pytest.skip("this version has no per-head tables")
    heads = res.layer_table(per_head=True, tokens=[ex.tokens], by="role")
    assert "head_index" in heads.columns
    rows, _, _ = views.shares(heads, semiring)
    plain = ex.layers[ex.layers["semiring"] == semiring].copy()
    total = plain.assign(w=plain["value"].abs().where(plain["path"], 0.0))
    total["t"] = total.groupby(["layer", "sublayer", "token"])["w"].transform("sum")
    merged = rows.merge(total, on=["layer", "sublayer", "token", "branch"])
    assert len(merged) == len(plain)
    live = merged[merged["path_y"]]  # (no path: the semiring's zero, -inf for MaxProduct)
    assert (merged["path_x"] == merged["path_y"]).all()
    assert ((live["value_x"] - live["value_y"]).abs() <= 1e-9 * live["t"] + 1e-300).all()
    want = (merged["w"] / merged["t"]).where(merged["t"] > 0)
    assert ((merged["share"] - want).abs().fillna(0) <= 1e-9).all()
    page = views.branches(heads, semiring=semiring).html()
    assert "query head 0: " in page and "value head 1: " in page


def test_real_heatmap_says_values_can_cancel(views_ex):
    ex = views_ex
    table = ex.layers[ex.layers["semiring"] == "Real"]
    assert "can cancel" in views.branches(table).html()
    with pytest.raises(InputError, match="entropy does not split"):
        views.branches(ex.layers, semiring="Entropy")


# -- terminals ------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_terminal_colour_only_on_a_terminal_without_no_color(views_ex, monkeypatch):
    ex = views_ex
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    v = ex.view("top_path")
    plain, tty = io.StringIO(), _Tty()
    v.show(plain)
    v.show(tty)
    assert "\x1b[" not in plain.getvalue() and "\x1b[48;2;" in tty.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    tty = _Tty()
    v.show(tty)
    assert "\x1b[" not in tty.getvalue()
    text = plain.getvalue()
    ro = ex.result.aggregate(ex.source, sbp.MaxProduct())
    values = torch.where(ro.hi.abs() >= ro.lo.abs(), ro.hi, ro.lo)[0].tolist()  # signed
    for t, val in zip(ex.tokens, values):
        assert f"{t} {val:.4g}" in text  # each token with its value


# -- files and the CLI ----------------------------------------------------------------


def test_to_html_writes_one_self_contained_file(views_ex, tmp_path):
    ex = views_ex
    for obj in (ex, ex.path, ex.result):
        file = tmp_path / f"{type(obj).__name__}.html"
        assert obj.to_html(file) == str(file)
        page = file.read_text()
        assert_self_contained(page)
        assert obj.view().body in page
    for obj in (ex, ex.path, ex.result):
        frag = obj._repr_html_()
        assert frag.startswith("<style>") and '<div class="sbp">' in frag
    with pytest.raises(InputError, match="is a directory"):
        ex.to_html(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="cannot write .*file/report.html"):
        ex.to_html(tmp_path / "file" / "report.html")  # a file where a folder should be


def test_cli_html(views_run):
    run = views_run
    assert run.rc == 0, run.err
    text = run.page.read_text()
    assert_self_contained(text)
    assert f"wrote {run.page}" in run.out
    assert [s[2] for s in spans_of(strip_section(text, "top path"))] == run.ex.tokens
    assert text == run.ex.view().html()
    # a directory for --html is refused before any work, with one error line
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(run.argv[:-1] + [str(run.dir)])
    assert rc == 2 and err.getvalue().startswith("error: ") and err.getvalue().count("\n") == 1
    assert out.getvalue() == ""


def test_branch_tables_show_their_heatmap_and_stay_dataframes(batch):
    import pandas as pd

    _, _, res = batch
    table = res.layer_table(tokens=BATCH_TOKENS)
    assert isinstance(table, pd.DataFrame)
    page = table._repr_html_()
    assert page.index("<svg") < page.index('class="dataframe"')
    for toks in BATCH_TOKENS:
        assert all(f">{t}</text>" in page for t in toks)
    assert table.view().html() == views.branches(table).html()
    # what pandas derives from it is a plain DataFrame (its rows may not make a heatmap)
    part = table[table["semiring"] == "Real"]
    assert type(part) is pd.DataFrame and "<svg" not in part._repr_html_()
    # a table with no semiring whose branches compete shows why, then its rows
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    two = sbp.backprop(layer, args=(torch.randn(1, 4, 8),), output=lambda y: y[0, 1, 0],
                       semirings=[sbp.Entropy(), sbp.MaxProduct()])  # fmt: skip
    only = two.layer_table(semirings=[sbp.Entropy()])
    assert "no heatmap: branch shares need" in only._repr_html_()
    # one fan-out point's table (no layers): one heatmap row, then its rows
    one = two.branches(0, sbp.MaxProduct())
    assert type(one).__name__ == "BranchTable" and "<svg" in one._repr_html_()
    assert "<table" in one._repr_html_() and ">branches</text>" in one.view().html()


def test_a_path_prints_with_the_branches_of_the_result_it_was_read_from(batch):
    import copy
    import pickle

    ids, margin, res = batch
    path = res.top_path(("bert.embeddings.word_embeddings", (1, 2)))
    assert str(path) == str(views.path(path, res=res))  # branches as Result.branches finds
    assert path.origin() is res
    plain = pickle.loads(pickle.dumps(path))  # the result stays behind
    assert plain == path and plain.origin() is None
    named = str(plain)  # branches from module names only: no heads
    assert named == str(views.path(plain)) and "(head " in str(path) and "(head " not in named
    assert copy.deepcopy(path).origin() is None
    several = [path, res.top_path(("bert.embeddings.word_embeddings", (0, 1)))]
    assert str(views.paths(several)) == str(views.paths(several, res=res))
