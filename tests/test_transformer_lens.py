"""TransformerLens ``HookedTransformer`` (tiny random configs, float64) against oracles.

- ``Real`` equals torch.autograd at the token embeddings (``hook_embed``) and at each
  block's input.
- The top ``MaxProduct`` path from a token's embedding has the aggregated readout as its
  value, and that value is the product of its edge weights.
- Path entropy is finite and within [0, log #paths].
- ``layer_table`` finds both blocks, with skip / query / key / value at the attention
  input and skip / mlp at the MLP input (TransformerLens reads ``attn.W_Q`` through an
  einsum: no query module exists), and under ``Real`` each branch's contribution is the
  gradient torch.autograd gives with the other branches cut by hooks.

Two configs: learned positions, LayerNorm and GELU; and a Llama-like one: rotary
positions, RMSNorm, grouped-query attention and a gated SiLU MLP.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.analysis import branches as br

tl = pytest.importorskip("transformer_lens")
try:  # removed in TransformerLens 4 (TransformerBridge replaces it)
    from transformer_lens import HookedTransformer, HookedTransformerConfig
except ImportError:
    pytest.skip("this TransformerLens has no HookedTransformer", allow_module_level=True)

# we test HookedTransformer itself, which TransformerLens 3 deprecates in favour of v4's bridge
pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

F64 = torch.float64
SEMIRINGS = [sbp.Real(), sbp.MaxProduct(), sbp.Entropy(), sbp.PathCount()]
IDS = torch.tensor([[3, 7, 1, 9, 4, 11]])
N_LAYERS = 2
CONFIGS = {
    "learned-ln": {"act_fn": "gelu"},
    "rotary-rms-gqa": {  # Llama-like: one key/value head shared by both query heads
        "positional_embedding_type": "rotary",
        "normalization_type": "RMS",
        "n_key_value_heads": 1,
        "gated_mlp": True,
        "act_fn": "silu",
    },
}
#: the weight each projection reads (grouped-query attention keeps ``_W_K``, ``_W_V``)
ROLE_WEIGHT = {
    "learned-ln": {"query": "W_Q", "key": "W_K", "value": "W_V"},
    "rotary-rms-gqa": {"query": "W_Q", "key": "_W_K", "value": "_W_V"},
}


def _output(logits):
    return logits[0, -1, 5] - logits[0, -2, 3]


@functools.cache
def model(name):
    cfg = HookedTransformerConfig(
        n_layers=N_LAYERS, d_model=16, n_heads=2, d_head=8, d_mlp=32, d_vocab=50, n_ctx=32,
        dtype=F64, device="cpu", seed=0, **CONFIGS[name],
    )  # fmt: skip
    return HookedTransformer(cfg).eval()


@functools.cache
def result(name):
    return sbp.backprop(model(name), args=(IDS,), output=_output, semirings=SEMIRINGS)


def _autograd_at(m, hooks):
    """d output / d (the output of each hook module in ``hooks``)."""
    seen, handles = {}, []
    for path in hooks:

        def keep(mod, args, out, path=path):
            out.retain_grad()
            seen[path] = out

        handles.append(m.get_submodule(path).register_forward_hook(keep))
    try:
        _output(m(IDS)).backward()
    finally:
        for h in handles:
            h.remove()
    m.zero_grad(set_to_none=True)
    return {p: t.grad for p, t in seen.items()}


@pytest.mark.parametrize("name", CONFIGS)
def test_real_equals_autograd(name):
    res, m = result(name), model(name)
    places = ["hook_embed"] + [f"blocks.{i}.hook_resid_pre" for i in range(N_LAYERS)]
    want = _autograd_at(m, places)
    for place in places:
        got = res.at(place, sbp.Real())
        assert got.abs().max() > 0
        torch.testing.assert_close(got, want[place], rtol=1e-10, atol=1e-13, msg=place)


@pytest.mark.parametrize("name", CONFIGS)
def test_top_path_from_each_token_is_the_readout(name):
    res = result(name)
    agg = res.aggregate("hook_embed", sbp.MaxProduct())
    for t in range(IDS.shape[1]):
        for sign, best in (("+", agg.hi), ("-", agg.lo)):
            path = res.top_path(("hook_embed", (0, t)), sign=sign)
            assert path.value == best[0, t].item()
            assert path.source.module == "hook_embed" and path.source.index[:2] == (0, t)
            product = math.prod(s.edge_weight for s in path.steps[1:])
            assert product == pytest.approx(path.value, rel=1e-9)
    assert (agg.hi >= agg.lo).all()


@pytest.mark.parametrize("name", CONFIGS)
def test_entropy_is_finite_and_at_most_log_paths(name):
    res = result(name)
    for place in ("hook_embed", "blocks.1.hook_resid_pre"):
        h = res.at(place, sbp.Entropy()).entropy
        log_n = res.at(place, sbp.PathCount()).log_count
        assert torch.isfinite(h).all() and torch.isfinite(log_n).all()
        assert (h >= -1e-9).all()
        assert (h <= log_n + 1e-9).all()
        assert h.max() > 1.0  # many paths of comparable weight, not one


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_table_roles(name):
    table = result(name).layer_table(semirings=[sbp.MaxProduct()])
    assert sorted(table["layer"].unique()) == list(range(N_LAYERS))
    for i in range(N_LAYERS):
        rows = table[table["layer"] == i]
        att, mlp = rows[rows["sublayer"] == "attention"], rows[rows["sublayer"] == "mlp"]
        assert set(att["branch"]) == {"skip", "query", "key", "value"}
        assert set(mlp["branch"]) == {"skip", "mlp"}
        for role, weight in ROLE_WEIGHT[name].items():
            assert set(att[att["branch"] == role]["consumer"]) == {f"blocks.{i}.attn.{weight}"}
        assert set(mlp[mlp["branch"] == "mlp"]["consumer"]) == {f"blocks.{i}.mlp"}
        for _, tok in rows.groupby(["sublayer", "token"]):
            if tok["path"].any():
                assert tok["winner"].sum() == 1
                assert tok.loc[tok["winner"], "value"].item() == tok["value"].max()


def _cut_grad(m, layer, sublayer, keep):
    """d output / d (block ``layer``'s residual at ``sublayer``) through ``keep`` only.

    The residual hook's output feeds the skip connection; the norm in front of the
    sublayer gets the same leaf from a pre-hook. TransformerLens calls ``ln1`` three
    times, for the query, key and value inputs in that order.
    """
    block = m.blocks[layer]
    hook, norm, roles = (
        (block.hook_resid_pre, block.ln1, ("query", "key", "value"))
        if sublayer == "attention"
        else (block.hook_resid_mid, block.ln2, ("mlp",))
    )
    state = {"calls": 0}

    def leaf(mod, args, out):
        state["leaf"] = out.detach().clone().requires_grad_()
        return state["leaf"] if "skip" in keep else state["leaf"].detach()

    def norm_input(mod, args):
        role = roles[state["calls"] % len(roles)]
        state["calls"] += 1
        return (state["leaf"] if role in keep else state["leaf"].detach(),)

    handles = [hook.register_forward_hook(leaf), norm.register_forward_pre_hook(norm_input)]
    try:
        y = _output(m(IDS))
    finally:
        for h in handles:
            h.remove()
    assert state["calls"] == len(roles)
    (g,) = torch.autograd.grad(y, state["leaf"], allow_unused=True)
    return torch.zeros_like(state["leaf"]) if g is None else g


@pytest.mark.parametrize("name", CONFIGS)
def test_real_branches_equal_autograd_with_other_branches_cut(name):
    res, m = result(name), model(name)
    s = res.semirings.index(sbp.Real())
    for i, block in enumerate(br.blocks(res)):
        for sub, point in block.points.items():
            v, ents = br.entries(res, point)
            by_role = {}  # a gated MLP has two consumers (W_gate, W_in) of one role
            for e in ents:
                got = sbp.Real().finalize(br.contribution(res, v, e)[s])
                by_role[e.role] = by_role.get(e.role, 0) + got
            roles = {"skip", "query", "key", "value"} if sub == "attention" else {"skip", "mlp"}
            assert set(by_role) == roles
            total = 0
            for role, got in by_role.items():
                want = _cut_grad(m, i, sub, {role})
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13,
                                           msg=f"layer {i} {sub} {role}")  # fmt: skip
                total = total + want
            # the branches partition the paths: together they are the whole gradient
            torch.testing.assert_close(total, res.at(v, sbp.Real()), rtol=1e-10, atol=1e-13)
