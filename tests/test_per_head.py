"""Per-head branch tables (``branches(..., per_head=True)``, ``layer_table(per_head=True)``).

Oracles:
- torch.autograd: under ``Real``, head ``h``'s row of a query/key/value branch is the
  gradient that flows through head ``h``'s columns of the projection's output alone
  (forward hooks detach every other column and the other branches). The columns of each
  head are written out here from each model's own layout: separate projections (BERT,
  Llama with grouped-query attention), GPT-2's ``[q | k | v]``, GPT-NeoX's per-head
  ``[q k v]``, Phi-3's ``[q heads | k heads | v heads]``.
- Partition: the ⊕ over a branch's heads is the branch's value, for every semiring and
  every field of its readout (MaxProduct's hi and lo, Entropy's log Z and entropy,
  TopK's k values); the per-head table's rows together still give D at the point.
- Brute force (tests/oracles.py): on a two-head ``nn.TransformerEncoderLayer`` every path
  from the point is listed and filed by the in-projection column it passes.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

import oracles
import semiring_backprop as sbp
from semiring_backprop.analysis import branches as br
from semiring_backprop.errors import InputError
from test_branches import (
    SEMIRINGS,
    _close,
    assert_same_value,
    expected,
    library_readout,
    oplus_all,
)

T = pytest.importorskip("transformers")

F64 = torch.float64
V = 40
IDS = torch.tensor([[3, 7, 1, 9, 4]])
QKV = ("query", "key", "value")


def _cols(start, size):
    return list(range(start, start + size))


# per model: config, where the layer input goes on the attention side, the projections
# and, for (role, head), (projection module, its output columns that form the head)
MODELS = {
    "bert": dict(
        build=lambda: T.BertForMaskedLM(T.BertConfig(
            vocab_size=V, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=16, max_position_embeddings=16)),
        output=lambda out: out.logits[0, 2].log_softmax(-1)[7],
        layer="bert.encoder.layer.{i}", attn_in="bert.encoder.layer.{i}.attention.self",
        heads={"query": 2, "key": 2, "value": 2},
        cols=lambda role, h: (f"attention.self.{role}", _cols(4 * h, 4)),
    ),
    "gpt2": dict(
        build=lambda: T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=V, n_embd=8, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
            eos_token_id=0)),
        output=lambda out: out.logits[0, -1, 5] - out.logits[0, -2, 3],
        layer="transformer.h.{i}", attn_in="transformer.h.{i}.ln_1",
        heads={"query": 2, "key": 2, "value": 2},
        cols=lambda role, h: ("attn.c_attn", _cols(8 * QKV.index(role) + 4 * h, 4)),
    ),
    "llama-gqa": dict(  # 4 query heads of 2, 2 K/V heads
        build=lambda: T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=V, hidden_size=8, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=16, max_position_embeddings=16)),
        output=lambda out: out.logits[0, -1, 5] - out.logits[0, -2, 3],
        layer="model.layers.{i}", attn_in="model.layers.{i}.input_layernorm",
        heads={"query": 4, "key": 2, "value": 2},
        cols=lambda role, h: (f"self_attn.{role[0]}_proj", _cols(2 * h, 2)),
        rtol=1e-5,  # LlamaRMSNorm computes in float32 inside the float64 model
    ),
    "gpt-neox": dict(  # per head [q k v]: head h's query is columns 3dh .. 3dh + d
        build=lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=V, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=16, max_position_embeddings=16)),
        output=lambda out: out.logits[0, -1, 5],
        layer="gpt_neox.layers.{i}", attn_in="gpt_neox.layers.{i}.input_layernorm",
        heads={"query": 2, "key": 2, "value": 2},
        cols=lambda role, h: ("attention.query_key_value", _cols(12 * h + 4 * QKV.index(role), 4)),
        rtol=1e-6,
    ),
    "phi3-gqa": dict(  # [4 query heads | 2 key heads | 2 value heads], head_dim 2
        build=lambda: T.Phi3ForCausalLM(T.Phi3Config(
            vocab_size=V, hidden_size=8, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=16, max_position_embeddings=16,
            pad_token_id=0, eos_token_id=1, bos_token_id=2)),
        output=lambda out: out.logits[0, -1, 5],
        layer="model.layers.{i}", attn_in="model.layers.{i}.input_layernorm",
        heads={"query": 4, "key": 2, "value": 2},
        cols=lambda role, h: ("self_attn.qkv_proj",
                              _cols({"query": 0, "key": 8, "value": 12}[role] + 2 * h, 2)),
        rtol=1e-6,
    ),
    "bloom": dict(  # per head [q k v], as GPT-NeoX (viewed as heads x 3 x head_dim)
        build=lambda: T.BloomForCausalLM(T.BloomConfig(
            vocab_size=V, hidden_size=8, n_layer=1, n_head=2)),
        output=lambda out: out.logits[0, -1, 5],
        layer="transformer.h.{i}", attn_in="transformer.h.{i}.input_layernorm",
        heads={"query": 2, "key": 2, "value": 2},
        cols=lambda role, h: ("self_attention.query_key_value",
                              _cols(12 * h + 4 * QKV.index(role), 4)),
        rtol=1e-6,
    ),
    "falcon-mqa": dict(  # multi-query: [2 query heads | 1 key head | 1 value head]
        build=lambda: T.FalconForCausalLM(T.FalconConfig(
            vocab_size=V, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)),
        output=lambda out: out.logits[0, -1, 5],
        layer="transformer.h.{i}", attn_in="transformer.h.{i}.input_layernorm",
        cut=("transformer.h.{i}.mlp",),  # parallel attention: the mlp reads the same norm
        heads={"query": 2, "key": 1, "value": 1},
        cols=lambda role, h: ("self_attention.query_key_value",
                              _cols({"query": 0, "key": 8, "value": 12}[role] + 4 * h, 4)),
    ),
}  # fmt: skip


@functools.cache
def model(name):
    torch.manual_seed(0)
    cfg_model = MODELS[name]["build"]()
    return cfg_model.to(F64).eval()


@functools.cache
def result(name, semirings=tuple(SEMIRINGS)):
    return sbp.backprop(model(name), kwargs={"input_ids": IDS}, output=MODELS[name]["output"],
                        semirings=list(semirings))  # fmt: skip


def attention_point(name, i=0):
    return f"{MODELS[name]['layer'].format(i=i)}:input"


# -- 1. Real per head against torch.autograd ---------------------------------------------


def autograd_through(name, i, role, head):
    """d output / d (layer i's input) along paths through one head's projection columns."""
    spec, m = MODELS[name], model(name)
    mods = dict(m.named_modules())
    layer = spec["layer"].format(i=i)
    proj, cols = spec["cols"](role, head)
    projections = {spec["cols"](r, 0)[0] for r in QKV}
    state, handles = {}, []

    def layer_pre(mod, args):
        state["leaf"] = args[0].detach().clone().requires_grad_()
        return (state["leaf"].detach(), *args[1:])  # the residual carries nothing

    def attn_pre(mod, args):
        return (state["leaf"], *args[1:])

    def keep_cols(keep):
        def post(mod, args, out):
            mask = torch.zeros(out.shape[-1], dtype=torch.bool)
            mask[keep] = True
            return torch.where(mask, out, out.detach())

        return post

    try:
        handles.append(mods[layer].register_forward_pre_hook(layer_pre))
        handles.append(mods[spec["attn_in"].format(i=i)].register_forward_pre_hook(attn_pre))
        for c in spec.get("cut", ()):
            cut = lambda mod, args: (args[0].detach(), *args[1:])  # noqa: E731
            handles.append(mods[c.format(i=i)].register_forward_pre_hook(cut))
        for p in projections:
            post = keep_cols(cols if p == proj else [])
            handles.append(mods[f"{layer}.{p}"].register_forward_hook(post))
        with torch.enable_grad():
            y = spec["output"](m(input_ids=IDS))
            (g,) = torch.autograd.grad(y, state["leaf"], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return torch.zeros_like(state["leaf"]) if g is None else g


def head_values(res, where, semiring, heads=None):
    """``{(role, head): value}`` from the library's per-head split, and the fan-out node."""
    v, ents = br.entries(res, where)
    es, parts = br.head_parts(res, v, ents, heads=heads)
    k = res.semirings.index(semiring)
    return v, ents, {(e.role, e.head): p[k] for e, p in zip(es, parts)}


@pytest.mark.parametrize("name", list(MODELS))
def test_real_per_head_equals_autograd_through_that_head(name):
    spec = MODELS[name]
    res = result(name, (sbp.Real(),))
    rtol = spec.get("rtol", 1e-9)
    _, _, got = head_values(res, attention_point(name), sbp.Real())
    assert sorted(got) == sorted((r, h) for r in QKV for h in range(spec["heads"][r]))
    for (role, h), value in got.items():
        want = autograd_through(name, 0, role, h)
        assert want.abs().max() > 0, f"{name} {role} head {h} carries no gradient"
        scale = float(want.abs().max())
        what = f"{name} {role} head {h}"
        torch.testing.assert_close(
            value[0], want, rtol=rtol, atol=rtol * scale, msg=lambda m, w=what: f"{w}: {m}"
        )


# -- 2. ⊕ over heads = the branch, every semiring --------------------------------------------


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama-gqa"])
def test_oplus_over_heads_is_the_branch_every_semiring(name):
    res = result(name)
    rtol = MODELS[name].get("rtol", 1e-9)
    for i in range(2):
        v, ents = br.entries(res, attention_point(name, i))
        es, head_parts = br.head_parts(res, v, ents)
        for role in QKV:
            branch = [br.contribution(res, v, e) for e in ents if e.role == role]
            heads = [p for e, p in zip(es, head_parts) if e.role == role]
            assert len(heads) == MODELS[name]["heads"][role]
            for s, sr in enumerate(res.semirings):
                want = oplus_all(sr, [b[s] for b in branch])
                got = oplus_all(sr, [h[s] for h in heads])
                what = f"{name} layer {i} {role}"
                if isinstance(sr, sbp.TopK):
                    assert_same_topk(sr, got, want, rtol, what)
                else:
                    assert_same_value(sr, got, want, rtol, what=what)


def assert_same_topk(sr, got, want, rtol, what):
    """TopK's k values: magnitudes everywhere; signs where no other entry ties the
    magnitude (rotary embeddings make pairs of paths of equal |product| and opposite
    signs, either of which may come first) and not at the k-th place (its tie may be
    the (k+1)-th path, which the readout does not show)."""
    a, b = sr.finalize(got).values, sr.finalize(want).values
    scale = float(b[torch.isfinite(b)].abs().max())
    torch.testing.assert_close(a.abs(), b.abs(), rtol=rtol, atol=rtol * scale)
    mag = b.abs()
    tied = torch.isclose(mag[..., :, None], mag[..., None, :], rtol=1e-6).sum(-1) > 1
    tied[..., -1] = True
    torch.testing.assert_close(
        torch.where(tied, 0, a), torch.where(tied, 0, b), rtol=rtol, atol=rtol * scale,
        msg=lambda m: f"{what} TopK signs: {m}",
    )  # fmt: skip


def _oplus_scalars(sr, values):
    """⊕ of table values where the scalar readout determines it. (Real's table values
    are sums over hidden units that cancel to rounding noise after a layer norm; Real is
    checked elementwise against autograd above.)"""
    if isinstance(sr, sbp.MaxProduct | sbp.MaxAbs):
        return max(values)
    if isinstance(sr, sbp.LogAbs | sbp.PathCount):
        return float(torch.logsumexp(torch.tensor(values, dtype=F64), 0))
    return None  # Entropy, TopK: their ⊕ needs every field (checked above)


def test_layer_table_per_head():
    name = "llama-gqa"  # 4 query heads, 2 K/V heads
    res = result(name)
    rtol = MODELS[name].get("rtol", 1e-9)
    plain = res.layer_table()
    table = res.layer_table(per_head=True)
    assert list(table.columns) == [
        "layer", "sublayer", "token", "token_text", "consumer", "branch", "head_index", "value",
        "winner", "path", "semiring",
    ]  # fmt: skip
    assert str(table["head_index"].dtype) == "Int64"
    qkv = table["branch"].isin(QKV)
    assert table.loc[~qkv, "head_index"].isna().all() and table.loc[qkv, "head_index"].notna().all()
    n_heads = MODELS[name]["heads"]
    keys = ["layer", "sublayer", "token", "semiring", "branch"]
    for key, rows in table[qkv].groupby(keys):
        assert sorted(rows["head_index"]) == list(range(n_heads[key[-1]])), key
    # rows without heads are the same as in the plain table
    cols = [*keys, "consumer", "value", "path"]
    a = table.loc[~qkv, cols].reset_index(drop=True)
    b = plain.loc[~plain["branch"].isin(QKV), cols].reset_index(drop=True)
    assert a.equals(b)
    # a role's heads give its plain value where the scalar readout determines the ⊕
    srs = {sr.name: sr for sr in res.semirings}
    by_key = plain.set_index(keys).sort_index()  # (sorted: a lookup past an unsorted level warns)
    for key, rows in table[qkv].groupby(keys):
        want = by_key.loc[key, "value"]
        got = _oplus_scalars(srs[key[3]], rows["value"].tolist())
        if got is not None:  # Real's sums over hidden units cancel: tolerance of the parts
            same = plain.loc[plain["semiring"] == key[3], "value"].abs()
            scale = same[np.isfinite(same)].max()
            assert got == pytest.approx(want, rel=rtol, abs=rtol * scale), key
    # one winner per (layer, sublayer, token, semiring) with a path, holding the max
    for key, rows in table.groupby(["layer", "sublayer", "token", "semiring"]):
        if not rows["path"].any():  # no path from the token: no winner
            assert not rows["winner"].any(), key
            continue
        if (rows["value"] == 0).all():  # Real sums that are all exactly 0: a tie
            continue
        assert rows["winner"].sum() == 1, key
        # TopK's number is signed; ⊕ selects the row of largest |value|
        by = rows["value"].abs() if key[3].startswith("TopK") else rows["value"]
        assert by[rows["winner"]].item() == by.max(), key


def test_per_head_tables_view_and_keep_dataframe_head():
    """A per-head table of one fan-out point or of every layer shows its heatmap (its
    shares: the ⊕ of each branch's heads, against the plain table's), names its heads
    on hover, and leaves ``DataFrame.head()`` to pandas (the column is ``head_index``)."""
    import html

    res = result("llama-gqa", (sbp.MaxProduct(),))
    place = attention_point("llama-gqa")
    for table in (res.branches(place, per_head=True), res.layer_table(per_head=True)):
        assert "head_index" in table.columns and "head" not in table.columns
        first = table.head(2)
        assert len(first) == 2 and list(first.columns) == list(table.columns)
        page = html.unescape(table.view().html())
        assert "<svg" in page and "query head 3: " in page and "key head 1: " in page
    one = res.branches(place, per_head=True)
    plain = res.branches(place)
    rows, _, _ = sbp.views.shares(one)
    want = plain.assign(w=plain["value"].abs().where(plain["path"], 0.0))
    want["share"] = want["w"] / want.groupby("token")["w"].transform("sum")
    got = rows.set_index(["token", "branch"])["share"].sort_index()
    want = want.rename(columns={"role": "branch"}).set_index(["token", "branch"])["share"]
    np.testing.assert_allclose(got.to_numpy(), want.sort_index().to_numpy(), rtol=1e-9)


def test_branches_per_head_by_role_and_batch():
    res = result("llama-gqa", (sbp.MaxProduct(),))
    place = attention_point("llama-gqa")
    table = res.branches(place, per_head=True, by="role")
    assert set(zip(table["role"], table["head_index"].fillna(-1))) >= {("query", 3), ("key", 1)}
    # bucket_sum: every hidden unit goes to one (branch, head), so per token the heads'
    # buckets add up to the plain table's
    split = res.branches(place, aggregate="bucket_sum", per_head=True)
    plain = res.branches(place, aggregate="bucket_sum")
    per_token = [t.groupby("token")["value"].sum().to_numpy() for t in (split, plain)]
    np.testing.assert_allclose(*per_token, rtol=1e-9)
    assert split.groupby("token")["winner"].sum().eq(1).all()
    # a batch of two examples: an example column, heads per example
    m = model("bert")
    ids = torch.tensor([[3, 7, 1, 9, 4], [5, 2, 8, 6, 4]])
    batch = sbp.backprop(m, kwargs={"input_ids": ids}, semirings=[sbp.MaxProduct()],
                         output=lambda out: out.logits[:, 2, 7].sum())  # fmt: skip
    t = batch.branches(attention_point("bert"), per_head=True)
    assert sorted(t["example"].unique()) == [0, 1]
    assert len(t) == 2 * 5 * (1 + 3 * 2)  # examples x tokens x (skip + 3 roles x 2 heads)


# -- 3. brute force on a two-head encoder layer ----------------------------------------------

E, NHEAD = 2, 2  # head_dim 1


@functools.cache
def tiny_mha():
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(E, NHEAD, 2, dropout=0.0, batch_first=True,
                                       layer_norm_eps=0.5).to(F64).eval()  # fmt: skip
    x = torch.randn(1, 2, E, dtype=F64)
    res = sbp.backprop(layer, args=(x,), output=lambda y: y[0, 1, 1], semirings=SEMIRINGS)
    return res, oracles.build(res), oracles.scalar_dag(res)


def _in_proj(res):
    """The in-projection's output node: the contraction in ``self_attn`` 3E wide."""
    aten = torch.ops.aten
    (node,) = [
        n for n in res.graph.nodes
        if n.target in (aten.addmm.default, aten.mm.default)
        and res.values[n].shape[-1] == 3 * E
    ]  # fmt: skip
    return node


def _region(v, p):
    down, todo = set(), [v]
    while todo:
        n = todo.pop()
        if n not in down:
            down.add(n)
            todo.extend(n.users)
    out, todo = set(), [p]
    while todo:
        n = todo.pop()
        if n not in out and n in down:
            out.add(n)
            todo.extend(n.all_input_nodes)
    return out


def test_per_head_against_brute_force_paths():
    res, orc, dag = tiny_mha()
    v = res.node(0)
    p = _in_proj(res)
    region = _region(v, p)
    n = res.values[v].numel()
    hd = E // NHEAD
    buckets = {(r, h): [[] for _ in range(n)] for r in QKV for h in range(NHEAD)}

    def walk(node, flat, prefix, start):
        for dst, _slot, mask, w in dag.consumers.get(node, []):
            for o in np.nonzero(mask[:, flat])[0]:
                q = prefix * float(w[o, flat])
                if dst is p:  # MHA's in_proj columns: [q | k | v], head_dim each head
                    col = int(o) % (3 * E)
                    key = (QKV[col // E], (col % E) // hd)
                    buckets[key][start].append(q * orc.products[p][o])
                elif dst in region:
                    walk(dst, o, q, start)

    for i in range(n):
        walk(v, i, 1.0, i)
    _, ents = br.entries(res, 0)
    es, parts = br.head_parts(res, v, ents)
    assert sorted((e.role, e.head) for e in es) == sorted(buckets)
    shape = tuple(res.values[v].shape)
    for e, part in zip(es, parts):
        paths = [np.concatenate(b) if b else np.zeros(0) for b in buckets[(e.role, e.head)]]
        assert any(len(b) for b in paths), f"no path through {e.role} head {e.head}"
        want = [expected(b) for b in paths]
        for s, sr in enumerate(res.semirings):
            for field, got in library_readout(sr, part[s]).items():
                flat = got.reshape(n, *got.shape[len(shape) :]).numpy()
                exp = np.stack([w[field] for w in want])
                what = f"{e.role} head {e.head} {sr.name}.{field}"
                if field == "topk":  # magnitudes; signs where no other path ties them
                    tied = np.stack([w["topk_tied"] for w in want])
                    _close(np.abs(flat), np.abs(exp), what)
                    flat, exp = np.where(tied, 0.0, flat), np.where(tied, 0.0, exp)
                _close(flat, exp, what)


# -- 4. head counts: from the model, given, refused ------------------------------------------


class _Attn(nn.Module):  # no attribute says how many heads it has
    def __init__(self, d):
        super().__init__()
        self.query, self.key, self.value, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, 2, d // 2).transpose(1, 2)
                   for f in (self.query, self.key, self.value))  # fmt: skip
        a = (q @ k.transpose(-1, -2) / math.sqrt(d // 2)).softmax(-1)
        return self.out((a @ v).transpose(1, 2).reshape(b, t, d))


class _Layer(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.attn = _Attn(d)

    def forward(self, x):
        return x + self.attn(x)


def test_unknown_head_count_is_refused_and_heads_gives_it():
    torch.manual_seed(4)
    net = nn.Sequential(_Layer()).to(F64).eval()
    x = torch.randn(1, 3, 4, dtype=F64)
    res = sbp.backprop(net, args=(x,), output=lambda y: y[0, -1, 0],
                       semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip
    with pytest.raises(InputError, match=r"heads=<number of query heads>"):
        res.branches("0:input", per_head=True)
    with pytest.raises(InputError, match=r"heads=<number of query heads>"):
        res.layer_table(per_head=True)
    with pytest.raises(InputError, match="do not divide"):
        res.branches("0:input", per_head=True, heads=3)
    with pytest.raises(InputError, match="positive int"):
        res.branches("0:input", per_head=True, heads=0)
    with pytest.raises(InputError, match="add per_head=True"):
        res.branches("0:input", heads=2)
    with pytest.raises(InputError, match="no count for"):
        res.branches("0:input", per_head=True, heads={"query": 2})
    table = res.branches("0:input", sbp.Real(), per_head=True, heads=2)
    assert sorted(table.loc[table["role"] == "key", "head_index"].unique()) == [0, 1]
    same = res.branches("0:input", sbp.Real(), per_head=True,
                        heads={"query": 2, "key": 2, "value": 2})  # fmt: skip
    assert table.equals(same)
    # the autograd oracle: query head 1 alone
    leaf = x.clone().requires_grad_()
    attn = net[0].attn

    def post(mod, args, out):
        keep = torch.tensor([False, False, True, True])
        return torch.where(keep, out, out.detach())

    cut = [attn.key.register_forward_hook(lambda m, a, o: o.detach()),
           attn.value.register_forward_hook(lambda m, a, o: o.detach()),
           attn.query.register_forward_hook(post)]  # fmt: skip
    try:
        with torch.enable_grad():
            y = attn(leaf)[0, -1, 0]
            (g,) = torch.autograd.grad(y, leaf)
    finally:
        for h in cut:
            h.remove()
    rows = table[(table["role"] == "query") & (table["head_index"] == 1)]
    np.testing.assert_allclose(rows["value"].to_numpy(), g[0].sum(-1).numpy(), rtol=1e-9)


# -- 5. TransformerLens: projections that are weights read through einsums ------------------

TL_CONFIGS = {
    "learned-ln": {"act_fn": "gelu"},
    "rotary-rms-gqa": {  # 4 query heads, 2 key/value heads
        "positional_embedding_type": "rotary", "normalization_type": "RMS",
        "n_key_value_heads": 2, "gated_mlp": True, "act_fn": "silu",
    },
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind", list(TL_CONFIGS))
def test_transformer_lens_heads_equal_autograd_through_hook_qkv(kind):
    """Head ``h`` of a role is autograd's gradient with every other head of ``hook_q``,
    ``hook_k``, ``hook_v`` (whose outputs are ``[batch, pos, head, d_head]``) detached."""
    tl = pytest.importorskip("transformer_lens")
    if not hasattr(tl, "HookedTransformer"):
        pytest.skip("this TransformerLens has no HookedTransformer")
    cfg = tl.HookedTransformerConfig(
        n_layers=1, d_model=8, n_heads=4, d_head=2, d_mlp=16, d_vocab=V, n_ctx=16,
        dtype=F64, device="cpu", seed=0, **TL_CONFIGS[kind],
    )  # fmt: skip
    m = tl.HookedTransformer(cfg).eval()
    out = lambda logits: logits[0, -1, 5] - logits[0, -2, 3]  # noqa: E731
    res = sbp.backprop(m, args=(IDS,), output=out, semirings=[sbp.Real()])
    _, _, got = head_values(res, "blocks.0:input", sbp.Real())
    n_kv = TL_CONFIGS[kind].get("n_key_value_heads", 4)
    assert sorted(got) == sorted(
        [("query", h) for h in range(4)] + [(r, h) for r in ("key", "value") for h in range(n_kv)]
    )
    block, state = m.blocks[0], {}

    def block_pre(mod, args):
        state["leaf"] = args[0].detach().clone().requires_grad_()
        return (state["leaf"].detach(), *args[1:])

    def ln_pre(mod, args):
        return (state["leaf"], *args[1:])

    def keep_head(head):  # [batch, pos, head, d_head]: only ``head`` carries gradient
        def post(mod, args, o):
            mask = torch.zeros(o.shape[-2], 1, dtype=torch.bool)
            if head is not None:
                mask[head] = True
            return torch.where(mask, o, o.detach())

        return post

    for (role, h), value in got.items():
        hooks = [block.register_forward_pre_hook(block_pre),
                 block.ln1.register_forward_pre_hook(ln_pre)]  # fmt: skip
        for r in QKV:
            hook = getattr(block.attn, f"hook_{r[0]}")
            hooks.append(hook.register_forward_hook(keep_head(h if r == role else None)))
        try:
            with torch.enable_grad():
                (want,) = torch.autograd.grad(out(m(IDS)), state["leaf"])
        finally:
            for hk in hooks:
                hk.remove()
        assert want.abs().max() > 0
        torch.testing.assert_close(value[0], want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))
