"""Branches per attention head: the query, key and value branches of a fan-out point,
split by the columns of each head in the projection's output (:func:`head_parts`)."""

from __future__ import annotations

import torch

from ..errors import InputError
from .fanout import Entry, Roles, ancestors, carry_within, descendants, first_contraction

QKV = ("query", "key", "value")
_N_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_N_KV = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_key_value_heads")
_HEAD_DIM = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_head")


def head_parts(res, v, ents, down=None, heads=None, roles=None) -> tuple[list, list]:
    """The query, key and value entries of ``ents`` split by attention head: entries with
    ``head`` set and their contributions (one value per semiring each).

    Head ``h`` of a projection is the ⊕ over the paths from ``v`` through head ``h``'s
    columns of the projection's output (a fused projection: of its part's columns, in
    order, ``head_dim`` per head). Under grouped-query attention the key and value
    heads are the K/V heads (each read by several query heads). ``heads``: the number
    of query heads (an int) or ``{"query": n, "key": n_kv, "value": n_kv}``; by default
    read from the attention module's attributes or the model's config."""
    r = Roles(res, roles)
    down = down if down is not None else descendants(v)
    groups: dict = {}  # (contraction, role) -> (columns, entries)
    for e in ents:
        if e.role not in QKV:
            continue
        proj = e.proj or first_contraction(r, e.op)
        if proj is None:
            raise InputError(
                f"cannot split the {e.role} branch ({e.consumer!r}) by head: no matmul "
                "follows it (a projection whose output holds heads × head_dim columns); "
                "use per_head=False for this model"
            )
        cols = e.cols or tuple(range(res.values[proj].shape[-1]))
        groups.setdefault((proj, e.role), (cols, []))[1].append(e)
    if not groups:
        return [], []
    widths = {role: len(cols) for (_, role), (cols, _) in groups.items()}
    consumer = next((e.consumer for e in ents if e.role in QKV), "")
    counts = head_counts(res.graph, consumer, widths, heads)
    region_of: dict = {}
    out_e, out_p = [], []
    for (proj, role), (cols, es) in groups.items():
        if proj not in region_of:
            region_of[proj] = set().union(*(ancestors(a, down) for a in proj.all_input_nodes))
        d_proj, like = res._store[proj], res.values[proj]
        size = len(cols) // counts[role]
        for h in range(counts[role]):
            mask = torch.zeros(like.shape[-1], dtype=torch.bool, device=like.device)
            mask[list(cols[h * size : (h + 1) * size])] = True
            d = [only_columns(sr, val, mask, like) for sr, val in zip(res.semirings, d_proj)]
            out_p.append(carry_within(res, v, proj, d, region_of[proj]))
            e = es[0]
            out_e.append(Entry(role, e.consumer, e.op, e.via, proj, e.cols, h))
    return out_e, out_p


def only_columns(sr, value, cols, like):
    """``value`` where the last dim is in ``cols`` (a bool mask), the zero elsewhere."""
    zero = sr.zero(like.shape, like)
    out = []
    for f, z in zip(value, zero):
        m = cols.reshape(cols.shape + (1,) * (f.dim() - like.dim()))
        out.append(torch.where(m, f, z))
    return tuple(out)  # a plain tuple: no longer a path at every element


def head_counts(graph, consumer: str, widths: dict, heads) -> dict:
    """``{role: number of heads}`` for projections of ``widths`` columns per role."""
    where = f"the attention at {consumer!r}"
    how = (
        "Give it as heads=<number of query heads> (or heads={'query': n, 'key': n_kv, "
        "'value': n_kv} for grouped-query attention)"
    )
    if isinstance(heads, dict):
        counts = {role: heads.get(role) for role in widths}
        missing = [role for role, n in counts.items() if n is None]
        if missing:
            raise InputError(f"heads= gives no count for {missing} at {where}. {how}")
    else:
        if heads is not None:
            if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
                raise InputError(f"heads must be a positive int or a dict, got {heads!r}")
            n_q, n_kv, d = heads, None, None
        else:
            attrs = _attrs_of(graph, consumer)
            n_q = next((attrs[k] for k in _N_HEADS if k in attrs), None)
            n_kv = next((attrs[k] for k in _N_KV if k in attrs), None)
            if n_kv is None and n_q and "num_key_value_groups" in attrs:
                n_kv = n_q // attrs["num_key_value_groups"]
            d = next((attrs[k] for k in _HEAD_DIM if k in attrs), None)
        if d is None and n_q is not None:
            ref = "query" if "query" in widths else next(iter(widths))
            if widths[ref] % n_q:
                raise InputError(
                    f"{n_q} heads do not divide the {widths[ref]} output columns of the "
                    f"{ref} projection of {where}. {how}"
                )
            d = widths[ref] // n_q
        if d is None or d < 1:
            raise InputError(
                f"cannot tell how many heads {where} has: neither the module nor the "
                f"model's config gives {'/'.join(_N_HEADS)} or {'/'.join(_HEAD_DIM)}. {how}"
            )
        counts = {role: w // d for role, w in widths.items()}
        kv = n_kv if n_kv is not None else (n_q if heads is None else None)
        want = {"query": n_q, "key": kv, "value": kv}
        for role, n in counts.items():
            if want[role] is not None and n != want[role] or n * d != widths[role]:
                raise InputError(
                    f"the {role} projection of {where} has {widths[role]} output columns, "
                    f"not {want[role]} heads × head_dim {d}: its output is not laid out as "
                    f"heads × head_dim. {how}, or use per_head=False"
                )
    for role, n in counts.items():
        if not isinstance(n, int) or n < 1 or widths[role] % n:
            raise InputError(
                f"{n!r} {role} heads do not divide the {widths[role]} output columns of "
                f"the {role} projection of {where}. {how}"
            )
    return counts


def _attrs_of(graph, path: str) -> dict:
    """Head attributes of ``path`` and its ancestors (the nearest module's first)."""
    table = getattr(graph, "head_attrs", {}) or {}
    out: dict = {}
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        for k, val in table.get(".".join(parts[:i]), {}).items():
            out.setdefault(k, val)
    return out
