"""The forward semiring pass (alpha) and max-marginals against brute force.

- alpha at every node equals the ⊕ over the enumerated paths from the seeded sources to
  it, and the max-marginal at every node (and over every edge into an op) the ⊕ over the
  enumerated whole paths through it, for Real, MaxProduct (neuron), MaxAbs, LogAbs,
  Entropy, PathCount and TopK(2), with both seeds ("structural" and "x"), on the cases
  of test_oracle.py (MLPs with negative weights, one-layer attention, norms, routing);
- Real alpha equals torch.func.jvp with the seed as tangent;
- every forward rule is the transpose of its reverse rule: <a, Rev(b)> = <Fwd(a), b>
  under Real, for every registered overload (the samples of test_rules.py).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

import oracles
import semiring_backprop as sbp
import test_oracle
import test_rules
from semiring_backprop import rules
from semiring_backprop.engine.reverse import _pair, make_op

F64 = torch.float64
K = 2
SEMIRINGS = [
    sbp.Real(), sbp.MaxProduct(), sbp.MaxAbs(), sbp.LogAbs(), sbp.Entropy(), sbp.PathCount(),
    sbp.TopK(K),
]  # fmt: skip
#: test_oracle cases whose ops all have forward rules (convolution and pooling do not yet)
CASES = [c for c in test_oracle.CASES if not c.startswith(("conv", "pooling"))]
#: registered overloads without a forward rule yet (alpha raises UnsupportedOpError there)
NO_FORWARD_YET = {
    "aten._adaptive_avg_pool2d.default",
    "aten._adaptive_avg_pool3d.default",
    "aten._grouped_mm.default",
    "aten.avg_pool2d.default",
    "aten.avg_pool3d.default",
    "aten.convolution.default",
    "transformers.grouped_mm_fallback.default",
}


class Run:
    def __init__(self, name):
        torch.manual_seed(0)
        self.model, self.args, self.output, _ = test_oracle.CASES[name]()
        whole = test_oracle.KEEP.get(name, ())
        self.res = sbp.backprop(self.model, self.args, output=self.output,
                                semirings=SEMIRINGS, whole=whole)  # fmt: skip
        self.dag = oracles.scalar_dag(self.res)
        self.sources = oracles.sources(self.res)

    def seeds(self, seed):
        v = self.res.values
        if seed == "structural":
            return {n: np.ones(v[n].numel()) for n in self.sources}
        return {n: v[n].double().reshape(-1).numpy() for n in self.sources}


_RUNS: dict = {}


def get_run(name) -> Run:
    if name not in _RUNS:
        _RUNS[name] = Run(name)
    return _RUNS[name]


def assert_matches(readout, products, shape, sr, what):
    """``readout`` (of semiring ``sr``) equals the oracle's answer over ``products``."""
    exp = oracles.stats(products, shape, K + 1)
    close = test_oracle._close
    if isinstance(sr, sbp.Real):
        close(readout, exp["real"], what)
    elif isinstance(sr, sbp.MaxProduct):
        close(readout.hi, exp["hi"], f"{what} hi")
        close(readout.lo, exp["lo"], f"{what} lo")
    elif isinstance(sr, sbp.MaxAbs):
        close(readout.value, exp["max_abs"], what)
    elif isinstance(sr, sbp.PathCount):  # (a LogAbs: test it first)
        close(readout.log_count, exp["log_count"], what, atol=1e-11)
    elif isinstance(sr, sbp.LogAbs):
        close(readout.log, exp["log_abs"], what, atol=1e-11)
    elif isinstance(sr, sbp.Entropy):
        close(readout.entropy, exp["entropy"], f"{what} entropy", atol=1e-11)
        close(readout.log_z, exp["log_z"], f"{what} log Z", atol=1e-11)
    else:
        test_oracle._assert_topk(readout.values, exp["topk"], what)


@pytest.mark.parametrize("seed", ["structural", "x"])
@pytest.mark.parametrize("case", CASES)
def test_alpha_and_marginals_match_enumeration(case, seed):
    run = get_run(case)
    res, dag = run.res, run.dag
    prefix = oracles.prefixes(res, dag, run.seeds(seed))
    compared = 0
    for node in res.needed:
        if node not in prefix:  # no path reaches it: alpha is the zero
            assert not res.alpha(node, sbp.Real(), seed).any(), node.name
            assert (res.alpha(node, sbp.PathCount(), seed).log_count == -np.inf).all()
            continue
        shape = tuple(res.values[node].shape)
        whole = oracles.through(prefix[node], dag, node) if node in dag.consumers or (
            node is res.graph.output_node) else None  # fmt: skip
        for sr in SEMIRINGS:
            what = f"{case} {seed} {sr.name} at {node.name} ({node.target})"
            assert_matches(res.alpha(node, sr, seed), prefix[node], shape, sr, f"alpha {what}")
            if whole is not None:
                assert_matches(res.marginal(node, sr, seed), whole, shape, sr, f"m {what}")
        compared += 1
    assert compared > 2


def _edge_products(run, prefix, u, v):
    """Per element of ``u``: the whole paths through it that enter ``v`` next."""
    out = [[] for _ in range(run.res.values[u].numel())]
    for dst, _, mask, w in run.dag.consumers.get(u, []):
        if dst is not v:
            continue
        for o, i in zip(*np.nonzero(mask)):
            tails = np.array([s for s, _ in run.dag.suffixes(v, int(o))])
            out[i].append(np.outer(prefix[u][i] * w[o, i], tails).reshape(-1))
    return [np.concatenate(p) if p else np.zeros(0) for p in out]


@pytest.mark.parametrize("case", ["mlp_relu", "attention", "fanout_broadcast", "routing_zoo"])
def test_edge_marginals_match_enumeration(case):
    run = get_run(case)
    res = run.res
    prefix = oracles.prefixes(res, run.dag, run.seeds("structural"))
    checked = 0
    for u, outs in run.dag.consumers.items():
        if u not in prefix:
            continue
        for v in {dst for dst, *_ in outs}:
            products = _edge_products(run, prefix, u, v)
            shape = tuple(res.values[u].shape)
            for sr in SEMIRINGS:
                got = res.marginal(u, sr, into=v)
                assert_matches(got, products, shape, sr, f"{case} {sr.name} {u.name}->{v.name}")
            checked += 1
    assert checked > 2


def test_marginals_of_a_cut_sum_to_the_output():
    """Every path passes the MLP's hidden layer once: under Real its marginals add up
    to the output's value (the gradient times x, with seed x); under MaxProduct their
    best is the best path's."""
    run = get_run("mlp_relu")
    res = run.res
    out = res.graph.output_node
    hidden = res.node("1")  # the ReLU's output: a cut
    real = res.marginal(hidden, sbp.Real(), "x").sum()
    torch.testing.assert_close(real, res.marginal(out, sbp.Real(), "x"), rtol=1e-12, atol=1e-14)
    mp = res.marginal(hidden, sbp.MaxProduct())
    top = res.marginal(out, sbp.MaxProduct())
    torch.testing.assert_close(mp.hi.max(), top.hi)
    torch.testing.assert_close(mp.lo.min(), top.lo)


@pytest.mark.parametrize(
    "case",
    [
        "mlp_relu",
        "residual_gelu",
        "attention",
        "layer_norm_module",
        "kept_composites",
        "routing_zoo",
        "pointwise_zoo",
        "norms",
    ],
)
def test_real_alpha_is_jvp(case):
    run = get_run(case)
    floats = [i for i, a in enumerate(run.args) if a.is_floating_point()]
    tangents = {i: torch.randn(run.args[i].shape, dtype=F64) for i in floats}

    def f(*xs):
        args = list(run.args)
        for i, x in zip(floats, xs):
            args[i] = x
        return run.output(run.model(*args))

    primals = tuple(run.args[i] for i in floats)
    with warnings.catch_warnings():  # torch.func's first use scripts a function (deprecated)
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*")
        _, want = torch.func.jvp(f, primals, tuple(tangents[i] for i in floats))
    got = run.res.alpha(run.res.graph.output_node, sbp.Real(), seed=tangents)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_seed_errors_and_baseline():
    run = get_run("mlp_relu")
    res = run.res
    x = run.args[0]
    with pytest.raises(sbp.InputError, match="seed="):
        res.alpha(0, sbp.Real(), seed="ones")
    with pytest.raises(sbp.InputError, match="shape"):
        res.alpha(0, sbp.Real(), seed={0: torch.ones(5)})
    base = torch.randn(x.shape, dtype=F64)
    a = res.alpha("2", sbp.Real(), seed="x", baseline={0: base})
    torch.testing.assert_close(a, res.alpha("2", sbp.Real(), seed={0: x - base}))
    with pytest.raises(sbp.InputError, match="no edge"):
        res.marginal(0, sbp.Real(), into=res.graph.output_node)


def test_an_op_without_forward_rule_is_named():
    conv = torch.nn.Conv1d(1, 1, 2).double().eval()
    res = sbp.backprop(conv, (torch.randn(1, 1, 4, dtype=F64),), output=lambda y: y.sum())
    with pytest.raises(sbp.UnsupportedOpError, match="aten.convolution.default"):
        res.alpha(res.graph.output_node, sbp.Real())


# -- forward rules are the transposes of the reverse rules ----------------------------------


def test_every_rule_has_a_forward_rule_or_is_listed():
    assert set(rules.without_forward()) == NO_FORWARD_YET


def _law_params():
    out = []
    for op in sorted(rules.registered(), key=str):
        if str(op) in NO_FORWARD_YET:
            continue
        cases = test_rules.CASES.get(op, [])
        out += [pytest.param(op, c, id=f"{op}-{i}") for i, c in enumerate(cases)]
    for op, cases in test_rules.GENERIC.items():
        out += [pytest.param(op, c, id=f"generic:{op}-{i}") for i, c in enumerate(cases)]
    return out


def _check_law(node, values, needed, graph=None, g=None):
    """<a, Rev(b)> == <Fwd(a), b> at one node, for random a (per input) and b."""
    gen = torch.Generator().manual_seed(len(node.name))
    op = make_op(node, values, needed, graph) if graph is not None else g
    out = op.out
    ins = [n for n in node.all_input_nodes if n in needed]
    a = {n: torch.randn(values[n].shape, generator=gen, dtype=F64).to(out.dtype) for n in ins}
    b = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    sr = sbp.Real()
    rule = rules.lookup(node.target)
    rev = rule.fn(sr, (b,), op, *op.args, **op.kwargs)
    lhs = sum(float((a[n] * c[0].to(out.dtype)).sum()) for n, c in _pair(node.args, rev)
              if n in a and c is not None)  # fmt: skip
    fwd = rules.lookup_forward(node.target)
    alphas = [map_arg(x, lambda n: (a[n],) if n in a else None) if _has_node(x) else None
              for x in node.args]  # fmt: skip
    got = fwd(sr, alphas, op, *op.args, **op.kwargs)
    rhs = 0.0 if got is None else float((got[0] * b).sum())
    all_f64 = all(values[n].dtype == F64 for n in ins) and out.dtype == F64
    tol = 1e-9 if all_f64 else 1e-4  # a cast to float32 on either side rounds
    assert abs(lhs - rhs) <= tol * max(1.0, abs(lhs), abs(rhs)), (node.target, lhs, rhs)


def _has_node(x):
    return any(isinstance(leaf, torch.fx.Node) for leaf in pytree.tree_leaves(x))


@pytest.mark.parametrize(("op", "case"), _law_params())
def test_forward_rule_is_transpose(op, case):
    assert rules.lookup_forward(op) is not None, f"{op} has no forward rule"
    if isinstance(case, test_rules.Direct):
        _law_direct(op, case)
        return
    inputs = case.inputs()
    torch.manual_seed(0)
    res = sbp.backprop(case.fn, args=inputs, output=lambda y: y.sum() if y.dim() else y,
                       semirings=[sbp.Real()], whole=case.whole)  # fmt: skip
    nodes = [n for n in res.graph.nodes if n.op == "call_function" and n in res.needed
             and any(i in res.needed for i in n.all_input_nodes)]  # fmt: skip
    with torch.no_grad():
        for node in nodes:  # every op of the sample's graph, this op among them
            _check_law(node, res.values, res.needed, res.graph)


def _law_direct(op, case):
    direct = _direct_node(op, case)
    if direct is not None:
        node, values, needed, g = direct
        with torch.no_grad():
            _check_law(node, values, needed, g=g)


def _direct_node(op, case):
    """``(node, values, needed, op)`` for a :class:`test_rules.Direct` case: ``op`` called
    on its arguments as one node of a graph of its own; None where its output is not a
    float tensor."""
    args = case.args()
    leaves, spec = pytree.tree_flatten((args, case.kwargs))
    fx = torch.fx.Graph()
    nodes = [fx.placeholder(f"a{i}") if isinstance(x, torch.Tensor) else x
             for i, x in enumerate(leaves)]  # fmt: skip
    node_args, node_kwargs = pytree.tree_unflatten(nodes, spec)
    node = fx.call_function(op, tuple(node_args), node_kwargs)
    needed = frozenset(n for n, x in zip(nodes, leaves)
                       if isinstance(x, torch.Tensor) and x.is_floating_point())  # fmt: skip
    a0, k0 = pytree.tree_unflatten(leaves, spec)
    with torch.no_grad():
        out = op(*a0, **k0)
    if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
        return None
    values = {n: x for n, x in zip(nodes, leaves) if isinstance(n, torch.fx.Node)}
    values[node] = out
    return node, values, needed, rules.Op(node, a0, k0, out, needed)


ROW_SEMIRINGS = [sbp.Real(), sbp.MaxProduct(), sbp.MaxProduct("tensor")]


def _rows_params():
    return [p for p in _law_params() if rules.takes_rows(p.values[0])]


def _random_value(sr, shape, gen, dtype):
    """A random value of ``sr``: MaxProduct's hi >= lo, with some elements its zero."""
    x = torch.randn(shape, generator=gen, dtype=F64).to(dtype)
    if not isinstance(sr, sbp.MaxProduct):
        return (x,)
    y = torch.randn(shape, generator=gen, dtype=F64).to(dtype)
    hi, lo = torch.maximum(x, y), torch.minimum(x, y)
    none = torch.rand(shape, generator=gen) < 0.2
    hi, lo = hi.masked_fill(none, -np.inf), lo.masked_fill(none, np.inf)
    return sr.leave((hi, lo), 0)


def _check_rows(node, values, needed, graph=None, g=None, n_rows=3):
    """A forward rule given ``n_rows`` rows at once (``Op.rows``) gives each row what it
    gives that row alone, under every semiring whose values take rows."""
    gen = torch.Generator().manual_seed(len(node.name))
    fwd = rules.lookup_forward(node.target)
    ins = [n for n in node.all_input_nodes if n in needed]
    for sr in ROW_SEMIRINGS:
        assert sr.rows
        a = {n: _random_value(sr, (n_rows, *values[n].shape), gen, values[n].dtype) for n in ins}

        def run(given, rows, sr=sr):
            op = make_op(node, values, needed, graph) if graph is not None else g
            op.rows = rows
            alphas = [map_arg(x, given.get) if _has_node(x) else None
                      for x in node.args]  # fmt: skip
            got = fwd(sr.inner, alphas, op, *op.args, **op.kwargs)
            return None if got is None else sr.leave(got, 0)

        together = run(a, n_rows)
        alone = [run({n: tuple(f[r] for f in v) for n, v in a.items()}, 0)
                 for r in range(n_rows)]  # fmt: skip
        if together is None:
            assert all(x is None for x in alone), node.target
            continue
        assert tuple(together[0].shape) == (n_rows, *values[node].shape), node.target
        for r in range(n_rows):
            for f, h in zip(together, alone[r]):
                torch.testing.assert_close(f[r], h, rtol=1e-6, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize(("op", "case"), _rows_params())
def test_forward_rules_that_take_rows_give_each_row_its_own(op, case):
    """Oracle: the same rule on each row alone (what ``torch.vmap`` would give)."""
    if isinstance(case, test_rules.Direct):
        direct = _direct_node(op, case)
        if direct is not None:
            node, values, needed, g = direct
            with torch.no_grad():
                _check_rows(node, values, needed, g=g)
        return
    res = sbp.backprop(case.fn, args=case.inputs(), output=lambda y: y.sum() if y.dim() else y,
                       semirings=[sbp.Real()], whole=case.whole)  # fmt: skip
    nodes = [n for n in res.graph.nodes if n.op == "call_function" and n in res.needed
             and rules.takes_rows(n.target)
             and any(i in res.needed for i in n.all_input_nodes)]  # fmt: skip
    with torch.no_grad():
        for node in nodes:
            _check_rows(node, res.values, res.needed, res.graph)


@pytest.mark.parametrize("rows", [3, 4])
def test_rows_as_many_as_a_broadcast_dim_are_not_taken_for_it(rows):
    """A (4,) input broadcast against a (3, 4) one, with 3 rows: a value of shape (3, 4)
    is the input's rows, not the output's shape (and with 4 rows likewise)."""
    x, y = torch.randn(4, dtype=F64), torch.randn(3, 4, dtype=F64)
    res = sbp.backprop(lambda x, y: x * y + x, args=(x, y), output=lambda t: t.sum(),
                       semirings=[sbp.Real()])  # fmt: skip
    nodes = [n for n in res.graph.nodes if n.op == "call_function" and n in res.needed
             and any(i in res.needed for i in n.all_input_nodes)]  # fmt: skip
    assert {str(n.target) for n in nodes} >= {"aten.mul.Tensor", "aten.add.Tensor"}
    with torch.no_grad():
        for node in nodes:
            _check_rows(node, res.values, res.needed, res.graph, n_rows=rows)


def test_forward_through_attention_with_mask_and_embedding():
    """A one-layer attention over looked-up embeddings with a padding mask: sources are
    the embeddings and the float mask; alpha and marginals are finite everywhere."""
    emb = torch.nn.Embedding(6, 4).double()
    lin = torch.nn.Linear(4, 4).double()

    def f(ids, mask):
        h = emb(ids)
        s = h @ lin(h).transpose(-1, -2) + (1.0 - mask[:, None, :].to(F64)) * -1e4
        return (F.softmax(s, -1) @ h).sum(-1)

    ids, mask = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 0]])
    res = sbp.backprop(f, (ids, mask), output=lambda y: y[0, 0], semirings=SEMIRINGS)
    for sr in SEMIRINGS:
        for node in res.needed:
            for t in pytree.tree_leaves(
                vars(m) if not isinstance(m := res.marginal(node, sr), torch.Tensor) else m
            ):
                assert not torch.isnan(t).any(), (sr.name, node.name)
