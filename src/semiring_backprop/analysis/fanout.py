"""Fan-out points: the branches that leave a tensor, and ⊕ over the paths through each.

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

from ..engine.reverse import contributions, propagate
from ..errors import NotFoundError
from ..tracing.trace import mark_module, mark_op

aten = torch.ops.aten

ROLES = ("skip", "query", "key", "value", "mlp", "other")

ROLE_NAMES = {
    "query": {"query", "q_proj", "q_lin", "q", "wq", "to_q", "query_proj", "q_attn", "q_head"},
    "key": {"key", "k_proj", "k_lin", "k", "wk", "to_k", "key_proj", "k_head"},
    "value": {"value", "v_proj", "v_lin", "v", "wv", "to_v", "value_proj", "v_head"},
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
        "ff",  # XLNet
        "block_sparse_moe",  # mixtures of experts: Granite-MoE, PhiMoE, JetMoE
        "moe",
    },  # fmt: skip
}
#: weights and hook modules that name the projection a contraction makes (TransformerLens)
_READS = {  # (XLNet's weights are rel_attn.q, .k, .v)
    "query": {"w_q", "hook_q", "q"},
    "key": {"w_k", "hook_k", "k"},
    "value": {"w_v", "hook_v", "v"},
    "mlp": {"w_in", "w_gate", "hook_pre"},
}
# (not ``in_proj``: that is Mamba's mixer input, z / x / dt, far more often than an
# attention's; nn.MultiheadAttention is known by its type)
FUSED_QKV = {"c_attn", "qkv", "qkv_proj", "wqkv", "query_key_value", "w_pack"}
_TRANSPARENT = {mark_op, aten.clone.default, aten.alias.default}
_SHIFT_OPS = {aten.add.Tensor, aten.sub.Tensor}
#: ops that move every element of their input on, unchanged, in a module with no role of
#: its own: a branch is named by what follows them
_MOVES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.t.default, aten.expand.default, aten.constant_pad_nd.default,
    aten.roll.default,
}  # fmt: skip
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


class Roles:
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
            for role, names in ROLE_NAMES.items():
                if part.lower() in names:
                    return role
        return None

    def is_norm(self, path: str) -> bool:
        kind = self.types.get(path, "")
        last = path.rsplit(".", 1)[-1].lower()
        return "norm" in kind.lower() or bool(re.fullmatch(r"(ln|layer_?norm|norm)\w*", last))

    def is_fused(self, path: str) -> bool:
        last = path.rsplit(".", 1)[-1].lower()
        return last in FUSED_QKV or self.types.get(path) == "MultiheadAttention"

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
        proj = first_contraction(self, u)
        if proj is None:
            return None
        for a in proj.all_input_nodes:
            name = self.weight_of(a)
            if name and (role := role_of_weight(name)):
                return role, name
        n = proj
        for _ in range(8):
            users = self.users(n)
            if len(users) != 1 or not (users[0].target in _ROUTING or self.transparent(users[0])):
                return None
            n = users[0]
            if n.target is mark_op and (role := role_of_weight(mark_module(n))):
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


def role_of_weight(name: str) -> str | None:
    last = name.rsplit(".", 1)[-1].lower().lstrip("_")  # TransformerLens' GQA: ``_W_K``
    return next((role for role, names in _READS.items() if last in names), None)


def _match(mapping, path):
    for pattern, role in mapping.items():
        if re.search(pattern, path):
            return role
    return None


def entries(res, where, roles=None) -> tuple[torch.fx.Node, list[Entry]]:
    """The fan-out point ``where`` and the branches leaving it."""
    r = Roles(res, roles)
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


def _classify(r: Roles, u, via, todo) -> list[Entry]:
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
    if u.target in _MOVES:  # Swin pads and cuts windows between its norm and attention
        todo.append(u)
        return []
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


def _fused_entries(r: Roles, u, via, module) -> list[Entry]:
    """q/k/v from a fused projection: label its output columns by index and follow them
    through the data-movement ops to the first ops that take a part of them (slices,
    selects, indexing). Those parts, in the order of their first column, are the query,
    the key and the value: ``[q | k | v]`` (GPT-2), per head ``[q k v]`` (GPT-NeoX,
    Bloom), ``[q heads | k | v]`` of unequal widths (grouped-query Phi-3, Falcon)."""
    proj = first_contraction(r, u)
    if proj is None:
        return [Entry("other", module, u, via)]
    shape = r.res.values[proj].shape
    width = shape[-1]
    labels = {proj: torch.arange(width).expand(shape).contiguous()}
    parts: dict = {}  # frozenset of columns -> [(op, the node it reads)]
    todo = [proj]
    # (every part that reads the projection, also one no path leaves under relevance
    # weights, where the query and key carry none: engine.relevance)
    needed = r.res.needed if getattr(r.res.graph, "weights", "gradient") == "relevance" else ()
    while todo:
        n = todo.pop(0)
        for c in r.users(n) if not needed else [c for c in n.users if c in needed]:
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


#: the ops a projection's matmul becomes
CONTRACTIONS = (aten.addmm.default, aten.mm.default, aten.bmm.default, aten.matmul.default)


def first_contraction(r, u):
    n = u
    for _ in range(16):
        if n.target in CONTRACTIONS:
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


def descendants(v):
    out, todo = set(), [v]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(n.users)
    return out


def ancestors(t, stop):
    out, todo = set(), [t]
    while todo:
        n = todo.pop()
        if n not in out and n in stop:
            out.add(n)
            todo.extend(n.all_input_nodes)
    return out


def contribution(res, v, entry: Entry, down=None) -> list:
    """⊕ over the paths from ``v`` that leave through ``entry``: one value per semiring."""
    down = down if down is not None else descendants(v)
    if entry.op not in res._store:  # no path leaves there (a query under relevance weights)
        x = res.values[v]
        return [sr.zero(x.shape, x) for sr in res.semirings]
    region = ancestors(entry.via, down)
    return carry_within(res, v, entry.op, res._store[entry.op], region)


def carry_within(res, v, u, d, region) -> list:
    """⊕ over the paths from ``v`` that stay in ``region`` up to ``u`` and go on from
    ``u`` with the values ``d`` (one per semiring) at ``u``."""
    graph, values, needed = res.graph, res.values, res.needed
    u_id = graph.ids[u]
    acc: dict = {}
    with torch.no_grad():  # the weights are constants here, as in the pass
        for inp, s, c in contributions(graph, values, res.semirings, u_id, d, needed):
            if inp in region:
                slot = acc.setdefault(inp, [None] * len(res.semirings))
                sr = res.semirings[s]
                slot[s] = sr.accumulate(slot[s], c)
        for inp, slot in acc.items():
            for s, sr in enumerate(res.semirings):
                if slot[s] is None:
                    slot[s] = sr.zero(values[inp].shape, values[inp])
        store = propagate(
            graph, values, res.semirings, acc, needed, within=region, store_at=frozenset([v])
        )
    if v not in store:
        return [sr.zero(values[v].shape, values[v]) for sr in res.semirings]
    return store[v]
