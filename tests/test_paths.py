"""Top paths (``Result.top_path`` / ``top_paths``) against the brute-force path lister.

Every path read from back-pointers must be a real path of the scalar gradient graph
(tests/oracles.py lists them all, with their hops and products), carry the product it
claims, and be the best one: the max (min) path product over the source set under
MaxProduct, the largest |product| under MaxAbs, the k largest |products| under TopK.
Each step's edge weight is also recomputed by torch.autograd on the op alone.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import oracles
import semiring_backprop as sbp
from semiring_backprop.engine import checkpoints
from test_oracle import CASES, KEEP

F64 = torch.float64
TOPKS = (1, 3, 5)
SEMIRINGS = [
    sbp.MaxProduct(),
    sbp.MaxProduct("tensor"),
    sbp.MaxAbs(),
    *(sbp.TopK(k) for k in TOPKS),
]


def close(a, b, rel=1e-9, abs_=1e-12) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def flat_index(index, shape) -> int:
    return int(np.ravel_multi_index(index, shape)) if len(shape) else 0


# -- programs ---------------------------------------------------------------------------


def case_parallel_edges():
    """``x * x``, ``x + x`` and ``mm(x, x)``: the same element enters one op through two
    slots, so two paths differ only in the slot taken (and tie under ``x + x``)."""
    gen = torch.Generator().manual_seed(5)
    c = torch.randn(3, 3, dtype=F64, generator=gen)

    def f(x):
        a = torch.tanh(x * x)
        b = (x + x) * c
        return (a * b).sum() + (torch.mm(x, x) * c).sum() + (x @ x.T)[0, 1]

    x = torch.randn(3, 3, dtype=F64, generator=gen)
    return f, (x,), None, [0]


ALL_CASES = {**CASES, "parallel_edges": case_parallel_edges}

# case -> extra sources beyond every float user input (module outputs / inputs)
EXTRA = {
    "residual_gelu": ["f.1", ("f", (1,))],
    "layer_norm_module": ["1:input", ("1", (0, 2))],
    "embedding_module": ["emb", ("emb", (0, 2)), ("emb", (0, slice(1, 3), 1))],
    "attention": ["q", ("v", (1, 0)), "up:input"],
    "kept_composites": ["ln"],
}

PATH_CASES = [
    "parallel_edges",
    "fanout_broadcast",
    "mlp_relu",
    "residual_gelu",
    "layer_norm_module",
    "softmax",
    "embedding_weight",
    "embedding_module",
    "attention",
    "attention_batched",
    "dense_zeros",
    "kept_composites",
    "routing_zoo",
    "random_0",
    "random_2",
]


class Run:
    def __init__(self, name):
        torch.manual_seed(0)
        model, args, output, _ = ALL_CASES[name]()
        self.res = sbp.backprop(
            model, args, output=output, semirings=SEMIRINGS, whole=KEEP.get(name, ())
        )
        self.dag = oracles.scalar_dag(self.res)
        self.sources = self._sources(name)

    def _sources(self, name):
        """A whole tensor, one element, an index prefix and a slice, for every float input
        (and the extra module places of the case)."""
        out = []
        for key, node in self.res.graph.user_inputs.items():
            val = self.res.values[node]
            if not val.is_floating_point():
                continue
            last = tuple(s - 1 for s in val.shape)
            if not out:  # a slice, for the first float input only (time)
                cut = (slice(None), val.shape[1] - 1) if val.dim() > 1 else (slice(1, None),)
                out.append((key, cut))
            out += [key, (key, last), (key, (0,))]
        return out + EXTRA.get(name, [])

    def oracle_paths(self, source):
        """Every oracle path from the elements the source names: {hops: product}."""
        where, index = source if isinstance(source, tuple) else (source, ())
        node = self.res.node(where)
        shape = tuple(self.res.values[node].shape)
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[index if isinstance(index, tuple) else (index,)] = True
        paths = {}
        for flat in torch.nonzero(mask.reshape(-1)).reshape(-1).tolist():
            for p, hops in self.dag.paths(node, flat):
                assert hops not in paths
                paths[hops] = p
        return node, mask, paths


@functools.cache
def get_run(name) -> Run:
    return Run(name)


def hops_of(res, path) -> tuple:
    return tuple(
        (s.node, flat_index(s.index, tuple(res.values[_node(res, s.node)].shape)), s.slot)
        for s in path.steps
    )


_NAMES: dict = {}


def _node(res, name):
    if id(res) not in _NAMES:
        _NAMES[id(res)] = (res, {n.name: n for n in res.graph.nodes})  # keeps res alive
    return _NAMES[id(res)][1][name]


def check_steps(res, path, node, mask, rel=1e-9):
    """The path starts at an element of the source set, ends at the output, follows real
    edges (consumer relation, slot) whose weights autograd confirms, and its running
    product and edge-weight product are its value."""
    steps = path.steps
    first, last = steps[0], steps[-1]
    group = {n.name for n in res.graph.aliases.get(node, (node,))}
    assert first.node in group, f"path starts at {first.node}, not at the source {node.name}"
    assert mask[first.index], f"path starts at {first.index}, outside the source set"
    assert (first.edge_weight, first.running, first.slot) == (None, 1.0, None)
    if _node(res, first.node).op == "placeholder":
        assert first.op == "input"
    out = res.graph.output_node
    assert last.node == out.name, f"path ends at {last.node}, not at the output {out.name}"
    assert last.index == tuple(0 for _ in res.values[out].shape)
    running = 1.0
    for prev, step in zip(steps, steps[1:]):
        consumer, producer = _node(res, step.node), _node(res, prev.node)
        assert producer in consumer.all_input_nodes, f"{prev.node} does not feed {step.node}"
        slots = {s: src for s, _, src in oracles.carried_slots(res, consumer)}
        assert slots.get(step.slot) is producer, f"slot {step.slot} of {step.node}"
        assert step.op == str(consumer.target)
        out_flat = flat_index(step.index, tuple(res.values[consumer].shape))
        in_flat = flat_index(prev.index, tuple(res.values[producer].shape))
        want = float(oracles.local_derivative(res, consumer, step.slot, out_flat)[in_flat])
        assert close(step.edge_weight, want, rel), (
            f"edge {prev.node}{prev.index} -> {step.node}{step.index} (slot {step.slot}): "
            f"{step.edge_weight} vs autograd {want}"
        )
        running *= step.edge_weight
        assert close(step.running, running, rel), f"running product at {step.node}"
    assert close(running, path.value, rel), f"edge product {running} vs value {path.value}"
    assert close(last.running, path.value, rel)


def check_is_oracle_path(run, path, paths):
    hops = hops_of(run.res, path)
    assert hops in paths, f"not a path of the scalar graph: {hops}"
    assert close(paths[hops], path.value), f"oracle product {paths[hops]} vs {path.value}"


# -- neuron granularity: MaxProduct, MaxAbs ---------------------------------------------


@pytest.mark.parametrize("case", PATH_CASES)
def test_top_path_is_the_best_oracle_path(case):
    run = get_run(case)
    res = run.res
    checked = live = 0
    for source in run.sources:
        node, mask, paths = run.oracle_paths(source)
        products = np.array(list(paths.values()))
        live += bool(len(products))
        for sign, best in (("+", np.max), ("-", np.min)):
            if not len(products):
                with pytest.raises(sbp.NotFoundError):
                    res.top_path(source, sign=sign)
                continue
            path = res.top_path(source, sign=sign)
            assert path.sign == sign and path.semiring == "MaxProduct(neuron)"
            assert close(path.value, float(best(products))), (
                f"{source} sign {sign}: {path.value} vs oracle {best(products)}"
            )
            check_is_oracle_path(run, path, paths)
            check_steps(res, path, node, mask)
            checked += 1
        # MaxAbs: the largest |product|; a path of zero weight only is no path
        top = float(np.abs(products).max()) if len(products) else 0.0
        if top == 0:
            with pytest.raises(sbp.NotFoundError):
                res.top_path(source, sbp.MaxAbs())
            continue
        path = res.top_path(source, sbp.MaxAbs())
        assert close(abs(path.value), top), f"{source}: |{path.value}| vs oracle {top}"
        check_is_oracle_path(run, path, paths)
        check_steps(res, path, node, mask)
    assert checked == 2 * live and live >= 3


@pytest.mark.parametrize("case", PATH_CASES)
def test_top_paths_are_the_k_heaviest_oracle_paths(case):
    run = get_run(case)
    res = run.res
    for source in run.sources:
        node, mask, paths = run.oracle_paths(source)
        mags = np.sort(np.abs(np.array(list(paths.values()) or [0.0])))[::-1]
        mags = mags[mags > 0]  # zero-weight paths have log|w| = -inf: not ranked
        for k in TOPKS:
            if not len(mags):
                with pytest.raises(sbp.NotFoundError):
                    res.top_paths(source, k, sbp.TopK(k))
                continue
            got = res.top_paths(source, k, sbp.TopK(k))
            assert len(got) == min(k, len(mags)), f"{source} k={k}: {len(got)} paths"
            values = np.array([abs(p.value) for p in got])
            assert (np.diff(values) <= 1e-12 * values[0]).all(), "not heaviest first"
            np.testing.assert_allclose(values, mags[: len(got)], rtol=1e-9, atol=1e-300)
            seen = set()
            for p in got:
                assert p.semiring == f"TopK({k})"
                assert p.sign == ("+" if p.value >= 0 else "-")
                check_is_oracle_path(run, p, paths)
                check_steps(res, p, node, mask)
                seen.add(tuple((s.node, s.index, s.slot) for s in p.steps))
            assert len(seen) == len(got), f"{source} k={k}: repeated paths"
            if k == 3:  # a larger TopK gives the same heaviest paths (up to ties)
                more = res.top_paths(source, k, sbp.TopK(max(TOPKS)))
                np.testing.assert_allclose([abs(p.value) for p in more], values, rtol=1e-9)
        # top_path under TopK is the heaviest of top_paths
        if not len(mags):
            with pytest.raises(sbp.NotFoundError):
                res.top_path(source, sbp.TopK(3))
            continue
        one = res.top_path(source, sbp.TopK(3))
        assert close(abs(one.value), float(mags[0]))
        check_is_oracle_path(run, one, paths)


def test_parallel_edges_are_distinct_paths():
    """``x + x``: the two slots give two paths of equal product; both are listed, told
    apart by the slot; ``mm(x, x)`` reads the diagonal element through both slots."""
    run = get_run("parallel_edges")
    res = run.res
    ops = {str(n.target) for n in res.graph.nodes}
    assert {"aten.mul.Tensor", "aten.add.Tensor", "aten.mm.default"} <= ops
    for idx in [(0, 0), (1, 2), (2, 2)]:
        source = (0, idx)
        _, _, paths = run.oracle_paths(source)
        unslotted = {tuple((n, i) for n, i, _ in h) for h in paths}
        assert len(unslotted) < len(paths), "the program has parallel edges"
        got = res.top_paths(source, 5, sbp.TopK(5))
        assert len({hops_of(res, p) for p in got}) == 5
    # some top-5 list holds two paths that differ in the slot only (x + x: equal products)
    add = next(n for n in res.graph.nodes if str(n.target) == "aten.add.Tensor")
    assert [a.name for a in add.args] == ["args_0", "args_0"]
    twins = 0
    for idx in np.ndindex(3, 3):
        got = res.top_paths((0, idx), 5, sbp.TopK(5))
        names = [tuple((s.node, s.index) for s in p.steps) for p in got]
        twins += len(names) - len(set(names))
    assert twins > 0, "no top-5 list holds two paths that differ only in the slot"


def test_zero_weight_paths():
    """Row 1 of x reaches the output only through dead relus: MaxProduct still has a path
    (product 0); MaxAbs and TopK rank |product| in log space and find none."""
    W = torch.tensor([[1.0, 2.0], [3.0, 1.0]], dtype=F64)

    def f(x):
        return torch.relu(x @ W).sum()

    x = torch.tensor([[1.0, 2.0], [-1.0, -2.0]], dtype=F64)
    res = sbp.backprop(f, (x,), semirings=SEMIRINGS)
    paths = {h: p for i in (2, 3) for p, h in oracles.scalar_dag(res).paths(res.node(0), i)}
    path = res.top_path((0, (1,)))
    assert path.value == 0.0
    assert hops_of(res, path) in paths
    with pytest.raises(sbp.NotFoundError):
        res.top_path((0, (1,)), sbp.MaxAbs())
    with pytest.raises(sbp.NotFoundError):
        res.top_paths((0, (1,)), 3, sbp.TopK(3))
    # x[0, j] -> h[0, i] with weight W[j, i], then relu' = 1 (h = [7, 4] > 0), then sum
    assert close(res.top_path((0, (0, 0))).value, 2.0)
    assert close(res.top_path((0, (0, 1))).value, 3.0)
    assert close(res.top_path((0, (0, 1)), sign="-").value, 1.0)


# -- tensor granularity -------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["fanout_broadcast", "attention", "residual_gelu", "random_1", "embedding_module"]
)
def test_tensor_granularity_path_is_a_chain_of_ops(case):
    run = get_run(case)
    res, tensor = run.res, sbp.MaxProduct("tensor")
    for source in run.sources:
        node, mask, paths = run.oracle_paths(source)
        if not paths:
            continue
        ro = res.at(source if not isinstance(source, tuple) else source[0], tensor)
        for sign in ("+", "-"):
            path = res.top_path(source, tensor, sign=sign)
            assert path.semiring == "MaxProduct(tensor)"
            field = ro.hi if sign == "+" else ro.lo
            picked = field[mask]
            want = float(picked.max() if sign == "+" else picked.min())
            assert close(path.value, want), f"{source} {sign}: {path.value} vs readout {want}"
            steps = path.steps
            assert steps[0].node == node.name and steps[-1].node == res.graph.output_node.name
            assert all(s.index is None and s.edge_weight is None for s in steps)
            for prev, step in zip(steps, steps[1:]):
                assert _node(res, prev.node) in _node(res, step.node).all_input_nodes


def test_tensor_path_leaves_a_fanout_through_the_winning_consumer():
    """Where a tensor feeds several ops, the path goes on through the op whose
    contribution won the element the path is at (the example of test_oracle's
    tensor-granularity test, worked by hand)."""
    W = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 0.5, 2.0]], dtype=F64)
    a = torch.tensor([2.0, -1.0, 0.5], dtype=F64)
    b = torch.tensor([-3.0, 4.0, 1.0], dtype=F64)

    def f(x):
        h = x @ W
        return (h * a + h * b).sum()

    tensor = sbp.MaxProduct("tensor")
    res = sbp.backprop(f, (torch.tensor([[0.3, -0.7]], dtype=F64),), semirings=[tensor])
    # x: hi (0.5, 3.5), lo (-3, 2); D(h): hi (2, 4, 1) from (a, b, b), lo (-3, -1, 0.5)
    # from (b, a, a). "+" starts at x_1 (3.5): at h its best hi is 4, from h * b.
    # "-" starts at x_0 (-3): at h its lowest lo is -3, from h * b as well; the lo of
    # the second element (-1) comes from h * a.
    for sign, value in (("+", 3.5), ("-", -3.0)):
        path = res.top_path(0, tensor, sign=sign)
        assert close(path.value, value)
        ops = [s.op for s in path.steps]
        assert ops[:3] == ["input", "aten.mm.default", "aten.mul.Tensor"], ops
        mul = _node(res, path.steps[2].node)
        other = [n for n in mul.all_input_nodes if n.name != path.steps[1].node]
        assert torch.equal(res.values[other[0]], b), sign


# -- whole models -------------------------------------------------------------------------

try:  # the Hugging Face models of test_models (which skips itself without transformers)
    from test_models import HF, _embedding_name, hf_model
except (ImportError, pytest.skip.Exception):
    HF = None
needs_hf = pytest.mark.skipif(HF is None, reason="needs transformers")

MODEL_SEMIRINGS = [sbp.MaxProduct(), sbp.TopK(2)]


def _check_model_path(res, model, path, node, mask, rel):
    check_steps(res, path, node, mask, rel=rel)
    names = set(dict(model.named_modules()))
    for s in path.steps:
        assert s.module is None or s.module in names, f"unknown module {s.module!r}"


def _check_model(res, model, where, token, rel=1e-9, topk=True, whole=True):
    """top_path from ``where``: one element, one token (index prefix), the whole tensor."""
    node = res.node(where)
    mp = res.at(where, sbp.MaxProduct())
    agg = res.aggregate(where, sbp.MaxProduct(), dims=(-1,))
    shape = tuple(mp.hi.shape)
    elem = (*token, shape[-1] - 1)
    for source, hi, lo in [
        ((where, elem), mp.hi[elem], mp.lo[elem]),
        ((where, token), agg.hi[token], agg.lo[token]),
        (where, mp.hi.max(), mp.lo.min()),
    ][: 3 if whole else 2]:
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[source[1] if isinstance(source, tuple) else ()] = True
        for sign, want in (("+", hi), ("-", lo)):
            path = res.top_path(source, sign=sign)
            assert close(path.value, float(want), rel), f"{source} {sign}: {path.value} {want}"
            _check_model_path(res, model, path, node, mask, rel)
        if not topk:
            continue
        paths = res.top_paths(source, 2)
        top = res.at(where, sbp.TopK(2)).values
        want = top[mask].reshape(-1).abs().sort(descending=True).values[:2]
        np.testing.assert_allclose([abs(p.value) for p in paths], want.numpy(), rtol=rel)
        assert len({tuple((s.node, s.index, s.slot) for s in p.steps) for p in paths}) == 2
        for p in paths:
            _check_model_path(res, model, p, node, mask, rel)


HF_CASES = [("bert-cls", "eager"), ("bert-mlm", "sdpa"), ("gpt2", "eager"), ("llama", "sdpa")]


@functools.cache
def hf_result(name, impl):
    """BERT reads token ids (a batch of 2, the output reads example 0 only); GPT-2 and
    Llama read ``inputs_embeds``."""
    model, output = hf_model(name, impl), HF[name][2]
    if name.startswith("bert"):
        ids = torch.tensor([[3, 7, 1, 9], [5, 2, 8, 13]])
        mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
        kwargs = {"input_ids": ids, "attention_mask": mask}
    else:
        kwargs = {"inputs_embeds": model.get_input_embeddings()(torch.tensor([[3, 7, 1, 9]]))}
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"].detach()
    return sbp.backprop(model, kwargs=kwargs, output=output, semirings=MODEL_SEMIRINGS)


@needs_hf
@pytest.mark.parametrize(("name", "impl"), HF_CASES, ids=[f"{n}-{i}" for n, i in HF_CASES])
def test_hf_top_path(name, impl):
    model, res = hf_model(name, impl), hf_result(name, impl)
    rel = 1e-6 if name == "llama" else 1e-9
    if name.startswith("bert"):
        _check_model(res, model, _embedding_name(model), (0, 2), rel)
        _check_model(res, model, "bert.embeddings", (0, 1), rel, topk=False, whole=False)
        where = _embedding_name(model)
    else:
        # Llama's float32 islands: see test_llama_top_paths_with_float32_islands
        _check_model(res, model, "inputs_embeds", (0, 1), rel, topk=name != "llama")
        where = "inputs_embeds"
    # the path passes through the model's blocks, in order
    path = res.top_path(where)
    mods = [m for m in path.modules if m]
    layer = "layers" if name == "llama" else ("h" if name == "gpt2" else "layer")
    blocks = [m.split(f".{layer}.")[1].split(".")[0] for m in mods if f".{layer}." in m]
    assert blocks == sorted(blocks, key=int) and len(set(blocks)) == 2, blocks


@needs_hf
def test_llama_top_paths_with_float32_islands():
    """A float64 Llama runs RMSNorm in float32: paths through it must still be read."""
    res = hf_result("llama", "sdpa")
    top = res.at("inputs_embeds", sbp.TopK(2)).values
    for t in range(4):
        paths = res.top_paths(("inputs_embeds", (0, t)), 2)
        want = top[0, t].reshape(-1).abs().sort(descending=True).values[:2]
        np.testing.assert_allclose([abs(p.value) for p in paths], want.numpy(), rtol=1e-6)
    path = res.top_path(("inputs_embeds", (0, 3, 12)), sign="-")
    assert close(path.value, float(res.at("inputs_embeds", sbp.MaxProduct()).lo[0, 3, 12]), 1e-6)


@needs_hf
def test_hf_second_example_has_no_path():
    """The output reads the first example only: the second one's tokens have no path."""
    model, res = hf_model("bert-cls", "eager"), hf_result("bert-cls", "eager")
    emb = _embedding_name(model)
    for source in [(emb, (1,)), (emb, (1, 2)), (emb, (1, 0, 5))]:
        with pytest.raises(sbp.NotFoundError):
            res.top_path(source)
        with pytest.raises(sbp.NotFoundError):
            res.top_path(source, sign="-")
        with pytest.raises(sbp.NotFoundError):
            res.top_paths(source, 2)
    path = res.top_path(emb)  # the whole tensor: the best element is in example 0
    assert path.source.index[0] == 0


def test_transformer_encoder_layer_top_path():
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    layer = layer.to(F64).eval()
    x = torch.randn(1, 4, 16, dtype=F64)
    res = sbp.backprop(
        layer, (x,), output=lambda y: y[0, 1, 3] - y[0, 2, 0], semirings=MODEL_SEMIRINGS
    )
    _check_model(res, layer, 0, (0, 2))
    _check_model(res, layer, "linear1:input", (0, 1))
    _check_model(res, layer, "self_attn", (0, 1))


def test_mlp_top_path():
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)
    )
    mlp = mlp.to(F64).eval()
    x = torch.randn(3, 5, dtype=F64)
    res = sbp.backprop(mlp, (x,), output=lambda y: y[1, 2], semirings=MODEL_SEMIRINGS)
    _check_model(res, mlp, 0, (1,))
    _check_model(res, mlp, "2", (1,))
    _check_model(res, mlp, "4:input", (1,))
    path = res.top_path(0)
    assert [m for m in path.modules if m] == ["0", "1", "2", "3", "4", "5"]


# -- export: frame, JSON, compact -------------------------------------------------------


def _runs(steps):
    runs = []
    for s in steps:
        if not runs or runs[-1] != s.module:
            runs.append(s.module)
    return runs


def test_path_export(tmp_path):
    run = get_run("attention")
    for path in [
        run.res.top_path(0),
        run.res.top_path(("q", (1, 0)), sign="-"),
        run.res.top_paths(0, 3, sbp.TopK(3))[2],
        run.res.top_path(0, sbp.MaxAbs()),
        run.res.top_path(0, sbp.MaxProduct("tensor")),
    ]:
        frame = path.to_frame()
        cols = ["step", "node", "module", "op", "index", "slot", "edge_weight", "running"]
        assert list(frame.columns) == cols
        assert len(frame) == len(path) == len(path.steps)
        assert frame["step"].tolist() == list(range(len(path)))
        slots = frame["slot"]
        assert [None if m else int(v) for v, m in zip(slots, slots.isna())] == [
            s.slot for s in path.steps
        ]
        for row, s in zip(frame.itertuples(index=False), path.steps):
            assert (row.node, row.op, row.index) == (s.node, s.op, s.index)
            assert row.module == s.module or (s.module is None and pd.isna(row.module))
            for got, want in [(row.edge_weight, s.edge_weight), (row.running, s.running)]:
                assert (want is None and (got is None or math.isnan(got))) or got == want

        text = path.to_json()
        data = json.loads(text)
        assert data["value"] == path.value
        assert (data["semiring"], data["sign"]) == (path.semiring, path.sign)
        assert len(data["steps"]) == len(path)
        for d, s in zip(data["steps"], path.steps):
            assert d["node"] == s.node and d["module"] == s.module and d["op"] == s.op
            assert d["index"] == (None if s.index is None else list(s.index))
            assert d["slot"] == s.slot
            assert d["edge_weight"] == s.edge_weight and d["running"] == s.running
        out = tmp_path / "path.json"
        assert path.to_json(file=out) == text and out.read_text() == text

        lines = str(path).splitlines()  # one line per module run, not one long line
        assert 2 < len(lines) <= len(_runs(path.steps)) + 2 and f"{path.value:.4g}" in lines[0]
        runs = _runs(path.steps)
        line = path.compact()
        assert line.count(" → ") == len(runs) - 1, (line, runs)
        assert path.modules == runs


def test_compact_collapses_module_runs():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 1))
    mlp = mlp.to(F64).eval()
    res = sbp.backprop(
        mlp,
        (torch.randn(2, 3, dtype=F64),),
        output=lambda y: y[0, 0] * y[1, 0],
        semirings=[sbp.MaxProduct()],
    )
    path = res.top_path((0, (0, 1)))
    runs = _runs(path.steps)
    assert runs[0] is None and {"0", "1", "2", "3"} <= set(runs)
    assert len(runs) < len(path)  # some module holds several ops
    line = path.compact()
    assert line.count(" → ") == len(runs) - 1
    assert line.startswith("input ") and "product" in line
    assert "(" in line.split(" → ")[1]  # a run of several ops says how many


# -- errors ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(3, 4, dtype=F64, generator=gen)

    def f(x, y):
        return torch.tanh(x @ W)[0].sum() * y.sum()  # row 1 of x does not matter

    x, y = torch.randn(2, 3, dtype=F64, generator=gen), torch.randn(2, dtype=F64, generator=gen)
    return sbp.backprop(f, (x, y), semirings=[sbp.MaxProduct(), sbp.TopK(2)])


def test_errors_bad_source(small):
    with pytest.raises(sbp.NotFoundError):
        small.top_path("no_such_module")
    with pytest.raises(sbp.NotFoundError):
        small.top_paths("no_such_module", 1)
    for index in [(2, 0), (0, 3), (0, 0, 0), 5]:
        with pytest.raises(sbp.InputError):
            small.top_path((0, index))
        with pytest.raises(sbp.InputError):
            small.top_paths((0, index), 2)


def test_errors_semiring_not_computed(small):
    for sr in [sbp.MaxAbs(), sbp.MaxProduct("tensor"), sbp.TopK(1)]:
        with pytest.raises(sbp.InputError):
            small.top_path(0, sr)
    with pytest.raises(sbp.InputError):
        small.top_paths(0, 1, sbp.TopK(1))  # TopK(1) was not computed
    with pytest.raises(sbp.InputError):
        small.top_path(0, sbp.Real())  # not selective: no pointers


def test_errors_k_and_sign(small):
    with pytest.raises(sbp.InputError):
        small.top_paths(0, 3, sbp.TopK(2))
    with pytest.raises(sbp.InputError):
        small.top_paths(0, 3)  # no TopK with k >= 3 was computed
    assert len(small.top_paths(0, 2)) == 2
    for sign in ["x", "max", "", None]:
        with pytest.raises(sbp.InputError):
            small.top_path(0, sign=sign)


def test_errors_source_without_path(small):
    for source in [(0, (1,)), (0, (1, 2)), (0, (slice(1, 2), slice(None)))]:
        with pytest.raises(sbp.NotFoundError):
            small.top_path(source)
        with pytest.raises(sbp.NotFoundError):
            small.top_path(source, sign="-")
        with pytest.raises(sbp.NotFoundError):
            small.top_paths(source, 2)
    assert small.top_path(0).source.index[0] == 0
    assert small.top_path(1).source.node == small.node(1).name


def _unused_input():
    def f(x, y):
        return (x * 2).sum()  # y is traced but does not reach the output

    x = torch.randn(2, 3, dtype=F64)
    return sbp.backprop(f, (x, x.clone()), semirings=[sbp.MaxProduct(), sbp.TopK(2)])


def test_errors_input_not_on_any_path():
    """An input that never reaches the output: one of our errors, naming it."""
    res = _unused_input()
    for call in [lambda: res.top_path(1), lambda: res.top_paths((1, (0, 1)), 2)]:
        with pytest.raises(sbp.SemiringBackpropError, match="args_1"):
            call()


def test_input_not_on_any_path_is_not_found():
    res = _unused_input()
    with pytest.raises(sbp.NotFoundError):
        res.top_path(1)


# -- a result that does not hold together is refused ------------------------------------

TAMPER_SEMIRINGS = [sbp.MaxProduct(), sbp.MaxProduct("tensor"), sbp.MaxAbs(), sbp.TopK(2)]

# reader -> (semiring, how it reads the path from input 0)
READERS = {
    "maxproduct+": (sbp.MaxProduct(), lambda res: res.top_path(0)),
    "maxproduct-": (sbp.MaxProduct(), lambda res: res.top_path(0, sign="-")),
    "tensor+": (sbp.MaxProduct("tensor"), lambda res: res.top_path(0, sbp.MaxProduct("tensor"))),
    "tensor-": (
        sbp.MaxProduct("tensor"),
        lambda res: res.top_path(0, sbp.MaxProduct("tensor"), sign="-"),
    ),
    "maxabs": (sbp.MaxAbs(), lambda res: res.top_path(0, sbp.MaxAbs())),
    "topk-top_paths": (sbp.TopK(2), lambda res: res.top_paths(0, 2, sbp.TopK(2))[0]),
    "topk-top_path": (sbp.TopK(2), lambda res: res.top_path(0, sbp.TopK(2))),
}


def _tamper_result():
    """A fresh result (nothing memoized): every path from x passes through tanh."""
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(3, 4, dtype=F64, generator=gen)

    def f(x, y):
        return torch.tanh(x @ W)[0].sum() * y.sum()

    x, y = torch.randn(2, 3, dtype=F64, generator=gen), torch.randn(2, dtype=F64, generator=gen)
    # every node held, so that a value can be changed in place (a checkpointed result
    # computes its segments again from the checkpoints)
    checkpoints.ENABLED = False
    try:
        return sbp.backprop(f, (x, y), semirings=TAMPER_SEMIRINGS)
    finally:
        checkpoints.ENABLED = True


def _tamper_stored(res, sr, path):
    """Make the semiring's value at the path's source element more extreme (it stays the
    one the reader picks), leaving everything the path is recomputed from as it was."""
    node = _node(res, path.source.node)
    k = res.semirings.index(sr)
    raw = res._store[node][k]
    if path.source.index is None:  # tensor granularity: the most extreme element
        ro = sr.finalize(raw)
        e = int(ro.hi.argmax() if path.sign == "+" else ro.lo.argmin())
    else:
        e = flat_index(path.source.index, tuple(res.values[node].shape))
    fields = list(raw)
    if isinstance(sr, sbp.MaxProduct):  # hi (sign +) or lo (sign -), doubled
        f = 0 if path.sign == "+" else 1
        assert (path.value > 0) == (f == 0) and path.value != 0
        changed = [f]
    elif isinstance(sr, sbp.MaxAbs):  # log |value| + 1
        changed = [0]
    else:  # TopK: every rank's log |value| + 1
        changed = list(range(sr.k))
    for f in changed:
        fields[f] = fields[f].clone()
        if isinstance(sr, sbp.MaxProduct):
            fields[f].view(-1)[e] *= 2
        else:
            fields[f].view(-1)[e] += 1
    res._store[node][k] = type(raw)(fields)


@pytest.mark.parametrize("reader", list(READERS))
def test_reader_refuses_a_changed_semiring_value(reader):
    sr, read = READERS[reader]
    honest = read(_tamper_result())  # the check passes on the untouched result
    res = _tamper_result()
    _tamper_stored(res, sr, honest)
    with pytest.raises(sbp.errors.PathMismatchError, match="changed after the pass") as info:
        read(res)
    assert sr.name in str(info.value)
    assert isinstance(info.value, sbp.SemiringBackpropError)


@pytest.mark.parametrize("reader", list(READERS))
def test_reader_refuses_a_changed_forward_value(reader):
    """tanh's edge weight is 1 - tanh(x)^2, read from its output: halving the output
    changes the weight of a step every path takes, not the stored semiring values."""
    sr, read = READERS[reader]
    res = _tamper_result()
    tanh = next(n for n in res.graph.nodes if str(n.target) == "aten.tanh.default")
    res.values[tanh] = res.values[tanh] * 0.5
    with pytest.raises(sbp.errors.PathMismatchError, match="changed after the pass") as info:
        read(res)
    assert sr.name in str(info.value)


def test_topk_reader_refuses_a_flipped_sign():
    """TopK stores the sign apart from log |value|: a sign flipped at the source makes the
    path product's sign disagree, with magnitudes equal."""
    sr, read = READERS["topk-top_paths"]
    honest = read(_tamper_result())
    res = _tamper_result()
    node = _node(res, honest.source.node)
    k = res.semirings.index(sr)
    e = flat_index(honest.source.index, tuple(res.values[node].shape))
    fields = list(res._store[node][k])
    for r in range(sr.k):  # the sign fields follow the k value fields
        fields[sr.k + r] = fields[sr.k + r].clone()
        fields[sr.k + r].view(-1)[e] *= -1
    res._store[node][k] = type(res._store[node][k])(fields)
    with pytest.raises(sbp.errors.PathMismatchError, match="TopK"):
        read(res)


@pytest.mark.parametrize("reader", ["maxproduct+", "maxproduct-", "maxabs", "topk-top_paths"])
def test_reader_refuses_edge_weights_that_disagree_with_the_pass(reader, monkeypatch):
    """The product check itself: edge weights recomputed 1.5 times too large (as from a
    rule whose real weights disagree with its semiring pass) leave every stored value and
    pointer as it was, but not the path's product."""
    from semiring_backprop.analysis import paths

    sr, read = READERS[reader]
    res = _tamper_result()
    real = paths._Edges.weights
    monkeypatch.setattr(
        paths._Edges, "weights", lambda self, *a: [(s, w * 1.5) for s, w in real(self, *a)]
    )
    with pytest.raises(sbp.errors.PathMismatchError, match="the path from") as info:
        read(res)
    assert sr.name in str(info.value)


def test_topk_back_pointers_read_back_as_stamped():
    """A TopK value's back-pointers are packed into one int64 per entry: what ``tag``
    stamps (node, each element's flat index, each rank) is what ``pointers`` reads,
    the largest node and element it takes included, and "no pointer" reads as node -1."""
    from semiring_backprop.semirings import topk

    sr = sbp.TopK(3)
    like = torch.zeros(())
    fresh = sr.one((2, 5), like)
    _, _, node, element, rank = sr.pointers(fresh)
    assert bool((node == -1).all())
    for node_id in (0, 7, (1 << topk._NODE_BITS) - 1):
        v, s, node, element, rank = sr.pointers(sr.tag(fresh, node_id))
        assert bool((node == node_id).all())
        assert torch.equal(element, torch.arange(10).view(2, 5, 1).expand(2, 5, 3))
        assert torch.equal(rank, torch.arange(3).expand(2, 5, 3))
        assert torch.equal(v, sr.pointers(fresh)[0]) and bool((s == 1).all())
    big = torch.tensor([(1 << topk._ELEMENT_BITS) - 1]) << topk._ELEMENT_SHIFT
    assert int(topk.unpack_pointers(big | 254)[1]) == (1 << topk._ELEMENT_BITS) - 1
    assert int(topk.unpack_pointers(big | 254)[2]) == 254


def test_topk_refuses_what_its_pointers_cannot_name():
    sr = sbp.TopK(2)
    one = sr.one((3,), torch.zeros(()))
    with pytest.raises(sbp.InputError, match="node 524288"):
        sr.tag(one, 1 << 19)
    with pytest.raises(sbp.InputError, match="at most 255"):
        sbp.TopK(256)
