"""Battery cases: what the views show (issue 29). The similarity of two texts of unequal
length on a tiny sentence-transformers directory (the second text padded by two): every
view, table, share and figure must leave the padding out, show the sign of each token's
heaviest path, caption each example with its own text, name where a path starts, and say
that a skip win is close to built in. Per-head tables view, keep ``DataFrame.head()``
and come from the command line.

Oracles: the tokenizer's own attention mask, the result's ``hi`` and ``lo``, the texts
given, the configuration's head count, and where matplotlib draws a caption.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from unittest import mock

import semiring_backprop as sbp
from battery import Cli, case, graceful
from views_models import SIM_PAIR, SIM_TEXT, save_sentence_model

SOURCE = "embeddings.word_embeddings"


def _sim_dir(env):
    return env.memo("sim_dir", lambda: save_sentence_model(env.root / "models" / "tiny-minilm"))


def _sim(env):
    """The explained pair (max, entropy, real), its figures (kept open) and the
    tokenizer's own mask and tokens."""

    def make():
        import transformers

        from semiring_backprop import plots
        from semiring_backprop.hf.explain import explain

        d = _sim_dir(env)
        ex = explain(d, SIM_TEXT, text_pair=SIM_PAIR, task="similarity",
                     semirings=("max", "entropy", "real"))  # fmt: skip
        figures = {}
        with mock.patch.object(plots, "save", lambda f, p: figures.setdefault(p.stem, f)):
            ex.write(env.tmp("views-sim"))
        tok = transformers.AutoTokenizer.from_pretrained(d)
        enc = tok([SIM_TEXT, SIM_PAIR], padding=True, return_tensors="pt")
        return {
            "ex": ex, "figures": figures, "tok": tok, "mask": enc["attention_mask"].bool(),
            "tokens": [tok.convert_ids_to_tokens(r) for r in enc["input_ids"]],
            "page": html.unescape(ex.view().html()),
        }  # fmt: skip

    return env.memo("sim", make)


def _real(sim, e):
    return [t for t, m in zip(sim["tokens"][e], sim["mask"][e].tolist()) if m]


def _strip(page, heading):
    start = page.index(f"<h3>{heading}</h3>")
    end = page.find("<h3>", start + 1)
    return page[start : end if end > 0 else None]


def _hover_values(section, quantity):
    return [float(v) for v in re.findall(rf"{quantity} = (-?[\d.e+-]+)", section)]


# -- the sign of the top path -------------------------------------------------------------


def _signed_top_path(sim, env):
    ro = sim["ex"].result.aggregate(SOURCE, sbp.MaxProduct())
    want, negative = [], 0
    for e in range(2):
        for t in range(sim["mask"].shape[1]):
            if sim["mask"][e, t]:
                hi, lo = float(ro.hi[e, t]), float(ro.lo[e, t])
                want.append(hi if abs(hi) >= abs(lo) else lo)
                negative += abs(lo) > abs(hi)
    section = _strip(sim["page"], "top path")
    got = _hover_values(section, "top_path")
    if not negative:
        return "the pair has no token whose heaviest path is negative: no test of the sign"
    if len(got) != len(want) or any(abs(a - b) > 1e-3 * abs(b) for a, b in zip(got, want)):
        return f"strip {got} != the heavier of hi and lo, signed {want}"
    if not re.search(r"blue[^<]*lowers[^<]*red", section):
        return "the strip does not say what its colours mean"
    return True


@graceful("result.views-top-path-sign", _signed_top_path)
def _(env):
    """the top-path strip shows each token's heaviest path with its sign (hi or lo)"""
    return _sim(env)


# -- padding ------------------------------------------------------------------------------


def _no_padding_in_views(sim, env):
    page = sim["page"]
    if "[PAD]" in page:
        return "the report page shows [PAD]"
    top = re.findall(r"title=\"'([^']*)' \(position", _strip(page, "top path"))
    if top != _real(sim, 0) + _real(sim, 1):
        return f"top-path strip tokens {top} != the texts' tokens"
    res = sim["ex"].result
    if "[PAD]" in res.view(tokens=sim["tokens"]).html():
        return "Result.view shows [PAD]"
    table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=sim["tokens"])
    if "[PAD]" in table.view().html():
        return "the layer table's heatmap shows [PAD]"
    return True


@graceful("result.views-padding-left-out-of-views", _no_padding_in_views)
def _(env):
    """padding (attention mask 0) is in no strip or heatmap of the report or the result"""
    return _sim(env)


def _no_padding_in_tables(sim, env):
    ex = sim["ex"]
    for name, table in (("layers", ex.layers), ("entropy", ex.entropy)):
        pads = [(e, t) for e, t in zip(table["example"], table["token"]) if not sim["mask"][e, t]]
        if pads:
            return f"ex.{name} has rows at padded positions {sorted(set(pads))}"
    if "[PAD]" in ex.report():
        return "the text report shows [PAD]"
    return True


@graceful("result.views-padding-left-out-of-tables", _no_padding_in_tables)
def _(env):
    """explain's tables and text report have no row at a padded position"""
    return _sim(env)


def _shares_of_tokens(sim, env):
    n = int(sim["mask"][1].sum())
    for name in ("branches_attention_1", "branches_mlp_1"):
        heights = [p.get_height() for p in sim["figures"][name].axes[0].patches]
        if not heights or any(abs(h * n - round(h * n)) > 1e-6 for h in heights):
            return f"{name}: bar heights {heights} are not shares of the {n} tokens"
    ticks = [t.get_text() for t in sim["figures"]["token_heatmap_1"].axes[0].get_xticklabels()]
    if ticks != _real(sim, 1):
        return f"token heatmap of the pair labels {ticks}"
    from semiring_backprop import views

    table = sim["ex"].result.layer_table(semirings=[sbp.MaxProduct()])
    rows, _, _ = views.shares(table)
    cells = len(rows.drop_duplicates(["example", "token"]))
    return cells == int(sim["mask"].sum()) or f"shares over {cells} positions, not the tokens"


@graceful("result.views-padding-left-out-of-shares", _shares_of_tokens)
def _(env):
    """figures' shares and the heatmap's denominators count tokens, not padded positions"""
    return _sim(env)


# -- captions and start tokens --------------------------------------------------------------


def _captions(sim, env):
    d = str(_sim_dir(env))
    for name, fig in sim["figures"].items():
        said = fig._suptitle.get_text().replace("\n", " ")
        own, other = (SIM_PAIR, SIM_TEXT) if name.endswith("_1") else (SIM_TEXT, SIM_PAIR)
        if f'"{own}"' not in said or f'"{other}"' in said:
            return f"{name} is captioned {said!r}"
        if d in said or "tiny-minilm" not in said:
            return f"{name}'s caption names the model by {said!r}"
        fig.canvas.draw()
        box = fig._suptitle.get_window_extent()
        if box.x0 < 0 or box.x1 > fig.bbox.width + 0.5:
            return f"{name}'s caption is cut at the figure's edges ({box})"
    return True


@graceful("result.views-captions-own-example", _captions)
def _(env):
    """each figure is captioned with its own example's text, the model's name, uncut"""
    return _sim(env)


def _start_tokens(sim, env):
    for e, path in enumerate(sim["ex"].paths):
        example, position = path.steps[0].index[:2]
        token = sim["tokens"][example][position]
        title = sim["figures"][f"top_path_{e}"].axes[0].get_title()
        if f"from {token!r}" not in title:
            return f"the path diagram of example {e} is titled {title!r}, not from {token!r}"
        if f"from {token!r} (position {position}" not in sim["page"]:
            return f"the report does not name the start token {token!r} of example {e}"
    return True


@graceful("result.views-path-start-token", _start_tokens)
def _(env):
    """path diagrams and path views name the token their path starts from"""
    return _sim(env)


def _skip_said(sim, env):
    from semiring_backprop.views.html import SKIP_NOTE

    flat = lambda s: re.sub(r"\s+", " ", s)  # noqa: E731
    layers = sim["ex"].layers
    won = layers[layers.winner & layers.semiring.str.startswith("MaxProduct")]
    if (won.branch == "skip").mean() <= 0.5:
        return "skip does not win here: the case tests nothing"
    if SKIP_NOTE not in flat(sim["ex"].report()) or SKIP_NOTE not in flat(sim["page"]):
        return "the report does not say that a skip win is close to built in"
    caption = flat(sim["figures"]["branches_attention_1"]._suptitle.get_text())
    return "close to built in" in caption or "the branch figure does not say it"


@graceful("result.views-skip-wins-said", _skip_said)
def _(env):
    """where skip wins are shown, the views say a skip win is close to built in"""
    return _sim(env)


# -- per-head tables and the pair's tokens ----------------------------------------------------


def _per_head_view(table, env):
    if "head_index" not in table.columns or "head" in table.columns:
        return f"columns {list(table.columns)}"
    if len(table.head(2)) != 2:
        return "DataFrame.head() is shadowed"
    page = html.unescape(table.view().html())
    return ("query head 1: " in page and "<svg" in page) or "the heatmap names no head"


@graceful("result.per-head-branches-view", _per_head_view)
def _(env):
    """Result.branches(per_head=True).view(): a heatmap with heads on hover"""
    return env.bert_result().branches("encoder.layer.0:input", sbp.MaxProduct(), per_head=True)


@graceful("result.per-head-layer-table-view", _per_head_view)
def _(env):
    """Result.layer_table(per_head=True).view() and .head()"""
    return env.bert_result().layer_table(semirings=[sbp.MaxProduct()], per_head=True)


def _pair_tokens(sim, env):
    one = lambda t: sim["tok"].convert_ids_to_tokens(sim["tok"](t)["input_ids"])  # noqa: E731
    ex = sim["ex"]
    if ex.tokens != one(SIM_TEXT) or ex.pair_tokens != one(SIM_PAIR):
        return f"tokens {ex.tokens} / pair_tokens {ex.pair_tokens}"
    return ex.examples == sim["tokens"] or "ex.examples is not the batch"


@graceful("result.explain-pair-tokens", _pair_tokens)
def _(env):
    """ex.tokens and ex.pair_tokens hold each text's own tokens"""
    return _sim(env)


def _cli_per_head(ran, env):
    out = env.tmp("cli-per-head") / "out"
    layers = json.loads((out / "explanation.json").read_text())["layers"]
    heads = {r["head_index"] for r in layers if r.get("head_index") is not None}
    config = json.loads((Path(_sim_dir(env)) / "config.json").read_text())
    want = set(range(config["num_attention_heads"]))
    if heads != want:
        return f"head_index values {heads} != the config's heads {want}"
    return ("query.0" in ran.out and "[PAD]" not in ran.out) or ran.out[-800:]


@case("cli.explain-per-head", "graceful", check=_cli_per_head)
def _(env):
    """explain --per-head: the layer table split by head, as the config counts them"""
    out = env.tmp("cli-per-head") / "out"
    argv = ["explain", _sim_dir(env), "--task", "similarity", "--text", SIM_TEXT,
            "--text-pair", SIM_PAIR, "--semiring", "max", "--per-head",
            "--out", str(out)]  # fmt: skip
    return Cli(argv)
