"""A path through the gradient graph, as read from a result: :class:`Path`, a list of
:class:`Step` (one per node, with the edge weight into it and the running product),
and how it prints, renders, and turns into JSON or a DataFrame. :mod:`.paths` reads
them from the pass."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

_MARK_NAME = "semiring_backprop.mark.default"


@dataclass(frozen=True)
class Step:
    """One node on a path. ``edge_weight`` is the edge into this node (None at the source);
    ``running`` the product of edge weights from the source up to here.

    Examples:
        >>> path = res.top_path(("bert.embeddings.word_embeddings", (0, 2)))
        >>> path.source
        Step(node='mark', module='bert.embeddings.word_embeddings',
             op='semiring_backprop.mark.default', index=(0, 2, 6), edge_weight=None,
             running=1.0, slot=None)
        >>> import math
        >>> math.isclose(path.steps[-1].running, path.value)   # the product so far
        True
    """

    node: str  #: graph node name
    module: str | None  #: owning module path (None for ops outside any submodule)
    op: str  #: the ATen op (or ``input`` for a model input)
    index: tuple[int, ...] | None  #: element of the node's output (None: tensor granularity)
    edge_weight: float | None
    running: float | None
    slot: int | None = None  #: argument slot of ``op`` the edge enters (``mul(x, x)``: 0 or 1)


@dataclass(frozen=True)
class Path:
    """A path through the gradient graph, from a source element to the explained output.

    Examples:
        >>> path = res.top_path(("bert.embeddings.word_embeddings", (0, 2)))
        >>> print(path)            # one line per module the path passes through
        MaxProduct(neuron) top path, product 0.0001151, 95 steps, from
        bert.embeddings.word_embeddings[0,2,6]:
        steps layer branch   edge prod    running  module
        ...
        >>> path.to_frame().columns.tolist()   # one row per step
        ['step', 'node', 'module', 'op', 'index', 'slot', 'edge_weight', 'running']
        >>> path.modules[:3]
        ['bert.embeddings.word_embeddings', 'bert.embeddings', 'bert.embeddings.LayerNorm']
    """

    steps: tuple[Step, ...]
    value: float  #: the path product (the semiring's readout at the source element)
    semiring: str
    sign: str = "+"

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    @property
    def source(self) -> Step:
        return self.steps[0]

    @property
    def modules(self) -> list[str]:
        """The modules the path passes through, in order, runs collapsed."""
        return [m for m, _ in _runs(self.steps)]

    def to_frame(self):
        """One row per step (a pandas DataFrame).

        Examples:
            >>> path = res.top_path(("bert.embeddings.word_embeddings", (0, 2)))
            >>> print(path.to_frame()[["step", "op", "edge_weight", "running"]].head(3))
               step                              op  edge_weight  running
            0     0  semiring_backprop.mark.default          NaN      1.0
            1     1                 aten.add.Tensor          1.0      1.0
            2     2                 aten.add.Tensor          1.0      1.0
        """
        import pandas as pd

        rows = [asdict(s) for s in self.steps]
        for i, r in enumerate(rows):
            r["step"] = i
            r["index"] = None if r["index"] is None else tuple(r["index"])
        cols = ["step", "node", "module", "op", "index", "slot", "edge_weight", "running"]
        frame = pd.DataFrame(rows, columns=cols)
        frame["slot"] = frame["slot"].astype("Int64")
        return frame

    def to_dict(self) -> dict:
        """The path as plain data (what ``to_json`` writes); non-finite floats as strings."""
        return {
            "semiring": self.semiring,
            "sign": self.sign,
            "value": _json_float(self.value),
            "steps": [
                {
                    **asdict(s),
                    "index": None if s.index is None else list(s.index),
                    "edge_weight": _json_float(s.edge_weight),
                    "running": _json_float(s.running),
                }
                for s in self.steps
            ],
        }

    def to_json(self, file=None, **kwargs) -> str:
        """The path as JSON text, also written to ``file`` when one is given.

        Examples:
            >>> path = res.top_path(("bert.embeddings.word_embeddings", (0, 2)))
            >>> path.to_json("api-path.json")[:48]
            '{"semiring": "MaxProduct(neuron)", "sign": "+", '
        """
        text = json.dumps(self.to_dict(), **kwargs)
        if file is not None:
            from .._files import atomic_write  # whole or not at all, never through a link

            atomic_write(file, lambda tmp: tmp.write_text(text))
        return text

    def compact(self, strip: str | None = None, marks: bool = False) -> str:
        """One line: the runs of steps inside one module, joined by arrows. Runs made only
        of module-boundary marks (identity steps) are left out unless ``marks=True``.

        Examples:
            >>> path = res.top_path(("bert.embeddings.word_embeddings", (0, 2)))
            >>> print(path.compact(strip="bert."))
            embeddings.word_embeddings[0,2,6] → embeddings[0,2,6] (2 ops) → ...
            → output[6,10] (8 ops)   (product 0.0001151)
        """
        parts = []
        runs = _runs(self.steps)
        for i, (module, steps) in enumerate(runs):
            ends = i in (0, len(runs) - 1)
            if not marks and not ends and all(s.op == _MARK_NAME for s in steps):
                continue
            name = module or ("output" if i == len(runs) - 1 else "(top level)")
            if steps[0].op == "input":
                name = f"input {steps[0].node}"
            if strip and name.startswith(strip):
                name = name[len(strip) :] or name
            first = steps[0]
            where = f"[{','.join(map(str, first.index))}]" if first.index is not None else ""
            ops = f" ({len(steps)} ops)" if len(steps) > 1 else ""
            parts.append(f"{name}{where}{ops}")
        return " → ".join(parts) + f"   (product {self.value:.4g})"

    def __str__(self) -> str:
        """One line per module the path passes: layer, branch, edge product, running."""
        from .. import views  # (a door up: views read paths)

        return str(views.path(self))

    def origin(self):
        """The result this path was read from (``Result.top_path``), while it is alive;
        else None. Views use it to name branches as ``Result.branches`` finds them."""
        ref = self.__dict__.get("_origin")
        return ref() if ref is not None else None

    def __getstate__(self):  # the result stays behind in a pickle or a copy
        return {k: v for k, v in self.__dict__.items() if k != "_origin"}

    def __repr__(self) -> str:
        n, v = len(self.steps), self.value
        return f"<Path {self.semiring} {self.sign}: {n} steps, product {v:.6g}>"

    def view(self, title: str = "top gradient path", res=None):
        """The path as a chain ([views.path][semiring_backprop.views.path]; ``res``: the
        result it was read from, for the branches as ``Result.branches`` finds them).

        Examples:
            >>> res.top_path("bert.embeddings.word_embeddings").view(res=res)
            <View 'top gradient path': ... characters of HTML>
        """
        from .. import views  # (a door up: views read paths)

        return views.path(self, title, res)

    def _repr_html_(self) -> str:
        return self.view()._repr_html_()

    def to_html(self, file) -> str:
        """Write the chain to one self-contained HTML file; returns its path.

        Examples:
            >>> res.top_path("bert.embeddings.word_embeddings").to_html("api-path.html")
            'api-path.html'
        """
        return self.view().to_html(file)


def _runs(steps):
    out: list[tuple[str | None, list[Step]]] = []
    for s in steps:
        if out and out[-1][0] == s.module:
            out[-1][1].append(s)
        else:
            out.append((s.module, [s]))
    return out


def _json_float(x):
    if x is None or math.isfinite(x):
        return x
    return str(x)
