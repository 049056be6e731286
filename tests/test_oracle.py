"""Every semiring against the brute-force path enumerator (tests/oracles.py).

Each case traces a small model once, runs every semiring in one pass, expands the
traced graph into its scalar DAG and lists every path; then the library's readout must
equal the directly computed answer at every node of the graph (inputs, module outputs
and every intermediate), elementwise.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import oracles
import semiring_backprop as sbp

F64 = torch.float64
aten = torch.ops.aten
K = 4
SEMIRINGS = [
    sbp.Real(),
    sbp.MaxProduct(),
    sbp.MaxAbs(),
    sbp.LogAbs(),
    sbp.Entropy(),
    sbp.PathCount(),
    sbp.TopK(1),
    sbp.TopK(K),
]


def randn(*shape):
    return torch.randn(*shape, dtype=F64)


# -- cases ----------------------------------------------------------------------------
# Each builder returns (model, args, output, wheres): ``wheres`` are the places (input
# keys, module paths) that must have a value; every other node is compared as well.


def case_fanout_broadcast():
    W, b, c = randn(3, 3), randn(3), randn(2, 3)

    def f(x, u, v):
        h = x @ W + b  # bias broadcast over rows
        a, s = torch.tanh(h), torch.sigmoid(h)  # h feeds two ops
        p = u * v  # (2, 1) * (1, 3)
        return a * s + p * x * x  # x * x: two parallel edges

    return f, (randn(2, 3), randn(2, 1), randn(1, 3)), lambda y: (y * c).sum(), [0, 1, 2]


def case_mlp_relu():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
    return model, (randn(2, 3),), lambda y: y[0, 1] - y[1, 0], [0, "0", "1", "2"]


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(3, 3), nn.GELU(), nn.Linear(3, 3), nn.Sigmoid())
        self.g = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.g(x + self.f(x))


def case_residual_gelu():
    model = Residual().double().eval()
    c = randn(2, 3)
    return model, (randn(2, 3),), lambda y: (y * c).sum(), [0, "f", "f.1", "f.2", "g"]


def case_layer_norm_module():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh()).double().eval()
    with torch.no_grad():
        model[1].weight.copy_(randn(4))
        model[1].bias.copy_(randn(4))
    c = randn(2, 4)
    return model, (randn(2, 3),), lambda y: (y * c).sum(), [0, "0", "1", "1:input"]


def case_layer_norm_functional():
    def f(x, w, b):
        return F.layer_norm(x, (4,), w, b)

    return f, (randn(2, 4), randn(4), randn(4)), lambda y: y[0, 1] + 2 * y[1, 3], [0, 1, 2]


def case_softmax():
    W = randn(3, 4)

    def f(x):
        return torch.softmax(x @ W, -1)

    return f, (randn(2, 3),), lambda y: y[1, 2] - y[0, 0], [0]


def case_embedding_weight():
    ids = torch.tensor([[1, 3, 1, 0], [3, 3, 2, 1]])  # repeated ids: rows used twice
    V = randn(3, 2)

    def f(weight, ids):
        return torch.tanh(F.embedding(ids, weight)) @ V

    return f, (randn(5, 3), ids), lambda y: y[0].sum() - y[1, 1, 0], [0]


class EmbedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.lin = nn.Linear(3, 2)

    def forward(self, ids):
        h = self.emb(ids)
        return self.lin(torch.tanh(h) * h)


def case_embedding_module():
    model = EmbedModel().double().eval()
    ids = torch.tensor([[0, 2, 2, 4, 0]])
    return model, (ids,), lambda y: y[0, :, 1].sum(), ["emb", "lin"]


class Attention(nn.Module):
    """One head of self-attention with a residual and a post layer norm."""

    def __init__(self, d=2):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln = nn.LayerNorm(d + 1)
        self.up = nn.Linear(d, d + 1)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        h = self.o(torch.softmax(s, -1) @ self.v(x))
        return self.ln(self.up(x + h))


def case_attention():
    model = Attention().double().eval()
    return model, (randn(3, 2),), lambda y: y[2, 0] - y[1, 2], [0, "q", "k", "v", "o", "up"]


class Composites(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.ln = nn.LayerNorm(4)
        self.act = nn.Tanh()

    def forward(self, x):
        h = self.act(self.ln(self.lin(x)))
        return torch.softmax(h, -1) + torch.log_softmax(h * x[:, :1], -1)


def case_kept_composites():
    """Composite ops kept whole: their dense per-row Jacobians define the edges."""
    model = Composites().double().eval()
    with torch.no_grad():
        model.ln.weight.copy_(randn(4))
    c = randn(2, 4)
    return model, (randn(2, 3),), lambda y: (y * c).sum(), [0, "lin", "ln", "act"]


def case_attention_batched():
    """Batch of 2: projections become views around addmm, scores and mixing become bmm."""
    model = Attention().double().eval()
    return model, (randn(2, 3, 2),), lambda y: y[0, 2, 0] - y[1, 1, 2], [0, "k", "o", "ln"]


def case_dense_zeros():
    """Contractions are dense: an exact 0 in either operand is still an edge (weight 0)."""
    W = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]], dtype=F64)

    def f(x, y):
        h = torch.relu(x @ W)  # zeros from the weight's 0s and from dead units
        return h @ y.T  # both operands depend on inputs

    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5]], dtype=F64)
    return f, (x, randn(2, 3)), lambda s: s[0, 1] + s[1, 0] * 0.0, [0, 1]


def case_routing_zoo():
    """where / masked_fill / cat / flip / index / gather / pad / roll / repeat / max."""
    idx = torch.tensor([[0, 0, 2], [1, 2, 1], [2, 2, 2], [0, 1, 0]])
    rows = torch.tensor([0, 2, 2, 3])
    w, c = randn(8, 4), randn(8, 4)

    def f(x, y):
        a = torch.where(x > 0, x, y).masked_fill(x < -1.0, 0.5)  # (2, 3)
        d = torch.cat([a, x.flip(0) * y], 0)[rows]  # (4, 3), row 2 twice
        e = F.pad(torch.gather(d, 1, idx), (1, 0)).roll(1, -1)  # (4, 4)
        return e.t().repeat(2, 1) * w + e.amax()  # (8, 4)

    return f, (randn(2, 3), randn(3)), lambda y: (y * c).sum(), [0, 1]


def case_uniform_masks():
    """Masks that hold everywhere or nowhere (an unpadded input's attention mask): their
    rules pass D on or give the zero without a ``where``; ``z`` is read only where a
    mask never holds, and through a fill that masks everything."""
    c = randn(2, 3)

    def f(x, y, z):
        n = x.shape[-1]
        always, never = torch.arange(n) >= 0, torch.arange(n) < 0
        a = torch.where(always, x, z)  # x everywhere
        b = torch.where(never, z, a * y)  # a * y everywhere
        e = b.masked_fill(never, 0.5) + torch.where(always[None], x, 1.5)  # nothing masked
        return e * 2 + torch.tanh(z).masked_fill(always, 0.0)  # z: masked everywhere

    return f, (randn(2, 3), randn(3), randn(2, 3)), lambda y: (y * c).sum(), [0, 1]


def case_pointwise_zoo():
    def f(x):
        z = torch.exp(x)
        a = torch.log(z + 1) + torch.sqrt(z) - z**3 / 4 + 1 / z
        b = torch.abs(x) * torch.relu(x - 0.5) + torch.sin(x) * torch.cos(x)
        return x / (z + 1) + (1 - a) * b - b.mean(-1, keepdim=True)

    return f, (randn(2, 3),), lambda y: y[0, 2] - y.sum(), [0]


def case_conv_padding_groups():
    w1, w2 = randn(4, 1, 3), randn(2, 4, 2)  # depthwise-style groups, then a dense conv
    c = randn(1, 2, 2)

    def f(x):
        h = torch.tanh(F.conv1d(x, w1, padding=1, groups=2))  # (1, 4, 4)
        return F.conv1d(h, w2, stride=2, dilation=1)  # (1, 2, 2)

    return f, (randn(1, 2, 4),), lambda y: (y * c).sum(), [0]


def case_conv_more_output_channels():
    """Few input channels (an image's first conv): the other order of contraction."""
    w, c = randn(6, 1, 2, 2), randn(1, 6, 2, 2)

    def f(x):
        return F.conv2d(x, w, stride=2, padding=1, groups=1)

    return f, (randn(1, 1, 3, 3),), lambda y: (y * c).sum(), [0]


def case_conv2d_transposed_and_weight_input():
    c = randn(1, 2, 2, 2)

    def f(x, w):
        h = F.conv2d(x, w, padding=1, stride=2)  # the weight is an input: it has edges too
        return F.conv_transpose2d(h, w.transpose(0, 1), stride=2, padding=1)

    return f, (randn(1, 2, 3, 3), randn(2, 2, 2, 2)), lambda y: (y * c).sum(), [0, 1]


def case_pooling():
    c = randn(1, 2, 2, 2)

    def f(x):
        a = F.max_pool2d(x, 2, stride=1)  # (1, 2, 3, 3): overlapping windows
        b = F.avg_pool2d(x, 2, stride=2, padding=1, count_include_pad=False)  # (1, 2, 3, 3)
        m = F.adaptive_max_pool2d(a * b, 2)  # (1, 2, 2, 2)
        return m + F.adaptive_avg_pool2d(b, 2)

    return f, (randn(1, 2, 4, 4),), lambda y: (y * c).sum(), [0]


def case_topk_routing():
    """A mixture-of-experts router: the top-2 scores' softmax weights the chosen experts."""
    router, experts, c = randn(3, 4), randn(4, 3, 3), randn(2, 3)

    def f(x):
        scores = x @ router  # (2, 4)
        top, idx = scores.topk(2, dim=-1)
        weights = torch.softmax(top, -1)  # edges to the two selected scores only
        chosen = experts[idx]  # (2, 2, 3, 3): constants picked by integer indices
        out = torch.einsum("ti,tkij->tkj", x, chosen)
        return (weights[..., None] * out).sum(1) + x.sort(-1).values

    return f, (randn(2, 3),), lambda y: (y * c).sum(), [0]


def case_inplace_view_writes():
    c = randn(3, 4)

    def f(x, y):
        g = x * 1.0
        g += torch.tanh(y)  # an in-place residual
        g[:, :2] *= 2  # then a write into a view of it
        g[1:, 2:] = y[:2, :2] * x[1:, :2]  # and an assignment (aten.copy)
        return g

    return f, (randn(3, 4), randn(3, 4)), lambda y: (y * c).sum(), [0, 1]


def case_boolean_mask_indexing():
    def f(x):
        picked = x[x > 0]  # a data-dependent number of elements
        return torch.tanh(x) * picked.sum() + x.abs().amax()

    return f, (randn(2, 3),), lambda y: y[0, 1] - y[1, 2], [0]


def case_norms():
    bn = nn.BatchNorm1d(2).double()
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 2.0)
    bn.eval()
    gn = nn.GroupNorm(1, 2).double().eval()
    c = randn(2, 2, 3)

    def f(x):
        h = gn(bn(x))
        return F.normalize(h, dim=-1) * torch.linalg.vector_norm(x, dim=1, keepdim=True)

    return f, (randn(2, 2, 3),), lambda y: (y * c).sum(), [0]


KEEP = {"kept_composites": ("softmax", "log_softmax", "layer_norm")}


def _random_program(seed):
    """A random straight-line program over (2, 3) tensors: seven distinct ops, operands
    drawn from every value so far, so fan-out, ``x * x`` and residuals occur naturally."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    menu = ["tanh", "sigmoid", "relu", "gelu", "mul", "bias", "outer", "linear", "softmax"]
    menu += ["log_softmax", "layer_norm", "rowsum", "residual"]
    rng.shuffle(menu)
    steps = [(name, rng.randrange(100), rng.randrange(100)) for name in menu[:7]]
    consts = {
        "bias": torch.randn(3, dtype=F64, generator=gen),
        "W": torch.randn(3, 3, dtype=F64, generator=gen),
        "c": torch.randn(3, 2, 3, dtype=F64, generator=gen),
    }
    unary = {
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
        "relu": torch.relu,
        "gelu": F.gelu,
        "bias": lambda a: a + consts["bias"],
        "linear": lambda a: a @ consts["W"],
        "softmax": lambda a: torch.softmax(a, -1),
        "log_softmax": lambda a: torch.log_softmax(a, -1),
        "layer_norm": lambda a: F.layer_norm(a, (3,)),
        "rowsum": lambda a: a - 0.3 * a.sum(-1, keepdim=True),
        "residual": lambda a: a + torch.tanh(a),
    }
    binary = {"mul": lambda a, b: a * b, "outer": lambda a, b: a[:, :1] * b[:1, :]}

    def f(x, y):
        pool = [x, y]
        for name, i, j in steps:
            a, b = pool[i % len(pool)], pool[j % len(pool)]
            pool.append(unary[name](a) if name in unary else binary[name](a, b))
        return torch.stack([pool[-1], pool[-2], x * torch.sigmoid(y)])  # uses both inputs

    args = (
        torch.randn(2, 3, dtype=F64, generator=gen),
        torch.randn(2, 3, dtype=F64, generator=gen),
    )
    return f, args, lambda out: (out * consts["c"]).sum(), [0, 1]


CASES = {
    "fanout_broadcast": case_fanout_broadcast,
    "mlp_relu": case_mlp_relu,
    "residual_gelu": case_residual_gelu,
    "layer_norm_module": case_layer_norm_module,
    "layer_norm_functional": case_layer_norm_functional,
    "softmax": case_softmax,
    "embedding_weight": case_embedding_weight,
    "embedding_module": case_embedding_module,
    "attention": case_attention,
    "attention_batched": case_attention_batched,
    "dense_zeros": case_dense_zeros,
    "kept_composites": case_kept_composites,
    "routing_zoo": case_routing_zoo,
    "uniform_masks": case_uniform_masks,
    "pointwise_zoo": case_pointwise_zoo,
    "conv_padding_groups": case_conv_padding_groups,
    "conv2d_transposed_and_weight_input": case_conv2d_transposed_and_weight_input,
    "conv_more_output_channels": case_conv_more_output_channels,
    "pooling": case_pooling,
    "topk_routing": case_topk_routing,
    "inplace_view_writes": case_inplace_view_writes,
    "boolean_mask_indexing": case_boolean_mask_indexing,
    "norms": case_norms,
    **{f"random_{s}": (lambda s=s: _random_program(s)) for s in range(8)},
}


class Run:
    def __init__(self, name):
        torch.manual_seed(0)
        self.model, self.args, self.output, self.wheres = CASES[name]()
        self.keep = KEEP.get(name, ())
        self.res = sbp.backprop(
            self.model, self.args, output=self.output, semirings=SEMIRINGS, whole=self.keep
        )
        self.oracle = oracles.build(self.res)


_RUNS: dict[str, Run] = {}


def get_run(name) -> Run:
    if name not in _RUNS:
        _RUNS[name] = Run(name)
    return _RUNS[name]


# -- comparisons ----------------------------------------------------------------------


def _close(actual, expected, what, atol=1e-12):
    expected = torch.as_tensor(np.asarray(expected), dtype=F64)
    torch.testing.assert_close(
        actual, expected, rtol=1e-10, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def _assert_topk(actual, expected, what):
    """Magnitudes must match in order; signs wherever the magnitude is not tied (paths
    of equal |product| and opposite sign may come in either order). ``expected`` may
    list more entries than ``actual``: they reveal ties at the cut."""
    expected = torch.as_tensor(expected, dtype=F64)
    mag = expected.abs()
    tied = torch.zeros_like(mag, dtype=torch.bool)
    gap = torch.isclose(mag[..., 1:], mag[..., :-1], rtol=1e-9, atol=1e-300)
    tied[..., 1:] |= gap
    tied[..., :-1] |= gap
    k = actual.shape[-1]
    expected, tied = expected[..., :k], tied[..., :k]
    _close(actual.abs(), expected.abs(), f"{what} |top-k|")
    _close(torch.where(tied, 0.0, actual), torch.where(tied, 0.0, expected), f"{what} top-k")


def assert_node_matches(res, oracle, node, dims=None):
    """Every semiring's readout at ``node`` equals the oracle's, elementwise (or, with
    ``dims``, the aggregated derivative over those dims)."""
    exp = oracle.readouts(node, K + 1, dims or ())
    name = f"node {node.name} ({node.target})" + (f" aggregated over {dims}" if dims else "")

    def at(sr):
        return res.at(node, sr) if dims is None else res.aggregate(node, sr, dims)

    _close(at(sbp.Real()), exp["real"], f"Real at {name}")
    mp = at(sbp.MaxProduct())
    _close(mp.hi, exp["hi"], f"MaxProduct.hi at {name}")
    _close(mp.lo, exp["lo"], f"MaxProduct.lo at {name}")
    ma = at(sbp.MaxAbs())
    _close(ma.value, exp["max_abs"], f"MaxAbs.value at {name}")
    _close(ma.log, exp["max_abs_log"], f"MaxAbs.log at {name}", atol=1e-11)
    _close(at(sbp.LogAbs()).log, exp["log_abs"], f"LogAbs at {name}", atol=1e-11)
    ent = at(sbp.Entropy())
    _close(ent.entropy, exp["entropy"], f"Entropy.entropy at {name}", atol=1e-11)
    _close(ent.log_z, exp["log_z"], f"Entropy.log_z at {name}", atol=1e-11)
    pc = at(sbp.PathCount()).log_count
    _close(pc, exp["log_count"], f"PathCount at {name}", atol=1e-11)
    _assert_topk(at(sbp.TopK(K)).values, exp["topk"], f"TopK({K}) at {name}")
    _assert_topk(at(sbp.TopK(1)).values, exp["topk"], f"TopK(1) at {name}")


def compared_nodes(run: Run) -> list:
    """Every node the oracle reaches; the library must have a value wherever a path exists."""
    nodes = []
    for node in run.oracle.products:
        try:
            run.res.value(node, SEMIRINGS[0])
        except sbp.InputError:
            assert run.oracle.count(node).sum() == 0, f"no value at {node.name}, but paths exist"
            continue
        nodes.append(node)
    return nodes


def readouts(res, node):
    out = []
    for sr in SEMIRINGS:
        r = res.at(node, sr)
        out.extend([r] if isinstance(r, torch.Tensor) else vars(r).values())
    return out


# -- tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_every_semiring_matches_oracle(case):
    run = get_run(case)
    nodes = compared_nodes(run)
    wanted = [run.res.node(w) for w in run.wheres]
    missing = [w for w, n in zip(run.wheres, wanted) if n not in nodes]
    assert not missing, f"no value at {missing}"
    assert len(nodes) > len(run.res.graph.user_inputs) + 1  # intermediates are compared too
    for node in nodes:
        assert_node_matches(run.res, run.oracle, node)


@pytest.mark.parametrize("case", ["attention", "embedding_weight", "random_2", "dense_zeros"])
def test_aggregate_matches_oracle(case):
    """The aggregated derivative (Eq. 3) pools the paths of every element aggregated."""
    run = get_run(case)
    for key in run.res.graph.user_inputs:
        node = run.res.node(key)
        if node not in run.oracle.products or run.oracle.count(node).sum() == 0:
            continue
        shape = run.res.values[node].shape
        for dims in [(-1,), tuple(range(len(shape)))]:
            assert_node_matches(run.res, run.oracle, node, dims)


@pytest.mark.parametrize("case", [c for c in CASES if c != "embedding_module"])
def test_real_equals_autograd(case):
    run = get_run(case)
    args = [a.clone().requires_grad_(a.is_floating_point()) for a in run.args]
    floats = [a for a in args if a.requires_grad]
    grads = torch.autograd.grad(run.output(run.model(*args)), floats, allow_unused=True)
    keys = [i for i, a in enumerate(args) if a.requires_grad]
    for key, g, a in zip(keys, grads, floats):
        g = torch.zeros_like(a) if g is None else g
        torch.testing.assert_close(run.res.at(key, sbp.Real()), g, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_no_nan_anywhere(case):
    run = get_run(case)
    for node in compared_nodes(run):
        for t in readouts(run.res, node):
            assert not torch.isnan(t).any(), f"NaN at {node.name}"


@pytest.mark.parametrize("case", ["attention", "mlp_relu", "random_3", "embedding_weight"])
def test_top1_is_maxabs_and_maxproduct(case):
    """TopK(1) is MaxAbs with a sign, and that sign is MaxProduct's winning field."""
    run = get_run(case)
    for node in compared_nodes(run):
        top = run.res.at(node, sbp.TopK(1)).values[..., 0]
        ma = run.res.at(node, sbp.MaxAbs())
        mp = run.res.at(node, sbp.MaxProduct())
        torch.testing.assert_close(top.abs(), ma.value, rtol=1e-9, atol=0)
        has = torch.isfinite(mp.hi)
        hi, lo = torch.where(has, mp.hi, 0.0), torch.where(has, mp.lo, 0.0)
        torch.testing.assert_close(ma.value, torch.maximum(hi.abs(), lo.abs()), rtol=1e-9, atol=0)
        clear = (hi.abs() - lo.abs()).abs() > 1e-9 * ma.value
        expect = torch.where(hi.abs() >= lo.abs(), hi, lo)
        torch.testing.assert_close(top[clear], expect[clear], rtol=1e-9, atol=0)


def test_maxproduct_is_extreme_of_full_topk():
    """With k at least the number of paths, TopK lists every path: hi is its largest
    positive value (when positive), lo its most negative (when negative)."""
    run = get_run("fanout_broadcast")
    k = max(int(run.oracle.count(n).max()) for n in compared_nodes(run))
    assert 2 <= k <= 64
    res = sbp.backprop(
        run.model, run.args, output=run.output, semirings=[sbp.MaxProduct(), sbp.TopK(k)]
    )
    for key in run.res.graph.user_inputs:
        mp, top = res.at(key, sbp.MaxProduct()), res.at(key, sbp.TopK(k)).values
        pos = torch.where(top > 0, top, -math.inf).amax(-1)
        neg = torch.where(top < 0, top, math.inf).amin(-1)
        torch.testing.assert_close(mp.hi[mp.hi > 0], pos[mp.hi > 0], rtol=1e-9, atol=0)
        torch.testing.assert_close(mp.lo[mp.lo < 0], neg[mp.lo < 0], rtol=1e-9, atol=0)
        assert (mp.hi > 0).any() and (mp.lo < 0).any()


def test_path_counts():
    """PathCount against the oracle's counts, and against a count written out by hand."""
    run = get_run("mlp_relu")
    for node in compared_nodes(run):
        counts = torch.as_tensor(run.oracle.count(node), dtype=F64)
        torch.testing.assert_close(run.res.at(node, sbp.PathCount()).log_count, counts.log())
    # y[0, 1] - y[1, 0]: x[b, j] -> 4 hidden units -> one output element (relu edges count)
    torch.testing.assert_close(
        run.res.at(0, sbp.PathCount()).log_count, torch.full((2, 3), math.log(4), dtype=F64)
    )


def test_dead_units_unused_rows_and_zero_constants():
    """Row 0 of x: one live path and one through a zero constant; row 1: only paths through
    dead relus; row 2: no path at all. No NaN anywhere; exact values written out."""
    W = torch.tensor([[1.0, 2.0], [3.0, 1.0]], dtype=F64)
    c = torch.tensor([[0.5, 0.0], [1.0, 2.0]], dtype=F64)

    def f(x):
        return (torch.relu(x @ W)[:2] * c).sum()

    x = torch.tensor([[1.0, 2.0], [-1.0, -2.0], [5.0, 6.0]], dtype=F64)
    res = sbp.backprop(f, (x,), semirings=SEMIRINGS)
    oracle = oracles.build(res)
    for node in oracle.products:
        try:
            res.value(node, SEMIRINGS[0])
        except sbp.InputError:
            continue
        assert_node_matches(res, oracle, node)
        for t in readouts(res, node):
            assert not torch.isnan(t).any(), f"NaN at {node.name}"
    inf, t = math.inf, lambda rows: torch.tensor(rows, dtype=F64)
    # x[0, j] paths: W[j, 0] * 1 * 0.5 and W[j, 1] * 1 * 0.0
    _close(res.at(0, sbp.Real()), [[0.5, 1.5], [0, 0], [0, 0]], "Real")
    mp = res.at(0, sbp.MaxProduct())
    _close(mp.hi, [[0.5, 1.5], [0, 0], [-inf, -inf]], "hi")
    _close(mp.lo, [[0.0, 0.0], [0, 0], [inf, inf]], "lo")
    ma = res.at(0, sbp.MaxAbs())
    _close(ma.value, [[0.5, 1.5], [0, 0], [0, 0]], "MaxAbs")
    _close(ma.log, t([[0.5, 1.5], [0, 0], [0, 0]]).log(), "MaxAbs.log")
    _close(res.at(0, sbp.LogAbs()).log, t([[0.5, 1.5], [0, 0], [0, 0]]).log(), "LogAbs")
    ent = res.at(0, sbp.Entropy())
    _close(ent.entropy, torch.zeros(3, 2), "entropy")
    _close(ent.log_z, t([[0.5, 1.5], [0, 0], [0, 0]]).log(), "log Z")
    _close(res.at(0, sbp.PathCount()).log_count, t([[2, 2], [2, 2], [0, 0]]).log(), "count")
    top = res.at(0, sbp.TopK(K)).values
    _close(top[..., 0], [[0.5, 1.5], [0, 0], [0, 0]], "top-1")
    _close(top[..., 1:], torch.zeros(3, 2, K - 1), "rest of top-k")


def test_maxproduct_tensor_granularity_by_hand():
    """Tensor granularity: real sums inside one op (a contraction, a broadcast), max/min
    only where a tensor feeds several ops. Expected values are written out by hand."""
    W = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 0.5, 2.0]], dtype=F64)
    a = torch.tensor([2.0, -1.0, 0.5], dtype=F64)
    b = torch.tensor([-3.0, 4.0, 1.0], dtype=F64)

    def f(x):
        h = x @ W  # one op: x[k] -> h[i] for every i
        return (h * a + h * b).sum()  # h feeds two ops

    tensor, neuron = sbp.MaxProduct(granularity="tensor"), sbp.MaxProduct()
    x = torch.tensor([[0.3, -0.7]], dtype=F64)
    res = sbp.backprop(f, (x,), semirings=[sbp.Real(), tensor, neuron])
    # D(h)_i = (max(a_i, b_i), min(a_i, b_i)) = hi (2, 4, 1), lo (-3, -1, 0.5)
    # x_0: hi = 1*2 - 2*4 + 3*1 = -3, lo = 1*(-3) - 2*(-1) + 3*0.5 = 0.5 -> swapped
    # x_1: hi = -1*2 + 0.5*4 + 2*1 = 2, lo = -1*(-3) + 0.5*(-1) + 2*0.5 = 3.5 -> swapped
    t = res.at(0, tensor)
    _close(t.hi, [[0.5, 3.5]], "tensor hi")
    _close(t.lo, [[-3.0, 2.0]], "tensor lo")
    # neuron: paths of x_0 are 2, -3, 2, -8, 1.5, 3; of x_1: -2, 3, -0.5, 2, 1, 2
    n = res.at(0, neuron)
    _close(n.hi, [[3.0, 3.0]], "neuron hi")
    _close(n.lo, [[-8.0, -2.0]], "neuron lo")
    _close(res.at(0, sbp.Real()), [[-2.5, 5.5]], "gradient")

    # a broadcast is a reduction inside one op: x (1, 3) + C (2, 3) sums over the rows
    C = torch.zeros(2, 3, dtype=F64)
    A = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, -1.0]], dtype=F64)
    B = torch.tensor([[-1.0, 2.5, 2.0], [-2.0, -4.0, 1.0]], dtype=F64)

    def g(x):
        h = x + C
        return (h * A + h * B).sum()

    res = sbp.backprop(g, (torch.ones(1, 3, dtype=F64),), semirings=[tensor, neuron])
    t, n = res.at(0, tensor), res.at(0, neuron)
    # hi: max(A, B) = [[1, 2.5, 2], [3, 1, 1]] summed over rows; lo: min(A, B) likewise
    _close(t.hi, [[1.0 + 3.0, 2.5 + 1.0, 2.0 + 1.0]], "broadcast tensor hi")
    _close(t.lo, [[-1.0 - 2.0, -2.0 - 4.0, 0.5 - 1.0]], "broadcast tensor lo")
    _close(n.hi, [[3.0, 2.5, 2.0]], "broadcast neuron hi")
    _close(n.lo, [[-2.0, -4.0, -1.0]], "broadcast neuron lo")


def _cnn(c_in):
    """Convolutions (with ``c_in=1``, D(x) contracts over the output channels first), a
    transposed one and average pooling, none of whose tensors feeds two ops."""
    layers = [
        nn.Conv2d(c_in, 3, 3, padding=1, stride=2),
        nn.Tanh(),
        nn.ConvTranspose2d(3, 2, 2, stride=2),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(18, 1),
    ]
    return nn.Sequential(*layers), randn(2, c_in, 6, 6)


NO_FANOUT = {
    "mlp_4_8_1": lambda: (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), randn(3, 4)),
    "cnn_gather_first": lambda: _cnn(4),
    "cnn_columns_first": lambda: _cnn(1),
}


@pytest.mark.parametrize("name", list(NO_FANOUT))
def test_maxproduct_tensor_granularity_is_gradient_without_fanout(name):
    """Where no tensor feeds two ops, tensor granularity (the real sum inside every op)
    gives hi == lo == grad."""
    model, x = NO_FANOUT[name]()
    model = model.double().eval()
    tensor = sbp.MaxProduct(granularity="tensor")
    res = sbp.backprop(model, (x,), output=lambda y: y.sum(), semirings=[sbp.Real(), tensor])
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(model(xg).sum(), xg)
    t = res.at(0, tensor)
    torch.testing.assert_close(res.at(0, sbp.Real()), grad)
    torch.testing.assert_close(t.hi, grad)
    torch.testing.assert_close(t.lo, grad)
    assert grad.abs().sum() > 0


def test_generic_pointwise_rule_matches_oracle():
    """Ops without a derivative formula (gelu kept whole, expm1) go through the generic
    pointwise rule (torch.func.jvp). Its first use imports torch's jvp decompositions,
    which call the deprecated torch.jit.script (a DeprecationWarning: see the filter in
    pyproject.toml)."""

    def f(x):
        return torch.expm1(F.gelu(x) * 0.5)

    x = randn(2, 3)
    res = sbp.backprop(
        f, (x,), output=lambda y: y[0].sum() - y[1, 2], semirings=SEMIRINGS, whole=("gelu",)
    )
    assert {aten.gelu.default, aten.expm1.default} <= {n.target for n in res.graph.nodes}
    oracle = oracles.build(res)
    for node in oracle.products:
        assert_node_matches(res, oracle, node)


def test_leaky_relu_slope_is_exact_in_float64():
    """The local derivative of leaky_relu on the negative side is the slope itself, in
    the input's dtype (a float32 0.1 is off by 1.5e-9 relative)."""

    def f(x):
        return F.leaky_relu(x, 0.1)

    x = torch.tensor([[-1.0, 2.0, -3.0]], dtype=F64)
    res = sbp.backprop(f, (x,), output=lambda y: y.sum(), semirings=SEMIRINGS)
    expect = torch.tensor([[0.1, 1.0, 0.1]], dtype=F64)
    torch.testing.assert_close(res.at(0, sbp.Real()), expect, rtol=1e-15, atol=0)
    oracle = oracles.build(res)
    for node in oracle.products:
        assert_node_matches(res, oracle, node)
