"""Ablating one site or one branch of a :class:`.patching.Patching` (DESIGN §3b):

- a **site** (the token embedding, a head's columns of its output projection's input, an
  MLP's output, at one position): its value ablated for every consumer;
- a **branch** at a block's fan-out point (skip, query, key, value, mlp): what that
  branch's consumers read, recomputed from the fan-out point with its value at one
  position ablated; the block's other consumers read the fan-out point unchanged.

The effect is ``m(M) - m(ablated)``, from the patched forward of the ``Patching`` (its
ablated values: corrupted, mean or zero).
"""

from __future__ import annotations

import torch

from ..analysis.branches import blocks
from ..analysis.fanout import entries
from ..errors import InputError

__all__ = ["NODE_KEY", "EDGE_KEY", "BRANCHES", "node_effects", "branch_effect"]

#: the columns that name a site (roles embedding / head / mlp)
NODE_KEY = ("layer", "position", "head_index", "role")
#: the columns that name an edge (``Circuit.edges``' columns before ``token``)
EDGE_KEY = ("src_layer", "src_role", "src_head_index", "dst_layer", "dst_role",
            "dst_head_index", "input", "position")  # fmt: skip
#: the branches of a block's fan-out points, as ``layer_table`` names them
BRANCHES = ("skip", "query", "key", "value", "mlp")


def node_effects(p, progress: bool = False):
    """``NODE_KEY`` + ``effect``: m(M) - m(that site ablated for every consumer), one
    patched forward per site (component and position), ``p.batch`` at a time: the sites
    of one node (a block's heads) in one batch, each forward from that node on
    (:class:`.remainder.Remainder`: the clean run's values before it)."""
    import pandas as pd

    lay = p.lay
    groups: dict = {}
    for c, comp in enumerate(lay.components):
        groups.setdefault(comp.nodes, []).append(c)
    rows = []
    items = list(groups.items())
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="sites")
    for nodes, cs in items:
        a, free = p.assign[nodes[0]]
        keeps = []
        for c in cs:
            for pos in (q for q in range(lay.positions) if q not in p.padding):
                k = torch.ones(lay.positions, a.shape[1], dtype=a.dtype, device=a.device)
                k[pos] = 1 - a[c]
                keeps.append(k)
                comp = lay.components[c]
                rows.append({"layer": comp.layer, "position": pos, "head_index": comp.head,
                             "role": comp.role})  # fmt: skip

        rest = p.remainder(nodes)

        def run(k, nodes=nodes, rest=rest):
            return rest(p.base, {n: _site_patch(p.ablated[n], k) for n in nodes}).reshape(())

        for r, m in zip(rows[len(rows) - len(keeps) :], p.batched(run, torch.stack(keeps))):
            r["effect"] = p.clean - m
    frame = pd.DataFrame(rows, columns=[*NODE_KEY, "effect"])
    for col in ("layer", "position", "head_index"):
        frame[col] = frame[col].astype("Int64")
    return frame


def _site_patch(abl, keep):
    """A value's replacement: ``keep`` (1: kept, 0: ablated) mixes it with ``abl``."""

    def patch(value):
        k = keep.reshape(value.shape)
        return k * value + (1 - k) * abl

    return patch


def branch_effect(p, layer: int, branch: str, position: int,
                  sublayer: str | None = None) -> float:  # fmt: skip
    """m(M) - m(only ``branch``'s consumers of block ``layer``'s fan-out point ablated at
    ``position``): they read what they read, recomputed from the fan-out point with
    its value at ``position`` ablated. ``branch``: skip, query, key, value (at the
    block's input) or mlp (at its MLP's input); ``sublayer`` ("attention" / "mlp")
    picks the fan-out point of ``skip`` (default: the block's input)."""
    if branch not in BRANCHES:
        raise InputError(f"branch={branch!r}: give one of {BRANCHES}")
    sublayer = sublayer or ("mlp" if branch == "mlp" else "attention")
    found = blocks(p.res, p.roles)
    if not isinstance(layer, int) or not 0 <= layer < len(found):
        raise InputError(f"layer={layer!r}: the model has blocks 0 to {len(found) - 1}")
    if not isinstance(position, int) or not 0 <= position < p.lay.positions:
        raise InputError(f"position={position!r}: give 0 to {p.lay.positions - 1}")
    point = found[layer].points.get(sublayer)
    if point is None or sublayer not in ("attention", "mlp"):
        raise InputError(f"sublayer={sublayer!r}: block {layer} has {list(found[layer].points)}")
    _, ents = entries(p.res, point, p.roles)
    reads = {e.op: e.via for e in ents if e.role == branch}
    if not reads:
        raise InputError(f"block {layer}'s {sublayer} fan-out point has no {branch!r} branch "
                         f"(it has {sorted({e.role for e in ents})})")  # fmt: skip
    like = p.base[point]
    keep = torch.ones(p.lay.positions, like.numel() // p.lay.positions,
                      dtype=like.dtype, device=like.device)  # fmt: skip
    keep[position] = 0
    with torch.no_grad():
        got = p.output(branch=(point, keep.reshape(like.shape), reads))
    p.evaluations += 1
    return p.clean - float(got)
