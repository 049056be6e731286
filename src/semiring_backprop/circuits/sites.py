"""Sites and edges of a circuit as integer arrays, for the exports, the drawing and
pruning of circuits of millions of edges without a Python step per edge.

A site (a component at a position) gets one integer (:func:`site_codes`): its block
(0: the embeddings; ``l + 1``: layer ``l``; the target its own), its slot in the block
(a head's index; the MLP; the residual stream) and its position. Names are made once
per distinct site (:func:`site_names`), and sums over sites or edges are grouped
reductions (:func:`oplus_groups`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..errors import InputError

#: roles of the rows of ``Circuit.nodes``, in the order of their indices here
ROLES = ("embedding", "head", "mlp", "residual", "target")
EMBEDDING, HEAD, MLP, RESIDUAL, TARGET = range(len(ROLES))
_POSITIONS = 2**20  # per component: positions; the last one: a site of no position
NO_POSITION = _POSITIONS - 1
_SLOTS = 2**12  # per block: the heads, then the MLP and the residual stream
_MLP_SLOT, _RESIDUAL_SLOT = _SLOTS - 2, _SLOTS - 1
_TARGET_BLOCK = 2**20
#: the entry of a residual edge into its destination, by index (the ``input`` column)
INPUTS = ("q", "k", "v", "mlp", "target")


def floats(column) -> np.ndarray:
    """A numeric column (nullable ints, floats or objects) as float64, NaN where missing."""
    if hasattr(column, "to_numpy"):
        return column.to_numpy(dtype="float64", na_value=np.nan)
    return np.asarray(column, dtype="float64")


def role_index(column) -> np.ndarray:
    """The index in :data:`ROLES` of each role (InputError for another)."""
    import pandas as pd

    if not isinstance(column, pd.Series | pd.Index):
        column = np.asarray(column, dtype=object)
    codes, found = pd.factorize(column)
    known = {r: i for i, r in enumerate(ROLES)}
    odd = [r for r in found if r not in known]
    if odd:
        raise InputError(f"unknown site role {odd[0]!r}: expected one of embedding, head, mlp, "
                         "residual, target")  # fmt: skip
    table = np.array([known[r] for r in found] or [0], dtype=np.int64)
    return table[codes] if len(codes) else np.zeros(0, dtype=np.int64)


def _ints(x, n: int, missing: int) -> np.ndarray:
    """A column (or one value for every row) as int64, ``missing`` where missing."""
    if x is None:
        return np.full(n, missing, dtype=np.int64)
    if np.isscalar(x):
        return np.full(n, int(x), dtype=np.int64)
    try:  # nullable ints: no float copy (but a copy: the caller may write into it)
        a = np.array(x.to_numpy(dtype="int64", na_value=missing), dtype=np.int64, copy=True)
    except (AttributeError, TypeError, ValueError):
        f = floats(x)
        a = np.where(np.isnan(f), missing, f).astype(np.int64)
    if a.shape != (n,):
        raise InputError(f"site columns of {a.shape} values for {n} rows: give one per row")
    return a


def site_codes(role, layer, head, position) -> np.ndarray:
    """One int64 per row naming its site, from its columns (``role`` a column or array;
    the others columns, arrays or one value for every row): a target's position is
    ignored, a missing position is none."""
    roles = role_index(role)
    n = len(roles)
    block = _ints(layer, n, -1) + 1
    block[roles == EMBEDDING] = 0
    block[roles == TARGET] = _TARGET_BLOCK
    heads = roles == HEAD
    slot = np.where(heads, _ints(head, n, 0), 0)
    slot[roles == MLP] = _MLP_SLOT
    slot[roles == RESIDUAL] = _RESIDUAL_SLOT
    p = _ints(position, n, NO_POSITION)
    p[roles == TARGET] = NO_POSITION
    if n and (p.min() < 0 or p.max() > NO_POSITION or block.min() < 0
              or (heads & ((slot < 0) | (slot >= _MLP_SLOT))).any()):  # fmt: skip
        raise InputError(f"a site's layer, position or head index is out of range (positions "
                         f"0..{NO_POSITION - 1}, heads 0..{_MLP_SLOT - 1})")  # fmt: skip
    return (block * _SLOTS + slot) * _POSITIONS + p


def head_codes(layer, head, position) -> np.ndarray:
    """:func:`site_codes` of heads (``position``: a column or array)."""
    n = len(position)
    return site_codes(np.full(n, "head", dtype=object), layer, head, position)


def component_label(comp: int) -> str:
    """The EAP-IG name of a component (:func:`component_codes`): ``input``, ``a0.h1``,
    ``m0``, ``r0`` (a residual stream), ``logits``."""
    block, slot = divmod(int(comp), _SLOTS)
    if block == 0:
        return "input"
    if block == _TARGET_BLOCK:
        return "logits"
    layer = block - 1
    if slot == _MLP_SLOT:
        return f"m{layer}"
    if slot == _RESIDUAL_SLOT:
        return f"r{layer}"
    return f"a{layer}.h{slot}"


def name_of(code: int) -> str:
    """A site's name, as ``exports.site_id`` writes it (``a0.h1@3``; ``logits``)."""
    comp, p = divmod(int(code), _POSITIONS)
    name = component_label(comp)
    return name if comp // _SLOTS == _TARGET_BLOCK or p == NO_POSITION else f"{name}@{p}"


def is_head(codes) -> np.ndarray:
    comp = np.asarray(codes) // _POSITIONS
    block, slot = comp // _SLOTS, comp % _SLOTS
    return (block > 0) & (block < _TARGET_BLOCK) & (slot < _MLP_SLOT)


def component_codes(codes) -> np.ndarray:
    """The component of each site (its code without the position)."""
    return np.asarray(codes) // _POSITIONS


def site_names(codes, name=name_of) -> np.ndarray:
    """The names of ``codes`` (an object array), each made once."""
    import pandas as pd

    at, unique = pd.factorize(np.asarray(codes, dtype=np.int64))
    names = np.array([name(int(c)) for c in unique] or [""], dtype=object)
    return names[at] if len(at) else np.zeros(0, dtype=object)


def oplus_groups(name: str, values, groups, n: int) -> np.ndarray:
    """⊕ (see ``exports.oplus``) of ``values`` (one semiring's column) within each of
    ``n`` groups (``groups``: the group of each value); NaN values are left out, and a
    group without values is ⊕ of none (Real 0, the others -inf)."""
    v = np.asarray(values, dtype="float64")
    g = np.asarray(groups, dtype=np.int64)
    keep = ~np.isnan(v)
    v, g = v[keep], g[keep]
    if name == "Real":
        return np.bincount(g, weights=v, minlength=n).astype("float64")
    if name == "MaxAbs":
        out = np.full(n, -math.inf)
        np.maximum.at(out, g, v)
        return out
    fin = np.isfinite(v)
    v, g = v[fin], g[fin]
    out = np.full(n, -math.inf)
    if name.startswith(("MaxProduct", "TopK")):  # the value of largest size, signed
        size = np.abs(v)
        top = np.full(n, -1.0)
        np.maximum.at(top, g, size)
        first = np.full(n, len(v), dtype=np.int64)  # the first row of that size (ties)
        at = np.flatnonzero(size == top[g])
        np.minimum.at(first, g[at], at)
        has = first < len(v)
        out[has] = v[first[has]]
        return out
    if name in ("LogAbs", "PathCount"):
        np.maximum.at(out, g, v)
        total = np.bincount(g, weights=np.exp(v - out[g]), minlength=n)
        return np.where(total > 0, out + np.log(np.where(total > 0, total, 1.0)), -math.inf)
    raise InputError(
        f"{name}: its values of several sites do not combine into one (no ⊕ of readouts); "
        "export under Real or MaxProduct"
    )


class EdgeArrays:
    """Every edge of a circuit (the rows of ``edges``, then of ``attention_edges``) as
    arrays, each made when first read: the site codes of its ends (``src``, ``dst``), its
    key (the input entered, or ``attention``: ``keys[entry]``), ``attention`` (bool),
    its positions (``position`` of a residual edge, ``src_position`` and
    ``dst_position`` of an attention edge; -1 for the other kind) and its value per
    semiring (:meth:`value`)."""

    def __init__(self, circuit):
        self.edges, self.att = circuit.edges, circuit.attention_edges
        self.names = list(circuit.names)
        self.n_residual = len(self.edges)
        self._values: dict = {}

    def __len__(self) -> int:
        return len(self.edges) + len(self.att)

    @functools.cached_property
    def src(self) -> np.ndarray:
        e, a = self.edges, self.att
        src = site_codes(e["src_role"], e["src_layer"], e["src_head_index"], e["position"])
        return np.concatenate([src, head_codes(a["layer"], a["head_index"], self.src_position[
            self.n_residual:])])  # fmt: skip

    @functools.cached_property
    def dst(self) -> np.ndarray:
        e, a = self.edges, self.att
        dst = site_codes(e["dst_role"], e["dst_layer"], e["dst_head_index"], e["position"])
        return np.concatenate([dst, head_codes(a["layer"], a["head_index"], self.dst_position[
            self.n_residual:])])  # fmt: skip

    @functools.cached_property
    def _entries(self):
        import pandas as pd

        entry, keys = pd.factorize(self.edges["input"])
        keys = [str(k) for k in keys] + ["attention"]
        tail = np.full(len(self.att), len(keys) - 1, dtype=np.int64)
        return np.concatenate([entry.astype(np.int64), tail]), keys

    @property
    def entry(self) -> np.ndarray:
        """The index of each edge's key in ``keys``."""
        return self._entries[0]

    @property
    def keys(self) -> list:
        """q, k, v, mlp, target (those the edges enter) and attention."""
        return self._entries[1]

    @property
    def key(self) -> np.ndarray:
        """Each edge's key (an object array)."""
        return np.array(self.keys, dtype=object)[self.entry]

    @functools.cached_property
    def attention(self) -> np.ndarray:
        return np.arange(len(self)) >= self.n_residual

    @functools.cached_property
    def position(self) -> np.ndarray:
        pos = _ints(self.edges["position"], self.n_residual, -1)
        return np.concatenate([pos, np.full(len(self.att), -1, np.int64)])

    def _att_positions(self, column) -> np.ndarray:
        got = _ints(self.att[column], len(self.att), -1)
        return np.concatenate([np.full(self.n_residual, -1, np.int64), got])

    @functools.cached_property
    def src_position(self) -> np.ndarray:
        return self._att_positions("src_position")

    @functools.cached_property
    def dst_position(self) -> np.ndarray:
        return self._att_positions("dst_position")

    def value(self, name: str) -> np.ndarray:
        """The edges' values under ``name`` (a semiring's column; NaN where a frame has
        none)."""
        if name not in self._values:
            parts = [floats(f[name]) if name in f.columns else np.full(len(f), np.nan)
                     for f in (self.edges, self.att)]  # fmt: skip
            self._values[name] = np.concatenate(parts)
        return self._values[name]

    @property
    def values(self) -> dict:
        """Every semiring's :meth:`value`."""
        return {n: self.value(n) for n in self.names}


def edge_arrays(circuit) -> EdgeArrays:
    """:class:`EdgeArrays` of ``circuit``'s edges and attention edges."""
    return EdgeArrays(circuit)


def lookup(codes, known) -> tuple[np.ndarray, np.ndarray]:
    """``(found, at)``: whether each of ``codes`` is one of ``known`` (a few site codes)
    and its index there (0 where not found); a binary search, no hash of ``codes``."""
    known = np.asarray(known, dtype=np.int64)
    codes = np.asarray(codes, dtype=np.int64)
    if not len(known):
        return np.zeros(len(codes), bool), np.zeros(len(codes), np.int64)
    order = np.argsort(known, kind="stable")
    ranked = known[order]
    at = np.clip(np.searchsorted(ranked, codes), 0, len(ranked) - 1)
    found = ranked[at] == codes
    return found, np.where(found, order[at], 0)


#: edges written before a progress bar shows (fewer take under a second)
BAR_FROM = 2**19


def chunks(n: int, what: str, step: int = 2**18):
    """Slices of ``range(n)`` in steps, with a tqdm bar (``what``) where ``n`` is at
    least :data:`BAR_FROM` (a million edges written one by one take seconds)."""
    from tqdm.auto import tqdm

    with tqdm(total=n, desc=what, unit="edge", disable=n < BAR_FROM, leave=False) as bar:
        for start in range(0, n, step):
            yield slice(start, min(start + step, n))
            bar.update(min(step, n - start))


def member(codes, known) -> np.ndarray:
    """Whether each of ``codes`` is one of ``known`` (:func:`lookup`)."""
    return lookup(codes, known)[0]


def node_codes(frame) -> np.ndarray:
    """:func:`site_codes` of the rows of a ``nodes`` frame."""
    return site_codes(frame["role"], frame["layer"], frame["head_index"], frame["position"])
