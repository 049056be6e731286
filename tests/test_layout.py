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
