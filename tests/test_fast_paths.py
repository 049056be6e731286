"""Fast paths give the same answers as the plain implementation.

- compiled max-times / max-plus kernels == the eager formulas (values and argmax); the
  blocked max-plus top-k == brute force (values, and indices that point at them), and
  TopK through it == every path of a two-layer net enumerated;
- MaxProduct's pass without pointers (found again when a path is read) == the pass
  that carries full pointers through every rule;
- constant edge weights through ``scale`` == through ``times``;
- contractions that skip rows carrying no path == the full semiring matmul;
- a reused :class:`Backprop` == a fresh ``backprop`` call, and it re-traces when the
  model's parameters are replaced.
"""

from __future__ import annotations

import math

import pytest
import torch

import oracles
import semiring_backprop as sbp
from semiring_backprop import kernels
from semiring_backprop.rules import contraction

F64 = torch.float64
INF = math.inf


def _fields(n, m, batch=(), dtype=F64, holes=True):
    g = torch.Generator().manual_seed(n * 100 + m)
    hi = torch.randn(*batch, n, m, generator=g, dtype=dtype)
    lo = hi - torch.rand(*batch, n, m, generator=g, dtype=dtype)
    if holes:  # no path: the semiring zero (-inf, +inf) in some entries and a whole row
        hole = torch.rand(*batch, n, m, generator=g) < 0.2
        hole[..., 0, :] = True
        hi = hi.masked_fill(hole, -INF)
        lo = lo.masked_fill(hole, INF)
    return hi, lo


def _weights(m, p, batch=(), dtype=F64):
    g = torch.Generator().manual_seed(m * 7 + p)
    w = torch.randn(*batch, m, p, generator=g, dtype=dtype)
    w[..., 0, :] = 0.0  # structurally present edges of weight 0
    return w


@pytest.fixture
def compiled(monkeypatch, torch_kernels):
    """Force the compiled kernels even on small problems (the native ones off)."""
    monkeypatch.setattr(kernels, "MIN_WORK", 0)
    mode = kernels._state["compile"]
    kernels.set_compile(True)
    yield
    kernels.set_compile(mode)
    # the compiled kernels really ran (a failure would have fallen back to eager)
    assert not kernels._state["failed"], kernels._state["failed"]


@pytest.mark.parametrize("batch", [(), (3,)], ids=["2d", "batched"])
def test_compiled_maxtimes_equals_eager(compiled, batch):
    hi, lo = _fields(5, 7, batch)
    w = _weights(7, 4, batch)
    fast = kernels.maxtimes(hi, lo, w.transpose(-2, -1))
    kernels.set_compile(False)
    slow = kernels.maxtimes(hi, lo, w.transpose(-2, -1))
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the eager formulas are the definition: max over j of the sign-aware products
    h = torch.where(w[..., None, :, :] >= 0, hi[..., :, :, None], lo[..., :, :, None])
    prod = h * w[..., None, :, :]
    prod = torch.where(torch.isnan(prod), -INF, prod)  # 0 · inf: no path
    torch.testing.assert_close(slow[0], prod.amax(-2))
    # the arg-max is the first index where the maximum is attained
    hit = prod == prod.amax(-2, keepdim=True)
    first = hit.to(torch.int64).argmax(-2)
    assert torch.equal(slow[1], first)
    lo_h = torch.where(w[..., None, :, :] >= 0, lo[..., :, :, None], hi[..., :, :, None])
    lprod = lo_h * w[..., None, :, :]
    lprod = torch.where(torch.isnan(lprod), INF, lprod)
    torch.testing.assert_close(slow[2], lprod.amin(-2))
    assert torch.equal(slow[3], (lprod == lprod.amin(-2, keepdim=True)).to(torch.int64).argmax(-2))


def test_compiled_maxplus_equals_eager(compiled):
    m, _ = _fields(6, 5)
    lw = torch.log(_weights(5, 3).abs())
    fast = kernels.maxplus(m, lw.mT)
    kernels.set_compile(False)
    slow = kernels.maxplus(m, lw.mT)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 3])
def test_compiled_maxplus_topk_finds_the_k_best(compiled, k):
    # 300 inner elements (padded to 320 with log 0, as TopK.prepare pads), integer
    # values (ties), holes and one row without any path
    g = torch.Generator().manual_seed(k)
    m = torch.randint(-4, 4, (2, 5, 300), generator=g).to(F64)
    m[torch.rand(m.shape, generator=g) < 0.3] = -INF
    m[:, 0] = -INF
    lw = torch.randint(-4, 4, (2, 300, 7), generator=g).to(F64)
    lwt = torch.nn.functional.pad(lw.mT, (0, 20), value=-INF)
    fast = kernels.maxplus_topk(m, lwt, k)
    assert ("maxplus_topk", F64, "cpu") in kernels._COMPILED_KEYS
    kernels.set_compile(False)
    slow = kernels.maxplus_topk(m, lwt, k)
    every = m[..., :, None, :] + lw.mT[..., None, :, :]  # (2, 5, 7, 300): brute force
    best = every.sort(-1, descending=True).values[..., :k]
    for vals, idx in (fast, slow):
        assert torch.equal(vals, best)
        live = vals > -INF
        assert torch.equal(every.gather(-1, idx.clamp(max=299))[live], vals[live])
        for a in range(k):  # a path is listed once
            for b in range(a):
                assert not (live[..., a] & (idx[..., a] == idx[..., b])).any()


def test_compiled_topk_semiring_equals_path_enumeration(compiled):
    """TopK(3) at the input of x -> x W1 -> W2 -> sum, with W1 (4, 300): the matmul takes
    the blocked kernel; every one of the 4 x 300 x 2 paths enumerated."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(4, 300, generator=g, dtype=F64)
    w2 = torch.randn(300, 2, generator=g, dtype=F64)
    w1[0, :150] = 0.0  # edges of weight 0: no path through them

    class Net(torch.nn.Module):
        def forward(self, x):
            return ((x @ w1) @ w2).sum()

    x = torch.randn(1, 4, generator=g, dtype=F64)
    res = sbp.backprop(Net().eval(), x, semirings=[sbp.TopK(3)])
    got = res.at(0, sbp.TopK(3)).values[0]  # (4, 3)
    paths = w1[:, :, None] * w2[None, :, :]  # (4, 300, 2): every path's product
    paths = torch.where(paths == 0, 0.0, paths).flatten(1)
    order = paths.abs().argsort(-1, descending=True)[:, :3]
    expected = paths.gather(-1, order)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    assert ("maxplus_topk", F64, "cpu") in kernels._COMPILED_KEYS


def test_auto_compiles_once_eager_work_would_have_paid_for_it(monkeypatch, torch_kernels):
    """``auto``: eager while the eager work done so far costs less than one compilation
    (estimated from the problem sizes, not timed), compiled from then on; the values
    are the same either way."""
    monkeypatch.setattr(kernels, "MIN_WORK", 0)
    monkeypatch.setattr(kernels, "_COMPILED_KEYS", set())
    monkeypatch.setitem(kernels._state, "eager_s", {})
    mode = kernels._state["compile"]
    kernels.set_compile("auto")
    ran = []
    monkeypatch.setattr(kernels, "_compiled",  # (what it would compile, run eagerly)
                        lambda name: ran.append(name) or kernels._WHOLE[name])  # fmt: skip
    hi, lo = _fields(5, 7)
    w = _weights(7, 4).transpose(-2, -1)
    per_call = 5 * 7 * 4 * kernels._EAGER_S_PER_TRIPLE["cpu"]
    monkeypatch.setattr(kernels, "COMPILE_COST_S", 2.5 * per_call)
    try:
        outs = [kernels.maxtimes(hi, lo, w) for _ in range(4)]
    finally:
        kernels.set_compile(mode)
    assert ran == ["maxtimes", "maxtimes"]  # calls 1-2 eager (2x < 2.5x), 3-4 compiled
    for out in outs[1:]:
        for a, b in zip(outs[0], out, strict=True):
            assert torch.equal(a, b)


SEMIRINGS = oracles.all_semirings()


@pytest.mark.parametrize("sr", SEMIRINGS, ids=lambda s: s.name)
def test_zero_rows_are_skipped_without_changing_values(sr):
    """Rows of D(out) equal to the zero (positions the output never reads) give zero
    rows; the live rows are computed exactly as by the full semiring matmul."""
    torch.manual_seed(0)
    w = _weights(6, 4)
    live = sr.times(sr.one((5, 6), w), torch.randn(5, 6, dtype=F64))
    zero = sr.zero((5, 6), w)
    rows = torch.tensor([True, False, True, False, False])
    g = tuple(
        torch.where(rows.view(-1, *([1] * (a.dim() - 1))), a, z)
        for a, z in zip(live, zero, strict=True)
    )
    want = sr.matmul(g, w)
    got = contraction._live_matmul(sr, g, w)
    for a, b in zip(got, want, strict=True):  # live rows: every field, pointers included
        assert torch.equal(a[rows], b[rows])
    # dead rows: the same readout (no path); their unused fields (a sign) may differ
    for a, b in zip(_readouts(sr, got), _readouts(sr, want), strict=True):
        torch.testing.assert_close(a, b)


def _readouts(sr, value):
    ro = sr.finalize(value)
    if isinstance(ro, torch.Tensor):
        return [ro]
    return [getattr(ro, f) for f in ro.__dataclass_fields__]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _grad(model, x, output):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(output(model(x)), x)
    return g


def test_backprop_object_reuses_its_trace_and_stays_exact():
    torch.manual_seed(0)
    model = _Net().to(F64).eval()
    output = lambda y: y[0, 1]  # noqa: E731
    bp = sbp.Backprop(model, output, [sbp.Real(), sbp.MaxProduct()], dynamic=True)
    x1, x2 = torch.randn(2, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    r1, r2 = bp((x1,)), bp((x2,))
    assert r1.graph is r2.graph  # one trace for one input shape
    torch.testing.assert_close(r2.at(0, sbp.Real()), _grad(model, x2, output))
    fresh = sbp.backprop(model, (x2,), output=output, semirings=[sbp.MaxProduct()])
    torch.testing.assert_close(r2.at(0, sbp.MaxProduct()).hi, fresh.at(0, sbp.MaxProduct()).hi)
    # another batch size: the same (symbolic) trace, still exact
    x3 = torch.randn(5, 4, dtype=F64)
    r3 = bp((x3,))
    assert r3.graph is r1.graph and bp.traces == 1
    torch.testing.assert_close(r3.at(0, sbp.Real()), _grad(model, x3, output))
    # traced for fixed shapes: another shape is another trace
    fixed = sbp.Backprop(model, output, [sbp.Real()], dynamic=False)
    f1, f3 = fixed((x1,)), fixed((x3,))
    assert f1.graph is not f3.graph and fixed.traces == 2
    torch.testing.assert_close(f3.at(0, sbp.Real()), _grad(model, x3, output))


def test_backprop_object_follows_parameter_changes():
    torch.manual_seed(1)
    model = _Net().to(F64).eval()
    output = lambda y: y[0, 0]  # noqa: E731
    bp = sbp.Backprop(model, output, [sbp.Real()])
    x = torch.randn(1, 4, dtype=F64)
    bp((x,))
    with torch.no_grad():  # in place
        model.a.weight.mul_(-2.0)
    torch.testing.assert_close(bp((x,)).at(0, sbp.Real()), _grad(model, x, output))
    model.b = torch.nn.Linear(8, 3).to(F64).eval()  # a new module object
    torch.testing.assert_close(bp((x,)).at(0, sbp.Real()), _grad(model, x, output))


def _same(sr, a, b):
    for x, y in zip(_readouts(sr, a), _readouts(sr, b), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_prepared_weights_give_the_same_values_and_follow_weight_changes():
    """Weight-only work kept across calls (weight_cache) changes no value, and is
    dropped when the weights change in place."""
    torch.manual_seed(2)
    model = _Net().to(F64).eval()
    output = lambda y: y[0, 1] - y[1, 2]  # noqa: E731
    x = torch.randn(2, 4, dtype=F64)
    cached = sbp.Backprop(model, output, SEMIRINGS)
    cached((x,))  # fills the store
    assert cached._prepared.used > 0
    plain = sbp.Backprop(model, output, SEMIRINGS, weight_cache=0)
    got, want = cached((x,)), plain((x,))
    for sr in SEMIRINGS:
        _same(sr, got.value(0, sr), want.value(0, sr))
    with torch.no_grad():
        model.a.weight.mul_(-0.5)
    got, want = cached((x,)), sbp.backprop(model, (x,), output=output, semirings=SEMIRINGS)
    for sr in SEMIRINGS:
        _same(sr, got.value(0, sr), want.value(0, sr))


@pytest.mark.parametrize("how", ["data", "numpy", "refresh"])
def test_prepared_weights_follow_writes_the_version_counter_misses(how):
    """``p.data`` and NumPy writes leave ``p._version`` as it is: the prepared weights
    are checked by sampled elements (a whole-tensor write), or dropped by refresh()."""
    torch.manual_seed(2)
    model = _Net().to(F64).eval()
    output = lambda y: y[0, 1] - y[1, 2]  # noqa: E731
    x = torch.randn(2, 4, dtype=F64)
    cached = sbp.Backprop(model, output, SEMIRINGS)
    cached((x,))
    assert cached._prepared.used > 0
    version = model.a.weight._version
    if how == "data":
        model.a.weight.data.mul_(-0.5)
    elif how == "numpy":
        view = model.a.weight.detach().numpy()
        view *= -0.5
        version = model.a.weight._version  # (detach() bumped it; the NumPy write did not)
    else:  # one element: maybe not sampled; refresh() is the documented way
        model.a.weight.data[1, 2] += 1.0
        cached.refresh()
    assert model.a.weight._version == version  # torch did not see it
    got = cached((x,))
    want = sbp.backprop(model, (x,), output=output, semirings=SEMIRINGS, reuse=False)
    for sr in SEMIRINGS:
        _same(sr, got.value(0, sr), want.value(0, sr))


@pytest.mark.parametrize("granularity", ["neuron", "tensor"])
def test_found_pointers_equal_carried_pointers(granularity):
    """The pass keeps no MaxProduct back-pointers; those path reading finds again (⊕
    replayed over the consumers, the element named by a rule run with pointers) are
    the ones a pass carrying every pointer stores (``MaxProduct.pointed``, the plain
    implementation): the same consumer and element wherever there is a path."""
    from semiring_backprop.analysis.paths import _Pointers
    from semiring_backprop.semirings.maxproduct import PTR_SHIFT

    model = _tiny_bert()
    emb = model.get_input_embeddings()(torch.randint(1, 40, (1, 5))).detach()
    output = lambda out: out.logits[0, 2].log_softmax(-1)[5]  # noqa: E731
    sr = sbp.MaxProduct(granularity)
    full = sr.pointed
    res = sbp.backprop(model, kwargs={"inputs_embeds": emb}, output=output, semirings=[sr, full])
    pointers = _Pointers(res, 0, sr)
    fanout = checked = 0
    for node, (a, b) in res._store.items():
        assert len(a) == 2 and len(b) == 4, node
        a, b = sr._normalize(a), full._normalize(b)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), node
        path = a[0] != -INF
        if node is res.graph.output_node or not bool(path.any()):
            continue
        fanout += len(node.users) > 1
        for f in (0, 1):
            carried = b[2 + f].expand(path.shape)[path]
            found = pointers.consumers(node)[f][path]
            if granularity == "tensor":
                assert torch.equal(found, carried), node
                continue
            assert torch.equal(found, carried >> PTR_SHIFT), node
            flat = path.reshape(-1).nonzero()[:, 0]
            for c_id in found.unique().tolist():
                sel = found == c_id
                elements = [pointers.element(c_id, node, int(e), f) for e in flat[sel]]
                want = carried[sel] & ((1 << PTR_SHIFT) - 1)
                assert elements == want.tolist(), node
        checked += 1
    assert fanout > 10 and checked > 50


class _NeverMeta(type):
    def __instancecheck__(cls, obj):
        return False


class _Never(tuple, metaclass=_NeverMeta):
    """Stands in for a value type: makes plain tuples, and nothing is an instance."""

    def __new__(cls, fields):
        return tuple(fields)


def test_dense_values_skip_the_zero_marks_without_changing_values(monkeypatch):
    """Tensor granularity: values known to have a path at every element skip the NaN
    marks that keep the zero, and values known to be normalized (hi >= lo) skip the
    swap; constant weights skip the multiply by 1. Every stored value is the same bit
    for bit as with none of that (the types that carry the knowledge replaced by plain
    tuples, constants through ``times``)."""
    from semiring_backprop.semirings import maxproduct

    model = _tiny_bert()
    emb = model.get_input_embeddings()(torch.randint(1, 40, (1, 5))).detach()
    output = lambda out: out.logits[0, 2].log_softmax(-1)[5]  # noqa: E731
    bp = sbp.Backprop(model, output, [sbp.MaxProduct("tensor")])  # one trace, two runs

    def run():
        res = bp(kwargs={"inputs_embeds": emb})
        return {node: d[0] for node, d in res._store.items()}

    fast = run()
    dense = sum(isinstance(v, maxproduct._Dense) for v in fast.values())
    # positions the output does not read have no path in the last layer: both kinds occur
    assert len(fast) // 2 < dense < len(fast)

    normal = sum(isinstance(v, maxproduct._Normal) for v in fast.values())
    assert normal == len(fast)
    for name in ("_Dense", "_Normal", "_NormalDense"):
        monkeypatch.setattr(maxproduct, name, _Never)
    monkeypatch.setattr(maxproduct.MaxProduct, "scale", lambda self, a, c: self.times(
        a, torch.tensor(float(c), dtype=a[0].dtype)))  # fmt: skip
    plain = run()
    assert all(type(v) is tuple for v in plain.values())
    assert fast.keys() == plain.keys()
    for node, a in fast.items():
        b = plain[node]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), node


def test_values_marked_dense_have_a_path_everywhere():
    """A value typed Dense (contractions then skip the search for rows without a path)
    has a path at every element: where MaxProduct's hi is not -inf. The positions the
    output does not read have none in the last layer, so both kinds occur."""
    from semiring_backprop.semirings.base import Dense

    model = _tiny_bert()
    emb = model.get_input_embeddings()(torch.randint(1, 40, (1, 5))).detach()
    output = lambda out: out.logits[0, 2].log_softmax(-1)[5]  # noqa: E731
    srs = [sbp.Real(), sbp.MaxProduct(), sbp.MaxProduct("tensor"), sbp.Entropy()]
    res = sbp.backprop(model, kwargs={"inputs_embeds": emb}, output=output, semirings=srs)
    dense = [0] * len(srs)
    for node, values in res._store.items():
        everywhere = bool((values[1][0] != -INF).all())
        for k, v in enumerate(values):
            if isinstance(v, Dense):
                assert everywhere, (srs[k], node)
                dense[k] += 1
    assert all(len(res._store) // 4 < n < len(res._store) for n in dense), dense


def _unary_chain(x):
    """Every pointwise op whose rule reads only its input or only its output."""
    a = x * 0.3
    c = torch.log(torch.exp(a) + 1.0)
    t = torch.tanh(a) + torch.sigmoid(a) + torch.relu(a - 0.5)
    r = torch.rsqrt(a.abs() + 1.0) + torch.sqrt(a.abs() + 2.0) + torch.reciprocal(a.abs() + 3.0)
    e = torch.erf(c) + torch.sin(t) + torch.cos(r) + c**3
    return torch.nn.functional.leaky_relu(e - 0.2, 0.1) + (e - 1.0).abs()


def test_keep_drops_what_pointwise_rules_do_not_read():
    """Pointwise rules declare whether they read their input or their output (exp,
    tanh, ... their output; log, erf, ... their input): with keep=, the other one is
    dropped, and every semiring's value at the input is the same."""
    from semiring_backprop.engine import liveness
    from semiring_backprop.engine.reverse import needed_nodes

    aten = torch.ops.aten
    torch.manual_seed(7)
    x = torch.randn(3, 4, dtype=F64)
    output = lambda y: y.sum()  # noqa: E731
    full = sbp.backprop(_unary_chain, (x,), output=output, semirings=SEMIRINGS)
    lean = sbp.backprop(_unary_chain, (x,), output=output, semirings=SEMIRINGS, keep=(0,))
    for sr in SEMIRINGS:
        _same(sr, lean.value(0, sr), full.value(0, sr))
    graph = lean.graph
    plan = liveness.plan(graph, needed_nodes(graph, graph.output_node), lean.kept)
    read = {n.target for n in plan.held | plan.recomputed if n.op == "call_function"}
    # outputs that only an add reads: neither held nor recomputed where the op's own
    # rule reads its input
    reads_input = [aten.erf, aten.sin, aten.cos, aten.relu, aten.leaky_relu, aten.abs]
    assert not ({op.default for op in reads_input} | {aten.pow.Tensor_Scalar}) & read
    reads_output = {op.default for op in (aten.exp, aten.tanh, aten.sigmoid, aten.rsqrt,
                                          aten.sqrt, aten.reciprocal)}  # fmt: skip
    # every one is a pointwise function of the input, which is held anyway: recomputed
    assert reads_output <= {n.target for n in plan.recomputed}


def _tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(3)
    return BertForMaskedLM(cfg).to(F64).eval()


def test_keep_stores_only_the_kept_places_with_the_same_values():
    model = _tiny_bert()
    emb = model.get_input_embeddings()(torch.randint(1, 40, (1, 6))).detach()
    output = lambda out: out.logits[0, 2].log_softmax(-1)[5]  # noqa: E731
    kw = {"inputs_embeds": emb}
    full = sbp.Backprop(model, output, SEMIRINGS)(kwargs=kw)
    lean = sbp.Backprop(model, output, SEMIRINGS, keep=("inputs_embeds", "*.attention:input"))
    res = lean(kwargs=kw)
    places = ["inputs_embeds", *(f"bert.encoder.layer.{i}.attention:input" for i in (0, 1))]
    assert res.kept == {res.node(p) for p in places}
    for place in places:
        for sr in SEMIRINGS:
            _same(sr, res.value(place, sr), full.value(place, sr))
    with pytest.raises(sbp.errors.InputError, match="not kept"):
        res.at("bert.encoder.layer.0.output", sbp.Real())
    with pytest.raises(sbp.errors.InputError, match="keep=None"):
        res.top_path("inputs_embeds")
    with pytest.raises(sbp.errors.NotFoundError, match="matches no module"):
        sbp.Backprop(model, output, [sbp.Real()], keep=("*.nothing",))(kwargs=kw)


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_keep_frees_values_during_the_pass():
    from semiring_backprop.engine import forward, liveness
    from semiring_backprop.engine.reverse import needed_nodes, reverse

    model = _tiny_bert()
    emb = model.get_input_embeddings()(torch.randint(1, 40, (1, 5))).detach()
    bp = sbp.Backprop(model, lambda out: out.logits[0, 1, 3], [sbp.Real()])
    graph = bp.graph((), {"inputs_embeds": emb})
    values = forward.run(graph, (), {"inputs_embeds": emb})
    computed = [n for n in values if getattr(n, "op", None) == "call_function"]
    kept = frozenset([graph.user_inputs["inputs_embeds"]])
    store = reverse(graph, values, [sbp.Real()], graph.output_node, kept)
    assert set(store) == set(kept)
    left = [  # values that still hold memory (a value let go is a stand-in)
        n for n, v in values.items() if getattr(n, "op", None) == "call_function"
        and not (isinstance(v, torch.Tensor) and v.is_floating_point()
                 and _same_storage(v, liveness.stand_in(v)))
    ]  # fmt: skip
    # only values no rule reads (off every path: masks, ids) can be left
    assert len(left) < len(computed) // 4, (len(left), len(computed))
    assert not set(left) & needed_nodes(graph, graph.output_node)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_keep_drops_unread_forward_values_without_changing_values(name):
    """With keep=, forward values no rule reads are dropped as the forward goes (the
    rules' ``reads``): every semiring's value at the kept places is the same as with
    every value kept, and the values held after the forward are fewer."""
    from semiring_backprop.engine import forward, liveness
    from semiring_backprop.engine.reverse import needed_nodes
    from test_branches import HF_SPECS

    spec = HF_SPECS[name]
    torch.manual_seed(5)
    model = spec.build().to(F64).eval()
    emb = model.get_input_embeddings()(torch.randint(1, 20, (1, 6))).detach()
    kw = {"inputs_embeds": emb}
    full = sbp.Backprop(model, spec.output, SEMIRINGS)(kwargs=kw)
    lean = sbp.Backprop(model, spec.output, SEMIRINGS, keep=("inputs_embeds",))
    res = lean(kwargs=kw)
    for sr in SEMIRINGS:
        _same(sr, res.value("inputs_embeds", sr), full.value("inputs_embeds", sr))

    graph = lean.graph((), kw)
    drop = liveness.unread_values(graph, needed_nodes(graph, graph.output_node), res.kept)
    dropped = {n for nodes in drop.values() for n in nodes}
    assert dropped and not dropped & res.kept
    every, values = forward.run(graph, (), kw), forward.run(graph, (), kw, drop)
    for n in dropped:  # stand-ins: the shape, dtype and device, no memory
        v = values[n]
        assert (v.shape, v.dtype, v.device) == (every[n].shape, every[n].dtype, every[n].device)
        assert v.stride() == (0,) * v.dim()

    def held(vals):
        storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                    for v in vals.values() if isinstance(v, torch.Tensor)}  # fmt: skip
        return sum(storages.values())

    assert held(values) < held(every)


class _GeluNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(6, 8), torch.nn.Linear(8, 8),
                                  torch.nn.Linear(8, 3))  # fmt: skip

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        h = torch.nn.functional.gelu(self.b(h), approximate="tanh")
        return self.c(h)


def test_keep_recomputes_cheap_values_instead_of_holding_them():
    """With keep=, values the rules read that are pointwise functions of one held value
    (GELU's 0.5x, x/√2 and 1 + erf(x/√2)) are not held through the forward but
    recomputed in the reverse pass: every semiring's value is the same bit for bit, and
    one value per GELU is held where its rules read three or more."""
    from semiring_backprop.engine import forward, liveness
    from semiring_backprop.engine.reverse import needed_nodes

    torch.manual_seed(4)
    model = _GeluNet().to(F64).eval()
    x = torch.randn(4, 6, dtype=F64)
    output = lambda y: y[0, 1] - y[2, 0]  # noqa: E731
    full = sbp.backprop(model, (x,), output=output, semirings=SEMIRINGS)
    lean = sbp.backprop(model, (x,), output=output, semirings=SEMIRINGS, keep=(0,))
    for sr in SEMIRINGS:
        _same(sr, lean.value(0, sr), full.value(0, sr))

    graph = lean.graph
    needed = needed_nodes(graph, graph.output_node)
    plan = liveness.plan(graph, needed, lean.kept)
    aten = torch.ops.aten
    targets = [n.target for n in plan.recomputed]
    assert aten.erf.default not in targets  # read by nothing: its rule reads its input
    # the erf GELU's 0.5x and x/√2, the tanh GELU's 0.5x (no rule reads its other muls)
    assert targets.count(aten.mul.Tensor) == 3 and aten.tanh.default in targets
    values = forward.run(graph, (x,), {}, liveness.unread_values(graph, needed, lean.kept))
    for n in plan.recomputed:  # not held: stand-ins
        assert _same_storage(values[n], liveness.stand_in(values[n]))
    held = [  # hidden-sized values holding memory after the forward
        n for n in graph.nodes if n.op == "call_function" and _held(values[n])
        and tuple(values[n].shape) == (4, 8)
    ]  # fmt: skip
    assert len(held) == 2, held  # the two GELU inputs


def _held(v):
    from semiring_backprop.engine import liveness

    return isinstance(v, torch.Tensor) and not _same_storage(v, liveness.stand_in(v))


def test_views_and_weights_that_require_grad_run_the_program_of_their_sizes(compiled, monkeypatch):
    """A compiled kernel reads its inputs as :func:`kernels.plain` makes them: views at
    an offset into a larger storage, a dim of size 1 with an odd stride and weights that
    require grad run the program compiled for plain tensors of their sizes (each of
    those was a program of its own, a second or more to compile), with the eager
    formulas' values and argmax."""
    programs = []
    real = kernels._compiled

    def counted(name):
        fn = real(name)

        def run(*args):
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            out = fn(*args)
            programs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
            return out

        return run

    monkeypatch.setattr(kernels, "_compiled", counted)
    for batch, n, m, p in [((), 5, 7, 4), ((3,), 5, 7, 4), ((2,), 1, 7, 4)]:
        hi, lo = _fields(n, m, batch)
        w = _weights(m, p, batch)
        kernels.maxtimes(hi, lo, w.transpose(-2, -1))  # (compiles for these sizes)
        programs.clear()
        big_hi, big_lo = _fields(n + 2, m, batch)
        v_hi, v_lo = big_hi[..., 2:, :], big_lo[..., 2:, :]  # (views at an offset)
        wt = _weights(m, p, batch).transpose(-2, -1).contiguous().requires_grad_()
        if n == 1:  # (a dim of size 1 with a stride of its own)
            v_hi = v_hi.as_strided(v_hi.shape, (*v_hi.stride()[:-2], 99, 1))
        fast = kernels.maxtimes(v_hi, v_lo, wt)
        assert programs == [0], (batch, n, programs)
        kernels.set_compile(False)
        slow = kernels.maxtimes(v_hi, v_lo, wt.detach())
        kernels.set_compile(True)
        for a, b in zip(fast, slow, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
