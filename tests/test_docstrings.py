"""Every public name's docstring has an example, and every example runs.

The public names are ``semiring_backprop.__all__`` and the ``__all__`` of the public
modules (``views``, ``captum``, ``data``) and the figure functions of ``plots``. Each
one's docstring (a class's methods included) is run with :mod:`doctest` in the
namespace that the set-up block at the top of ``docs/api.md`` makes: that block is
executed here, so the API reference's examples and its set-up cannot drift apart. A
constant (a string or a table) has no docstring of its own to hold an example: its
module's example must use it. ``run`` and ``load_results`` keep their examples in
``docs/api.md`` itself (run by ``tests/test_docs.py``): this test checks that they are
there.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("pandas")
pytest.importorskip("matplotlib").use("Agg")

import semiring_backprop  # noqa: E402
from semiring_backprop.rules import registry  # noqa: E402

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
#: (semiring_backprop.captum needs the optional Captum: its examples run where it is)
MODULES = ("semiring_backprop.views", "semiring_backprop.data") + (
    ("semiring_backprop.captum",) if importlib.util.find_spec("captum") else ()
)
PLOTS = ("branch_bars", "token_heatmap", "token_bars", "path_diagram", "save", "caption", "role_of")
#: public names whose examples live in docs/api.md (their module is edited elsewhere)
IN_API_MD = {
    "semiring_backprop.run": "sbp.run(",
    "semiring_backprop.load_results": "sbp.load_results(",
}
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def public_names() -> dict:
    """``{"semiring_backprop.views.path": object, ...}`` for every public name."""
    names = {"semiring_backprop": semiring_backprop}
    names.update({m: importlib.import_module(m) for m in MODULES})
    names.update({f"semiring_backprop.{n}": getattr(semiring_backprop, n)
                  for n in semiring_backprop.__all__})  # fmt: skip
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        names.update({f"{module_name}.{n}": getattr(module, n) for n in module.__all__})
    plots = importlib.import_module("semiring_backprop.plots")
    names.update({f"semiring_backprop.plots.{n}": getattr(plots, n) for n in PLOTS})
    return names


NAMES = public_names()


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture(scope="module")
def namespace(tmp_path_factory):
    """What the first python block of docs/api.md defines, run in a scratch folder
    (it writes a vocabulary file) with one torch thread, as the docs tests run it."""
    setup = _blocks(API_MD.read_text(encoding="utf-8"), "python")[0]
    before, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(tmp_path_factory.mktemp("api"))
    torch.set_num_threads(1)
    try:
        ns = {"__name__": "api_md"}
        exec(compile(setup, str(API_MD), "exec"), ns)
        yield ns
    finally:
        torch.set_num_threads(threads)
        os.chdir(before)


def _doctests(name: str, obj) -> list[doctest.DocTest]:
    """The examples in ``obj``'s docstring (a class's: its methods' too)."""
    finder = doctest.DocTestFinder(recurse=inspect.isclass(obj), exclude_empty=True)
    module = inspect.getmodule(obj) if (inspect.isclass(obj) or callable(obj)) else None
    return finder.find(obj, name, module=module or False, globs={})


def _is_constant(obj) -> bool:
    return not (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj))


@pytest.mark.parametrize("name", sorted(NAMES))
def test_has_an_example(name):
    obj = NAMES[name]
    if name in IN_API_MD:
        text = API_MD.read_text(encoding="utf-8")
        code = "\n".join(_blocks(text, "python")[1:])
        assert IN_API_MD[name] in code, f"docs/api.md has no example calling {IN_API_MD[name]}"
        return
    if _is_constant(obj):
        module_name, short = name.rsplit(".", 1)
        module = importlib.import_module(module_name)
        examples = [ex.source for t in _doctests(module_name, module) for ex in t.examples]
        assert any(short in src for src in examples), (
            f"{name} is a constant: the example in {module_name}'s docstring should use it"
        )
        return
    own = [t for t in _doctests(name, obj) if t.name == name]
    assert own and own[0].examples, f"{name}'s docstring has no example (>>> lines)"


@pytest.mark.parametrize("name", sorted(n for n in NAMES if n not in IN_API_MD))
def test_examples_run(name, namespace):
    obj = NAMES[name]
    if _is_constant(obj):
        pytest.skip("a constant: its module's example runs")
    tests = _doctests(name, obj)
    report = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    rules = dict(registry._RULES)  # register's example adds a rule: other tests never see it
    try:
        for t in tests:
            t.globs = dict(namespace)
            runner.run(t, out=report.append)
    finally:
        registry._RULES.clear()
        registry._RULES.update(rules)
    failed = runner.summarize(verbose=False).failed
    assert failed == 0, "".join(report)


#: private modules whose examples need nothing from docs/api.md: run as they are
SELF_CONTAINED = ("semiring_backprop.analysis.tokens", "semiring_backprop.data.synthetic",
                  "semiring_backprop.circuits.ig", "semiring_backprop.tokens",
                  "semiring_backprop.analysis.faithfulness",
                  "semiring_backprop.data.agreement_pairs")  # fmt: skip
#: modules whose examples read a model built first: the test named runs every one of them
RUN_BY = {
    "semiring_backprop.data.induction": "test_induction.py::test_module_examples_run",
    "semiring_backprop.experiments.models": "test_induction.py::test_module_examples_run",
}


def _own(module_name: str) -> list[doctest.DocTest]:
    """The module docstring's examples and those of its private functions (the public
    names' run in the docs namespace above)."""
    module = importlib.import_module(module_name)
    public = {id(obj) for obj in NAMES.values()}
    found = doctest.DocTestFinder().find(module, module_name, globs=dict(vars(module)))
    objs = {t.name: t for t in found if t.examples}
    return [t for name, t in objs.items()
            if id(_resolve(module, name.removeprefix(module_name))) not in public]  # fmt: skip


def _resolve(module, dotted: str):
    obj = module
    for part in filter(None, dotted.split(".")):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module_name", SELF_CONTAINED)
def test_self_contained_examples_run(module_name):
    tests, report = _own(module_name), []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for t in tests:
        runner.run(t, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.attempted and not result.failed, "".join(report)


def test_every_example_in_the_package_is_run():
    """A ``>>>`` example that no test runs could drift from the code unseen: every one in
    the package is in a public name's docstring (run above) or a self-contained module.
    Illustrations that cannot run here (a hub model, a data file) are literal blocks."""
    import pkgutil

    def places(tests):  # by the docstring itself: the finder's file and line vary
        return {t.docstring for t in tests if t.examples}

    run = set()
    for name, obj in NAMES.items():
        if name not in IN_API_MD and not _is_constant(obj):
            run |= places(_doctests(name, obj))
    for module_name in SELF_CONTAINED:
        run |= places(_own(module_name))
    for module_name, test in RUN_BY.items():
        file, name = test.split("::")
        source = (Path(__file__).parent / file).read_text()
        assert f"def {name}(" in source and module_name.rsplit(".", 1)[1] in source, test
        run |= places(doctest.DocTestFinder().find(importlib.import_module(module_name)))
    unrun = []
    for info in pkgutil.walk_packages(semiring_backprop.__path__, "semiring_backprop."):
        if info.name.endswith("__main__"):  # importing it runs the command line
            continue
        if info.name == "semiring_backprop.captum" and info.name not in MODULES:
            continue  # an optional extra, not installed here
        module = importlib.import_module(info.name)
        for t in doctest.DocTestFinder().find(module, info.name):
            if t.examples and t.docstring not in run:
                unrun.append(f"{t.name} ({Path(t.filename).name}:{t.lineno})")
    assert not unrun, f"examples that no test runs: {unrun}"
