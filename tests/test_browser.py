"""The written report in a real browser: headless Chromium (the Debian package
``chromium``; ``.ci/run`` installs it) opens the file ``explain --html`` writes.

Chromium logs every console message (errors, uncaught exceptions) to stderr with
``--enable-logging=stderr``; the page has no script, so any message is a failure. A
negative control (a page with a console error and an exception) checks that the check
sees them. ``--dump-dom`` gives the DOM after loading: every token and every path step
must be in it. ``--screenshot`` saves a PNG, kept in pytest's temporary folder (and
copied to ``$SEMIRING_BACKPROP_SCREENSHOTS`` when that is set).

Skipped only where Chromium is missing and ``CI`` is not ``true``; in CI it fails.
"""

from __future__ import annotations

import html.parser
import os
import shutil
import struct
import subprocess

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("_offline_quiet")


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is missing in CI: .ci/run installs it (apt-get install chromium)")
    pytest.skip("chromium is not installed (apt-get install chromium)")


def _run(*args, timeout=60) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--hide-scrollbars", "--enable-logging=stderr", "--v=0", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


class _Text(html.parser.HTMLParser):
    """Text of the token labels (``<b>`` in token spans) and of table cells."""

    def __init__(self):
        super().__init__()
        self.tokens, self.cells, self._where = [], [], None
        self.tags = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        cls = dict(attrs).get("class") or ""
        if tag == "span" and "tok" in cls.split():
            self._where = "tok"
        elif tag == "b" and self._where == "tok":
            self._where = "b"
            self.tokens.append("")
        elif tag == "td":
            self._where = "td"
            self.cells.append("")

    def handle_endtag(self, tag):
        if tag in ("b", "td", "span"):
            self._where = None

    def handle_data(self, data):
        if self._where == "b":
            self.tokens[-1] += data
        elif self._where == "td":
            self.cells[-1] += data


def png_size(file) -> tuple[int, int]:
    with open(file, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_the_console_check_sees_errors(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><html><body><p>x</p>"
        "<script>console.error('boom'); notDefined();</script></body></html>"
    )
    run = _run("--dump-dom", bad.as_uri())
    messages = console_messages(run.stderr)
    assert any("boom" in m for m in messages), run.stderr
    assert any("notDefined" in m for m in messages), run.stderr


def test_report_in_chromium(views_ex, tmp_path):
    ex = views_ex
    page = tmp_path / "report.html"
    ex.to_html(page)
    run = _run("--dump-dom", page.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    assert console_messages(run.stderr) == []
    dom = _Text()
    dom.feed(run.stdout)
    assert not dom.tags & {"script", "img", "link", "iframe"}
    strips = len(dom.tokens) // len(ex.tokens)
    assert strips >= 3 and dom.tokens == ex.tokens * strips  # every strip, every token
    cells = set(dom.cells)
    for step in ex.path.steps:  # every step of the path, by its node name
        assert step.node in cells, step.node
    shot = tmp_path / "report.png"
    run = _run("--window-size=1280,1800", f"--screenshot={shot}", page.as_uri())
    assert run.returncode == 0 and console_messages(run.stderr) == []
    assert png_size(shot) == (1280, 1800) and shot.stat().st_size > 20_000
    keep = os.environ.get("SEMIRING_BACKPROP_SCREENSHOTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(shot, os.path.join(keep, "report.png"))
