"""tracing.blocks: a repeated block traced once, the other members copies of its trace.

Every test compares the traced program whole with the one a full trace gives (each
member traced by torch.export): every node's name, op, arguments, module stack and value
layout, in order, the signature, the constants and the places of modules; and counts the
members that were copies (stand-ins), so that the comparison is not of two full traces.
The model matrix of test_families runs in the slow tier.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.tracing import blocks as B
from semiring_backprop.tracing import trace as T

pytestmark = pytest.mark.usefixtures("_offline_quiet")


def _traced(model, kwargs=None, args=(), output=None, reuse=True):
    """``(graph, stand-ins)``: the trace, with blocks traced once (``reuse``) or each in
    full, and how many members its program had as copies."""
    seen = {"stand_ins": 0}
    real = T.stitch

    def stitch(program, attempt):
        seen["stand_ins"] += len(attempt.stubs)
        return real(program, attempt)

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        mp.setattr(T, "stitch", stitch)
        if not reuse:
            mp.setattr(B, "find_groups", lambda model: [])
        graph = T.trace(model, args, kwargs, output, dynamic=False)
    return graph, seen["stand_ins"]


def _nodes(program):
    out = []
    for n in program.graph.nodes:
        v = n.meta.get("val")
        layout = None
        if isinstance(v, torch.Tensor):
            layout = (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.requires_grad)
        stack = list((n.meta.get("nn_module_stack") or {}).items())
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)
        out.append((n.name, n.op, str(n.target), repr(args), layout, stack))
    return out


def _same_as_full(model, kwargs=None, args=(), output=None):
    """The program with blocks traced once is the full trace's; returns the stand-ins."""
    got, stand_ins = _traced(model, kwargs, args, output)
    want, none = _traced(model, kwargs, args, output, reuse=False)
    assert none == 0
    a, b = got.program, want.program
    for i, (x, y) in enumerate(zip(_nodes(a), _nodes(b))):
        assert x == y, f"node {i}: blocks traced once {x}, in full {y}"
    assert len(a.graph.nodes) == len(b.graph.nodes)
    assert a.graph_signature == b.graph_signature
    assert sorted(a.constants) == sorted(b.constants)
    for key, value in a.constants.items():
        assert torch.equal(value, b.constants[key]), key
    assert a.module_call_graph == b.module_call_graph
    assert {k: n.name for k, n in got.tags.items()} == {k: n.name for k, n in want.tags.items()}
    return stand_ins


def _llama(layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                      max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_llama_each_layer_but_the_first_a_copy():
    """Its key / value cache (on by default) makes constants in every layer: made again
    for each copy, numbered and ordered as torch.export does."""
    model = _llama(layers=4)
    ids = torch.tensor([[3, 7, 1, 9, 4]])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    assert _same_as_full(model, kwargs, output=lambda out: out.logits[0, -1, 5]) == 3
    _, stand_ins = _traced(model, {**kwargs, "use_cache": False},
                           output=lambda out: out.logits[0, -1, 5])  # fmt: skip
    assert stand_ins == 3


def test_bert_and_gpt2():
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)  # fmt: skip
    bert = BertModel(cfg, add_pooling_layer=False).eval()
    emb = torch.randn(1, 6, 16)
    out = _same_as_full(bert, {"inputs_embeds": emb},
                        output=lambda o: o.last_hidden_state[0, -1, :3].sum())  # fmt: skip
    assert out == 2
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=3, n_head=2,
                                      n_positions=32)).eval()  # fmt: skip
    ids = torch.tensor([[3, 7, 1, 9]])
    assert _same_as_full(gpt2, {"input_ids": ids}, output=lambda o: o.logits[0, -1, 5]) == 2


def test_t5_first_block_differs():
    """T5's first block holds the relative position bias: it is traced in full, the
    second too (the first of the others), the rest are copies of the second's."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=4, num_heads=2,
                   relative_attention_num_buckets=8,
                   relative_attention_max_distance=16)  # fmt: skip
    torch.manual_seed(0)
    model = T5EncoderModel(cfg).eval()
    emb = torch.randn(1, 5, 16)
    kwargs = {"inputs_embeds": emb}
    assert _same_as_full(model, kwargs, output=lambda o: o.last_hidden_state[0, -1, 3]) == 2


class _Block(torch.nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale + x


class _Net(torch.nn.Module):
    def __init__(self, scales):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)  # (every block's input then requires grad)
        self.blocks = torch.nn.ModuleList([_Block(s) for s in scales])

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_a_member_that_computes_otherwise_is_traced_in_full():
    """Block 2 scales by 2: its record differs, so it is traced in full (a second
    template), and block 3 is a copy of block 0's trace; the gradient is autograd's."""
    torch.manual_seed(0)
    net = _Net([1.0, 1.0, 2.0, 1.0]).eval()
    x = torch.randn(2, 4)
    assert _same_as_full(net, args=(x,), output=lambda y: y[0, 1]) == 2
    r = sbp.backprop(net, (x,), output=lambda y: y[0, 1])
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(net(xg)[0, 1], xg)
    torch.testing.assert_close(r.at(0, sbp.Real()), grad)


def test_a_member_given_other_inputs_is_a_template_at_once():
    """Block 0's input requires no grad, the others' do: block 1 is traced in full as
    it comes (nothing of it ran yet), and no export is abandoned."""
    torch.manual_seed(0)
    net = _Net([1.0] * 4).eval()
    net.inp = torch.nn.Identity()
    attempts = []
    real = B.Attempt.__init__

    def count(self, *args):
        attempts.append(self)
        real(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(B.Attempt, "__init__", count)
        assert _same_as_full(net, args=(torch.randn(2, 4),), output=lambda y: y[0, 1]) == 2
    assert len(attempts) == 2  # (one each way)


_OFFSET = torch.tensor([0.5, -0.5, 1.0, 0.0])


class _Shifted(_Block):
    def forward(self, x):
        return self.lin(x) + _OFFSET  # a tensor of no block: the members are not compared


def test_a_block_reading_a_tensor_of_its_own_is_traced_in_full():
    torch.manual_seed(0)
    net = _Net([1.0] * 3).eval()
    net.blocks = torch.nn.ModuleList([_Shifted() for _ in range(3)])
    assert _same_as_full(net, args=(torch.randn(2, 4),), output=lambda y: y[0, 1]) == 0


def test_a_copy_read_where_only_a_full_trace_has_it():
    """The output reads the last layer's key cache, which a copy does not fill: the
    export fails with copies, and the model is traced again in full."""
    model = _llama(layers=3)
    ids = torch.tensor([[3, 7, 1, 9, 4]])
    out = _same_as_full(model, {"input_ids": ids},
                        output=lambda o: o.past_key_values.layers[-1].keys.sum())  # fmt: skip
    assert out == 0


class _Twice(_Net):
    def forward(self, x):
        return super().forward(super().forward(x))


def test_members_called_twice():
    """A member's second call is traced as it is (its marks are another call's)."""
    torch.manual_seed(0)
    net = _Twice([1.0] * 3).eval()
    assert _same_as_full(net, args=(torch.randn(2, 4),), output=lambda y: y[0, 1]) == 2


def test_another_thread_runs_the_model_as_it_is():
    """While an export's members are patched, a thread that is not the tracing one
    runs the model as it is, and leaves the groups as they were."""
    torch.manual_seed(0)
    net = _Net([1.0] * 3).eval()
    x = torch.randn(2, 4)
    want = net(x)
    attempt = B.Attempt(B.find_groups(net), lambda: 0)
    got = []
    with attempt.patched():
        thread = threading.Thread(target=lambda: got.append(net(x)))
        thread.start()
        thread.join()
    torch.testing.assert_close(got[0], want)
    assert not attempt.stubs and not any(g.off for g in attempt.groups)


def test_groups():
    """Members of one class and structure, none shared; the outermost lists only."""
    net = _Net([1.0] * 3)
    (g,) = B.find_groups(net)
    assert (g.path, g.paths) == ("blocks", ["blocks.0", "blocks.1", "blocks.2"])
    shared = _Block()
    net.blocks = torch.nn.ModuleList([shared, shared])
    assert B.find_groups(net) == []
    net.blocks = torch.nn.ModuleList([_Block(), torch.nn.Linear(4, 4)])
    assert B.find_groups(net) == []
    outer = torch.nn.Sequential(_Net([1.0] * 2), _Net([1.0] * 2))
    assert [g.path for g in B.find_groups(outer)] == [""]


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
    _same_as_full(model, kwargs, output=output)
