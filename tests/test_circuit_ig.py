"""Integrated-gradients steps for a circuit's seed (``ig_steps``) on a tiny two-layer
BERT, float64, random weights; the baseline is the word embeddings of another text.

Oracles:
- Captum's ``NeuronConductance`` (the conductance of one neuron, summed here over the
  input features and the site's neurons), with the same points and weights: every
  kind of site (a head's columns of the output projection's input, an MLP's output,
  the residual stream at a layer's input) and the edges into a head's query and the
  attention edges (the conductance of the head's query and value columns); Captum's
  ``IntegratedGradients`` for the token embeddings;
- Captum's ``LayerConductance``, which discretizes the same integral otherwise (first
  order in 1/N): its Richardson extrapolation from 64 and 128 steps agrees loosely;
- torch.autograd for one step at the baseline (gradient at x' times x - x');
- the model's own forward for completeness (F(x) - F(x')).
"""

from __future__ import annotations

import contextlib
import functools

import pandas as pd
import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.circuits.exports import ATTENTION_COLUMNS, EDGE_COLUMNS
from semiring_backprop.circuits.ig import METHODS, quadrature
from semiring_backprop.errors import InputError

T = pytest.importorskip("transformers")
captum_attr = pytest.importorskip("captum.attr")

F64 = torch.float64
IDS = torch.tensor([[3, 7, 1, 9, 4]])
BASE_IDS = torch.tensor([[3, 5, 2, 9, 4]])  # positions 1 and 2 differ
PLACE = "bert.embeddings.word_embeddings"
N = 6
HEAD = 4  # hidden 8, 2 heads


@functools.cache
def model():
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=16, max_position_embeddings=16,
                       attn_implementation="sdpa")  # fmt: skip
    return T.BertForMaskedLM(cfg).to(F64).eval()


def margin(out):
    logp = out.logits[0, 2].log_softmax(-1)
    return logp[7] - logp[9]


def per_example(e):
    """The explained scalar per example of a batch of embeddings (Captum's batches)."""
    logp = model()(inputs_embeds=e).logits[:, 2].log_softmax(-1)
    return logp[:, 7] - logp[:, 9]


def embeddings(ids):
    with torch.no_grad():
        return model().bert.embeddings.word_embeddings(ids)


def baseline():
    return {PLACE: embeddings(BASE_IDS)}


@functools.cache
def result():
    return sbp.backprop(model(), kwargs={"input_ids": IDS}, output=margin,
                        semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip


@functools.cache
def whole():
    """The circuit with edges, Real only, N Gauss-Legendre steps."""
    return sbp.circuit(model(), kwargs={"input_ids": IDS}, output=margin,
                       semirings=[sbp.Real()], baseline=baseline(), ig_steps=N)  # fmt: skip


def nodes_only(steps, method="gausslegendre", semirings=None):
    """Sites only (the edges given empty): from_result on the shared pass."""
    srs = list(semirings) if semirings is not None else [sbp.Real()]
    names = [s.name for s in srs]
    c = sbp.Circuit.from_result(
        result(), srs, baseline=baseline(), ig_steps=steps, ig_method=method,
        edges=pd.DataFrame(columns=[*EDGE_COLUMNS, *names]),
        attention_edges=pd.DataFrame(columns=[*ATTENTION_COLUMNS, *names]),
    )  # fmt: skip
    return c.nodes


@contextlib.contextmanager
def float64_default():
    """Captum makes its points (torch.linspace) and weights (torch.tensor) in the
    default dtype: float64 here, as ours are."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def neuron_conductance(layer, neurons, to_input, steps=N, method="gausslegendre"):
    """Captum's conductance of each neuron (position, column), summed over the input
    features and the neurons."""
    x, xb = embeddings(IDS), embeddings(BASE_IDS)
    total = 0.0
    with float64_default():
        nc = captum_attr.NeuronConductance(per_example, layer)
        for sel in neurons:
            got = nc.attribute(x, baselines=xb, neuron_selector=sel, n_steps=steps,
                               method=method, attribute_to_neuron_input=to_input)  # fmt: skip
            total += float(got.sum())
    return total


def site(frame, role, layer, position, head=None):
    rows = frame[(frame.role == role) & (frame.layer == layer) & (frame.position == position)]
    rows = rows[rows.head_index == head] if head is not None else rows
    assert len(rows) == 1
    return float(rows.Real.iloc[0])


def _layers():
    return model().bert.encoder.layer


# (role, layer, position, head) -> (Captum's layer, its input?, neurons)
SITES = {
    "head": (("head", 0, 2, 1), lambda: _layers()[0].attention.output.dense, True,
             [(2, j) for j in range(HEAD, 2 * HEAD)]),
    "head-last": (("head", 1, 2, 0), lambda: _layers()[1].attention.output.dense, True,
                  [(2, j) for j in range(HEAD)]),
    "mlp": (("mlp", 0, 1, None), lambda: _layers()[0].output.dense, False,
            [(1, j) for j in range(8)]),
    "mlp-last": (("mlp", 1, 2, None), lambda: _layers()[1].output.dense, False,
                 [(2, j) for j in range(8)]),
    # the residual stream at a layer's input: the tensor its query (and key, value,
    # skip) read; Captum's gradient is the tensor's, through all of its readers
    "residual": (("residual", 0, 1, None), lambda: _layers()[0].attention.self.query, True,
                 [(1, j) for j in range(8)]),
    "residual-last": (("residual", 1, 2, None), lambda: _layers()[1].attention.self.query,
                      True, [(2, j) for j in range(8)]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SITES))
def test_sites_equal_captum_neuron_conductance(name):
    (role, layer, pos, head), module, to_input, neurons = SITES[name]
    got = site(whole().nodes, role, layer, pos, head)
    want = neuron_conductance(module(), neurons, to_input)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-13)
    assert want != 0


@pytest.mark.parametrize("method,steps", [("riemann_middle", 3), ("riemann_right", 4)])
def test_other_methods_equal_captum(method, steps):
    (role, layer, pos, head), module, to_input, neurons = SITES["residual-last"]
    got = site(nodes_only(steps, method), role, layer, pos, head)
    want = neuron_conductance(module(), neurons, to_input, steps, method)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-13)


def test_trapezoid_is_captums_times_n_over_n_minus_1():
    """Captum's riemann_trapezoid weighs its points 1/n (ends halved): they sum to
    1 - 1/n; the trapezoid rule on their spacing is that times n / (n - 1)."""
    steps = 4
    (role, layer, pos, head), module, to_input, neurons = SITES["residual-last"]
    got = site(nodes_only(steps, "riemann_trapezoid"), role, layer, pos, head)
    want = neuron_conductance(module(), neurons, to_input, steps, "riemann_trapezoid")
    assert got == pytest.approx(want * steps / (steps - 1), rel=1e-9)


def test_quadrature_is_captums():
    from captum.attr._utils.approximation_methods import approximation_parameters

    for method in METHODS:
        for n in (2, 3, 7):
            with float64_default():
                sizes, alphas = (f(n) for f in approximation_parameters(method))
            points, weights = quadrature(n, method)
            assert points == pytest.approx(alphas, abs=1e-15)
            scale = n / (n - 1) if method == "riemann_trapezoid" else 1.0
            assert weights == pytest.approx([s * scale for s in sizes], abs=1e-15)
            assert sum(weights) == pytest.approx(1.0)


def test_embeddings_equal_captum_integrated_gradients():
    x, xb = embeddings(IDS), embeddings(BASE_IDS)
    with float64_default():
        attr = captum_attr.IntegratedGradients(per_example).attribute(
            x, baselines=xb, n_steps=N, method="gausslegendre")  # fmt: skip
    emb = whole().nodes[whole().nodes.role == "embedding"].sort_values("position")
    # (float64 sums of terms up to the output's size, 0.06: absolute error ~1e-13)
    assert emb.Real.tolist() == pytest.approx(attr[0].sum(-1).tolist(), rel=1e-9, abs=1e-11)
    assert emb.Real.iloc[1] != 0 and emb.Real.iloc[2] != 0


def test_edges_into_a_query_equal_its_conductance():
    """Every path into head (1, 0)'s query at position 2 leaves one last component
    before: the edges into it sum to the conductance of its query columns there."""
    e = whole().edges
    into = e[(e.dst_role == "head") & (e.dst_layer == 1) & (e.dst_head_index == 0)
             & (e.input == "q") & (e.position == 2)]  # fmt: skip
    want = neuron_conductance(_layers()[1].attention.self.query, [(2, j) for j in range(HEAD)],
                              False)  # fmt: skip
    assert len(into) >= 3  # the embedding, heads and MLP of layer 0
    assert into.Real.sum() == pytest.approx(want, rel=1e-9)


def test_attention_edges_equal_the_value_conductance():
    a = whole().attention_edges
    head = a[(a.layer == 1) & (a.head_index == 0)]
    neurons = [(p, j) for p in range(IDS.shape[1]) for j in range(HEAD)]
    want = neuron_conductance(_layers()[1].attention.self.value, neurons, False)
    assert len(head) == IDS.shape[1] ** 2
    assert head.Real.sum() == pytest.approx(want, rel=1e-9)


def test_layer_conductance_agrees_as_steps_grow():
    """Captum's LayerConductance sums the layer's activation differences between n + 1
    points times the gradient at the first of each pair: first order in 1/n, so its
    Richardson extrapolation 2 L(2n) - L(n) is taken (n = 64); it agrees with the
    integral (ours, converged at N = 6 Gauss-Legendre points) to 2e-4 relative."""
    x, xb = embeddings(IDS), embeddings(BASE_IDS)
    for name in ("head", "mlp-last", "residual-last"):
        (role, layer, pos, head), module, to_input, neurons = SITES[name]
        got = site(whole().nodes, role, layer, pos, head)
        lc = captum_attr.LayerConductance(per_example, module())
        sums = []
        with float64_default():
            for n in (64, 128):
                attr = lc.attribute(x, baselines=xb, n_steps=n, method="riemann_trapezoid",
                                    attribute_to_layer_input=to_input)  # fmt: skip
                sums.append(sum(float(attr[0][p, j].detach()) for p, j in neurons))
        assert 2 * sums[1] - sums[0] == pytest.approx(got, rel=2e-4), name


def test_one_step_at_the_baseline_is_gradient_times_difference():
    nodes = nodes_only(1, "riemann_left")
    x, xb = embeddings(IDS), embeddings(BASE_IDS)
    e = xb.clone().requires_grad_()
    (grad,) = torch.autograd.grad(per_example(e).sum(), e)
    want = (grad * (x - xb))[0].sum(-1)
    emb = nodes[nodes.role == "embedding"].sort_values("position")
    assert emb.Real.tolist() == pytest.approx(want.tolist(), rel=1e-10, abs=1e-15)
    target = nodes[nodes.role == "target"].Real.item()
    assert target == pytest.approx(float(want.sum()), rel=1e-10)


def test_one_step_at_the_input_is_no_steps():
    """riemann_right with one step runs the pass at x itself: the seed x - x' there, as
    ig_steps=0 (the circuit of the pass itself, not run again)."""
    one = nodes_only(1, "riemann_right")
    none = sbp.Circuit.from_result(result(), [sbp.Real()], baseline=baseline(),
                                   edges=pd.DataFrame(columns=[*EDGE_COLUMNS, "Real"]),
                                   attention_edges=pd.DataFrame(
                                       columns=[*ATTENTION_COLUMNS, "Real"])).nodes  # fmt: skip
    assert one.node.tolist() == none.node.tolist()
    assert one.Real.tolist() == pytest.approx(none.Real.tolist(), rel=1e-10, abs=1e-15)


def test_completeness():
    """Every cut sums to the embeddings' total at any N (exactly: each step's does);
    that total tends to F(x) - F(x') as N grows (integrated gradients' completeness):
    here within 1e-2 relative at 2 Gauss-Legendre points, 1e-5 at 4, 1e-9 at 8."""
    with torch.no_grad():
        delta = float(per_example(embeddings(IDS)) - per_example(embeddings(BASE_IDS)))
    for steps, tol in ((2, 1e-2), (4, 1e-5), (8, 1e-9)):
        nodes = nodes_only(steps)
        target = nodes[nodes.role == "target"].Real.item()
        for role, layer in (("embedding", -1), ("residual", 0), ("residual", 1)):
            cut = nodes[(nodes.role == role) & (nodes.layer == layer)].Real.sum()
            assert cut == pytest.approx(target, rel=1e-10), (steps, role, layer)
        assert target == pytest.approx(delta, rel=tol), steps


def test_other_semirings_stay_at_the_input():
    """Only Real is integrated: MaxProduct is read at x with the seed x - x', as with
    ig_steps=0, and the frame's notes say so."""
    srs = (sbp.Real(), sbp.MaxProduct())
    steps = nodes_only(2, semirings=srs)
    none = sbp.Circuit.from_result(result(), list(srs), baseline=baseline(),
                                   edges=pd.DataFrame(columns=[*EDGE_COLUMNS, "Real",
                                                               srs[1].name]),
                                   attention_edges=pd.DataFrame(
                                       columns=[*ATTENTION_COLUMNS, "Real", srs[1].name])
                                   ).nodes  # fmt: skip
    name = srs[1].name
    assert steps[name].tolist() == none[name].tolist()
    assert steps.Real.tolist() != pytest.approx(none.Real.tolist(), rel=1e-6)
    notes = steps.attrs["notes"]
    assert "at the input" in notes[name] and "conductance" in notes["Real"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"ig_steps": 4}, "needs a baseline"),
        ({"ig_steps": -1, "baseline": "b"}, "whole number"),
        ({"ig_steps": 2.0, "baseline": "b"}, "whole number"),
        ({"ig_steps": True, "baseline": "b"}, "whole number"),
        ({"ig_steps": 4, "baseline": "b", "ig_method": "simpson"}, "Captum's names"),
        ({"ig_steps": 1, "baseline": "b", "ig_method": "riemann_trapezoid"}, ">= 2"),
        ({"ig_steps": 4, "baseline": "b", "seed": "structural"}, "use seed='x'"),
    ],
)  # fmt: skip
def test_refusals_before_the_pass(kwargs, message):
    if kwargs.get("baseline") == "b":
        kwargs = {**kwargs, "baseline": baseline()}
    with pytest.raises(InputError, match=message):
        sbp.circuit(object(), kwargs={"input_ids": IDS}, output=margin, **kwargs)


def test_refusal_without_real():
    with pytest.raises(InputError, match="add sbp.Real"):
        sbp.Circuit.from_result(result(), [sbp.MaxProduct()], baseline=baseline(), ig_steps=2)


def test_refusal_of_a_pass_that_kept_few_values():
    res = sbp.backprop(model(), kwargs={"input_ids": IDS}, output=margin,
                       semirings=[sbp.Real()], keep=[PLACE])  # fmt: skip
    with pytest.raises(InputError, match="keep=None"):
        sbp.Circuit.from_result(res, baseline=baseline(), ig_steps=2)
