"""A path as the views show it: its steps grouped in runs, one per module, each with the
branch it is on (skip, query, key, value, mlp), its layer and, where the path takes one
head's columns of a projection, that head."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from .branches import layer_of
from .fanout import FUSED_QKV, ROLE_NAMES

__all__ = ["Run", "entry_roles", "head_columns", "module_label", "path_runs"]

_MARK = "semiring_backprop.mark.default"
_CONTRACTIONS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "einsum", "convolution")


def head_columns(res) -> dict[tuple[str, str], tuple[tuple, int]]:
    """For each query / key / value projection of every attention block, by (graph node
    name, role): the output columns of its part and the columns per head, where the
    attention module or the model's config gives the number of heads (as per-head
    branch tables find it); a path through column ``j`` is in head
    ``cols.index(j) // per_head``."""
    from .branches import blocks
    from .fanout import Roles, entries, first_contraction
    from .heads import head_counts

    r = Roles(res)
    out: dict = {}
    for block in blocks(res):
        point = block.points.get("attention")
        if point is None:
            continue
        qkv = [e for e in entries(res, point)[1] if e.role in ("query", "key", "value")]
        groups: dict = {}
        for e in qkv:
            proj = e.proj or first_contraction(r, e.op)
            if proj is not None:
                cols = e.cols or tuple(range(_width(res, proj)))
                groups[proj, e.role] = tuple(cols)
        if not groups:
            continue
        widths = {role: len(cols) for (_, role), cols in groups.items()}
        try:
            counts = head_counts(res.graph, qkv[0].consumer, widths, None)
        except InputError:  # the head count is not known: the path names no head here
            continue
        for (proj, role), cols in groups.items():
            out[proj.name, role] = (cols, len(cols) // counts[role])
    return out


def _width(res, node) -> int:
    """The last dimension of ``node``'s output, from the trace (reading ``res.values``
    may run a segment of the forward again, where the pass kept checkpoints only)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return int(val.shape[-1])
    return int(res.values[node].shape[-1])


@dataclass
class Run:
    """Consecutive steps of a path inside one module."""

    module: str | None
    steps: list
    first: int  #: index of the first step in the path
    role: str = ""  #: skip / query / key / value / mlp / qkv, or "" outside a branch
    layer: int | None = None
    heads: tuple = ()
    before: list = field(default_factory=list)  #: module-boundary steps just before it

    @property
    def product(self) -> float | None:
        """The product of the edge weights of this run's steps."""
        ws = [s.edge_weight for s in self.steps if s.edge_weight is not None]
        return math.prod(ws) if ws else None

    @property
    def running(self) -> float | None:
        return self.steps[-1].running

    @property
    def ops(self) -> list[str]:
        return [_short_op(s.op) for s in self.steps if s.op != _MARK]


def _short_op(op: str) -> str:
    if op == _MARK:
        return "mark"
    return op.removeprefix("aten.").removesuffix(".default")


def _name_role(module: str) -> str:
    for part in reversed(module.lower().split(".")):
        if part in FUSED_QKV:
            return "qkv"
        for role, names in ROLE_NAMES.items():
            if part in names:
                return role
    return ""


def _is_residual(step) -> bool:
    """An add in a block's own module (GPT-2's ``h.3``), in BERT's ``*.output``, or at
    the top level (``nn.TransformerEncoderLayer`` as the model)."""
    if step.op != "aten.add.Tensor":
        return False
    if not step.module:
        return True
    last = step.module.rsplit(".", 1)[-1].lower()
    return last.isdigit() or last in ("output", "residual", "skip")


def entry_roles(res) -> dict[tuple[str, str], str]:
    """The role of every branch of every attention block, keyed by the branch's first
    edge (the node it reads, the op), by graph node names, as ``Result.branches`` finds
    them (fused projections by the columns each part takes). A path that takes that
    edge takes that branch (a residual add is entered by the skip edge and by the
    branch it ends)."""
    from .branches import blocks, entries

    out: dict[tuple[str, str], str] = {}
    for block in blocks(res):
        for point in block.points.values():
            for e in entries(res, point)[1]:
                out[e.via.name, e.op.name] = e.role
    return out


def _layer(module: str | None) -> int | None:
    path = layer_of(module or "")
    tail = path.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


def path_runs(path, marks: bool = False, roles: dict | None = None,
              heads: dict | None = None) -> list[Run]:  # fmt: skip
    """The runs of a path with the branch each is on. ``roles`` (:func:`entry_roles`):
    the path takes a branch where it passes that branch's first op. Without them, from
    module names: it leaves the residual stream through a projection named query / key
    / value / mlp (a fused one: ``qkv``), and an add reached with no contraction since
    the last one is the skip branch. A branch lasts until the residual add that ends
    it. ``heads`` (:func:`head_columns`): the head of a query / key / value branch, from
    the column the path takes at the projection's output. Runs made only of
    module-boundary marks are left out unless ``marks=True`` (the first and the last
    run always stay)."""
    runs: list[Run] = []
    for i, s in enumerate(path.steps):
        if runs and runs[-1].module == s.module:
            runs[-1].steps.append(s)
        else:
            runs.append(Run(s.module, [s], i))
    branch, contracted, prev, head, column = "", False, None, None, None
    heads = heads or {}
    projections = {n for n, _ in heads}
    for r in runs:
        named = _name_role(r.module or "") if roles is None else ""
        if named:
            branch = named
        role = branch
        for s in r.steps:
            edge, prev = (prev, s.node), s.node
            if roles is not None and edge in roles:
                branch = role = roles[edge]
                if role == "skip":  # the residual add itself: the branch ends here
                    branch, contracted = "", False
                    continue
            if s.op.removeprefix("aten.").split(".")[0] in _CONTRACTIONS:
                contracted = True
            if s.index and s.node in projections:
                column = (s.node, s.index[-1])  # the head is known once the branch is
            if column and head is None and (column[0], branch) in heads:
                cols, size = heads[column[0], branch]
                if column[1] in cols:
                    head = cols.index(column[1]) // size
            if head is not None:
                r.heads = (head,)
            if _is_residual(s):
                role = role if contracted or roles is not None else "skip"
                branch, contracted, head, column = "", False, None, None
        r.role = role
        r.layer = _layer(r.module)
        own = {h for s in r.steps if (h := getattr(s, "head", None)) is not None}
        r.heads = tuple(sorted(own)) or r.heads
    if marks:
        return runs
    kept, pending = [], []
    for i, r in enumerate(runs):
        if i in (0, len(runs) - 1) or r.ops:
            r.before, pending = pending, []
            kept.append(r)
        else:  # only module-boundary marks: listed with the next run's steps
            pending += r.steps
    return kept


def module_label(module: str | None, step, last: bool) -> str:
    if step.op == "input":
        return f"input {step.node}"
    if not module:
        return "output" if last else "(top level)"
    return module
