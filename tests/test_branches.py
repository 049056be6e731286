"""Branches at fan-out points (``Result.branches``, ``Result.layer_table``) against oracles.

- Partition law: every path from a fan-out point leaves through exactly one branch, so
  under every semiring the ⊕ of the branch contributions is D at the point.
- torch.autograd with the other branches cut (forward hooks that detach their inputs):
  under ``Real`` a branch's contribution is the gradient that flows through it alone.
- Brute force (tests/oracles.py): on a tiny ``nn.TransformerEncoderLayer`` every path
  from the point is listed and filed under the (via, op) edge where it leaves the point's
  region; each branch's value is then computed from its own list of paths.
- Roles, tables, aggregation readouts, batching and errors; projections that are weights
  read through einsums, not modules (TransformerLens' ``attn.W_Q`` and ``attn.hook_q``).

Models are tiny random configs in float64; each is traced once (``functools.cache``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import oracles
import semiring_backprop as sbp
from semiring_backprop.analysis import branches as br

transformers = pytest.importorskip("transformers")

F64 = torch.float64
SEMIRINGS = [
    sbp.Real(),
    sbp.MaxProduct(),
    sbp.MaxAbs(),
    sbp.LogAbs(),
    sbp.Entropy(),
    sbp.PathCount(),
    sbp.TopK(3),
]
ATTN_ROLES = {"skip", "query", "key", "value"}
MLP_ROLES = {"skip", "mlp"}
N_LAYERS = 2
VOCAB = 40
IDS = torch.tensor([[3, 7, 1, 9, 4]])
TOKENS = ["[CLS]", "the", "cat", "sat", "[SEP]"]


# -- models ----------------------------------------------------------------------------


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        attn_implementation="sdpa",
    )
    return transformers.BertForMaskedLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=8,
        n_layer=N_LAYERS,
        n_head=2,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,  # grouped-query attention
        intermediate_size=16,
        max_position_embeddings=16,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


def _mlm(out):
    logp = out.logits[0, 2].log_softmax(-1)
    return logp[7] - logp[9]


@dataclasses.dataclass(frozen=True)
class Spec:
    """Where to cut a model's branches with hooks (``{i}``: the layer index)."""

    build: object
    output: object
    layer: str  #: the layer module (its first argument is the attention fan-out point)
    attn_in: str  #: the module that reads the layer input on the attention side
    qkv: tuple = ()  #: (query, key, value) projection modules, if separate
    fused: str = ""  #: a fused qkv projection (GPT-2's c_attn), if any
    attn_out: str = ""  #: the attention module: its output makes the mlp fan-out point
    mlp_in: str = ""  #: the module that reads the mlp fan-out point on the mlp side
    rtol: float = 1e-9


HF_SPECS = {
    "bert": Spec(
        _bert,
        _mlm,
        layer="bert.encoder.layer.{i}",
        attn_in="bert.encoder.layer.{i}.attention.self",
        qkv=tuple(
            f"bert.encoder.layer.{{i}}.attention.self.{p}" for p in ("query", "key", "value")
        ),
        attn_out="bert.encoder.layer.{i}.attention",
        mlp_in="bert.encoder.layer.{i}.intermediate",
    ),
    "gpt2": Spec(
        _gpt2,
        lambda out: out.logits[0, -1, 5] - out.logits[0, -2, 3],
        layer="transformer.h.{i}",
        attn_in="transformer.h.{i}.ln_1",
        fused="transformer.h.{i}.attn.c_attn",
        attn_out="transformer.h.{i}.attn",
        mlp_in="transformer.h.{i}.ln_2",
    ),
    "llama": Spec(
        _llama,
        lambda out: out.logits[0, -1, 5] - out.logits[0, -2, 3],
        layer="model.layers.{i}",
        attn_in="model.layers.{i}.input_layernorm",
        qkv=tuple(f"model.layers.{{i}}.self_attn.{p}_proj" for p in "qkv"),
        attn_out="model.layers.{i}.self_attn",
        mlp_in="model.layers.{i}.post_attention_layernorm",
        rtol=1e-5,  # LlamaRMSNorm computes in float32 inside the float64 model
    ),
}


@functools.cache
def hf_model(name):
    torch.manual_seed(0)
    return HF_SPECS[name].build().to(F64).eval()


@functools.cache
def hf_result(name):
    kwargs = {"input_ids": IDS}
    return sbp.backprop(hf_model(name), kwargs=kwargs, output=HF_SPECS[name].output,
                        semirings=SEMIRINGS)  # fmt: skip


@functools.cache
def tel_model(norm_first, d_model=8, nhead=2, ff=16, eps=1e-5):
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(
        d_model, nhead, ff, dropout=0.0, batch_first=True, norm_first=norm_first,
        layer_norm_eps=eps,
    )  # fmt: skip
    return layer.to(F64).eval()


def _tel_output(y):
    return y[0, -1, 1] - y[0, 0, 0]


@functools.cache
def tel_result(norm_first):
    torch.manual_seed(2)
    x = torch.randn(1, 5, 8, dtype=F64)
    return sbp.backprop(tel_model(norm_first), args=(x,), output=_tel_output,
                        semirings=SEMIRINGS)  # fmt: skip


def result_of(key):
    kind, _, arg = key.partition("-")
    return tel_result(arg == "pre") if kind == "tel" else hf_result(kind)


def model_of(key):
    kind, _, arg = key.partition("-")
    return tel_model(arg == "pre") if kind == "tel" else hf_model(kind)


ALL_MODELS = ["bert", "gpt2", "llama", "tel-post", "tel-pre"]


# -- helpers ---------------------------------------------------------------------------


def readout_fields(sr, value) -> dict:
    """Every tensor of the readout of ``value`` (the user-visible numbers)."""
    ro = sr.finalize(value)
    if isinstance(ro, torch.Tensor):
        return {"value": ro}
    return {f.name: getattr(ro, f.name) for f in dataclasses.fields(ro)}


def assert_same_value(sr, got, want, rtol, what=""):
    g, w = readout_fields(sr, got), readout_fields(sr, want)
    for field in w:
        a, b = g[field].double(), w[field].double()
        fin = torch.isfinite(b)
        scale = float(b[fin].abs().max()) if fin.any() else 1.0
        # infinities (no path) must match exactly; finite numbers to rtol of the scale
        assert torch.equal(torch.isinf(a) & (a > 0), torch.isinf(b) & (b > 0)), (what, field)
        assert torch.equal(torch.isinf(a) & (a < 0), torch.isinf(b) & (b < 0)), (what, field)
        err = f"{what} {sr.name}.{field}"
        torch.testing.assert_close(
            torch.where(fin, a, 0.0), torch.where(fin, b, 0.0),
            rtol=rtol, atol=rtol * max(1.0, scale), msg=lambda m, err=err: f"{err}: {m}",
        )  # fmt: skip


def oplus_all(sr, values):
    total = values[0]
    for v in values[1:]:
        total = sr.plus(total, v)
    return total


def points(res):
    """(layer index, sublayer, fan-out node) for every block found."""
    return [(i, sub, p) for i, b in enumerate(br.blocks(res)) for sub, p in b.points.items()]


def token_live(res, v):
    """Per token (and example): whether any path leaves the token's units (from D(v))."""
    if sbp.PathCount() in res.semirings:
        return torch.isfinite(res.at(v, sbp.PathCount()).log_count).any(-1)
    ro = res.at(v, sbp.MaxProduct())
    return (torch.isfinite(ro.hi) | torch.isfinite(ro.lo)).any(-1)


def assert_winners(table, live, keys=("token",)):
    """One winner per token that has a path, holding its largest value; none otherwise."""
    live = live.reshape(-1, live.shape[-1]) if live.dim() > 1 else live[None]
    for key, rows in table.groupby(list(keys)):
        key = key if isinstance(key, tuple) else (key,)
        alive = bool(live[key[0] if len(key) == 2 else 0, key[-1]])
        n_win = int(rows["winner"].sum())
        if not alive:
            assert n_win == 0, f"token {key} has no path but a winner"
            continue
        if (rows["semiring"] == sbp.Real().name).all() and (rows["value"] == 0).all():
            assert n_win <= 1  # Real sums that are all exactly 0 (a layer norm): a tie
            continue
        assert n_win == 1, f"token {key}: {n_win} winners"
        # TopK's number is signed; ⊕ selects the branch of largest |value|
        by = rows["value"].abs() if (rows["semiring"] == sbp.TopK(3).name).all() else rows["value"]
        assert by[rows["winner"]].item() == by.max()


def contributions(res, where, roles=None):
    v, ents = br.entries(res, where, roles)
    return v, ents, [br.contribution(res, v, e) for e in ents]


# -- 1. partition law --------------------------------------------------------------------


@pytest.mark.parametrize("key", ALL_MODELS)
def test_partition_law_every_semiring(key):
    """⊕ over the branches of their contributions is D at the fan-out point."""
    res = result_of(key)
    pts = points(res)
    n_layers = 1 if key.startswith("tel") else N_LAYERS
    assert [(i, sub) for i, sub, _ in pts] == [
        (i, sub) for i in range(n_layers) for sub in ("attention", "mlp")
    ]
    rtol = 1e-5 if key == "llama" else 1e-9
    for i, sub, p in pts:
        v, ents, parts = contributions(res, p)
        assert len(ents) >= 2
        for s, sr in enumerate(res.semirings):
            total = oplus_all(sr, [part[s] for part in parts])
            assert_same_value(sr, total, res.value(v, sr), rtol, what=f"{key} layer {i} {sub}")


# -- 1b. Real branches against torch.autograd with the other branches cut ----------------


def _autograd_keep(name, i, keep):
    """d output / d (layer i's input) through the attention-point branches in ``keep``."""
    spec, model = HF_SPECS[name], hf_model(name)
    mods = dict(model.named_modules())
    state, handles = {}, []

    def layer_pre(mod, args):
        leaf = args[0].detach().clone().requires_grad_()
        state["leaf"] = leaf
        # the residual (skip) reads the layer's own input; the attention side gets ``leaf``
        return (leaf if "skip" in keep else leaf.detach(), *args[1:])

    def attn_pre(mod, args):
        return (state["leaf"], *args[1:])

    def cut_pre(mod, args):
        return (args[0].detach(), *args[1:])

    def fused_post(mod, args, out):
        parts = out.chunk(3, -1)
        kept = [p if r in keep else p.detach() for p, r in zip(parts, ("query", "key", "value"))]
        return torch.cat(kept, -1)

    try:
        handles.append(mods[spec.layer.format(i=i)].register_forward_pre_hook(layer_pre))
        handles.append(mods[spec.attn_in.format(i=i)].register_forward_pre_hook(attn_pre))
        for role, path in zip(("query", "key", "value"), spec.qkv):
            if role not in keep:
                handles.append(mods[path.format(i=i)].register_forward_pre_hook(cut_pre))
        if spec.fused:
            handles.append(mods[spec.fused.format(i=i)].register_forward_hook(fused_post))
        with torch.enable_grad():
            y = spec.output(model(input_ids=IDS))
            (g,) = torch.autograd.grad(y, state["leaf"], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return torch.zeros_like(state["leaf"]) if g is None else g


def _autograd_mlp_point(name, i):
    """(D(v), mlp part) at layer i's mlp fan-out point v, by autograd: D(v) is the grad at
    the attention module's output (v = that output, or that output + a residual), the mlp
    part is the grad at the copy of v that the mlp side's first module reads."""
    spec, model = HF_SPECS[name], hf_model(name)
    mods = dict(model.named_modules())
    kept, handles = {}, []

    def out_post(mod, args, out):
        t = out[0] if isinstance(out, tuple) else out
        t.retain_grad()
        kept["total"] = t

    def mlp_pre(mod, args):
        copy = args[0].view_as(args[0])
        copy.retain_grad()
        kept["mlp"] = copy
        return (copy, *args[1:])

    try:
        handles.append(mods[spec.attn_out.format(i=i)].register_forward_hook(out_post))
        handles.append(mods[spec.mlp_in.format(i=i)].register_forward_pre_hook(mlp_pre))
        with torch.enable_grad():
            spec.output(model(input_ids=IDS)).backward()
    finally:
        for h in handles:
            h.remove()
    return kept["total"].grad, kept["mlp"].grad


def _real_by_role(res, where):
    _, ents, parts = contributions(res, where)
    k = res.semirings.index(sbp.Real())
    out = {}
    for e, part in zip(ents, parts):
        out[e.role] = out.get(e.role, 0) + part[k][0]
    return out


def assert_grad_close(got, want, rtol, what):
    scale = max(1e-12, float(want.abs().max()))
    torch.testing.assert_close(
        got, want, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_real_branches_equal_autograd_with_other_branches_cut(name):
    res, spec = hf_result(name), HF_SPECS[name]
    for i in range(N_LAYERS):
        # attention fan-out point: the layer input; one branch kept at a time
        place = f"{spec.layer.format(i=i)}:input"
        got = _real_by_role(res, place)
        assert set(got) == ATTN_ROLES
        full = _autograd_keep(name, i, ATTN_ROLES)
        assert_grad_close(res.at(place, sbp.Real()), full, spec.rtol, f"{name} {place} full")
        for role in sorted(ATTN_ROLES):
            want = _autograd_keep(name, i, {role})
            assert want.abs().max() > 0, f"{name} layer {i}: {role} branch carries no gradient"
            assert_grad_close(got[role], want, spec.rtol, f"{name} layer {i} {role}")
        # mlp fan-out point
        mlp_point = br.blocks(res)[i].points["mlp"]
        got = _real_by_role(res, mlp_point)
        assert set(got) == MLP_ROLES
        total, mlp = _autograd_mlp_point(name, i)
        assert_grad_close(got["mlp"], mlp, spec.rtol, f"{name} layer {i} mlp")
        assert_grad_close(got["skip"], total - mlp, spec.rtol, f"{name} layer {i} skip@mlp")


# -- 2. brute force on a tiny encoder layer -------------------------------------------------


def _descendants(v):
    out, todo = set(), [v]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(n.users)
    return out


def _ancestors(nodes, within):
    out, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n not in out and n in within:
            out.add(n)
            todo.extend(n.all_input_nodes)
    return out


def branch_paths(res, v, ents, orc, dag):
    """Every path from each element of ``v``, filed by the branch it leaves through.

    A path leaves through entry ``e`` when it takes a scalar edge from ``e.via`` into
    ``e.op``; until then it stays between ``v`` and the entries' ``via`` nodes. Returns
    ``(buckets, stray)``: ``buckets[k][flat]`` is an array of the path products through
    entry ``k``; ``stray[flat]`` holds paths that left the region through no entry."""
    region = _ancestors({e.via for e in ents}, _descendants(v))
    entry_of = {(e.via, e.op): k for k, e in enumerate(ents)}
    n = res.values[v].numel()
    buckets = [[[] for _ in range(n)] for _ in ents]
    stray = [[] for _ in range(n)]

    def walk(node, flat, prefix, start):
        for dst, _slot, mask, w in dag.consumers.get(node, []):
            for o in np.nonzero(mask[:, flat])[0]:
                p = prefix * float(w[o, flat])
                k = entry_of.get((node, dst))
                if k is not None:
                    buckets[k][start].append(p * orc.products[dst][o])
                elif dst in region:
                    walk(dst, o, p, start)
                else:
                    stray[start].append(p * orc.products[dst][o])

    for i in range(n):
        walk(v, i, 1.0, i)
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0)  # noqa: E731
    return [[cat(b) for b in per] for per in buckets], [cat(s) for s in stray]


def expected(products: np.ndarray, k=3) -> dict:
    """Each semiring's readout, computed directly from a list of path products."""
    a = np.abs(products)
    z = a.sum()
    n = len(products)
    order = np.argsort(-a, kind="stable")[:k]
    top = np.zeros(k)
    top[: len(order)] = products[order]
    # an entry whose |product| another path ties (up to rounding) may come with either sign
    tied = np.array([np.isclose(a, a[j], rtol=1e-9, atol=0).sum() > 1 for j in order])
    tied = np.pad(tied, (0, k - len(order)))
    p = a[a > 0] / z if z > 0 else a[:0]
    return {
        "Real": products.sum(),
        "hi": products.max() if n else -math.inf,
        "lo": products.min() if n else math.inf,
        "max_abs": a.max() if n else 0.0,
        "log_abs": math.log(z) if z > 0 else -math.inf,
        "entropy": float(-(p * np.log(p)).sum()),
        "log_count": math.log(n) if n else -math.inf,
        "topk": top,
        "topk_tied": tied,
    }


def library_readout(sr, value) -> dict:
    ro = sr.finalize(value)
    if isinstance(sr, sbp.Real):
        return {"Real": ro}
    if isinstance(sr, sbp.MaxProduct):
        return {"hi": ro.hi, "lo": ro.lo}
    if isinstance(sr, sbp.MaxAbs):
        return {"max_abs": ro.value}
    if isinstance(sr, sbp.PathCount):
        return {"log_count": ro.log_count}
    if isinstance(sr, sbp.LogAbs):
        return {"log_abs": ro.log}
    if isinstance(sr, sbp.Entropy):
        return {"entropy": ro.entropy, "log_abs": ro.log_z}
    if isinstance(sr, sbp.TopK):
        return {"topk": ro.values}
    raise AssertionError(sr)


@functools.cache
def tiny_tel(norm_first):
    """d_model=2, one head, dim_feedforward=2, two tokens: ~40k paths from the input
    (d_model=4 already has ~8.5M). A large layer-norm eps keeps the 2-wide norm away from
    its degenerate limit (the normalized output is ±1 when eps -> 0)."""
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(
        2, 1, 2, dropout=0.0, batch_first=True, norm_first=norm_first, layer_norm_eps=0.5
    )
    layer = layer.to(F64).eval()
    x = torch.randn(1, 2, 2, dtype=F64)
    res = sbp.backprop(layer, args=(x,), output=lambda y: y[0, 1, 1], semirings=SEMIRINGS)
    return res, oracles.build(res), oracles.scalar_dag(res)


def _close(got, want, what, rtol=1e-9):
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    same_inf = np.array_equal(np.isinf(got) & (got > 0), np.isinf(want) & (want > 0)) and (
        np.array_equal(np.isinf(got) & (got < 0), np.isinf(want) & (want < 0))
    )
    assert same_inf, f"{what}: got {got}, want {want}"
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_branches_against_brute_force_paths(norm_first):
    res, orc, dag = tiny_tel(norm_first)
    (block,) = br.blocks(res)
    for sub, p in block.points.items():
        v, ents, parts = contributions(res, p)
        buckets, stray = branch_paths(res, v, ents, orc, dag)
        shape = tuple(res.values[v].shape)
        n = res.values[v].numel()
        all_paths = orc.products[v]
        for i in range(n):
            # every path leaves through exactly one listed branch
            assert len(stray[i]) == 0, f"{sub}: {len(stray[i])} paths from {i} leave by no branch"
            assert sum(len(b[i]) for b in buckets) == len(all_paths[i])
        # each branch's contribution, elementwise, under every semiring
        for k, e in enumerate(ents):
            want = [expected(buckets[k][i]) for i in range(n)]
            for s, sr in enumerate(res.semirings):
                for field, got in library_readout(sr, parts[k][s]).items():
                    flat = got.reshape(n, *got.shape[len(shape) :]).numpy()
                    exp = np.stack([w[field] for w in want])
                    what = f"{sub} {e.role} ({e.consumer}) {sr.name}.{field}"
                    if field == "topk":  # magnitudes; signs where no other path ties them
                        tied = np.stack([w["topk_tied"] for w in want])
                        _close(np.abs(flat), np.abs(exp), what)
                        flat, exp = np.where(tied, 0.0, flat), np.where(tied, 0.0, exp)
                    _close(flat, exp, what)

        # per token: ⊕ over branches = the max over all paths from the token's units,
        # and the winner is the branch of the best path
        table = res.branches(p, sbp.MaxProduct())
        best_all = orc.readouts(v, dims=(-1,))["hi"].reshape(-1)
        tokens = sorted(table["token"].unique())
        assert tokens == list(range(shape[1]))
        per_tok = np.arange(n).reshape(shape)[0]  # (tokens, hidden) flat indices
        for t in tokens:
            rows = table[table["token"] == t]
            assert len(rows) == len(ents)
            assert rows["value"].max() == pytest.approx(best_all[t], rel=1e-12)
            branch_best = [
                max((buckets[k][i].max() for i in per_tok[t] if len(buckets[k][i])),
                    default=-math.inf)
                for k in range(len(ents))
            ]  # fmt: skip
            np.testing.assert_allclose(rows["value"].to_numpy(), branch_best, rtol=1e-12)
            # ``path``: some path from the token's units leaves through the branch
            leaves = [any(len(buckets[k][i]) for i in per_tok[t]) for k in range(len(ents))]
            assert rows["path"].tolist() == leaves
            winners = list(rows[rows["winner"]].itertuples())
            if not any(len(all_paths[i]) for i in per_tok[t]):
                # no path from this token at all: no branch wins
                assert winners == [] and (rows["value"] == -math.inf).all()
                continue
            k_best = int(np.argmax(branch_best))
            (win,) = winners
            assert (win.consumer, win.role) == (ents[k_best].consumer, ents[k_best].role)


# -- 3. roles and the layer table --------------------------------------------------------


@pytest.mark.parametrize("key", ALL_MODELS)
def test_roles_discovered_at_each_layer(key):
    res, model = result_of(key), model_of(key)
    n_layers = 1 if key.startswith("tel") else N_LAYERS
    modules = {n for n, _ in model.named_modules()}
    table = res.layer_table(semirings=[sbp.MaxProduct()], tokens=TOKENS)
    assert set(table.columns) == {
        "layer", "sublayer", "token", "token_text", "branch", "consumer", "value", "winner",
        "path", "semiring",
    }  # fmt: skip
    assert "example" not in table.columns
    assert sorted(table["layer"].unique()) == list(range(n_layers))
    for layer in range(n_layers):
        rows = table[table["layer"] == layer]
        assert set(rows[rows["sublayer"] == "attention"]["branch"]) == ATTN_ROLES
        assert set(rows[rows["sublayer"] == "mlp"]["branch"]) == MLP_ROLES
    assert set(table["consumer"]) <= modules  # "" (a root module) is in named_modules
    assert list(table["token_text"]) == [TOKENS[t] for t in table["token"]]
    assert set(table["semiring"]) == {sbp.MaxProduct().name}
    for (layer, sub), rows in table.groupby(["layer", "sublayer"]):
        assert_winners(rows, token_live(res, br.blocks(res)[layer].points[sub])[0])


def test_layer_table_token_text_defaults_to_position():
    table = hf_result("bert").layer_table(semirings=[sbp.MaxAbs()], sublayers=("attention",))
    assert set(table["sublayer"]) == {"attention"}
    assert list(table["token_text"]) == [str(t) for t in table["token"]]


def test_user_roles_mapping_and_callable():
    res = hf_result("bert")
    place = "bert.encoder.layer.0:input"
    default = res.branches(place, sbp.MaxProduct())
    remapped = res.branches(place, sbp.MaxProduct(), roles={r"attention\.self\.query": "other"})
    by_fn = res.branches(
        place, sbp.MaxProduct(), roles=lambda path: "other" if path.endswith(".query") else None
    )
    for table in (remapped, by_fn):
        assert set(table["role"]) == {"skip", "other", "key", "value"}
        q = default["role"] == "query"
        assert (table.loc[q, "role"] == "other").all()
        assert (table.loc[~q, "role"] == default.loc[~q, "role"]).all()
        # the mapping renames; the numbers are those of the same consumers
        assert list(table["consumer"]) == list(default["consumer"])
        np.testing.assert_array_equal(table["value"], default["value"])


def test_user_roles_in_layer_table():
    res = hf_result("bert")
    table = res.layer_table(semirings=[sbp.MaxProduct()], roles={r"\.query$": "other"})
    assert sorted(table["layer"].unique()) == list(range(N_LAYERS))
    att = table[table["sublayer"] == "attention"]
    assert set(att["branch"]) == {"skip", "other", "key", "value"}


# -- 4. aggregation ---------------------------------------------------------------------


def _token_readout(sr, value):
    """⊕ over the last (hidden) dim, then the table's number, computed by hand."""
    if isinstance(sr, sbp.Real):
        return value[0].sum(-1)
    if isinstance(sr, sbp.MaxProduct):
        return sr.finalize(value).hi.amax(-1)
    if isinstance(sr, sbp.MaxAbs):
        return sr.finalize(value).value.amax(-1)
    if isinstance(sr, sbp.PathCount):
        return torch.logsumexp(sr.finalize(value).log_count, -1)
    if isinstance(sr, sbp.LogAbs):
        return torch.logsumexp(sr.finalize(value).log, -1)
    if isinstance(sr, sbp.Entropy):
        ro = sr.finalize(value)
        lz = torch.logsumexp(ro.log_z, -1, keepdim=True)
        w = torch.exp(ro.log_z - lz)
        # H of the pooled paths: Σ_u w_u (H_u - log Z_u) + log Z (w_u = Z_u / Z)
        m = torch.where(w > 0, ro.entropy - ro.log_z, 0.0)
        h = (w * m).sum(-1) + lz[..., 0]
        return torch.where(torch.isfinite(lz[..., 0]), h, 0.0)  # no path: H = 0
    if isinstance(sr, sbp.TopK):
        vals = sr.finalize(value).values[..., 0]  # each unit's heaviest path
        j = vals.abs().argmax(-1, keepdim=True)
        return vals.gather(-1, j)[..., 0]
    raise AssertionError(sr)


@pytest.mark.parametrize("key", ["bert", "gpt2", "tel-pre"])
def test_oplus_aggregate_readouts_and_winners(key):
    res = result_of(key)
    for _, sub, p in points(res):
        v, ents, parts = contributions(res, p)
        table = res.branches(p)  # every semiring of the pass
        assert set(table["semiring"]) == {sr.name for sr in SEMIRINGS}
        for s, sr in enumerate(res.semirings):
            rows = table[table["semiring"] == sr.name]
            want = torch.stack([_token_readout(sr, part[s])[0] for part in parts], -1)
            got = torch.tensor(rows["value"].to_numpy()).view(want.shape)
            assert list(rows["role"])[: len(ents)] == [e.role for e in ents]
            rtol = 1e-9
            fin = torch.isfinite(want)
            assert torch.equal(fin, torch.isfinite(got)), (key, sub, sr.name)
            atol = rtol * float(want[fin].abs().max()) if fin.any() else 0.0
            err = f"{key} {sub} {sr.name}"
            torch.testing.assert_close(
                got[fin], want[fin], rtol=rtol, atol=atol, msg=lambda m, err=err: f"{err}: {m}"
            )
            # exactly one winner per token (with a path), holding the token's largest value
            assert_winners(rows, token_live(res, v)[0])


@pytest.mark.parametrize("key", ["bert", "llama", "tel-post"])
def test_bucket_sum_assigns_every_unit_once(key):
    res = result_of(key)
    sr = sbp.MaxProduct()
    for _, sub, p in points(res):
        v = br.entries(res, p)[0]
        table = res.branches(p, sr, aggregate="bucket_sum")
        hi = sr.finalize(res.value(v, sr)).hi[0]  # (tokens, hidden)
        sums = table.groupby("token")["value"].sum().to_numpy()
        np.testing.assert_allclose(sums, hi.sum(-1).numpy(), rtol=1e-9, atol=1e-12)
        assert_winners(table, token_live(res, v)[0])
        assert sub in ("attention", "mlp")


def test_bucket_sum_needs_a_selective_semiring_and_aggregate_is_checked():
    res = hf_result("bert")
    place = "bert.encoder.layer.0:input"
    with pytest.raises(sbp.InputError, match="selective"):
        res.branches(place, sbp.Real(), aggregate="bucket_sum")
    with pytest.raises(sbp.InputError, match="aggregate"):
        res.branches(place, sbp.MaxProduct(), aggregate="bad")
    with pytest.raises(sbp.InputError, match="aggregate"):
        res.layer_table(aggregate="bad")
    with pytest.raises(sbp.InputError):
        res.branches(place, sbp.MaxProduct("tensor"))  # not computed in this pass


@pytest.mark.parametrize("key", ["bert", "llama"])
def test_several_aggregates_at_once_equal_each_alone(key):
    """A tuple of aggregates (the contributions computed once) gives, row for row, what
    each aggregate gives alone: ``oplus`` for every semiring, the others for the
    selective ones."""
    res = result_of(key)
    aggs = ("oplus", "bucket_sum", "paper")
    both = res.layer_table(aggregate=aggs, by="role")
    assert list(both.columns).index("aggregation") == list(both.columns).index("value") - 1
    for agg in aggs:
        alone = res.layer_table(aggregate=agg, by="role")
        got = both[both["aggregation"] == agg].drop(columns="aggregation")
        keys = ["layer", "sublayer", "token", "branch", "semiring"]
        got, alone = (t.sort_values(keys).reset_index(drop=True) for t in (got, alone))
        pd.testing.assert_frame_equal(got, alone)
    selective = {sr.name for sr in res.semirings if sr.selective}
    assert set(both.loc[both["aggregation"] == "paper", "semiring"]) == selective
    with pytest.raises(sbp.InputError, match="aggregate"):
        res.layer_table(aggregate=("oplus", "bad"))
    with pytest.raises(sbp.InputError, match="selective"):
        res.layer_table(semirings=[sbp.Real()], aggregate=("bucket_sum",))


# -- 5. batches ---------------------------------------------------------------------------


def test_batched_input_has_an_example_column():
    model = hf_model("bert")
    ids = torch.tensor([[3, 7, 1, 9, 4], [5, 2, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    out = lambda o: o.logits[0, 2, 7] + o.logits[1, 1, 4]  # noqa: E731
    res = sbp.backprop(model, kwargs={"input_ids": ids, "attention_mask": mask}, output=out,
                       semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip
    place = "bert.encoder.layer.1:input"
    table = res.branches(place, sbp.Real())
    assert "example" in table.columns
    assert sorted(table["example"].unique()) == [0, 1]
    assert sorted(table["token"].unique()) == list(range(5))
    assert len(table) == 2 * 5 * 4
    # partition law per example and token
    sums = table.groupby(["example", "token"])["value"].sum().to_numpy().reshape(2, 5)
    want = res.at(place, sbp.Real()).sum(-1)
    torch.testing.assert_close(torch.tensor(sums), want, rtol=1e-9, atol=1e-12)
    layer = res.layer_table(semirings=[sbp.MaxProduct()])
    assert "example" in layer.columns
    for (i, sub), rows in layer.groupby(["layer", "sublayer"]):
        live = token_live(res, br.blocks(res)[i].points[sub])
        assert_winners(rows, live, keys=("example", "token"))
    # a single example has no example column
    assert "example" not in hf_result("bert").branches(place, sbp.Real()).columns


# -- 6. errors ----------------------------------------------------------------------------


def test_unknown_place_raises_not_found():
    res = hf_result("bert")
    with pytest.raises(sbp.NotFoundError):
        res.branches("bert.encoder.layer.7:input")
    with pytest.raises(sbp.NotFoundError):
        br.entries(res, "no_such_module")


def test_model_without_attention_has_no_layer_table():
    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64).eval()
    x = torch.randn(2, 3, dtype=F64)
    res = sbp.backprop(mlp, args=(x,), output=lambda y: y[0, 1], semirings=[sbp.MaxProduct()])
    with pytest.raises(sbp.NotFoundError, match="roles="):
        res.layer_table()
    # a fan-out point can still be named directly: the input feeds one Linear only
    table = res.branches(0)
    assert set(table["role"]) == {"other"}


# -- user roles on a model with unknown names -------------------------------------------


class _Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.wa, self.wb, self.wc, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        q, k, v = self.wa(x), self.wb(x), self.wc(x)
        a = (q @ k.transpose(-1, -2) / math.sqrt(x.shape[-1])).softmax(-1)
        return self.out(a @ v)


class _Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Net(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(d), _Layer(d)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


CUSTOM_ROLES = {r"\.wa$": "query", r"\.wb$": "key", r"\.wc$": "value"}


@functools.cache
def custom_result():
    torch.manual_seed(5)
    net = _Net().to(F64).eval()
    x = torch.randn(1, 3, 4, dtype=F64)
    return sbp.backprop(net, args=(x,), output=lambda y: y[0, -1, 0], semirings=SEMIRINGS)


def test_user_roles_name_unknown_projections():
    res = custom_result()
    place = "layers.0:input"
    assert set(res.branches(place, sbp.MaxProduct())["role"]) == {"skip", "other"}
    table = res.branches(place, sbp.MaxProduct(), roles=CUSTOM_ROLES)
    assert set(table["role"]) == ATTN_ROLES
    # the partition law holds whatever the labels
    v, ents, parts = contributions(res, place, CUSTOM_ROLES)
    for s, sr in enumerate(res.semirings):
        total = oplus_all(sr, [part[s] for part in parts])
        assert_same_value(sr, total, res.value(v, sr), 1e-9, what="custom")


def test_layer_table_finds_blocks_named_by_user_roles():
    table = custom_result().layer_table(semirings=[sbp.MaxProduct()], roles=CUSTOM_ROLES)
    assert sorted(table["layer"].unique()) == [0, 1]
    assert set(table[table["sublayer"] == "attention"]["branch"]) == ATTN_ROLES


# -- projections that are weights, not modules (TransformerLens' naming) ----------------


class _LensAttn(nn.Module):
    """Attention as TransformerLens writes it: per-head weights read through einsums,
    identity hook modules on q, k and v. ``cut``: roles whose input is detached."""

    def __init__(self, d, heads, names):
        super().__init__()
        e = d // heads
        for name in names:
            setattr(self, name, nn.Parameter(torch.randn(heads, d, e) / math.sqrt(d)))
        self.names = names
        self.W_O = nn.Parameter(torch.randn(heads, e, d) / math.sqrt(e))
        self.hook_q, self.hook_k, self.hook_v = nn.Identity(), nn.Identity(), nn.Identity()
        self.cut = set()

    def forward(self, x):
        wq, wk, wv = (getattr(self, n) for n in self.names)
        inp = {r: x.detach() if r in self.cut else x for r in ("query", "key", "value")}
        q = self.hook_q(torch.einsum("bpd,hde->bphe", inp["query"], wq))
        k = self.hook_k(torch.einsum("bpd,hde->bphe", inp["key"], wk))
        v = self.hook_v(torch.einsum("bpd,hde->bphe", inp["value"], wv))
        a = (torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(q.shape[-1])).softmax(-1)
        return torch.einsum("bqhe,hed->bqd", torch.einsum("bhqk,bkhe->bqhe", a, v), self.W_O)


class _LensMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.W_in = nn.Parameter(torch.randn(d, 2 * d) / math.sqrt(d))
        self.W_out = nn.Parameter(torch.randn(2 * d, d) / math.sqrt(2 * d))

    def forward(self, x):
        return torch.einsum("bpm,md->bpd", nn.functional.gelu(x @ self.W_in), self.W_out)


class _LensBlock(nn.Module):
    def __init__(self, d, names):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = _LensAttn(d, 2, names), _LensMLP(d)
        self.cut_skip = False

    def forward(self, x):
        x = (x.detach() if self.cut_skip else x) + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _LensNet(nn.Module):
    def __init__(self, names, d=4):
        super().__init__()
        self.blocks = nn.ModuleList([_LensBlock(d, names), _LensBlock(d, names)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


LENS_NAMES = {"weights": ("W_Q", "W_K", "W_V"), "hooks": ("wa", "wb", "wc")}


@functools.cache
def lens(kind):
    torch.manual_seed(6)
    net = _LensNet(LENS_NAMES[kind]).to(F64).eval()
    x = torch.randn(1, 3, 4, dtype=F64)
    return net, x, sbp.backprop(net, args=(x,), output=_tel_output, semirings=SEMIRINGS)


@pytest.mark.parametrize("kind", LENS_NAMES)
def test_projections_named_by_their_weights_or_hooks(kind):
    """Roles of consumers that read ``attn.W_Q`` (or feed ``attn.hook_q``) and no query
    module; under Real each branch is autograd's gradient with the other branches cut."""
    net, x, res = lens(kind)
    table = res.layer_table(semirings=[sbp.MaxProduct()])
    assert sorted(table["layer"].unique()) == [0, 1]
    for i in range(2):
        att = table[(table["layer"] == i) & (table["sublayer"] == "attention")]
        assert set(att["branch"]) == ATTN_ROLES
        mlp = table[(table["layer"] == i) & (table["sublayer"] == "mlp")]
        assert set(mlp["branch"]) == MLP_ROLES
        for role, name in zip(("query", "key", "value"), LENS_NAMES[kind]):
            via = name if kind == "weights" else f"hook_{role[0]}"
            assert set(att[att["branch"] == role]["consumer"]) == {f"blocks.{i}.attn.{via}"}
    v, ents, parts = contributions(res, "blocks.0:input")
    for s, sr in enumerate(res.semirings):
        total = oplus_all(sr, [part[s] for part in parts])
        assert_same_value(sr, total, res.value(v, sr), 1e-9, what=kind)
    block, real = net.blocks[0], res.semirings.index(sbp.Real())
    for e, part in zip(ents, parts):
        block.cut_skip = e.role != "skip"
        block.attn.cut = ATTN_ROLES - {"skip", e.role}
        leaf = x.clone().requires_grad_()
        try:
            (want,) = torch.autograd.grad(_tel_output(net(leaf)), leaf)
        finally:
            block.cut_skip, block.attn.cut = False, set()
        assert_grad_close(part[real][0], want, 1e-9, f"{kind} {e.role}")
