"""A notebook that uses the views (tests/notebooks/views.ipynb), executed by nbclient in a
fresh Python kernel: its outputs hold the views' HTML, with the tokens and the path, and a
figure of ``plots`` as a PNG (no ``%matplotlib inline`` needed)."""

from __future__ import annotations

import base64
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = pathlib.Path(__file__).parent / "notebooks" / "views.ipynb"
TOKENS = ["[CLS]", "the", "keys", "to", "the", "cabinet", "[MASK]", "[SEP]"]


def _html(cell) -> str:
    parts = [o.get("data", {}).get("text/html", "") for o in cell.outputs]
    return "".join(p if isinstance(p, str) else "".join(p) for p in parts)


def test_notebook_outputs_hold_the_views(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
    strips, path, heatmap, top3, printed, figure, table = code[1:8]
    for cell in (strips, path, heatmap, top3):
        page = _html(cell)
        assert page.startswith("<style>") and '<div class="sbp">' in page, cell.source
    page = _html(strips)
    for quantity in ("top path", "gradient", "entropy", "normalized entropy"):
        assert f"<h3>{quantity}</h3>" in page
    assert page.count("<b>[MASK]</b>") == 4  # one strip per quantity, every token
    for t in TOKENS:
        assert f"<b>{t}</b>" in page
    assert "top gradient path" in _html(path) and "running product" in _html(path)
    assert all(f">{t}</text>" in _html(heatmap) for t in TOKENS)
    assert _html(top3).count("<li>") == 3
    # a layer table ending a cell: the heatmap of shares above the DataFrame's rows
    page = _html(table)
    assert all(f">{t}</text>" in page for t in TOKENS) and "<svg" in page
    assert page.index("<svg") < page.index('class="dataframe"')
    text = "".join(o.get("text", "") for o in printed.outputs)
    assert text.startswith("MaxProduct(neuron) top path, product") and "\n" in text
    # a figure shows as a PNG without %matplotlib inline
    (png,) = [o["data"]["image/png"] for o in figure.outputs if "image/png" in o.get("data", {})]
    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert " skip " in text or " query " in text or " value " in text or " key " in text
