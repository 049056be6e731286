"""Files the library writes are written whole, under a new private name, then renamed:
a symbolic link planted at the target (or beside it) is replaced, never written through."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import semiring_backprop as sbp


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def test_a_figure_is_not_written_through_a_link(tmp_path):
    pytest.importorskip("matplotlib").use("Agg")
    import matplotlib.pyplot as plt

    from semiring_backprop import plots

    victim = _victim(tmp_path)
    target = tmp_path / "figure.png"
    target.symlink_to(victim)
    fig = plt.figure()
    plots.save(fig, target)
    plt.close(fig)
    assert victim.read_text() == "precious\n"
    assert not target.is_symlink() and target.read_bytes()[:4] == b"\x89PNG"


def test_a_path_saved_as_json_is_not_written_through_a_link(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double().eval()
    res = sbp.backprop(model, (torch.randn(1, 3, dtype=torch.float64),),
                       output=lambda y: y[0, 0], semirings=[sbp.MaxProduct()])  # fmt: skip
    victim = _victim(tmp_path)
    target = tmp_path / "path.json"
    target.symlink_to(victim)
    text = res.top_path(0).to_json(target)
    assert victim.read_text() == "precious\n"
    assert target.read_text() == text and not target.is_symlink()
