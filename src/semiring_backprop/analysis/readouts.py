"""What the views show, computed from a result, a path or a table (no pass is run here;
:mod:`semiring_backprop.views` only draws it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..semirings import Entropy, MaxAbs, MaxProduct, PathCount, Real
from ..tokens import readable_column, readable_rows
from .branches import layer_of
from .fanout import FUSED_QKV, ROLE_NAMES
from .tokens import per_example

#: per-token quantities: what each is, and whether it is signed (diverging colours)
QUANTITIES = {
    "gradient": (
        "gradient, summed over the token's hidden units (Real; signed terms can cancel)",
        True,
    ),
    "top_path": (
        "the heaviest path product from the token, with its sign: MaxProduct's most positive "
        "(hi) or most negative (lo) path, whichever is larger in size, ⊕ over its units; red: "
        "the heaviest path raises the output, blue: it lowers it",
        True,
    ),
    "entropy": ("path entropy in nats (Entropy, ⊕ over the token's units)", False),
    "normalized_entropy": ("path entropy / log #paths (Entropy, PathCount)", False),
}


@dataclass
class TokenValues:
    """One per-token quantity: ``values[example][position]`` (None: no path)."""

    quantity: str
    description: str
    signed: bool
    values: list  #: examples x positions of float or None
    tokens: list  #: examples x positions of str
    source: str = ""
    marks: dict = field(default_factory=dict)  #: (example, position) -> why it is marked
    warning: str = ""  #: what the reader must know before reading the colours
    #: examples x the positions shown (padding left out); None: every position
    positions: list | None = None
    #: examples x positions of hover notes (e.g. both path extremes), or None
    notes: list | None = None

    def position(self, i: int, j: int) -> int:
        """The position in the input of the ``j``-th token shown of example ``i``."""
        return j if self.positions is None else self.positions[i][j]


def _find(res, kind):
    return next((s for s in res.semirings if isinstance(s, kind)), None)


def _need(res, quantity, *kinds):
    got = [_find(res, k) for k in kinds]
    if any(g is None for g in got):
        names = ", ".join(f"sbp.{k.__name__}()" for k in kinds)
        computed = ", ".join(s.name for s in res.semirings)
        raise InputError(
            f"quantity={quantity!r} needs {names} in the pass (computed: {computed}); pass "
            f"semirings=[..., {names}] to backprop, or choose another quantity "
            f"({', '.join(QUANTITIES)})"
        )
    return got


def available(res) -> list[str]:
    """The per-token quantities this result can show."""
    srs = res.semirings
    have = {
        "top_path": any(isinstance(s, MaxProduct | MaxAbs) for s in srs),
        "gradient": Real() in srs,
        "entropy": Entropy() in srs,
        "normalized_entropy": Entropy() in srs and PathCount() in srs,
    }
    return [q for q in ("top_path", "gradient", "entropy", "normalized_entropy") if have[q]]


def default_source(res) -> str:
    """Where a result's tokens are read by default: a float input of the traced call,
    else the model's (word) embedding table's output."""
    g = res.graph
    for key, node in g.user_inputs.items():
        if node in res._store:
            return key
    types = getattr(g, "module_types", {}) or {}
    emb = [t for t in g.tags if types.get(t) == "Embedding" and g.tags[t] in res._store]
    word = [t for t in emb if any(w in t.lower() for w in ("word", "wte", "embed_tokens", "tok"))]
    if word or emb:
        return (word or emb)[0]
    raise InputError(
        "found no float input and no embedding table with values in this result: name the "
        "tensor whose tokens to show, e.g. source='model.embeddings' (a module path, an "
        "input position or name)"
    )


def token_mask(res, examples: int | None = None, positions: int | None = None):
    """Which positions are tokens: ``mask[example][position]`` (False: padding, where the
    traced call's attention mask is 0), or None where the call has no attention mask or
    every position is a token. ``examples``, ``positions``: the shape the mask must have
    (another shape: None)."""
    g = res.graph
    for key, node in g.user_inputs.items():
        if "attention_mask" not in str(key):
            continue
        try:
            m = res.values[node]
        except Exception:  # not kept: no mask known, every position shown
            return None
        if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.is_floating_point():
            return None
        if (examples, positions) != (None, None) and tuple(m.shape) != (examples, positions):
            return None
        m = m.detach().cpu().bool()
        return None if bool(m.all()) else m.tolist()
    return None


def check_mask(mask, examples: int, positions: int) -> list | None:
    """``mask`` (one list of 0/1 or bools per example) as lists of bools, checked
    against the values' shape."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().reshape(-1, mask.shape[-1]).tolist()
    rows = [[bool(v) for v in row] for row in mask]
    if len(rows) != examples or any(len(r) != positions for r in rows):
        raise InputError(
            f"mask= has {len(rows)} rows of {sorted({len(r) for r in rows})} positions, but "
            f"the values hold {examples} examples of {positions} positions: give the "
            "attention mask of the call (one row per example)"
        )
    return rows


def token_values(res, quantity: str, source=None, tokens=None, mask=None) -> TokenValues:
    """Per-token ``quantity`` at ``source`` (⊕ over the last dimension: hidden units).
    Positions where ``mask`` (default: the traced call's attention mask) is 0 are
    padding, not tokens: they are left out."""
    if quantity not in QUANTITIES:
        raise InputError(f"quantity must be one of {', '.join(QUANTITIES)}; got {quantity!r}")
    source = default_source(res) if source is None else source
    missing = None
    warning = ""
    notes = None
    if quantity == "gradient":
        (sr,) = _need(res, quantity, Real)
        v = res.aggregate(source, sr)
        warning = _cancels(res.at(source, sr), v)
    elif quantity == "top_path":
        sr = _find(res, MaxProduct) or _find(res, MaxAbs)
        if sr is None:
            _need(res, quantity, MaxProduct)
        ro = res.aggregate(source, sr)
        if isinstance(sr, MaxProduct):
            hi, lo = ro.hi, ro.lo
            missing = ~torch.isfinite(hi)
            v = torch.where(hi.abs() >= lo.abs(), hi, lo)  # the heavier extreme, signed
            notes = [
                [f"most positive path {_fmt(a)}, most negative path {_fmt(b)}"
                 for a, b in zip(r_hi, r_lo)]
                for r_hi, r_lo in zip(_examples_by_positions(hi, source),
                                      _examples_by_positions(lo, source))
            ]  # fmt: skip
        else:
            v = ro.value
            missing = ro.log == -math.inf
    else:
        (ent,) = _need(res, quantity, Entropy)
        ro = res.aggregate(source, ent)
        v, missing = ro.entropy, ro.log_z == -math.inf
        if quantity == "normalized_entropy":
            (pc,) = _need(res, quantity, PathCount)
            log_n = res.aggregate(source, pc).log_count
            v = torch.where(log_n > 0, v / log_n, torch.zeros_like(v))
    grid = _examples_by_positions(v, source)
    absent = None if missing is None else _examples_by_positions(missing, source)
    values = [
        [None if absent is not None and absent[i][j] else float(x) for j, x in enumerate(row)]
        for i, row in enumerate(grid)
    ]
    n, t = len(values), len(values[0])
    if tokens is None:
        labels = [[str(j) for j in range(t)] for _ in range(n)]
    else:  # as people read them: ' Mary' for 'ĠMary'
        labels = readable_rows(per_example(tokens, n, t))
    desc, signed = QUANTITIES[quantity]
    if quantity == "top_path" and not isinstance(sr, MaxProduct):
        desc, signed = "the largest |path product| from the token (MaxAbs, unsigned)", False
    keep = check_mask(mask, n, t) if mask is not None else token_mask(res, n, t)
    positions = None
    if keep is not None:  # padding is no token: left out of the strip and of its scale
        positions = [[j for j in range(t) if keep[i][j]] for i in range(n)]
        values = [[values[i][j] for j in ps] for i, ps in enumerate(positions)]
        labels = [[labels[i][j] for j in ps] for i, ps in enumerate(positions)]
        if notes is not None:
            notes = [[notes[i][j] for j in ps] for i, ps in enumerate(positions)]
    return TokenValues(quantity, desc, signed, values, labels, str(source), warning=warning,
                       positions=positions, notes=notes)  # fmt: skip


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else "none"


def _cancels(g: torch.Tensor, total: torch.Tensor) -> str:
    """A warning where each token's sum of gradients over its units is rounding noise
    next to the sum of their sizes (a LayerNorm after the point makes it 0)."""
    mass = g.abs().sum(-1)
    eps = torch.finfo(g.dtype).eps if g.is_floating_point() else 0.0
    noise = total.abs() <= 64 * eps * g.shape[-1] * mass
    if not bool(noise.all()) or not bool((mass > 0).any()):
        return ""
    return (
        "these sums cancel: for every token, |Σ gradient| is at the rounding level of "
        f"Σ |gradient| (up to {float(mass.max()):.3g}), as where a LayerNorm follows; "
        "the colours show rounding noise, not attribution. Read the gradient per unit "
        "(Result.at), or the top path and entropy strips."
    )


def _examples_by_positions(v: torch.Tensor, source) -> list[list]:
    v = v.detach().cpu()
    if v.dim() == 0:
        v = v.reshape(1, 1)
    elif v.dim() == 1:
        v = v.reshape(1, -1)
    elif v.dim() > 2:
        raise InputError(
            f"{source!r} holds {tuple(v.shape)} values per token after ⊕ over its last "
            "dimension; views show (examples, positions, hidden): name a tensor of that "
            "shape (an embedding or a layer's input)"
        )
    return v.double().tolist()


# -- paths ----------------------------------------------------------------------------

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


# -- branch tables --------------------------------------------------------------------

_ADDITIVE = ("Real", "MaxProduct", "MaxAbs", "TopK")
_LOG = ("LogAbs", "PathCount")


def pick_semiring(table, semiring=None) -> str:
    have = [str(n) for n in table["semiring"].unique()]
    if semiring is not None:
        names = {str(semiring), getattr(semiring, "name", str(semiring))}
        pick = next((n for n in have if n in names), None)
        if pick is None:
            raise InputError(f"semiring {semiring} is not in the table (it has {have})")
        return pick
    for prefix in ("MaxProduct", "MaxAbs", "TopK", "Real", "LogAbs"):
        pick = next((n for n in have if n.startswith(prefix)), None)
        if pick is not None:
            return pick
    raise InputError(
        f"branch shares need a semiring whose branch values compete (MaxProduct, MaxAbs, "
        f"TopK, Real, LogAbs); the table has {have}"
    )


def shares(table, semiring=None, mask=None):
    """The table's rows of one semiring with ``share``: each branch's part of the token's
    total, |value| / Σ |value| (log-space semirings: exp(value) / Σ exp(value)); rows
    without a path count 0. Per-head rows (a ``head_index`` column) are kept for the
    tooltips and left out of the shares where their branch has a row of its own. Rows at
    padding (``mask``, default the table's ``attrs["attention_mask"]``, 0) are left out.
    A table of one fan-out point (``Result.branches``: ``role``, no ``layer``) is one row."""
    import pandas as pd

    if mask is None:
        mask = table.attrs.get("attention_mask")
    if "layer" not in table.columns and "role" in table.columns and "branch" not in table.columns:
        table = table.rename(columns={"role": "branch"})
        table.insert(0, "sublayer", "branches")
        table.insert(0, "layer", "")
    for col in ("layer", "sublayer", "token", "branch", "value", "semiring"):
        if col not in table.columns:
            raise InputError(
                f"the table has no {col!r} column: pass a table from Result.layer_table(), "
                "Result.branches() or Explanation.layers"
            )
    if mask is not None and len(table):
        table = drop_padding(table, mask)
    name = pick_semiring(table, semiring)
    if name.startswith("Entropy"):
        raise InputError("path entropy does not split into branch shares; pick a semiring")
    rows = table[table["semiring"].astype(str) == name].copy()
    if "token_text" not in rows.columns:
        rows["token_text"] = rows["token"].astype(str)
    else:
        rows["token_text"] = readable_column(rows)
    if "example" not in rows.columns:
        rows["example"] = 0
    if "path" not in rows.columns:
        rows["path"] = True
    heads = None
    if "head_index" in rows.columns:
        per_head = rows["head_index"].notna()
        heads = rows[per_head]
        whole = rows[~per_head]
        have = set(zip(whole["layer"], whole["sublayer"], whole["branch"]))
        folded = heads[[k not in have for k in zip(heads["layer"], heads["sublayer"],
                                                   heads["branch"])]]  # fmt: skip
        rows = pd.concat([whole, _fold_heads(folded, name)], ignore_index=True)
    v = rows["value"].astype(float)
    live = rows["path"].astype(bool) & v.map(math.isfinite)
    if name.startswith(_LOG):
        keys = ["example", "layer", "sublayer", "token"]
        top = v.where(live).groupby([rows[k] for k in keys]).transform("max")
        weight = (v - top).map(math.exp).where(live, 0.0)
    else:
        weight = v.abs().where(live, 0.0)
    keys = [rows[k] for k in ("example", "layer", "sublayer", "token")]
    total = weight.groupby(keys).transform("sum")
    rows["share"] = (weight / total).where(total > 0)
    if "winner" not in rows.columns:
        rows["winner"] = False
    return rows, name, heads


def _fold_heads(rows, name):
    """⊕ of per-head rows into one row per branch, for branches without a row of their own."""
    if not len(rows):
        return rows.drop(columns="head_index")
    keys = ["example", "layer", "sublayer", "token", "token_text", "branch", "semiring"]
    keys = [k for k in keys if k in rows.columns]
    agg = "sum" if name == "Real" else "max"
    if name.startswith(_LOG):
        agg = lambda s: float(torch.logsumexp(torch.tensor(list(s), dtype=torch.float64), 0))
    elif name.startswith("TopK"):  # the signed value of the heaviest path: largest |value|
        agg = lambda s: float(s.loc[s.abs().idxmax()])
    have = {"value": ("value", agg), "path": ("path", "any")}
    if "winner" in rows.columns:
        have["winner"] = ("winner", "any")
    out = rows.groupby(keys, as_index=False).agg(**have)
    if "winner" not in out.columns:
        out["winner"] = False
    return out


def drop_padding(table, mask):
    """``table`` without its rows at positions where ``mask[example][token]`` is 0
    (padding is no token); ``mask``: one row of 0/1 per example."""
    rows = [[bool(v) for v in row] for row in mask]
    examples = table["example"] if "example" in table.columns else [0] * len(table)
    keep = []
    for e, t in zip(examples, table["token"]):
        e, t = int(e), int(t)
        keep.append(e >= len(rows) or t >= len(rows[e]) or rows[e][t])
    return table[keep]
