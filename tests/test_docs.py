"""The documentation: the site builds strictly, and every code block of the README and
of every page runs and prints what the page shows beside it (tests/docs_runner.py says
how blocks are read and compared).

All pages share one scratch directory; docs/quickstart.md runs first (a session fixture)
and makes the tiny checkpoints the other pages use. One test per page:
``pytest tests/test_docs.py -k results``. Only the README's set-up commands
(``pip install ...``) are skipped, and ``.ci/run`` runs them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from docs_runner import DocError, compare, parse, run_page

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, in order (paths under docs/)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def walk(items):
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from walk(value) if isinstance(value, list) else [value]

    return list(walk(config["nav"]))


PAGES = ["README.md"] + [f"docs/{p}" for p in nav_pages()]


def _id(page: str) -> str:
    return Path(page).stem


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory):
    """The scratch directory after docs/quickstart.md ran in it, and that run."""
    workdir = tmp_path_factory.mktemp("docs")
    return workdir, run_page(DOCS / "quickstart.md", workdir, "docs/quickstart.md")


# -- the site ---------------------------------------------------------------------------


def test_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, anchor or API reference fails."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason='the site builds with the docs extra: pip install '
                            '"semiring-backprop[docs]"')  # fmt: skip
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    seconds = time.perf_counter() - start
    print(f"mkdocs build --strict: {seconds:.1f} s")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-5000:]}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    missing = sorted(pages - set(nav_pages()))
    assert not missing, f"pages not in mkdocs.yml's nav (add them there): {missing}"


def test_the_readmes_local_links_exist():
    """The README is not part of the site (mkdocs checks the pages' links, not its)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if "://" not in t and not t.startswith("#")]
    missing = [t for t in local if t and not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


# -- skips: only the README's set-up commands, and .ci/run runs those --------------------


def _setup_block(block) -> bool:
    commands = [line for line in block.code.splitlines() if line.strip()]
    return block.lang == "bash" and all(c.split()[:2] == ["pip", "install"] for c in commands)


def _all_blocks():
    for page in PAGES:
        yield from parse((ROOT / page).read_text(encoding="utf-8"), page)


def test_only_the_readmes_setup_commands_are_skipped():
    skipped = {(b.page, b.line) for b in _all_blocks() if b.skip is not None}
    readme = parse((ROOT / "README.md").read_text(encoding="utf-8"), "README.md")
    setup = {(b.page, b.line) for b in readme if _setup_block(b)}
    assert setup, "the README shows no set-up block (a bash block of `pip install ...` lines)"
    assert skipped == setup, (
        f"skipped blocks {sorted(skipped)} must be exactly the README's set-up blocks "
        f"{sorted(setup)} (pip install ... lines, marked <!-- skip: reason -->)"
    )


def _words(command: str) -> list[str]:
    words = [w for w in shlex.split(command) if w != "--quiet"]
    if words[:3] == ["python3", "-m", "pip"] or words[:3] == ["python", "-m", "pip"]:
        words = ["pip"] + words[3:]
    return ["python" if w == "python3" else w for w in words]


def test_ci_runs_the_readmes_setup_commands():
    """Each command of the README's set-up lines (split at ``&&``) is a command of
    .ci/run, give or take ``--quiet`` and ``python3 -m`` before ``pip``."""
    ci = [_words(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]  # fmt: skip
    readme = parse((ROOT / "README.md").read_text(encoding="utf-8"), "README.md")
    for block in filter(_setup_block, readme):
        for n, line in enumerate(block.code.splitlines(), block.line + 1):
            for command in filter(str.strip, line.split("&&")):
                words = _words(command)
                assert any(c[: len(words)] == words for c in ci), (
                    f"README line {n}: `{command.strip()}` is not run by .ci/run"
                )


# -- the pages --------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page(page, quickstart):
    """Every block of the page runs; what it prints matches the text block beside it."""
    workdir, first = quickstart
    if page == "docs/quickstart.md":
        run = first
    else:
        if first.failure is not None:
            pytest.fail("the quick start (which makes the checkpoints) failed: see "
                        "test_page[quickstart]", pytrace=False)  # fmt: skip
        run = run_page(ROOT / page, workdir, page)
    total = sum(run.seconds.values())
    slowest = sorted(run.seconds.items(), key=lambda kv: -kv[1])[:3]
    print(f"{page}: {len(run.seconds)} blocks in {total:.1f} s; slowest (line, s): "
          + ", ".join(f"({line}, {s:.1f})" for line, s in slowest))  # fmt: skip
    if run.failure is not None:
        pytest.fail(run.failure, pytrace=False)
    if page != "README.md":
        assert not run.skipped, f"{page}: only the README's set-up commands may be skipped"
    if run.missing:  # the other blocks ran and printed what the page shows
        left_out = [f"line {b.line} imports {', '.join(names)}" for b, names in run.missing]
        pytest.skip(f"{page}: blocks left out, their packages not installed: {'; '.join(left_out)}")


# -- the checker itself -----------------------------------------------------------------


@pytest.mark.parametrize(
    "expected, printed",
    [
        ("p = 0.5", "p = 0.5004"),  # relative 8e-4 < 1e-3
        ("tiny 1e-9", "tiny 1.5e-9"),  # absolute 5e-10 < 1e-6
        ("key 0.000373", "key 0.000372"),  # one unit in the last place: rounding
        ("q 2.51e-02", "q 2.52e-02"),  # the same, written with an exponent
        ("a   b\n\n c", "a b\nc  "),  # whitespace and blank lines
        ("first\n...\nlast", "first\nx\ny\nlast"),
        ("first\n...\nlast", "first\nlast"),  # ... may stand for no line
        ("...\n0.25", "anything\n0.25"),
        ("layer.0 h1 torch.Size([1, 6])", "layer.0 h1 torch.Size([1, 6])"),
    ],
)
def test_compare_accepts(expected, printed):
    assert compare(expected, printed) is None


@pytest.mark.parametrize(
    "expected, printed, why",
    [
        ("p = 0.5", "p = 0.5006", "relative difference"),  # 1.2e-3 > 1e-3
        ("n = 1000", "n = 1001", "integer 1000 vs 1001"),  # integers exactly
        ("tiny 1e-5", "tiny 3e-5", "number"),
        ("key 0.000373", "key 0.000371", "number"),  # two units in the last place
        ("q 2.51e-02", "q 2.53e-02", "number"),
        ("query wins", "key wins", "text"),
        ("a\nb", "a\nb\nc", "expected 2 lines, printed 3"),
        ("layer.0", "layer.1", "text"),  # digits in names are text
        ("first\n...\nlast", "first\nx\nlast but one", ""),
        ("0.25 0.5", "0.25", "different text or count of numbers"),
    ],
)
def test_compare_refuses(expected, printed, why):
    message = compare(expected, printed)
    assert message is not None and why in message
    assert "--- expected (the page)" in message and "+++ printed" in message


def test_parse_reads_the_conventions():
    page = (
        "x\n<!-- skip: installs -->\n```bash\npip install x\n```\n\n"
        "```python\nprint(1)\n```\n\n```text\n1\n```\n"
        "```json\n{}\n```\n"  # a display
        "- item\n\n    ```python\n    y = 2\n    ```\nprose\n\n```text\nshown\n```\n"
        "````text\n```python\nnot run\n```\n````\n"
    )
    blocks = parse(page, "p.md")
    assert [(b.line, b.lang, b.skip) for b in blocks] == [
        (3, "bash", "installs"), (7, "python", None), (19, "python", None)]  # fmt: skip
    assert blocks[1].expected == "1\n" and blocks[1].expected_line == 11
    assert blocks[2].code == "y = 2\n" and blocks[2].expected is None  # prose between


@pytest.mark.parametrize(
    "page, message",
    [
        ("```sh\nls\n```\n", "line 1: a ```sh block is neither run nor a display"),
        ("```\nls\n```\n", "(no language)"),
        ("<!-- skip -->\n```bash\nls\n```\n", "write a skip as <!-- skip: why -->"),
        ("```python\nx = 1\n", "never closed"),
    ],
)
def test_parse_refuses(page, message):
    with pytest.raises(DocError, match=re.escape(message)):
        parse(page, "p.md")


def _page(tmp_path, text):
    (tmp_path / "p.md").write_text(text)
    return run_page(tmp_path / "p.md", tmp_path, "p.md")


def test_run_page_checks_output_and_names_the_block(tmp_path):
    torch.set_num_threads(2)
    good = _page(
        tmp_path,
        "```python\nimport torch\nx = 0.1\n```\n\n```python\n"
        "print(x * 3, torch.get_num_threads())\n```\n\n```text\n0.3 1\n```\n"
        "```bash\necho $OMP_NUM_THREADS; ls p.md\n```\n```text\n1\np.md\n```\n",
    )
    assert good.failure is None, good.failure
    assert torch.get_num_threads() == 2  # restored

    bad = _page(tmp_path, "intro\n\n```python\nprint(0.25)\n```\n```text\n0.3\n```\n")
    assert bad.failure.startswith("p.md, block at line 3 (python):\n    print(0.25)\n")
    assert "```text block at line 6" in bad.failure and "-0.3\n+0.25" in bad.failure


@pytest.mark.parametrize(
    "code, message",
    [
        ("false\necho after", "exit status 1"),  # -e
        ("false | true", "exit status 1"),  # pipefail
        ("echo $UNSET_VARIABLE_X", "exit status 1"),  # -u
    ],
)
def test_run_page_bash_is_strict(tmp_path, code, message):
    run = _page(tmp_path, f"```bash\n{code}\n```\n")
    assert run.failure is not None and message in run.failure


def test_run_page_leaves_out_a_block_that_needs_a_missing_optional_package(tmp_path, monkeypatch):
    """Its other blocks run and are checked; the block is named with the package."""
    import docs_runner

    monkeypatch.setattr(docs_runner, "OPTIONAL", (*docs_runner.OPTIONAL, "no_such_extra_x"))
    text = ("```python\nprint(1)\n```\n```text\n1\n```\n"
            "```python\nimport torch\nfrom no_such_extra_x.sub import y\n```\n"
            "```python\nprint(2)\n```\n```text\n{}\n```\n")  # fmt: skip
    run = _page(tmp_path, text.format(2))
    assert run.failure is None and list(run.seconds) == [1, 11]
    assert [(b.line, names) for b, names in run.missing] == [(7, ["no_such_extra_x"])]
    run = _page(tmp_path, text.format(3))  # the blocks after it are still checked
    assert "block at line 11" in run.failure and "-3\n+2" in run.failure


def test_run_page_python_error_stops_the_page(tmp_path):
    run = _page(tmp_path, "```python\n1 / 0\n```\n```python\nprint('not reached')\n```\n")
    assert "line 1 (python)" in run.failure and "ZeroDivisionError" in run.failure
    assert list(run.seconds) == [1]


def test_run_page_names_a_file_left_open(tmp_path):
    run = _page(tmp_path, "```python\nopen('p.md').read()\nprint(1)\n```\n```text\n1\n```\n")
    assert run.failure.startswith("p.md, block at line 1 (python):")
    assert "left behind" in run.failure and "p.md" in run.failure


@pytest.mark.parametrize("installed", [False, True])
def test_run_page_leaves_out_the_real_models_blocks_where_it_is_not_installed(
    tmp_path, monkeypatch, installed
):
    """From the first block that finds the real model's file (``smollm2()``, or a
    command on ``smol``) on, no block runs where its package is missing; the blocks
    before it run and are checked. Where it is installed, every block runs."""
    import docs_runner

    monkeypatch.setattr(docs_runner, "REAL_MODEL", "json" if installed else "no_such_model_x")
    text = ("```python\ndef smollm2():\n    return 'model.gguf'\nprint(1)\n```\n```text\n1\n```\n"
            "```python\npath = smollm2()\n```\n"
            "```python\nprint(path)\n```\n```text\nmodel.gguf\n```\n"
            "```bash\necho semiring-backprop explain smol\n```\n"
            "```text\nsemiring-backprop explain smol\n```\n")  # fmt: skip
    run = _page(tmp_path, text)
    assert run.failure is None, run.failure
    if installed:
        assert list(run.seconds) == [1, 9, 12, 18] and not run.missing
    else:
        assert list(run.seconds) == [1]  # the other blocks would fail: `path` is not set
        left_out = [(b.line, names) for b, names in run.missing]
        assert left_out == [(line, ["no_such_model_x"]) for line in (9, 12, 18)]
    found = [docs_runner.uses_real_model(b) for b in parse(
        "```bash\nsemiring-backprop circuit smol --text hi\n```\n"
        "```python\nfrom semiring_backprop.hf.gguf import smollm2_installed\n```\n"
        "```bash\nsemiring-backprop explain smollish --text hi\n```\n", "p.md")]  # fmt: skip
    assert found == [True, False, False]
