"""The package's layout, read from its own imports (ast): no import circle between its
modules, and no private name taken from another module (a module whose own name starts
with ``_`` shares its names inside the package). Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import semiring_backprop

ROOT = Path(semiring_backprop.__file__).parent
PACKAGE = "semiring_backprop"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules) -> list[tuple[str, str, int]]:
    """``(module imported, name taken or "", line)`` for every import of the package."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                where = base[: len(base) - node.level + 1]
                target = ".".join(where + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:  # ``from . import module``
                    found.append((sub, "", node.lineno))
                else:
                    found.append((target, a.name, node.lineno))
    return [f for f in found if f[0] == PACKAGE or f[0].startswith(PACKAGE + ".")]


def _graph():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for target, taken, line in _imports(name, path, modules):
            if target in modules and target != name:
                edges[name].add(target)
            owner = target.rsplit(".", 1)[-1]
            if taken.startswith("_") and not taken.startswith("__") and not owner.startswith("_"):
                private.append(f"{path.relative_to(ROOT.parent)}:{line}: {taken} from {target}")
    return edges, private


def _circles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    edges, _ = _graph()
    assert not _circles(edges), f"modules that import each other: {_circles(edges)}"


def test_no_private_names_from_other_modules():
    _, private = _graph()
    assert not private, "private names imported from other modules (make them public "
    "names of the module that owns them):\n" + "\n".join(private)


# -- the scripts beside the package ---------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
#: folders of scripts run from the repository (``python benchmarks/bench_passes.py``): each
#: imports the package, and its neighbours by their bare names (its own folder is first on
#: ``sys.path`` when it runs)
SCRIPT_FOLDERS = ("benchmarks", "docs")


def _scripts() -> dict[str, Path]:
    """``{"benchmarks/bench_passes.py": path, ...}`` for every script of those folders."""
    return {p.relative_to(REPO).as_posix(): p
            for folder in SCRIPT_FOLDERS for p in sorted((REPO / folder).glob("*.py"))}  # fmt: skip


def _script_edges(modules) -> dict[str, set[str]]:
    """What each script imports: scripts of its own folder (by bare name) and package
    modules (by full name), imports inside functions included."""
    scripts = _scripts()
    edges: dict[str, set[str]] = {}
    for name, path in scripts.items():
        folder = name.rsplit("/", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for imported in names:
                neighbour = f"{folder}/{imported}.py"
                if neighbour in scripts and neighbour != name:
                    found.add(neighbour)
                elif imported in modules:
                    found.add(imported)
        edges[name] = found
    return edges


def test_scripts_and_package_import_no_circle():
    """The benchmarks and the docs' scripts with the package: no two import each other
    (through any chain). Two scripts that share code take it from a third."""
    edges, _ = _graph()
    scripts = _script_edges(set(edges))
    assert {"benchmarks", "docs"} <= {name.split("/")[0] for name in scripts}, scripts
    edges.update(scripts)
    assert not _circles(edges), f"files that import each other: {_circles(edges)}"


def test_script_edges_are_read():
    """The reading above sees a script's neighbours and the package (or the test above
    would pass on a graph with no edges)."""
    edges = _script_edges(set(_modules()))
    assert "benchmarks/pass_cases.py" in edges["benchmarks/bench_passes.py"]
    assert "benchmarks/bench_backprop.py" in edges["benchmarks/bench_circuit.py"]
    assert "semiring_backprop.places" in edges["benchmarks/bench_passes.py"]
    circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(circle) == [["a", "b", "c"]]


# -- module size ------------------------------------------------------------------------------

MAX_LINES = 500
#: modules over MAX_LINES for now, and why: each leaves this list when it is split
LONG: dict[str, str] = {}


def test_no_module_over_500_lines():
    """Modules stay under about 500 lines (STYLE.md): one idea a module. A module that
    grows past it is split by idea into sibling modules; the list above names those
    still waiting, and a module that no longer needs its entry loses it."""
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for p in ROOT.rglob("*.py")}  # fmt: skip
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    new = {name: n for name, n in long.items() if name not in LONG}
    assert not new, f"modules over {MAX_LINES} lines (split them by idea): {new}"
    done = sorted(set(LONG) - set(long))
    assert not done, f"{done} are {MAX_LINES} lines or fewer now: take them off LONG"


# -- arrows back up ---------------------------------------------------------------------------

#: the imports that run back up the layering (below), and why each is there: a function-level
#: import, made when it is called, of a room that imports the importer's room at module
#: level. Each leaves this list when it goes; a new one is refused until it is listed.
DOORS = {
    ("analysis/", "views/"): "Path prints and draws itself (__str__, view, _repr_html_) with "
    "the views, which read analysis tables",
}
MAX_DOORS = 2


def _room(module: str) -> str:
    """The room a module stands in: a subpackage of the package (``"views/"``) or a module
    beside them (``"result.py"``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    if (ROOT / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] + ".py"


def _room_imports() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Between rooms: what each imports at module level (``{room: {room, ...}}``), and
    the imports made inside functions (``(room, room, "module.py:line")``)."""
    modules = _modules()
    eager: dict[str, set[str]] = {_room(m): set() for m in modules}
    lazy = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inside = {
            n.lineno
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for n in ast.walk(f)
            if isinstance(n, ast.Import | ast.ImportFrom)
        }
        for target, _, line in _imports(name, path, modules):
            if target not in modules:
                continue
            a, b = _room(name), _room(target)
            if a == b:
                continue
            if line in inside:
                lazy.append((a, b, f"{path.relative_to(ROOT).as_posix()}:{line}"))
            else:
                eager[a].add(b)
    return eager, lazy


def _floors(eager: dict[str, set[str]]) -> dict[str, int]:
    """A room's floor: 1 + the highest floor of the rooms it imports at module level."""
    floors: dict[str, int] = {}

    def floor(room, path=()):
        assert room not in path, f"rooms that import each other at module level: {path}"
        if room not in floors:
            floors[room] = 1 + max((floor(r, (*path, room)) for r in eager[room]), default=0)
        return floors[room]

    for room in eager:
        floor(room)
    return floors


def _above(eager: dict[str, set[str]], a: str, b: str) -> bool:
    """Whether room ``a`` stands above ``b``: it imports ``b`` at module level, directly
    or through others (then its floor is higher)."""
    todo, seen = list(eager[a]), set()
    while todo:
        r = todo.pop()
        if r == b:
            return True
        if r not in seen:
            seen.add(r)
            todo += eager[r]
    return False


def _arrows_back_up() -> dict[tuple[str, str], list[str]]:
    """``{(room, room above it): [where]}``: the imports inside functions of a room that
    stands above the importer. (A floor number alone does not say "above": a room whose
    imports are all made inside functions, as the command line's, stands on floor 1 by
    module-level imports and is still above what it calls.)"""
    eager, lazy = _room_imports()
    floors = _floors(eager)
    up: dict[tuple[str, str], list[str]] = {}
    for a, b, where in lazy:
        if _above(eager, b, a):
            assert floors[b] > floors[a]
            up.setdefault((a, b), []).append(where)
    return up


def test_arrows_back_up_are_the_listed_doors():
    """Imports run down the layering (DESIGN §3). Where one must run back up, it is a
    function-level import (a door opened when it is called) listed in DOORS with its
    reason; at most MAX_DOORS, and a listed door that is gone leaves the list."""
    up = _arrows_back_up()
    new = {k: v for k, v in up.items() if k not in DOORS}
    assert not new, f"imports that run back up the layering (make them run down): {new}"
    gone = sorted(set(DOORS) - set(up))
    assert not gone, f"{gone} no longer run back up: take them off DOORS"
    assert len(up) <= MAX_DOORS, up


def test_arrows_back_up_are_read():
    """The reading sees a door (or the test above would pass on no imports at all), and
    the floors stand in the order the package is layered."""
    eager, lazy = _room_imports()
    floors = _floors(eager)
    assert floors["errors.py"] == 1
    assert floors["tracing/"] < floors["engine/"] < floors["analysis/"] < floors["circuits/"]
    assert floors["analysis/"] < floors["views/"] < floors["circuits/"]
    assert any(a == "result.py" and b == "views/" for a, b, _ in lazy)


def test_old_paths_of_moved_modules_are_the_modules():
    """A module that moved still imports from its old path, as the very module at the new
    one (the package's ``__init__`` maps the name: no file of its own, so no arrow)."""
    import importlib

    from semiring_backprop.ablation import faithfulness, patching
    from semiring_backprop.circuits import view

    moved = {"analysis.patching": patching, "analysis.faithfulness": faithfulness,
             "views.circuit": view}  # fmt: skip
    for old, module in moved.items():
        assert importlib.import_module(f"{PACKAGE}.{old}") is module, old
        assert not (ROOT / f"{old.replace('.', '/')}.py").exists(), old
    from semiring_backprop.analysis.patching import Patching
    from semiring_backprop.views.circuit import circuit_svg

    assert Patching is patching.Patching and circuit_svg is view.circuit_svg
