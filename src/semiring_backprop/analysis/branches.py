"""Branch tables: how D splits over the branches of every attention block, per token.

:func:`branches` tabulates the contribution of each branch leaving one fan-out point
(:mod:`.fanout` finds the branches and computes their contributions, :mod:`.heads`
splits the query, key and value branches by head); :func:`blocks` finds the attention
blocks and their two fan-out points, and :func:`layer_table` puts every block's
tables together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, NotFoundError
from .fanout import (
    FUSED_QKV,
    ROLE_NAMES,
    Entry,
    Roles,
    contribution,
    descendants,
    entries,
    role_of_weight,
)
from .heads import QKV, head_parts

aten = torch.ops.aten


# -- readouts and tables --------------------------------------------------------------


#: how a branch's per-unit values become one number per token (Result.branches)
AGGREGATES = ("oplus", "bucket_sum", "paper")


def _rank(sr, value, aggregate="bucket_sum") -> torch.Tensor:
    """What bucket_sum and paper rank branches by (the quantity ⊕ selects on)."""
    if not sr.selective:
        raise InputError(
            f"aggregate={aggregate!r} gives each hidden unit to the branch that wins its ⊕; "
            f"that needs a selective semiring (MaxProduct, MaxAbs, TopK), not {sr}"
        )
    return sr.rank(value)


def branches(res, where, semiring=None, aggregate="oplus", roles=None, hidden_dim=-1,
             by="consumer", per_head=False, heads=None):  # fmt: skip
    """Tidy DataFrame: the contribution through each consumer of ``where``, per token
    (with ``per_head``, the query, key and value branches per head: :func:`head_parts`).
    ``aggregate`` a tuple: the contributions computed once, read by each aggregate (an
    ``aggregation`` column; the aggregates other than ``oplus`` for the selective
    semirings only)."""
    import pandas as pd

    aggs = _aggregates(aggregate)
    if heads is not None and not per_head:
        raise InputError("heads= gives the head counts of per-head tables: add per_head=True")
    if semiring is None:
        srs = res.semirings
    elif isinstance(semiring, list | tuple):
        srs = list(semiring)
    else:
        srs = [semiring]
    for sr in srs:
        if sr not in res.semirings:
            raise InputError(f"{sr} was not computed in this pass (computed: {res.semirings})")
    v, ents = entries(res, where, roles)
    down = descendants(v)
    if per_head:
        head_e, head_p = head_parts(res, v, ents, down, heads, roles)
        ents = [e for e in ents if e.role not in QKV]
        parts = [contribution(res, v, e, down) for e in ents] + head_p
        ents += head_e
    else:
        parts = [contribution(res, v, e, down) for e in ents]
    if by == "role":  # ⊕ the branches that share a role (a gated MLP's gate and up)
        ents, parts = _by_role(res, ents, parts)
    elif by != "consumer":
        raise InputError(f"by must be 'consumer' or 'role', got {by!r}")
    frames = []
    for agg in aggs:
        use = srs if agg == "oplus" or isinstance(aggregate, str) else [
            sr for sr in srs if sr.selective]  # fmt: skip
        if not use:
            raise InputError(
                f"aggregate={agg!r} gives each hidden unit to the branch that wins "
                "its ⊕; that needs a selective semiring (MaxProduct, MaxAbs, TopK)"
            )
        for sr in use:
            f = _per_token(res, sr, [p[res.semirings.index(sr)] for p in parts], ents, agg,
                           hidden_dim, per_head)  # fmt: skip
            if not isinstance(aggregate, str):
                f.insert(f.columns.get_loc("value"), "aggregation", agg)
            frames.append(f)
    return pd.concat(frames, ignore_index=True)


def _aggregates(aggregate) -> tuple[str, ...]:
    """``aggregate`` (one name or a tuple of names) as a tuple, each checked."""
    aggs = (aggregate,) if isinstance(aggregate, str) else tuple(aggregate)
    bad = [a for a in aggs if a not in AGGREGATES]
    if bad or not aggs:
        raise InputError(
            f"aggregate must be one of {', '.join(map(repr, AGGREGATES))} (or a tuple of "
            f"them), got {aggregate!r}"
        )
    return aggs


def _by_role(res, ents, parts):
    merged: dict = {}
    for e, p in zip(ents, parts):
        key = (e.role, e.head)
        if key not in merged:
            merged[key] = (e, p)
            continue
        e0, p0 = merged[key]
        both = [sr.plus(a, b) for sr, a, b in zip(res.semirings, p0, p)]
        merged[key] = (Entry(e.role, f"{e0.consumer} + {e.consumer}", e0.op, e0.via,
                             head=e.head), both)  # fmt: skip
    return [e for e, _ in merged.values()], [p for _, p in merged.values()]


def _per_token(res, sr, values, ents, aggregate, hidden_dim, per_head=False):
    import pandas as pd

    rows = []
    zero = sr.zero((1,), values[0][0])[0].reshape(())
    if aggregate == "oplus":
        agg = [sr.sum(val, (hidden_dim,)) for val in values]
        stacked = torch.stack([sr.scalar(a) for a in agg])  # (branches, *tokens)
        # the winner is the branch ⊕ selects (TopK's headline is signed; it selects on |value|)
        win = (
            torch.stack([sr.rank(a) for a in agg]).argmax(0) if sr.selective else stacked.argmax(0)
        )
        has = torch.stack([a[0] != zero for a in agg])  # a path leaves through it
        has = has.reshape(*stacked.shape, -1).any(-1)
        live = has.any(0)
    else:
        score = torch.stack([_rank(sr, val, aggregate) for val in values])  # (branches, *shape)
        best = score.argmax(0)
        total = values[0]
        for val in values[1:]:
            total = sr.plus(total, val)
        unit = sr.scalar(total)
        hd = hidden_dim % unit.dim()
        if aggregate == "paper":  # the token's best unit, to the branch that wins it
            top = sr.rank(total).argmax(hd, keepdim=True)
            win = best.gather(hd, top).squeeze(hd)
            value = unit.gather(hd, top).squeeze(hd)
            stacked = torch.stack([torch.where(win == b, value, 0) for b in range(len(values))])
        else:
            stacked = torch.stack(
                [torch.where(best == b, unit, 0).sum(hd) for b in range(len(values))]
            )
            win = stacked.argmax(0)
        live = (total[0] != zero).reshape(*unit.shape, -1).any(-1).any(hd)
        has = torch.stack([(v[0] != zero).reshape(*unit.shape, -1).any(-1).any(hd)
                           for v in values])  # fmt: skip
    stacked = stacked.detach().cpu().double()
    batched = stacked.dim() > 2 and stacked.shape[1] > 1
    for idx in _indices(stacked.shape[1:]):
        for b, e in enumerate(ents):
            rows.append(
                {
                    **_position(idx, batched),
                    "consumer": e.consumer,
                    "role": e.role,
                    **({"head_index": e.head} if per_head else {}),
                    "value": float(stacked[(b, *idx)]),
                    "winner": bool(win[idx] == b) and bool(live[idx]),
                    "path": bool(has[(b, *idx)]),
                    "semiring": sr.name,
                }
            )
    frame = pd.DataFrame(rows)
    if per_head:  # None where a branch has no heads (skip, mlp)
        frame["head_index"] = frame["head_index"].astype("Int64")
    return frame


def _indices(shape):
    import itertools

    return itertools.product(*(range(s) for s in shape))


def _position(idx, batched):
    if len(idx) == 0:
        return {"token": 0}
    if len(idx) == 1:
        return {"token": idx[0]}
    if batched:
        return {"example": idx[0], "token": idx[-1]}
    return {"token": idx[-1]}


# -- every layer ----------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One attention block: its layer module and its two fan-out points."""

    layer: str  #: module path of the layer ("" when the model is a single layer)
    attention: str  #: module path of the attention module
    points: dict  #: sublayer ("attention" / "mlp") -> fan-out node


def on_result(res, key: tuple, make):
    """``make()``, once per result and ``key`` (kept on ``res``): what is read off one
    pass's graph, values and D (the blocks, the sites, the circuit's layout) is the same
    for each stage of a circuit that reads it. (``key`` holds the arguments' reprs:
    ``roles`` may be a dict.)"""
    memo = res.__dict__.setdefault("_found", {})
    if key not in memo:
        memo[key] = make()
    return memo[key]


def blocks(res, roles=None) -> list[Block]:
    """The attention blocks of the model, in order, with their fan-out points."""
    return on_result(res, ("blocks", repr(roles)), lambda: _blocks(res, roles))


def _blocks(res, roles) -> list[Block]:
    r = Roles(res, roles)
    types = r.types
    qkv = {"query", "key", "value"}
    owned: dict = {}  # module path -> its own weights (TransformerLens: W_Q, W_K, W_V)
    for w in r.weights.values():
        owned.setdefault(w.rsplit(".", 1)[0], []).append(w)
    attn = []
    for path, kind in types.items():
        kids = [p for p in types if p.rsplit(".", 1)[0] == path and p != path]
        builtin = {_builtin_role(k) for k in kids}
        chosen = {r.of_module(k) for k in kids}  # with the user's roles, if any
        kid_roles = builtin if qkv <= builtin else chosen
        reads = {role_of_weight(n) for n in kids + owned.get(path, [])}  # W_Q, hook_q, ...
        fused = kind == "MultiheadAttention" or any(
            k.rsplit(".", 1)[-1].lower() in FUSED_QKV for k in kids
        )
        if fused or qkv <= kid_roles or qkv <= reads:
            attn.append(path)
    attn = [a for a in attn if not any(a != b and a.startswith(b + ".") for b in attn)]
    out = []
    for a in attn:
        layer = layer_of(a)
        if not layer and len(attn) > 1:  # outside the numbered layers: a pooling head
            continue  # (SigLIP's), not a block of the residual stream
        v = res.graph.tags.get(f"{layer}:input") if layer else _first_input(res)
        if v is None or v not in res._store:
            continue
        points = {"attention": v}
        try:
            _, ents = entries(res, v, roles)
        except NotFoundError:
            continue
        skip = [e for e in ents if e.role == "skip"]
        if skip:
            m = _next_fanout(r, skip[0].op)
            if m is not None and not _feeds_attention(res, m, roles):
                points["mlp"] = m
        out.append(Block(layer, a, points))
    return out


def _feeds_attention(res, point, roles) -> bool:
    """Whether query / key / value branches leave ``point``: then it is the next block's
    input (a block with no MLP: attention-only models), not this block's MLP's."""
    try:
        _, ents = entries(res, point, roles)
    except NotFoundError:
        return False
    return any(e.role in QKV for e in ents)


def _builtin_role(path: str) -> str | None:
    last = path.rsplit(".", 1)[-1].lower()
    return next((role for role, names in ROLE_NAMES.items() if last in names), None)


def layer_of(path: str) -> str:
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _first_input(res):
    for node in res.graph.user_inputs.values():
        if node in res._store:
            return node
    return None


def _effective_users(r: Roles, node):
    out, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        for u in r.users(n):
            if u in seen:
                continue
            seen.add(u)
            (todo if r.transparent(u) else out).append(u)
    return out


_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _next_fanout(r: Roles, node, limit=8):
    """From a residual add, the next tensor that feeds several branches (through norms
    and reshapes: OPT flattens the batch between its sublayers)."""
    for _ in range(limit):
        users = _effective_users(r, node)
        if len(users) == 1 and users[0].target in _RESHAPES:
            node = users[0]
            continue
        mods = {r.module(u) for u in users}
        if len(mods) == 1 and (m := next(iter(mods))) and r.is_norm(m):
            node = r.res.graph.tags.get(m)
            if node is None:
                return None
            continue
        return node if len(users) >= 2 else None
    return None


def layer_table(res, semirings=None, aggregate="oplus", tokens=None, roles=None,
                sublayers=("attention", "mlp"), by="consumer", per_head=False,
                heads=None):  # fmt: skip
    """Tidy DataFrame of the branch values of every attention block's fan-out points."""
    import pandas as pd

    found = blocks(res, roles)
    if not found:
        raise NotFoundError(
            "found no attention block (a module with query/key/value projections, a fused "
            "qkv projection or an nn.MultiheadAttention); name a fan-out point with "
            "res.branches(where, ...) or pass roles={'module regex': 'query', ...}"
        )
    srs = list(semirings or res.semirings)
    if isinstance(aggregate, str) and aggregate != "oplus":
        srs = [sr for sr in srs if getattr(sr, "selective", False)]
    if not srs or ("oplus" not in _aggregates(aggregate)
                   and not any(getattr(sr, "selective", False) for sr in srs)):  # fmt: skip
        raise InputError(f"aggregate={aggregate!r} needs a selective semiring (MaxProduct…)")
    frames = []
    for i, b in enumerate(found):
        for sub in sublayers:
            if sub not in b.points:
                continue
            f = branches(res, b.points[sub], srs, aggregate, roles, by=by, per_head=per_head,
                         heads=heads)  # fmt: skip
            f.insert(0, "sublayer", sub)
            f.insert(0, "layer", i)
            frames.append(f)
    table = pd.concat(frames, ignore_index=True).rename(columns={"role": "branch"})
    if tokens is not None:  # one list per example, as long as the positions
        from .tokens import token_texts

        table.insert(table.columns.get_loc("token") + 1, "token_text",
                     token_texts(tokens, table))  # fmt: skip
    else:
        table.insert(table.columns.get_loc("token") + 1, "token_text",
                     table["token"].astype(str))  # fmt: skip
    return table
