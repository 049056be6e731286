"""Branches at fan-out points: how D splits over the consumers of one tensor.

Where a tensor ``v`` feeds several ops (a residual stream feeding the skip connection and
the query, key and value projections), every path from ``v`` leaves through exactly one
of them. The contribution of one branch is ⊕ over the paths that leave through it: the
branch's entry op applies its rule to its own D, and a pass restricted to the nodes
between ``v`` and that op carries it back to ``v`` (through identity marks, and through a
pre-norm's layer norm when the projections read the normed tensor). Under ⊕ the
branches give back D(v).

Roles come from module names (BERT, GPT-2, Llama, ``nn.TransformerEncoderLayer`` and
their relatives); fused projections (GPT-2's ``c_attn``, ``nn.MultiheadAttention``'s
``in_proj``) get theirs from which part of the projection's output each slice reads.
Where the projections are not modules of their own (TransformerLens' ``attn.W_Q``, read
through an einsum), a consumer's role is that of the weight its contraction reads or of
the hook module its output passes (``attn.hook_q``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.fx.node import map_arg

from .. import engine
from ..errors import InputError, NotFoundError
from ..tracing import mark_module, mark_op

aten = torch.ops.aten

ROLES = ("skip", "query", "key", "value", "mlp", "other")

_NAMES = {
    "query": {"query", "q_proj", "q_lin", "q", "wq", "to_q", "query_proj", "q_attn"},
    "key": {"key", "k_proj", "k_lin", "k", "wk", "to_k", "key_proj"},
    "value": {"value", "v_proj", "v_lin", "v", "wv", "to_v", "value_proj"},
    "mlp": {
        "mlp",
        "intermediate",
        "feed_forward",
        "ffn",
        "linear1",
        "fc1",
        "c_fc",
        "gate_proj",
        "up_proj",
        "dense_h_to_4h",
        "fc_in",
        "w1",
        "lin1",
        "densereludense",
        "wi",
        "wi_0",
        "wi_1",
        "gate_up_proj",
    },  # fmt: skip
}
#: weights and hook modules that name the projection a contraction makes (TransformerLens)
_READS = {
    "query": {"w_q", "hook_q"},
    "key": {"w_k", "hook_k"},
    "value": {"w_v", "hook_v"},
    "mlp": {"w_in", "w_gate", "hook_pre"},
}
_FUSED = {"c_attn", "qkv", "qkv_proj", "wqkv", "query_key_value", "in_proj", "w_pack"}
_TRANSPARENT = {mark_op, aten.clone.default, aten.alias.default}
_SHIFT_OPS = {aten.add.Tensor, aten.sub.Tensor}
_SKIP_OPS = {aten.add.Tensor}


@dataclass(frozen=True)
class Entry:
    """One branch leaving a fan-out point: ``op`` reads ``via`` (downstream of the point)."""

    role: str
    consumer: str  #: module path of the entry op, or the weight or hook that names its role
    op: torch.fx.Node
    via: torch.fx.Node
    #: a fused projection's contraction and the columns of its output this part reads
    proj: torch.fx.Node | None = None
    cols: tuple = ()
    head: int | None = None  #: per-head tables: the attention head (K/V heads under GQA)


class _Roles:
    def __init__(self, res, roles=None):
        self.res = res
        self.types = getattr(res.graph, "module_types", {}) or {}
        self.user = roles
        self.store = res._store
        sig = res.graph.program.graph_signature
        names = {**sig.inputs_to_buffers, **sig.inputs_to_parameters}
        #: placeholder -> weight path as the user names it (``blocks.0.attn.W_Q``)
        self.weights = {
            n: names[n.name].removeprefix("model.") for n in res.graph.constants if n.name in names
        }

    def module(self, node) -> str:
        return mark_module(node) or self.res.graph.module_of(node) or ""

    def of_user(self, path: str) -> str | None:
        if self.user is None:
            return None
        return self.user(path) if callable(self.user) else _match(self.user, path)

    def of_module(self, path: str) -> str | None:
        role = self.of_user(path)
        if role is not None:
            return role
        for part in reversed(path.split(".")):
            for role, names in _NAMES.items():
                if part.lower() in names:
                    return role
        return None

    def is_norm(self, path: str) -> bool:
        kind = self.types.get(path, "")
        last = path.rsplit(".", 1)[-1].lower()
        return "norm" in kind.lower() or bool(re.fullmatch(r"(ln|layer_?norm|norm)\w*", last))

    def is_fused(self, path: str) -> bool:
        last = path.rsplit(".", 1)[-1].lower()
        return last in _FUSED or self.types.get(path) == "MultiheadAttention"

    def users(self, node):
        return [u for u in node.users if u in self.store]

    def transparent(self, node) -> bool:
        """Moves its input on unchanged, or shifts it by a number (TransformerLens' ``x + 0.0``)."""
        if node.target in _TRANSPARENT:
            return True
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        return node.target in _SHIFT_OPS and len(tensors) == 1

    def read_role(self, u) -> tuple[str, str] | None:
        """(role, name) of the projection ``u`` feeds, from the weight its contraction reads
        (``attn.W_Q``) or the hook module on the projection's output (``attn.hook_q``)."""
        proj = _first_contraction(self, u)
        if proj is None:
            return None
        for a in proj.all_input_nodes:
            name = self.weight_of(a)
            if name and (role := _read_role(name)):
                return role, name
        n = proj
        for _ in range(8):
            users = self.users(n)
            if len(users) != 1 or not (users[0].target in _ROUTING or self.transparent(users[0])):
                return None
            n = users[0]
            if n.target is mark_op and (role := _read_role(mark_module(n))):
                return role, mark_module(n)
        return None

    def weight_of(self, node, limit=8) -> str | None:
        """The weight ``node`` is, through data-movement ops (a transpose, a reshape)."""
        for _ in range(limit):
            if node in self.weights:
                return self.weights[node]
            if node.target not in _ROUTING:
                return None
            inputs = node.all_input_nodes
            if len(inputs) != 1:
                return None
            node = inputs[0]
        return None


def _read_role(name: str) -> str | None:
    last = name.rsplit(".", 1)[-1].lower().lstrip("_")  # TransformerLens' GQA: ``_W_K``
    return next((role for role, names in _READS.items() if last in names), None)


def _match(mapping, path):
    for pattern, role in mapping.items():
        if re.search(pattern, path):
            return role
    return None


def entries(res, where, roles=None) -> tuple[torch.fx.Node, list[Entry]]:
    """The fan-out point ``where`` and the branches leaving it."""
    r = _Roles(res, roles)
    v = res.node(where)
    if v not in res._store:
        res.value(v, res.semirings[0])  # raises the explanatory error
    out, todo, seen = [], [v], set()
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        for u in r.users(n):
            out.extend(_classify(r, u, n, todo))
    if not out:
        raise NotFoundError(f"{where!r} has no consumer on a path to the output")
    return v, out


def _classify(r: _Roles, u, via, todo) -> list[Entry]:
    module = r.module(u)
    if r.transparent(u):
        todo.append(u)
        return []
    role = r.of_user(module)
    if role is None and _is_residual(u):  # Bloom adds the residual inside its MLP module
        role = "skip"
    role = role or r.of_module(module)
    if role is not None:
        return [Entry(role, module, u, via)]
    if module and r.is_norm(module):
        out = r.res.graph.tags.get(_call_output(module, via))
        if out is None:
            return [Entry("other", module, u, via)]
        todo.append(out)
        return []
    if module and r.is_fused(module):
        return _fused_entries(r, u, via, module)
    if u.target in _SKIP_OPS:
        return [Entry("skip", module, u, via)]
    read = r.read_role(u)
    if read is not None:
        role, name = read
        return [Entry(r.of_user(name) or role, name, u, via)]
    return [Entry("other", module, u, via)]


def _is_residual(u) -> bool:
    """A tensor + tensor add: the fan-out point added to a branch's result."""
    return u.target in _SKIP_OPS and sum(isinstance(a, torch.fx.Node) for a in u.args) == 2


def _call_output(module: str, via) -> str:
    """The tag of a module's output for the call that reads ``via``: a module called
    several times (TransformerLens' ``ln1`` for q, k and v) is tagged ``path@k`` per call."""
    tag = via.args[1] if via.target is mark_op else ""
    if tag.endswith(":input") and tag.split("@")[0].removesuffix(":input") == module:
        return tag.removesuffix(":input")
    return module


def _fused_entries(r: _Roles, u, via, module) -> list[Entry]:
    """q/k/v from a fused projection: label its output columns by index and follow them
    through the data-movement ops to the first ops that take a part of them (slices,
    selects, indexing). Those parts, in the order of their first column, are the query,
    the key and the value: ``[q | k | v]`` (GPT-2), per head ``[q k v]`` (GPT-NeoX,
    Bloom), ``[q heads | k | v]`` of unequal widths (grouped-query Phi-3, Falcon)."""
    proj = _first_contraction(r, u)
    if proj is None:
        return [Entry("other", module, u, via)]
    shape = r.res.values[proj].shape
    width = shape[-1]
    labels = {proj: torch.arange(width).expand(shape).contiguous()}
    parts: dict = {}  # frozenset of columns -> [(op, the node it reads)]
    todo = [proj]
    while todo:
        n = todo.pop(0)
        for c in r.users(n):
            if c in labels:
                continue
            lab = _route(c, n, labels[n], r.res.values)
            if lab is None:  # not a data-movement op: the labels stop here
                return [Entry("other", module, u, via)]
            cols = frozenset(lab.unique().tolist())
            if len(cols) == width:  # every column still: a reshape, a permute
                labels[c] = lab
                todo.append(c)
            else:
                parts.setdefault(cols, []).append((c, n))
    order = sorted(parts, key=min)
    disjoint = sum(map(len, order)) == len(frozenset().union(*order)) if order else False
    if len(order) not in (2, 3) or not disjoint:
        return [Entry("other", module, u, via)]
    names = ("query", "key", "value")[3 - len(order) :]
    # everything from the input up to each part's entry is one region: enter at ``u``
    return [
        Entry(name, r.module(c), c, n, proj, tuple(sorted(cols)))
        for name, cols in zip(names, order)
        for c, n in parts[cols]
    ]


def _first_contraction(r, u):
    n = u
    for _ in range(16):
        if n.target in (aten.addmm.default, aten.mm.default, aten.bmm.default, aten.matmul.default):
            return n
        users = r.users(n)
        if len(users) != 1:
            return None
        n = users[0]
    return None


_ROUTING = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.clone.default, aten.slice.Tensor, aten.select.int,
    aten.expand.default, aten.alias.default, aten.t.default, aten.contiguous.default, mark_op,
    aten.index.Tensor, aten.index_select.default,
}  # fmt: skip


def _route(node, src, labels, values):
    """Where ``node`` moves the elements of ``src`` (their labels), or None if it is not
    a data-movement op. Other tensor arguments (indices) are read from ``values``."""
    if node.target not in _ROUTING:
        return None
    if node.target is mark_op:
        return labels
    if node.target in (aten.view.default, aten._unsafe_view.default):
        return labels.reshape(values[node].shape)
    args, kwargs = map_arg((node.args, node.kwargs), lambda a: labels if a is src else values[a])
    if node.target is aten.index.Tensor and any(
        isinstance(i, torch.Tensor) and i.is_floating_point() for i in args[1]
    ):
        return None
    return node.target(*args, **kwargs)


# -- contributions --------------------------------------------------------------------


def _descendants(v):
    out, todo = set(), [v]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(n.users)
    return out


def _ancestors(t, stop):
    out, todo = set(), [t]
    while todo:
        n = todo.pop()
        if n not in out and n in stop:
            out.add(n)
            todo.extend(n.all_input_nodes)
    return out


def contribution(res, v, entry: Entry, down=None) -> list:
    """⊕ over the paths from ``v`` that leave through ``entry``: one value per semiring."""
    down = down if down is not None else _descendants(v)
    region = _ancestors(entry.via, down)
    return _carry(res, v, entry.op, res._store[entry.op], region)


def _carry(res, v, u, d, region) -> list:
    """⊕ over the paths from ``v`` that stay in ``region`` up to ``u`` and go on from
    ``u`` with the values ``d`` (one per semiring) at ``u``."""
    graph, values, needed = res.graph, res.values, res.needed
    u_id = graph.ids[u]
    acc: dict = {}
    with torch.no_grad():  # the weights are constants here, as in the pass
        for inp, s, c in engine.contributions(graph, values, res.semirings, u_id, d, needed):
            if inp in region:
                slot = acc.setdefault(inp, [None] * len(res.semirings))
                sr = res.semirings[s]
                slot[s] = sr.accumulate(slot[s], c)
        for inp, slot in acc.items():
            for s, sr in enumerate(res.semirings):
                if slot[s] is None:
                    slot[s] = sr.zero(values[inp].shape, values[inp])
        store = engine.propagate(graph, values, res.semirings, acc, needed, within=region)
    if v not in store:
        return [sr.zero(values[v].shape, values[v]) for sr in res.semirings]
    return store[v]


# -- per head --------------------------------------------------------------------------

_QKV = ("query", "key", "value")
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
    r = _Roles(res, roles)
    down = down if down is not None else _descendants(v)
    groups: dict = {}  # (contraction, role) -> (columns, entries)
    for e in ents:
        if e.role not in _QKV:
            continue
        proj = e.proj or _first_contraction(r, e.op)
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
    consumer = next((e.consumer for e in ents if e.role in _QKV), "")
    counts = _head_counts(res.graph, consumer, widths, heads)
    region_of: dict = {}
    out_e, out_p = [], []
    for (proj, role), (cols, es) in groups.items():
        if proj not in region_of:
            region_of[proj] = set().union(*(_ancestors(a, down) for a in proj.all_input_nodes))
        d_proj, like = res._store[proj], res.values[proj]
        size = len(cols) // counts[role]
        for h in range(counts[role]):
            mask = torch.zeros(like.shape[-1], dtype=torch.bool, device=like.device)
            mask[list(cols[h * size : (h + 1) * size])] = True
            d = [_only(sr, val, mask, like) for sr, val in zip(res.semirings, d_proj)]
            out_p.append(_carry(res, v, proj, d, region_of[proj]))
            e = es[0]
            out_e.append(Entry(role, e.consumer, e.op, e.via, proj, e.cols, h))
    return out_e, out_p


def _only(sr, value, cols, like):
    """``value`` where the last dim is in ``cols`` (a bool mask), the zero elsewhere."""
    zero = sr.zero(like.shape, like)
    out = []
    for f, z in zip(value, zero):
        m = cols.reshape(cols.shape + (1,) * (f.dim() - like.dim()))
        out.append(torch.where(m, f, z))
    return tuple(out)  # a plain tuple: no longer a path at every element


def _head_counts(graph, consumer: str, widths: dict, heads) -> dict:
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


# -- readouts and tables --------------------------------------------------------------


def _rank(sr, value) -> torch.Tensor:
    """What bucket_sum ranks branches by (the quantity ⊕ selects on)."""
    if not sr.selective:
        raise InputError(
            f"aggregate='bucket_sum' assigns each hidden unit to the branch that wins its ⊕; "
            f"that needs a selective semiring (MaxProduct, MaxAbs, TopK), not {sr}"
        )
    return sr.rank(value)


def branches(res, where, semiring=None, aggregate="oplus", roles=None, hidden_dim=-1,
             by="consumer", per_head=False, heads=None):  # fmt: skip
    """Tidy DataFrame: the contribution through each consumer of ``where``, per token
    (with ``per_head``, the query, key and value branches per head: :func:`head_parts`)."""
    import pandas as pd

    if aggregate not in ("oplus", "bucket_sum"):
        raise InputError(f"aggregate must be 'oplus' or 'bucket_sum', got {aggregate!r}")
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
    down = _descendants(v)
    if per_head:
        head_e, head_p = head_parts(res, v, ents, down, heads, roles)
        ents = [e for e in ents if e.role not in _QKV]
        parts = [contribution(res, v, e, down) for e in ents] + head_p
        ents += head_e
    else:
        parts = [contribution(res, v, e, down) for e in ents]
    if by == "role":  # ⊕ the branches that share a role (a gated MLP's gate and up)
        ents, parts = _by_role(res, ents, parts)
    elif by != "consumer":
        raise InputError(f"by must be 'consumer' or 'role', got {by!r}")
    frames = [
        _per_token(res, sr, [p[res.semirings.index(sr)] for p in parts], ents, aggregate,
                   hidden_dim, per_head)
        for sr in srs
    ]  # fmt: skip
    return pd.concat(frames, ignore_index=True)


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
        score = torch.stack([_rank(sr, val) for val in values])  # (branches, *shape)
        best = score.argmax(0)
        total = values[0]
        for val in values[1:]:
            total = sr.plus(total, val)
        unit = sr.scalar(total)
        hd = hidden_dim % unit.dim()
        stacked = torch.stack([torch.where(best == b, unit, 0).sum(hd) for b in range(len(values))])
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
                    **({"head": e.head} if per_head else {}),
                    "value": float(stacked[(b, *idx)]),
                    "winner": bool(win[idx] == b) and bool(live[idx]),
                    "path": bool(has[(b, *idx)]),
                    "semiring": sr.name,
                }
            )
    frame = pd.DataFrame(rows)
    if per_head:  # None where a branch has no heads (skip, mlp)
        frame["head"] = frame["head"].astype("Int64")
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


def blocks(res, roles=None) -> list[Block]:
    """The attention blocks of the model, in order, with their fan-out points."""
    r = _Roles(res, roles)
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
        reads = {_read_role(n) for n in kids + owned.get(path, [])}  # W_Q, hook_q, ...
        fused = kind == "MultiheadAttention" or any(
            k.rsplit(".", 1)[-1].lower() in _FUSED for k in kids
        )
        if fused or qkv <= kid_roles or qkv <= reads:
            attn.append(path)
    attn = [a for a in attn if not any(a != b and a.startswith(b + ".") for b in attn)]
    out = []
    for a in attn:
        layer = _layer_of(a)
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
            if m is not None:
                points["mlp"] = m
        out.append(Block(layer, a, points))
    return out


def _builtin_role(path: str) -> str | None:
    last = path.rsplit(".", 1)[-1].lower()
    return next((role for role, names in _NAMES.items() if last in names), None)


def _layer_of(path: str) -> str:
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


def _effective_users(r: _Roles, node):
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


def _next_fanout(r: _Roles, node, limit=8):
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
    frames = []
    for i, b in enumerate(found):
        for sub in sublayers:
            if sub not in b.points:
                continue
            srs = list(semirings or res.semirings)
            if aggregate == "bucket_sum":
                srs = [sr for sr in srs if getattr(sr, "selective", False)]
            if not srs:
                raise InputError("aggregate='bucket_sum' needs a selective semiring (MaxProduct…)")
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
