"""Figures from hand-built tidy tables: the values are inputs, so the checks read them back."""

import builtins
import itertools

import pytest

matplotlib = pytest.importorskip("matplotlib")
pd = pytest.importorskip("pandas")
matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

from semiring_backprop import plots  # noqa: E402
from semiring_backprop.analysis.paths import Path, Step  # noqa: E402
from semiring_backprop.errors import InputError  # noqa: E402

TEXTS = ["[CLS]", "the", "dog", "runs", "[SEP]"]
BRANCHES = ["skip", "query", "key", "value"]
# winner branch per (layer, token): layer 0 -> skip 3/5, query 2/5; layer 1 -> key 1/5,
# value 4/5; layer 2 -> skip 5/5
WINNERS = {
    0: ["skip", "skip", "query", "skip", "query"],
    1: ["value", "key", "value", "value", "value"],
    2: ["skip"] * 5,
}


def _table(semirings=("MaxProduct(neuron)",)):
    rows = []
    for sr, (layer, winners) in itertools.product(semirings, WINNERS.items()):
        for token, (text, win) in enumerate(zip(TEXTS, winners)):
            for b, branch in enumerate(BRANCHES):
                value = (-1) ** (token + b) * (layer + 1) * (b + 1) / 10
                rows.append(
                    dict(
                        layer=layer,
                        sublayer="attention",
                        token=token,
                        token_text=text,
                        branch=branch,
                        consumer=f"op_{b}",
                        value=value,
                        semiring=sr,
                        winner=branch == win,
                    )
                )
        # an mlp sublayer that must be filtered out
        rows.append(
            dict(
                layer=layer,
                sublayer="mlp",
                token=0,
                token_text=TEXTS[0],
                branch="mlp",
                consumer="fc",
                value=9.0,
                semiring=sr,
                winner=True,
            )
        )
    return pd.DataFrame(rows)


def _heights(ax) -> dict[str, list[float]]:
    return {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}


def test_branch_bars_heights_are_winner_fractions():
    fig = plots.branch_bars(_table())
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    got = _heights(fig.axes[0])
    want = {
        role: [WINNERS[layer].count(role) / len(TEXTS) for layer in sorted(WINNERS)]
        for role in ("skip", "query", "key", "value")
    }
    assert list(got) == ["skip", "query", "key", "value"]  # fixed role order
    for role in want:
        assert got[role] == pytest.approx(want[role])
    assert fig.axes[0].containers[0].patches[0].get_facecolor()[:3] == pytest.approx(
        matplotlib.colors.to_rgb(plots.COLORS["skip"])
    )


def test_branch_bars_sums_values_without_normalize():
    table = _table()
    fig = plots.branch_bars(table, normalize=False, sublayer="mlp")
    assert _heights(fig.axes[0]) == {"mlp": [9.0, 9.0, 9.0]}
    fig = plots.branch_bars(table, normalize=False)
    want = table[table.sublayer == "attention"].groupby(["branch", "layer"])["value"].sum()
    for role, hs in _heights(fig.axes[0]).items():
        assert hs == pytest.approx(want[role].tolist())


def test_branch_bars_needs_a_semiring_when_ambiguous():
    table = _table(("MaxProduct(neuron)", "MaxAbs"))
    with pytest.raises(InputError, match=r"MaxAbs.*MaxProduct\(neuron\)"):
        plots.branch_bars(table)
    fig = plots.branch_bars(table, semiring="MaxAbs")
    assert _heights(fig.axes[0])["skip"] == pytest.approx([0.6, 0.0, 1.0])
    with pytest.raises(InputError, match="not in the table"):
        plots.branch_bars(table, semiring="Entropy")
    with pytest.raises(InputError, match="sublayer"):
        plots.branch_bars(table, semiring="MaxAbs", sublayer="cross")


def test_branch_bars_draws_into_given_axes():
    fig = Figure()
    ax1, ax2 = fig.subplots(1, 2)
    assert plots.branch_bars(_table(), ax=ax2, title="mine") is fig
    assert ax2.get_title() == "mine" and not ax1.containers


def test_token_heatmap_shape_labels_and_colors():
    table = _table()
    fig = plots.token_heatmap(table)
    ax = fig.axes[0]
    assert len(fig.axes) == 2  # heatmap and colorbar
    data = ax.images[0].get_array()
    assert data.shape == (len(WINNERS), len(TEXTS))
    assert [t.get_text() for t in ax.get_xticklabels()] == TEXTS
    att = table[table.sublayer == "attention"]
    assert data[1, 2] == pytest.approx(att[(att.layer == 1) & (att.token == 2)].value.max())
    # a MaxProduct value is signed: diverging colours centred at 0, though every max
    # is positive here
    assert ax.images[0].get_cmap().name == "RdBu_r"
    lo, hi = ax.images[0].get_clim()
    assert -lo == hi == pytest.approx(float(data.max()))
    unsigned = table.assign(semiring="MaxAbs", value=table["value"].abs())
    assert plots.token_heatmap(unsigned).axes[0].images[0].get_cmap().name == "viridis"


def test_token_heatmap_one_branch():
    table = _table()
    fig = plots.token_heatmap(table, branch="key")
    data = fig.axes[0].images[0].get_array()
    key = table[(table.branch == "key") & (table.sublayer == "attention")]
    assert data[2, 3] == pytest.approx(key[(key.layer == 2) & (key.token == 3)].value.item())
    image = fig.axes[0].images[0]
    assert image.get_cmap().name == "RdBu_r"  # mixed signs: diverging, centered at 0
    lo, hi = image.get_clim()
    assert -lo == hi == pytest.approx(0.9)  # key weight 3 × layer 3 / 10
    with pytest.raises(InputError, match="branch='mlp'"):
        plots.token_heatmap(table, branch="mlp")
    table["value"] = table["value"].abs()
    table["semiring"] = "MaxAbs"  # |path product|: unsigned, a sequential map
    fig = plots.token_heatmap(table, title="abs")
    assert fig.axes[0].images[0].get_cmap().name == "viridis"
    assert fig.axes[0].get_title() == "abs"


def test_token_bars():
    frame = pd.DataFrame(
        {"token": [2, 0, 1], "token_text": ["c", "a", "b"], "entropy": [3.0, 1.0, 2.0]}
    )
    fig = plots.token_bars(frame)
    ax = fig.axes[0]
    assert len(fig.axes) == 1
    assert [p.get_height() for p in ax.patches] == [1.0, 2.0, 3.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]


def _path(modules, neuron=True):
    steps, running = [], 1.0
    for i, module in enumerate(modules):
        w = None if i == 0 else 0.9 - 0.01 * (i % 7)
        running = running * w if w is not None else running
        steps.append(
            Step(
                node=f"n{i}",
                module=module,
                op="input" if i == 0 else "aten.mm.default",
                index=(0, i % 4) if neuron else None,
                edge_weight=w if neuron else None,
                running=running if neuron else None,
            )
        )
    return Path(tuple(steps), running if neuron else 0.5, "MaxProduct(neuron)")


BERT = (
    [None]
    + [
        f"bert.encoder.layer.0.{m}"
        for m in (
            "attention.self.query",
            "attention.self.query",
            "attention.self",
            "attention.output.dense",
            "attention.output",
            "attention.output.LayerNorm",
            "intermediate.dense",
            "output.dense",
            "output",
        )
    ]
    + [None]
)


def _texts(fig):
    return [t.get_text() for t in fig.axes[0].texts if not isinstance(t, Annotation)]


def test_path_diagram_neuron_granularity():
    path = _path(BERT)
    fig = plots.path_diagram(path)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    texts = _texts(fig)
    assert len(texts) == len(path.modules) == 10
    assert texts[0] == "input n0\nproduct 1"
    assert texts[1].startswith("layer 0 attention.self.query  (2 ops)\nproduct ")
    assert texts[-1].startswith("model output\nproduct ")
    assert f"{path.steps[-2].running:.3g}" in texts[-2]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["skip", "query", "mlp", "other", "norm"]


def test_path_diagram_tensor_granularity_has_no_numbers():
    fig = plots.path_diagram(_path(BERT, neuron=False), title="t")
    assert not any("product" in t for t in _texts(fig))
    assert fig.axes[0].get_title() == "t"


def test_path_diagram_long_path(tmp_path):
    layers = [
        f"model.layers.{i // 6}.{m}"
        for i, m in enumerate(
            itertools.islice(
                itertools.cycle(
                    [
                        "self_attn.q_proj",
                        "self_attn",
                        "self_attn.o_proj",
                        "mlp.up_proj",
                        "mlp.act_fn",
                        "mlp.down_proj",
                    ]
                ),
                50,
            )
        )
    ]
    modules = [None] + [m for m in layers for _ in range(6)][:298] + [None]
    path = _path(modules)
    assert len(path) == 300 and len(path.modules) == 52
    fig = plots.path_diagram(path)
    assert len(_texts(fig)) == 52
    assert fig.get_figheight() < 20
    assert plots.save(fig, tmp_path / "long.png").stat().st_size > 0


def test_role_of():
    assert [plots.role_of(m) for m in BERT[1:-1]] == [
        "query",
        "query",
        "other",
        "other",
        "skip",
        "norm",
        "mlp",
        "mlp",
        "skip",
    ]
    assert plots.role_of("transformer.h.3") == "skip"
    assert plots.role_of("model.layers.2.self_attn.v_proj") == "value"
    assert plots.role_of("transformer.h.3.ln_1") == "norm"
    assert plots.role_of(None) == "other"


def test_save_writes_png(tmp_path):
    out = tmp_path / "a" / "b" / "bars.png"
    assert plots.save(plots.branch_bars(_table()), out) == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(InputError, match=r'pip install "semiring-backprop\[plots\]"'):
        plots.token_bars(pd.DataFrame({"token": [0], "token_text": ["a"], "entropy": [1.0]}))


def test_frames_without_the_columns_a_figure_reads_are_refused_by_name():
    import pandas as pd

    from semiring_backprop import plots

    with pytest.raises(InputError, match=r"no column \['token'.*it has \['entropy'\]"):
        plots.token_bars(pd.DataFrame({"entropy": [1.0]}))
    with pytest.raises(InputError, match=r"no column \['layer'.*Result\.layer_table"):
        plots.branch_bars(pd.DataFrame({"value": [1.0]}))
