"""Figures a researcher reads without the code beside them: path boxes name their layer,
bars of nearly equal values get an axis that starts where they differ, and a branch
share chart accounts for tokens with no path instead of stopping short of 1."""

import pathlib

import pytest

matplotlib = pytest.importorskip("matplotlib")
pd = pytest.importorskip("pandas")
pytestmark = pytest.mark.usefixtures("_offline_quiet")
matplotlib.use("Agg")

from matplotlib.text import Annotation  # noqa: E402

from semiring_backprop import plots  # noqa: E402
from semiring_backprop.analysis.paths import Path, Step  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402


def _path(modules):
    steps, running = [], 1.0
    for i, module in enumerate(modules):
        w = None if i == 0 else 0.9
        running = running * w if w is not None else running
        op = "input" if i == 0 else "aten.mm.default"
        steps.append(Step(f"n{i}", module, op, (0, i % 3), w, running))
    return Path(tuple(steps), running, "MaxProduct(neuron)")


def test_path_boxes_name_their_layer():
    modules = [None, "bert.embeddings.LayerNorm"]
    for layer in (0, 1, 11):
        modules += [f"bert.encoder.layer.{layer}.attention.output.LayerNorm",
                    f"bert.encoder.layer.{layer}.output"]  # fmt: skip
    modules.append(None)
    fig = plots.path_diagram(_path(modules))
    texts = [t.get_text() for t in fig.axes[0].texts if not isinstance(t, Annotation)]
    names = [t.split("\n")[0] for t in texts]
    assert names[1] == "embeddings.LayerNorm"
    for layer, (a, b) in zip((0, 1, 11), zip(names[2::2], names[3::2])):
        assert a == f"layer {layer} attention.output.LayerNorm"
        assert b == f"layer {layer} output"


def test_entropy_bars_axis_starts_where_they_differ():
    frame = pd.DataFrame({"token": [0, 1, 2], "token_text": ["a", "b", "c"],
                          "entropy": [281.2, 281.9, 282.5]})  # fmt: skip
    ax = plots.token_bars(frame).axes[0]
    lo, hi = ax.get_ylim()
    assert 280 < lo < 281.2 and 282.5 < hi < 283.5  # every bar's top inside, apart
    assert "axis from" in ax.get_ylabel()
    spread = pd.DataFrame({"token": [0, 1], "token_text": ["a", "b"], "entropy": [0.5, 3.0]})
    assert plots.token_bars(spread).axes[0].get_ylim()[0] == 0


def test_branch_shares_count_tokens_without_a_path():
    rows = []
    for token in range(4):
        for branch in ("skip", "mlp"):
            live = token == 2  # only the explained token has a path in this sublayer
            rows.append(dict(layer=0, sublayer="mlp", token=token, token_text=str(token),
                             branch=branch, value=1.0 if live else float("-inf"),
                             winner=live and branch == "mlp", path=live,
                             semiring="MaxProduct(neuron)"))  # fmt: skip
    ax = plots.branch_bars(pd.DataFrame(rows), sublayer="mlp").axes[0]
    heights = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    assert heights == {"mlp": [pytest.approx(0.25)], "no path": [pytest.approx(0.75)]}
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "no path" in legend


def test_figures_for_papers_name_the_text_target_and_semiring(views_ex, tmp_path):
    ex = views_ex
    files = [f for f in ex.write(tmp_path, "svg") if not f.endswith((".json", ".csv"))]
    names = {f.rsplit("/", 1)[-1] for f in files}
    assert names == {f"{n}.svg" for n in ("branches_attention", "branches_mlp",
                                          "token_heatmap", "entropy", "top_path")}  # fmt: skip
    for f in files:
        text = pathlib.Path(f).read_text()
        assert text.lstrip().startswith("<?xml") and "<svg" in text
        assert ex.text in text and f"log p({ex.target}) − log p({ex.foil})" in text
        semiring = "Entropy" if "entropy" in f else "MaxProduct(neuron)"
        assert semiring in text, f
    pdf = plots.save(plots.path_diagram(ex.path), tmp_path / "top_path.pdf")
    assert pathlib.Path(pdf).read_bytes().startswith(b"%PDF")
    with pytest.raises(InputError, match="choose png, svg or pdf"):
        ex.write(tmp_path / "x", "jpg")
    with pytest.raises(InputError, match="use .png, .svg or .pdf"):
        plots.save(plots.path_diagram(ex.path), tmp_path / "top_path.jpg")


def test_sva_branch_figure_keeps_its_legend_off_the_bars_and_centres_the_ticks():
    from semiring_backprop.experiments import sva_report

    big = {"0.attention": {"skip": 5.0, "query": None, "key": -2.0, "value": 9.0},
           "0.mlp": {"skip": 3.0, "mlp": 10.0}, "1.attention": {"skip": 8.0, "query": 11.0,
           "key": 1.0, "value": 12.0}, "1.mlp": {"skip": 12.0, "mlp": 12.5}}  # fmt: skip
    summary = {"branches": {"subject": big, "all": big}, "data": "/data/blimp/agreement.jsonl",
               "explained": 7, "branches_setting": "MaxProduct(neuron), oplus"}  # fmt: skip
    fig = sva_report.branch_plot(summary)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.axes[0].get_legend().get_window_extent(renderer)
    assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1  # inside the figure
    bars = [(ax, p) for ax in fig.axes for p in ax.patches]
    assert len(bars) == 2 * 11  # 12 branch values, one without a path (an x, no bar)
    for _, p in bars:
        assert not legend.overlaps(p.get_window_extent(renderer))
    for ax in fig.axes:
        centres = [p.get_x() + p.get_width() / 2 for p in ax.patches]
        centres += [x for line in ax.lines if line.get_marker() == "x" for x in line.get_xdata()]
        ticks = list(ax.get_xticks())
        assert ticks == [0, 1, 2, 3]
        for k, tick in enumerate(ticks):
            mine = sorted(c for c in centres if abs(c - k) < 0.5)
            assert len(mine) == len(big[list(big)[k]])
            assert (mine[0] + mine[-1]) / 2 == pytest.approx(tick)
    title = fig._suptitle.get_text()
    assert "agreement.jsonl" in title and "7 sentences" in title
    assert "log p(correct verb) − log p(wrong verb)" in title and "MaxProduct(neuron)" in title
    import matplotlib.pyplot as plt

    plt.close(fig)
