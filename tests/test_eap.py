"""Edge attribution patching (``Patching.eap``, ``eap_ig``) and exact edge patching
(``Patching.edge_effects``) on a tiny pre-LN GPT-2 (two layers, two heads), float64.

Oracles, on the model's own modules through hooks (not the traced graph):
- the gradient of the output at each destination's input: a zero tensor ``z`` added to
  the residual stream where only that destination reads it (the layer norm before the
  MLP, the final layer norm; for one head's query, key or value, its columns of
  ``c_attn`` computed again from ``ln_1(stream + z)``), torch.autograd;
- each source's output as it is added to the residual stream (the token embedding, a
  head's slice times its rows of ``c_proj``, the MLP's output), clean minus corrupted;
- EAP = (a - a') . that gradient; EAP-IG (inputs) the same with the gradient averaged
  over runs whose token embeddings are ``x' + (k / N)(x - x')``, ``k = 0 .. N - 1``;
- an edge's exact effect: the model with only that destination's input moved by
  ``a' - a`` of that source at that position.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import semiring_backprop as sbp
from semiring_backprop.analysis.patching import EDGE_KEY, Patching

T = pytest.importorskip("transformers")
pd = pytest.importorskip("pandas")

F64 = torch.float64
IDS = torch.tensor([[3, 7, 1, 9, 4]])
COR = torch.tensor([[3, 5, 1, 2, 4]])
E, H = 8, 2
D = E // H


def metric(out):
    return out.logits[0, -1, 5] - out.logits[0, -2, 3]


@functools.cache
def model():
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=20, n_embd=E, n_layer=2, n_head=H, n_positions=16,
                       bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")  # fmt: skip
    return T.GPT2LMHeadModel(cfg).to(F64).eval()


@functools.cache
def patching():
    res = sbp.backprop(model(), kwargs={"input_ids": IDS}, output=metric, semirings=[sbp.Real()])
    return Patching(res, {"input_ids": COR})


def _hooks(z, dst):
    """Hooks that add ``z`` (positions, hidden) to the stream where only ``dst`` reads it."""
    m = model()
    layer, role, head, inp = dst
    if role == "target":
        return [m.transformer.ln_f.register_forward_pre_hook(lambda mod, a: (a[0] + z,))]
    block = m.transformer.h[layer]
    if role == "mlp":
        return [block.ln_2.register_forward_pre_hook(lambda mod, a: (a[0] + z,))]
    stream = {}
    offset = "qkv".index(inp) * E + head * D
    cols = torch.zeros(3 * E, dtype=torch.bool)
    cols[offset : offset + D] = True

    def keep(mod, a):
        stream["x"] = a[0]

    def mine(mod, a, out):
        ln, proj = block.ln_1, block.attn.c_attn
        x = F.layer_norm(stream["x"] + z, (E,), ln.weight, ln.bias, ln.eps)
        return torch.where(cols, x @ proj.weight + proj.bias, out)

    return [block.ln_1.register_forward_pre_hook(keep),
            block.attn.c_attn.register_forward_hook(mine)]  # fmt: skip


def _output(ids, hooks=(), emb=None):
    extra = list(hooks)
    if emb is not None:
        extra.append(model().transformer.wte.register_forward_hook(lambda mod, a, out: emb))
    try:
        return metric(model()(ids))
    finally:
        for h in extra:
            h.remove()


def _gradient(dst, emb=None):
    z = torch.zeros(IDS.shape[1], E, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(_output(IDS, _hooks(z, dst), emb), z)
    return g


def _captured(ids):
    """Each source's output as added to the stream: ``{(layer, role, head): (positions, E)}``."""
    m = model()
    got, hooks = {}, []
    hooks.append(m.transformer.wte.register_forward_hook(
        lambda mod, a, out: got.__setitem__((-1, "embedding", None), out[0])))  # fmt: skip
    for i, block in enumerate(m.transformer.h):

        def heads(mod, a, i=i):
            x = a[0][0]
            for h in range(H):
                rows = slice(h * D, (h + 1) * D)
                got[(i, "head", h)] = x[:, rows] @ mod.weight[rows]

        hooks.append(block.attn.c_proj.register_forward_pre_hook(heads))
        hooks.append(block.mlp.register_forward_hook(
            lambda mod, a, out, i=i: got.__setitem__((i, "mlp", None), out[0])))  # fmt: skip
    with torch.no_grad():
        _output(ids, hooks)
    return got


def _key(row):
    def head(v):
        return None if pd.isna(v) else int(v)

    src = (int(row.src_layer), row.src_role, head(row.src_head_index))
    dst = (int(row.dst_layer), row.dst_role, head(row.dst_head_index), row.input)
    return src, dst, int(row.position)


def test_eap_is_the_difference_times_the_gradient_at_the_destinations_input():
    p = patching()
    scores = p.eap()
    assert list(scores.columns) == [*EDGE_KEY, "score"]
    diff = {k: a - b for (k, a), b in zip(_captured(IDS).items(), _captured(COR).values())}
    grads = {}
    for row in scores.itertuples():
        src, dst, pos = _key(row)
        if dst not in grads:
            grads[dst] = _gradient(dst)
        want = float(diff[src][pos] @ grads[dst][pos])
        assert row.score == pytest.approx(want, rel=1e-9, abs=1e-13), (src, dst, pos)
    assert (scores.score.abs() > 1e-6).sum() > 20
    assert set(scores.input) == {"q", "k", "v", "mlp", "target"}


def test_eap_ig_averages_the_gradient_over_interpolated_embeddings():
    p = patching()
    steps = 3
    scores = p.eap_ig(steps)
    wte = model().transformer.wte
    with torch.no_grad():
        x, x0 = wte(IDS), wte(COR)
    diff = {k: a - b for (k, a), b in zip(_captured(IDS).items(), _captured(COR).values())}
    grads = {}
    for row in scores.itertuples():
        src, dst, pos = _key(row)
        if dst not in grads:
            grads[dst] = (
                sum(_gradient(dst, x0 + k / steps * (x - x0)) for k in range(1, steps + 1)) / steps
            )
        want = float(diff[src][pos] @ grads[dst][pos])
        assert row.score == pytest.approx(want, rel=1e-9, abs=1e-13), (src, dst, pos)
    eap = p.eap()
    assert not (abs(eap.score - scores.score) < 1e-9).all()
    one = p.eap_ig(1)  # one point: the clean input, where EAP reads its gradient
    assert one.score.tolist() == pytest.approx(eap.score.tolist(), rel=1e-9, abs=1e-13)


def test_an_edges_effect_is_the_model_with_only_that_destinations_input_moved():
    p = patching()
    edges = p.edges()
    picked = []  # some edges of every kind of source and destination
    for _, rows in edges.groupby(["src_role", "input"], sort=False):
        picked += list(rows.index[:: max(1, len(rows) // 3)])
    chosen = edges.loc[picked]
    effects = p.edge_effects(chosen)
    assert len(effects) == len(chosen) and set(effects.src_role) == {"embedding", "head", "mlp"}
    clean = float(_output(IDS).detach())
    diff = {k: b - a for (k, a), b in zip(_captured(IDS).items(), _captured(COR).values())}
    nonzero = 0
    for row in effects.itertuples():
        src, dst, pos = _key(row)
        z = torch.zeros(IDS.shape[1], E, dtype=F64)
        z[pos] = diff[src][pos]
        with torch.no_grad():
            want = clean - float(_output(IDS, _hooks(z, dst)))
        assert row.effect == pytest.approx(want, rel=1e-9, abs=1e-13), (src, dst, pos)
        nonzero += abs(want) > 1e-6
    assert nonzero > 5


def test_eap_ig_with_gauss_legendre_points():
    """Two Gauss-Legendre points on [0, 1]: (1 -/+ 1/sqrt(3)) / 2, each weighed 1/2 (the
    rule's nodes and weights written out here, not read from the library)."""
    p = patching()
    scores = p.eap_ig(2, method="gausslegendre")
    wte = model().transformer.wte
    with torch.no_grad():
        x, x0 = wte(IDS), wte(COR)
    points = [(1 - 3**-0.5) / 2, (1 + 3**-0.5) / 2]
    diff = {k: a - b for (k, a), b in zip(_captured(IDS).items(), _captured(COR).values())}
    grads = {}
    for row in scores.itertuples():
        src, dst, pos = _key(row)
        if dst not in grads:
            grads[dst] = sum(0.5 * _gradient(dst, x0 + t * (x - x0)) for t in points)
        want = float(diff[src][pos] @ grads[dst][pos])
        assert row.score == pytest.approx(want, rel=1e-9, abs=1e-13), (src, dst, pos)
    right = p.eap_ig(2)
    assert not (abs(right.score - scores.score) < 1e-9).all()
    with pytest.raises(sbp.InputError, match="ig_method"):
        p.eap_ig(2, method="simpson")
