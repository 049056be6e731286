"""What the views show, computed from a result, a path or a table (no pass is run here;
:mod:`semiring_backprop.views` only draws it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..semirings import Entropy, MaxAbs, MaxProduct, PathCount, Real
from ..tokens import readable_column, readable_rows
from .path_runs import Run, entry_roles, head_columns, module_label, path_runs
from .tokens import per_example

#: (a path's runs, :mod:`.path_runs`, are imported from here too)
__all__ = ["QUANTITIES", "TokenValues", "available", "check_mask", "default_source",
           "drop_padding", "pick_semiring", "shares", "token_mask", "token_values",
           "Run", "entry_roles", "head_columns", "module_label", "path_runs"]  # fmt: skip

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
