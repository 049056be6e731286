"""Views that must not mislead (issue 29): the similarity of two texts of unequal length
on a tiny sentence-transformers directory laid out as all-MiniLM-L6-v2 is.

Oracles are independent of the views: the attention mask the tokenizer gives the pair
(padding is no token), the result's own ``hi`` and ``lo`` (the sign of a token's heaviest
path), the texts given, and where matplotlib draws a caption (inside the figure or not).
One ``semiring-backprop explain ... --per-head --html --out`` run is shared.
"""

from __future__ import annotations

import contextlib
import html
import io
import math
import re
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import cli, plots, views  # noqa: E402
from semiring_backprop.hf import explain as explain_mod  # noqa: E402
from test_views import spans_of, strip_section  # noqa: E402
from views_models import SIM_PAIR, SIM_TEXT, save_sentence_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("_offline_quiet")
SOURCE = "embeddings.word_embeddings"


@pytest.fixture(scope="module")
def sim(tmp_path_factory, _offline_quiet):
    """The CLI on the pair (the second text two tokens shorter), with the Explanation
    it made, the figures it saved (kept open) and the tokenizer's own mask."""
    d = save_sentence_model(tmp_path_factory.mktemp("st") / "tiny-minilm")
    out = tmp_path_factory.mktemp("sim_out")
    argv = ["explain", d, "--task", "similarity", "--text", SIM_TEXT, "--text-pair", SIM_PAIR,
            "--semiring", "max", "entropy", "real", "--per-head", "--html",
            str(out / "report.html"), "--out", str(out)]  # fmt: skip
    made, figures, real, save = [], {}, explain_mod.explain, plots.save
    so, se = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(explain_mod, "explain", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
        mp.setattr(plots, "save", lambda fig, p: figures.setdefault(p.stem, fig) and save(fig, p))
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            rc = cli.main(argv)
    assert rc == 0, se.getvalue()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    enc = tok([SIM_TEXT, SIM_PAIR], padding=True, return_tensors="pt")
    mask = enc["attention_mask"].bool()
    assert mask[0].all() and int(mask[1].sum()) == mask.shape[1] - 2  # two [PAD]
    return types.SimpleNamespace(
        ex=made[0], out=out, dir=d, text=so.getvalue(), page=(out / "report.html").read_text(),
        figures=figures, mask=mask, tok=tok,
        tokens=[tok.convert_ids_to_tokens(r) for r in enc["input_ids"]],
    )  # fmt: skip


def _real(sim, e):
    return [t for t, m in zip(sim.tokens[e], sim.mask[e].tolist()) if m]


# -- the top-path strip shows the sign of each token's heaviest path -----------------------


def test_top_path_strip_is_the_heavier_extreme_with_its_sign(sim):
    ro = sim.ex.result.aggregate(SOURCE, sbp.MaxProduct())
    section = strip_section(sim.page, "top path")
    spans = spans_of(section)
    want, negative = [], 0
    for e in range(2):
        for t in range(sim.mask.shape[1]):
            if not sim.mask[e, t]:
                continue
            hi, lo = float(ro.hi[e, t]), float(ro.lo[e, t])
            want.append(hi if abs(hi) >= abs(lo) else lo)
            negative += abs(lo) > abs(hi)
    assert negative  # this pair has tokens whose heaviest path is negative
    got = [float(s[0].split("top_path = ")[1].split(" ")[0]) for s in spans]
    assert got == pytest.approx(want, rel=1e-3)
    for s, v in zip(spans, want):  # the colour has the value's sign: red up, blue down
        r, _, b = (int(s[1][i : i + 2], 16) for i in (1, 3, 5))
        assert (r > b) == (v > 0), s
        assert "most positive path" in s[0] and "most negative path" in s[0]
    assert re.search(r"blue[^<]*lowers[^<]*red", section)  # the legend says what colour means


# -- padding is no token ------------------------------------------------------------------


def test_padding_is_left_out_of_tables_and_report(sim):
    ex = sim.ex
    assert ex.mask == sim.mask.long().tolist()
    for table in (ex.layers, ex.entropy):
        keep = [bool(sim.mask[e, t]) for e, t in zip(table["example"], table["token"])]
        assert all(keep) and "[PAD]" not in set(table["token_text"])
        assert len(table.drop_duplicates(["example", "token"])) == int(sim.mask.sum())
    for name in ("layers.csv", "entropy.csv"):
        assert "[PAD]" not in set(pd.read_csv(sim.out / name)["token_text"])
    assert "[PAD]" not in sim.text and "[PAD]" not in ex.report()
    assert not re.search(r"(?<![\d.])-0(?![\d.])", sim.text)  # no -0 of a padded position


def test_padding_is_left_out_of_every_view(sim):
    res = sim.ex.result
    spans = spans_of(sim.page)
    assert spans and "[PAD]" not in {s[2] for s in spans}
    top = spans_of(strip_section(sim.page, "top path"))
    assert [s[2] for s in top] == _real(sim, 0) + _real(sim, 1)
    assert "[PAD]" not in sim.page
    # a result's own views and tables read the mask from the traced call
    assert "[PAD]" not in res.view(tokens=sim.tokens).html()
    table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=sim.tokens)
    assert "[PAD]" in set(table["token_text"])  # the table indexes the tensors ...
    page = table.view().html()
    assert "[PAD]" not in page and "[SEP]" in page  # ... its view leaves padding out
    rows, _, _ = views.shares(table)
    assert len(rows.drop_duplicates(["example", "token"])) == int(sim.mask.sum())


def test_shares_count_only_tokens(sim):
    """The bars of the second text's figures are shares of its 6 tokens, not of 8
    positions (two of which were [PAD])."""
    n = int(sim.mask[1].sum())
    for name in ("branches_attention_1", "branches_mlp_1"):
        ax = sim.figures[name].axes[0]
        heights = [p.get_height() for p in ax.patches]
        assert heights and all(abs(h * n - round(h * n)) < 1e-6 for h in heights), heights
        assert "no path" not in [c.get_label() for c in ax.containers]
    ticks = [t.get_text() for t in sim.figures["token_heatmap_1"].axes[0].get_xticklabels()]
    assert ticks == _real(sim, 1)
    bars = [t.get_text() for t in sim.figures["entropy_1"].axes[0].get_xticklabels()]
    assert bars == _real(sim, 1)


# -- captions and path diagrams -------------------------------------------------------------


def _caption(fig) -> str:
    return fig._suptitle.get_text()


def test_each_caption_names_its_own_example_and_the_models_name(sim):
    assert len(sim.figures) == 10
    for name, fig in sim.figures.items():
        said = _caption(fig).replace("\n", " ")
        own, other = (SIM_PAIR, SIM_TEXT) if name.endswith("_1") else (SIM_TEXT, SIM_PAIR)
        assert f'"{own}"' in said and f'"{other}"' not in said, (name, said)
        assert "tiny-minilm" in said and str(sim.dir) not in said  # the name, not the path


def test_captions_fit_inside_their_figures(sim):
    long = " ".join(f"word{i}" for i in range(120))  # 900 characters: wrapped, not cut
    extra = plots.caption(plots.token_bars(sim.ex.entropy[sim.ex.entropy.example == 0]), long)
    for fig in [*sim.figures.values(), extra]:
        fig.canvas.draw()
        box = fig._suptitle.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width + 0.5, (box, fig.bbox)
    assert _caption(extra).replace("\n", " ") == long


def test_path_diagrams_name_their_start_token(sim):
    for e in range(2):
        path = sim.ex.paths[e]
        example, position = path.steps[0].index[:2]
        assert example == e
        token = sim.tokens[e][position]
        title = sim.figures[f"top_path_{e}"].axes[0].get_title()
        assert f"from {token!r}" in title, title
        assert f"from {token!r} (position {position}" in html.unescape(sim.page)
        assert f"from {token!r} (position {position}" in sim.text


# -- skip wins: said where the branch tables are shown ---------------------------------------


def test_skip_wins_is_said_to_be_built_in(sim):
    from semiring_backprop.views.html import SKIP_NOTE

    won = sim.ex.layers[sim.ex.layers.winner & sim.ex.layers.semiring.str.startswith("MaxP")]
    assert (won.branch == "skip").mean() > 0.5  # what the sentence explains
    flat = lambda s: re.sub(r"\s+", " ", s)  # noqa: E731
    assert SKIP_NOTE in flat(sim.text)
    assert SKIP_NOTE in flat(html.unescape(sim.page))
    for name in ("branches_attention_0", "branches_mlp_1"):
        assert SKIP_NOTE.split(":")[0] in flat(_caption(sim.figures[name]))
    from pathlib import Path

    docs = Path(__file__).parent.parent / "docs" / "views.md"
    assert "close to built in" in docs.read_text()


# -- the pair's tokens, and per-head tables from the command line ----------------------------


def test_pair_tokens_are_each_texts_own(sim):
    one = lambda t: sim.tok.convert_ids_to_tokens(sim.tok(t)["input_ids"])  # noqa: E731
    assert sim.ex.tokens == one(SIM_TEXT)
    assert sim.ex.pair_tokens == one(SIM_PAIR)
    assert sim.ex.examples == sim.tokens  # the batch as the tensors hold it
    data = __import__("json").loads((sim.out / "explanation.json").read_text())
    assert data["pair_tokens"] == one(SIM_PAIR) and data["mask"] == sim.ex.mask


def test_cli_per_head_table(sim):
    layers = sim.ex.layers
    assert "head_index" in layers.columns and "head" not in layers.columns
    assert isinstance(layers.head(3), pd.DataFrame) and len(layers.head(3)) == 3
    qkv = layers[layers.branch.isin(["query", "key", "value"])]
    heads = sorted(int(h) for h in qkv.head_index.unique())
    assert heads == list(
        range(transformers.AutoConfig.from_pretrained(sim.dir).num_attention_heads)
    )
    assert "query.0" in sim.text and "value.1" in sim.text
    assert "head 1:" in sim.page  # the heatmap names heads on hover
    # ⊕ over a branch's heads is the branch (MaxProduct: the max of hi)
    plain = sim.ex.result.layer_table(semirings=[sbp.MaxProduct()], by="role")
    got = qkv[qkv.semiring.str.startswith("MaxP")].groupby(
        ["layer", "sublayer", "example", "token", "branch"])["value"].max()  # fmt: skip
    want = plain.set_index(["layer", "sublayer", "example", "token", "branch"])["value"]
    want = want.reindex(got.index)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, want))
    assert torch.isfinite(torch.tensor(got.to_numpy())).all()
