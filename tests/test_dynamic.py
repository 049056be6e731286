"""``Backprop(dynamic=True)``: one symbolic-size trace serves inputs of other lengths; by
default the first trace is for exact shapes and the first other length traces symbolically.

Oracles: ``torch.autograd`` for the gradient (float64), and a static, per-shape trace
(``dynamic=False`` / a fresh ``sbp.backprop``) for the other semirings' readouts. Models
are tiny random Hugging Face models in float64 (nothing is downloaded).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop.errors import SemiringBackpropError

transformers = pytest.importorskip("transformers")

F64 = torch.float64
VOCAB, HIDDEN, MAX_POS = 50, 16, 32
SEMIRINGS = [sbp.Real(), sbp.MaxProduct(), sbp.Entropy()]
LENGTHS = (6, 3, 9, 2)  # traced at the first; every later one must reuse that graph
FRESH = 9  # also run through a fresh static trace


def output(out):
    """log p(token 3) at the last position (the negative index follows the length)."""
    return out.logits[0, -1].log_softmax(-1)[3]


def _config(name):
    common = dict(vocab_size=VOCAB, attn_implementation="eager")
    if name == "bert":
        return transformers.BertConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=MAX_POS,
            **common,
        )
    if name == "gpt2":
        return transformers.GPT2Config(
            n_embd=HIDDEN,
            n_layer=2,
            n_head=2,
            n_positions=MAX_POS,
            bos_token_id=0,
            eos_token_id=0,
            **common,
        )
    return transformers.LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=MAX_POS,
        **common,
    )


CLASSES = {"bert": "BertForMaskedLM", "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


@functools.cache
def hf_model(name):
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[name])(_config(name))
    return model.to(F64).eval()


def _autograd_rtol(name):
    # Llama's eager attention runs its softmax in float32 (autograd rounds through it)
    return 1e-6 if name == "llama" else 1e-10


def assert_grad_close(got, want, rtol=1e-10):
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale)


def assert_same_readouts(got, want, where, rtol=1e-9):
    """Real, MaxProduct (hi, lo) and Entropy (entropy, log Z) readouts at ``where`` agree.
    (MaxProduct's back-pointers name nodes of each graph, so they are not compared.)"""
    pairs = [
        (got.at(where, sbp.Real()), want.at(where, sbp.Real())),
        (got.at(where, sbp.MaxProduct()).hi, want.at(where, sbp.MaxProduct()).hi),
        (got.at(where, sbp.MaxProduct()).lo, want.at(where, sbp.MaxProduct()).lo),
        (got.at(where, sbp.Entropy()).entropy, want.at(where, sbp.Entropy()).entropy),
        (got.at(where, sbp.Entropy()).log_z, want.at(where, sbp.Entropy()).log_z),
    ]
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)


def autograd_wrt_embeds(model, embeds, fn=output):
    leaf = embeds.clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(model(inputs_embeds=leaf)), leaf)
    return g


def _embeds(length, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, length, HIDDEN, generator=gen, dtype=F64)


@functools.cache
def _runs(name):
    """A dynamic ``Backprop`` of one model called at every length, and a fresh one-shot
    ``sbp.backprop`` (static trace) at one length it did not trace."""
    model = hf_model(name)
    dyn = sbp.Backprop(model, output, SEMIRINGS, dynamic=True)
    inputs, dyn_res, traces = {}, {}, []
    for i, length in enumerate(LENGTHS):
        inputs[length] = _embeds(length, seed=100 + i)
        dyn_res[length] = dyn(kwargs={"inputs_embeds": inputs[length]})
        traces.append(dyn.traces)
    fresh = sbp.backprop(
        model, kwargs={"inputs_embeds": inputs[FRESH]}, output=output, semirings=SEMIRINGS
    )
    return {
        "name": name,
        "model": model,
        "dyn": dyn,
        "inputs": inputs,
        "dyn_res": dyn_res,
        "traces": traces,
        "fresh": fresh,
    }


@pytest.fixture(params=["bert", "gpt2", "llama"])
def runs(request):
    return _runs(request.param)


# -- 1. one trace, every length exact ---------------------------------------------------


def _only_graph(results):
    graphs = [res.graph for res in results]
    assert all(g is graphs[0] for g in graphs)
    return graphs[0]


def test_one_trace_serves_every_length(runs):
    assert runs["traces"] == [1] * len(LENGTHS)
    graph = _only_graph(runs["dyn_res"].values())
    # the sequence length is a symbol; batch (1) and hidden size are fixed
    batch, seq, hidden = graph.input_shapes["shapes"]["inputs_embeds"]
    assert (batch, hidden) == (1, HIDDEN)
    assert isinstance(seq, str)
    low, _ = graph.input_shapes["ranges"][seq]
    assert low <= min(LENGTHS)
    for length in LENGTHS:
        assert graph.accepts({"inputs_embeds": runs["inputs"][length]})


def test_dynamic_gradient_equals_autograd_at_every_length(runs):
    model, rtol = runs["model"], _autograd_rtol(runs["name"])
    for length, res in runs["dyn_res"].items():
        embeds = runs["inputs"][length]
        got = res.at("inputs_embeds", sbp.Real())
        assert got.shape == embeds.shape
        assert_grad_close(got, autograd_wrt_embeds(model, embeds), rtol=rtol)


def test_dynamic_readouts_equal_a_fresh_one_shot_backprop(runs):
    """Real, MaxProduct and Entropy at the inputs: the values of a graph traced for
    exactly that shape (``sbp.backprop``: static trace, no cache)."""
    res, fresh = runs["dyn_res"][FRESH], runs["fresh"]
    assert fresh.graph is not res.graph
    assert fresh.graph.input_shapes["shapes"]["inputs_embeds"] == (1, FRESH, HIDDEN)
    assert_same_readouts(res, fresh, "inputs_embeds")
    agg, want = (r.aggregate("inputs_embeds", sbp.MaxProduct()).hi for r in (res, fresh))
    assert agg.shape == (1, FRESH)
    torch.testing.assert_close(agg, want, rtol=1e-9, atol=1e-12)
    for length, r in runs["dyn_res"].items():
        ent = r.at("inputs_embeds", sbp.Entropy()).entropy
        assert ent.shape == (1, length, HIDDEN)
        assert bool(torch.isfinite(ent).all()) and bool((ent >= -1e-9).all())
        mp = r.at("inputs_embeds", sbp.MaxProduct())
        assert bool((mp.hi >= mp.lo).all())


def _word_embedding_grad(model, kwargs):
    """Autograd gradient at the output of the word-embedding module."""
    kept = {}

    def hook(mod, args, out):
        out.retain_grad()
        kept["out"] = out

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        with torch.enable_grad():
            output(model(**kwargs)).backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return kept["out"].grad


WORD_EMB = "bert.embeddings.word_embeddings"


def _ids_mask(n_ids, n_mask=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(1, n_ids if n_mask is None else n_mask, dtype=torch.long)
    mask[0, 1] = 0  # a masked-out key
    return {"input_ids": torch.randint(1, VOCAB, (1, n_ids), generator=gen), "attention_mask": mask}


@pytest.fixture(scope="module")
def bert_ids():
    """A dynamic ``Backprop`` of BERT on ``input_ids`` + ``attention_mask``, traced at 5."""
    model = hf_model("bert")
    assert dict(model.named_modules())[WORD_EMB] is model.get_input_embeddings()
    bp = sbp.Backprop(model, output, [sbp.Real()], dynamic=True)
    first = bp(kwargs=_ids_mask(5, seed=1))
    return model, bp, first


def test_bert_input_ids_and_mask_one_trace(bert_ids):
    model, bp, first = bert_ids
    for length, seed in ((5, 1), (8, 2), (5, 3)):
        kwargs = _ids_mask(length, seed=seed)
        res = bp(kwargs=kwargs)
        assert bp.traces == 1
        assert res.graph is first.graph
        got = res.at(WORD_EMB, sbp.Real())
        assert got.shape == (1, length, HIDDEN)
        assert_grad_close(got, _word_embedding_grad(model, kwargs))
    # ids and mask share one symbol in the graph
    shapes = first.graph.input_shapes["shapes"]
    assert shapes["input_ids"] == shapes["attention_mask"]
    assert isinstance(shapes["input_ids"][1], str)


# -- 2. a length of 1 is specialized -------------------------------------------------------


def test_length_one_traces_again_once():
    """A size-1 dim is specialized by torch.export: length 1 gets its own graph, once."""
    runs = _runs("gpt2")
    model, bp = runs["model"], runs["dyn"]
    first = _only_graph(runs["dyn_res"].values())
    assert bp.traces == 1  # traced at length 6 (and reused for 3, 9, 2)
    one = _embeds(1, seed=2)
    assert not first.accepts({"inputs_embeds": one})

    res = bp(kwargs={"inputs_embeds": one})
    assert bp.traces == 2
    assert res.graph is not first
    assert res.graph.input_shapes["shapes"]["inputs_embeds"] == (1, 1, HIDDEN)
    assert_grad_close(res.at("inputs_embeds", sbp.Real()), autograd_wrt_embeds(model, one))

    other_one = _embeds(1, seed=3)
    again = bp(kwargs={"inputs_embeds": other_one})
    assert bp.traces == 2
    assert again.graph is res.graph
    want = autograd_wrt_embeds(model, other_one)
    assert_grad_close(again.at("inputs_embeds", sbp.Real()), want)
    # longer inputs still go to the first graph
    seven = _embeds(7, seed=4)
    back = bp(kwargs={"inputs_embeds": seven})
    assert bp.traces == 2
    assert back.graph is first
    assert_grad_close(back.at("inputs_embeds", sbp.Real()), autograd_wrt_embeds(model, seven))


# -- 3. batch dimension ------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))


def test_batch_size_varies_in_one_trace():
    mlp = _mlp().to(F64).eval()
    out = lambda y: y.sum()  # noqa: E731
    bp = sbp.Backprop(mlp, out, [sbp.Real(), sbp.MaxProduct()], dynamic=True)
    for batch in (3, 7, 2):
        x = torch.randn(batch, 4, dtype=F64)
        res = bp((x,))
        assert bp.traces == 1
        leaf = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(out(mlp(leaf)), leaf)
        assert_grad_close(res.at(0, sbp.Real()), want)
        mp = res.at(0, sbp.MaxProduct())
        assert mp.hi.shape == (batch, 4)
        assert bool((mp.hi >= mp.lo).all())
    graph = res.graph
    shape = graph.input_shapes["shapes"][0]
    assert isinstance(shape[0], str) and shape[1] == 4
    # a batch of 1 is specialized: traced again, once
    for _ in range(2):
        x = torch.randn(1, 4, dtype=F64)
        res = bp((x,))
        assert bp.traces == 2 and res.graph is not graph
        leaf = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(out(mlp(leaf)), leaf)
        assert_grad_close(res.at(0, sbp.Real()), want)
    assert bp((torch.randn(5, 4, dtype=F64),)).graph is graph


def test_batch_size_varies_per_example_output():
    mlp = _mlp().to(F64).eval()
    out = lambda y: y[:, 0]  # noqa: E731
    bp = sbp.Backprop(mlp, out, [sbp.Real()], per_example=True, dynamic=True)
    for batch in (3, 7):
        x = torch.randn(batch, 4, dtype=F64)
        res = bp((x,))
        leaf = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(out(mlp(leaf)).sum(), leaf)
        assert_grad_close(res.at(0, sbp.Real()), want)
    assert bp.traces == 1


# -- 4. what a graph accepts, and what happens to the rest --------------------------------


def test_accepts_rejects_other_hidden_size_rank_and_range():
    runs = _runs("bert")
    graph = _only_graph(runs["dyn_res"].values())
    assert graph.accepts({"inputs_embeds": _embeds(12, seed=5)})
    assert not graph.accepts({"inputs_embeds": torch.randn(1, 6, HIDDEN + 1, dtype=F64)})
    assert not graph.accepts({"inputs_embeds": torch.randn(6, HIDDEN, dtype=F64)})
    assert not graph.accepts({"inputs_embeds": torch.randn(1, 1, 6, HIDDEN, dtype=F64)})
    assert not graph.accepts({"inputs_embeds": torch.randn(2, 6, HIDDEN, dtype=F64)})
    assert not graph.accepts({"inputs_embeds": _embeds(1, seed=6)})  # specialized
    assert not graph.accepts({})  # a missing input
    # BERT's position table bounds the length: beyond it the graph does not apply
    _, seq, _ = graph.input_shapes["shapes"]["inputs_embeds"]
    assert graph.input_shapes["ranges"][seq][1] == MAX_POS
    assert graph.accepts({"inputs_embeds": _embeds(MAX_POS, seed=7)})
    assert not graph.accepts({"inputs_embeds": _embeds(MAX_POS + 1, seed=8)})


def test_accepts_rejects_inconsistent_lengths_and_the_call_fails_clearly(bert_ids):
    model, bp, first = bert_ids
    graph = first.graph
    assert graph.accepts(_ids_mask(6))
    assert not graph.accepts(_ids_mask(5, 6))
    assert not graph.accepts(_ids_mask(6, 5))
    assert not graph.accepts({"input_ids": _ids_mask(5)["input_ids"]})
    traces = bp.traces
    # a mismatched mask is traced again, which fails with the library's error (never a
    # silent answer from the graph traced for equal lengths)
    with pytest.raises(SemiringBackpropError, match="could not trace"):
        bp(kwargs=_ids_mask(5, 6))
    assert bp.traces == traces
    # a hidden size the model cannot take: the same
    with pytest.raises(SemiringBackpropError, match="could not trace"):
        bp(kwargs={"inputs_embeds": torch.randn(1, 5, HIDDEN + 1, dtype=F64)})
    assert bp.traces == traces
    # the explainer still works afterwards, on its one graph
    kwargs = _ids_mask(7, seed=4)
    res = bp(kwargs=kwargs)
    assert bp.traces == traces and res.graph is graph
    assert_grad_close(res.at(WORD_EMB, sbp.Real()), _word_embedding_grad(model, kwargs))


def test_fixed_index_past_a_shorter_input_fails_clearly():
    """``y[0, 4]`` is a constant index: shorter inputs are outside the graph's range, and
    tracing them fails as the model does (no value is read past the end)."""
    mlp = _mlp().to(F64).eval()
    fixed = lambda y: y[0, 4].sum()  # noqa: E731
    bp = sbp.Backprop(mlp, fixed, [sbp.Real()], dynamic=True)
    res = bp((torch.randn(1, 6, 4, dtype=F64),))
    short = torch.randn(1, 3, 4, dtype=F64)
    assert not res.graph.accepts({0: short})
    assert res.graph.accepts({0: torch.randn(1, 5, 4, dtype=F64)})
    with pytest.raises(SemiringBackpropError, match="could not trace"):
        bp((short,))
    x = torch.randn(1, 8, 4, dtype=F64)
    res = bp((x,))
    assert bp.traces == 1
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(fixed(mlp(leaf)), leaf)
    assert_grad_close(res.at(0, sbp.Real()), want)
    assert res.at(0, sbp.Real())[0, 4].any()
    assert not res.at(0, sbp.Real())[0, 5:].any()


class _ShapeBranch(nn.Module):
    """Python control flow on the length: torch.export guards on it."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        n = x.shape[1]
        take = n % 2 == 0 if self.kind == "even" else n != 5
        return y * 2 if take else y * 3


@pytest.mark.parametrize("kind", ["even", "not_five"])
def test_shape_dependent_branch_is_not_reused_for_the_other_branch(kind):
    torch.manual_seed(0)
    model = _ShapeBranch(kind).to(F64).eval()
    out = lambda y: y.sum()  # noqa: E731
    bp = sbp.Backprop(model, out, [sbp.Real()], dynamic=True)
    bp((torch.randn(1, 6, 4, dtype=F64),))
    x = torch.randn(1, 5, 4, dtype=F64)  # takes the other branch
    res = bp((x,))
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(out(model(leaf)), leaf)
    assert_grad_close(res.at(0, sbp.Real()), want)


@pytest.mark.parametrize(
    ("first_shared", "dynamic"),
    [(True, True), (False, True), (True, False)],
    ids=["shared-then-distinct", "distinct-then-shared", "shared-then-distinct-static"],
)
def test_reuse_respects_which_inputs_are_one_tensor(first_shared, dynamic):
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(HIDDEN, 2, batch_first=True).to(F64).eval()
    out = lambda y: y[0][1, 2, 3]  # noqa: E731
    bp = sbp.Backprop(mha, out, [sbp.Real()], dynamic=dynamic)
    x = torch.randn(2, 5, HIDDEN, dtype=F64)
    qkv = tuple(torch.randn(2, 5, HIDDEN, dtype=F64) for _ in range(3))
    bp((x, x, x) if first_shared else qkv)
    if first_shared:
        res = bp(qkv)
        leaves = [t.clone().requires_grad_() for t in qkv]
        wants = torch.autograd.grad(out(mha(*leaves)), leaves)
    else:
        res = bp((x, x, x))
        leaf = x.clone().requires_grad_()
        wants = torch.autograd.grad(out(mha(leaf, leaf, leaf)), leaf) * 3
    for i, want in enumerate(wants):
        assert_grad_close(res.at(i, sbp.Real()), want)


# -- 5. dynamic=False -------------------------------------------------------------------


def test_static_traces_once_per_length_and_agrees():
    runs = _runs("gpt2")
    static = sbp.Backprop(runs["model"], output, SEMIRINGS, dynamic=False)
    lengths = (3, 9, 3)
    graphs = {}
    for length in lengths:
        res = static(kwargs={"inputs_embeds": runs["inputs"][length]})
        graph = graphs.setdefault(length, res.graph)
        assert res.graph is graph  # a length seen before is not traced again
        assert graph.input_shapes["shapes"]["inputs_embeds"] == (1, length, HIDDEN)
        assert graph.input_shapes["ranges"] == {}
        assert not graph.accepts({"inputs_embeds": _embeds(length + 1, seed=13)})
        # the same answers as the dynamic graph
        assert_same_readouts(res, runs["dyn_res"][length], "inputs_embeds")
    assert static.traces == len(set(lengths))


def test_static_mlp_retraces_per_batch_size():
    mlp = _mlp().to(F64).eval()
    out = lambda y: y.sum()  # noqa: E731
    static = sbp.Backprop(mlp, out, [sbp.Real()], dynamic=False)
    dyn = sbp.Backprop(mlp, out, [sbp.Real()], dynamic=True)
    batches = (3, 7, 3, 2)
    for batch in batches:
        x = torch.randn(batch, 4, dtype=F64)
        a, b = static((x,)), dyn((x,))
        assert_grad_close(a.at(0, sbp.Real()), b.at(0, sbp.Real()), rtol=1e-12)
    assert static.traces == len(set(batches))
    assert dyn.traces == 1


# -- 6. top paths on a reused graph ------------------------------------------------------


def test_top_path_value_is_the_maxproduct_maximum():
    runs = _runs("gpt2")
    for length in (6, 3, 9):
        res = runs["dyn_res"][length]
        path = res.top_path("inputs_embeds")
        hi = res.at("inputs_embeds", sbp.MaxProduct()).hi
        assert math.isfinite(path.value)
        assert path.value == pytest.approx(float(hi.max()), rel=1e-9, abs=1e-15)
        # the path starts at the best element of this input (this length's shape)
        index = tuple(path.source.index)
        assert len(index) == 3 and index[1] < length
        assert float(hi[index]) == pytest.approx(path.value, rel=1e-9, abs=1e-15)
        # its edge weights multiply to its value
        assert path.steps[-1].running == pytest.approx(path.value, rel=1e-9, abs=1e-15)
    # a graph traced for exactly this shape finds the same path value
    fresh_path = runs["fresh"].top_path("inputs_embeds")
    assert fresh_path.value == pytest.approx(
        runs["dyn_res"][FRESH].top_path("inputs_embeds").value, rel=1e-9, abs=1e-15
    )


# -- 6. the default: exact shapes first, symbolic once the sizes vary --------------------


def test_default_traces_exact_shapes_first_then_symbolic_sizes_once():
    """The first call traces for its exact shapes; the first call of another length
    traces once with symbolic sizes, which serves every later length. Each call's
    gradient is autograd's."""
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)
    out = lambda y: y.sum()  # noqa: E731
    bp = sbp.Backprop(mlp, out, [sbp.Real()])
    torch.manual_seed(0)
    xs = {n: torch.randn(n, 4, dtype=F64) for n in (3, 7, 2, 11)}
    first = bp.graph((xs[3],))
    traces = []
    for x in (xs[3], xs[7], xs[2], xs[3], xs[11]):
        res = bp((x,))
        traces.append(bp.traces)
        x_ = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(out(mlp(x_)), x_)
        torch.testing.assert_close(res.at(0, sbp.Real()), grad, rtol=1e-12, atol=1e-12)
    assert traces == [1, 2, 2, 2, 2]
    symbolic = bp.graph((xs[7],))
    assert symbolic is not first and bp.graph((xs[11],)) is symbolic
    assert bp.graph((xs[3],)) is first  # its own shapes still find the first graph
    assert bp.traces == 2
