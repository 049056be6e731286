"""Pruning a circuit: the components kept (by count, size or share of the total), and
the sites and edges that follow from them (a head is kept where it writes, and reads its
keys and values where its kept attention edges reach)."""

from __future__ import annotations

import math
from dataclasses import replace

from ..errors import InputError
from . import sites
from .exports import COMPONENT_ROLES

__all__ = ["keeping", "prune"]


def prune(circuit, top_n: int | None = None, threshold: float | None = None,
          cumulative: float | None = None, semiring=None):  # fmt: skip
    """``circuit.prune(...)``: the components kept by every criterion given, and the sites and
    edges that follow from them (:func:`keeping`)."""
    if top_n is None and threshold is None and cumulative is None:
        raise InputError("prune: give top_n, threshold or cumulative")
    if top_n is not None and (not isinstance(top_n, int) or top_n < 0):
        raise InputError(f"prune: top_n={top_n!r}; give a count, 0 or more")
    if cumulative is not None and not 0 <= cumulative <= 1:
        raise InputError(f"prune: cumulative={cumulative!r}; give a share from 0 to 1")
    col = circuit.column(semiring)
    comps = circuit.full.components()
    size = comps[col].astype(float).abs()
    size = size.where(size.map(math.isfinite), float("nan"))
    order = size.dropna().sort_values(ascending=False, kind="stable")
    keep = set(order.index)
    if top_n is not None:
        keep &= set(order.index[:top_n])
    if threshold is not None:
        keep &= set(order.index[order >= threshold])
    if cumulative is not None:
        total, running, chosen = float(order.sum()), 0.0, []
        for i, v in order.items():
            if total == 0 or running >= cumulative * total - 1e-12 * total:
                break
            chosen.append(i)
            running += v
        keep &= set(chosen)
    kept_rows = comps.loc[sorted(keep)]
    return keeping(circuit, kept_rows)


def keeping(circuit, kept_rows):
    """A new circuit, ``circuit``'s whole one with the components ``kept_rows`` kept: the other
    sites and the edges follow (see ``Circuit.prune``)."""
    import numpy as np

    full = circuit.full
    keys = sites.node_codes(kept_rows)
    n = full.nodes
    stays = ~n.role.isin(COMPONENT_ROLES) | n.index.isin(kept_rows.index)
    # A head's site is where it writes; it reads its keys and values at every
    # position its attention reaches. An attention edge q -> p stays when the head
    # is kept at p and the pair carries something; the head then reads q.
    a = full.attention_edges
    q, p = (sites.floats(a[c]) for c in ("src_position", "dst_position"))
    att = sites.member(sites.head_codes(a["layer"], a["head_index"], p), keys) & (
        (q == p) | _carries(a, circuit.names))  # fmt: skip
    heads = kept_rows[kept_rows.role == "head"]
    reads = np.concatenate([sites.head_codes(a["layer"], a["head_index"], q)[att],
                            sites.node_codes(heads)])  # fmt: skip
    e = full.edges
    ok = _edges_staying(e, keys, reads)
    return replace(
        full,
        nodes=n[stays].reset_index(drop=True),
        edges=e[ok].reset_index(drop=True) if len(e) else e,
        attention_edges=a[att].reset_index(drop=True) if len(a) else a,
        source=full,
    )


def _carries(frame, names):
    """Whether each attention edge carries a value under some semiring (finite, not 0): a
    masked pair holds the semiring's zero, and a pair no seeded path reaches holds 0."""
    import numpy as np

    out = np.zeros(len(frame), dtype=bool)
    for c in names:
        if c in frame.columns:
            v = sites.floats(frame[c])
            out |= np.isfinite(v) & (v != 0)
    return out


def _edges_staying(frame, keys, reads):
    """Whether each residual edge (source and entry at its ``position``) joins kept
    components: its source kept there (the embeddings always are); its destination the
    target, an MLP or a head's query kept there (``keys``: site codes), or a head's key
    or value read there (``reads``)."""
    import numpy as np

    src_role = sites.role_index(frame["src_role"])
    dst_role = sites.role_index(frame["dst_role"])
    src = sites.site_codes(frame["src_role"], frame["src_layer"], frame["src_head_index"],
                           frame["position"])  # fmt: skip
    dst = sites.site_codes(frame["dst_role"], frame["dst_layer"], frame["dst_head_index"],
                           frame["position"])  # fmt: skip
    read = np.asarray(frame["input"].isin(("k", "v")), dtype=bool)
    to = np.where(read, sites.member(dst, reads), sites.member(dst, keys))
    return ((src_role == sites.EMBEDDING) | sites.member(src, keys)) & (
        (dst_role == sites.TARGET) | to)  # fmt: skip
