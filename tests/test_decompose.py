"""tracing.decompose: the graph ``run_decompositions`` gives, each distinct op traced once.

Every test compares the two programs whole: every node's name, op, arguments, module and
value layout (shape, strides, offset, dtype, requires_grad), in order, and the
signatures. The model matrix of test_families runs in the slow tier.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.tracing import decompose as D
from semiring_backprop.tracing import op_keys
from semiring_backprop.tracing import trace as T

pytestmark = pytest.mark.usefixtures("_offline_quiet")


def _exported(model, kwargs=None, args=(), output=None, dynamic=False, **kw):
    """The program just before the decompositions, and the table (as trace makes them)."""
    seen = {}

    def keep(program, table):
        seen["program"], seen["table"] = program, table
        return program.run_decompositions(table)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(T, "decompose", keep)
        T.trace(model, args, kwargs, output, dynamic=dynamic, **kw)
    return seen["program"], seen["table"]


def _nodes(program):
    out = []
    for n in program.graph.nodes:
        v = n.meta.get("val")
        layout = None
        if isinstance(v, torch.Tensor):
            layout = (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.requires_grad)
        stack = list((n.meta.get("nn_module_stack") or {}).values())
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)
        out.append((n.name, n.op, str(n.target), repr(args), layout, stack[-1:]))
    return out


def _same_as_torch(program, table, fast=True):
    """``decompose`` gives what ``run_decompositions`` gives; ``fast``: without it."""
    want = program.run_decompositions(table)
    if fast:
        got = D._Decomposer(program, table).run()  # raises where it would fall back
    else:
        with pytest.raises(D.Unsupported):
            D._Decomposer(program, table).run()
        got = D.decompose(program, table)
    for i, (a, b) in enumerate(zip(_nodes(want), _nodes(got))):
        assert a == b, f"node {i}: run_decompositions {a}, decompose {b}"
    assert len(_nodes(want)) == len(_nodes(got))
    assert got.graph_signature == want.graph_signature
    return got


def _bert(layers=2, **kw):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers,
                     num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=32, **kw)  # fmt: skip
    torch.manual_seed(0)
    return BertModel(cfg, add_pooling_layer=False).eval()


def _bert_call(model, n=7):
    emb = torch.randn(1, n, model.config.hidden_size)
    return {"inputs_embeds": emb}, lambda out: out.last_hidden_state[0, -1, :3].sum()


def test_bert_each_distinct_op_once():
    model = _bert(layers=3)
    kwargs, output = _bert_call(model)
    program, table = _exported(model, kwargs=kwargs, output=output)
    traced = []
    d = D._Decomposer(program, table)
    batch = d._trace_batch
    d._trace_batch = lambda items: (traced.append(len(items)), batch(items))[1]
    d.run()
    # one batch, and the ops of the second and third layer are those of the first
    ops = sum(1 for n in program.graph.nodes if n.op == "call_function")
    assert len(traced) == 1 and traced[0] < ops / 3
    _same_as_torch(program, table)


@pytest.mark.parametrize(
    "kw", [{"whole": ("softmax", "layer_norm")}, {"paper": True}], ids=["whole", "paper"]
)
def test_kept_composites_and_paper_mode(kw):
    model = _bert()
    kwargs, output = _bert_call(model)
    program, table = _exported(model, kwargs=kwargs, output=output, **kw)
    _same_as_torch(program, table)


def test_a_mlp_gives_the_gradient():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    program, table = _exported(mlp, args=(x,), output=lambda y: y[1, 0])
    _same_as_torch(program, table)
    res = sbp.backprop(mlp, (x,), output=lambda y: y[1, 0], semirings=[sbp.Real()])
    leaf = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(mlp(leaf)[1, 0], leaf)
    torch.testing.assert_close(res.at(0, sbp.Real()), g)


def test_in_place_ops_and_symbolic_sizes_go_to_run_decompositions():
    class InPlace(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            y.add_(1)
            return y.sum()

    x = torch.randn(3, 4)
    program, table = _exported(InPlace(), args=(x,))
    _same_as_torch(program, table, fast=False)
    model = _bert()
    kwargs, output = _bert_call(model)
    program, table = _exported(model, kwargs=kwargs, output=output, dynamic=True)
    _same_as_torch(program, table, fast=False)


def test_dead_code_elimination_comes_back_after_a_failed_batch():
    dce = torch.fx.Graph.eliminate_dead_code
    with pytest.raises(RuntimeError), D._keep_dead_nodes():
        assert torch.fx.Graph.eliminate_dead_code is not dce
        raise RuntimeError
    assert torch.fx.Graph.eliminate_dead_code is dce


def test_a_failure_inside_falls_back_to_run_decompositions(monkeypatch):
    model = _bert()
    kwargs, output = _bert_call(model)
    program, table = _exported(model, kwargs=kwargs, output=output)

    def broken(self, items):
        raise RuntimeError("broken")

    monkeypatch.setattr(D._Decomposer, "_trace_batch", broken)
    got = D.decompose(program, table)
    assert _nodes(got) == _nodes(program.run_decompositions(table))


def _families():
    import test_families as tf

    return tf


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_families().FAMILIES))
def test_families(name):
    tf = _families()
    if tf.FAMILIES[name].refused is not None and tf.FAMILIES[name].refused() is not None:
        pytest.skip("the installed transformers' code of this family cannot be traced")
    model = tf._model(name)
    kwargs, _, output = tf._inputs(name, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        program, table = _exported(model, kwargs=kwargs, output=output)
    try:
        op_keys.check(program)
    except D.Unsupported:  # (in-place ops: decompose is run_decompositions itself)
        _same_as_torch(program, table, fast=False)
        return
    _same_as_torch(program, table)
