"""Bad inputs: each raises one of our exceptions, naming what was wrong and the fix."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop import rules
from semiring_backprop.rules import registry

aten = torch.ops.aten
F64 = torch.float64


def x34():
    return torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0))


def total(y):
    return y.sum()


class Net(nn.Module):
    """``lin`` then ``block = Sequential(Tanh, inner)``: errors inside ``inner`` must name
    ``block.1``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Tanh(), inner)
        self.to(F64).eval()

    def forward(self, x):
        return self.block(self.lin(x))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def raises(exc, *needles):
    """``pytest.raises`` that also requires every needle (a literal) in the message."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(exc)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *a):
            out = self.ctx.__exit__(*a)
            msg = str(self.info.value)
            missing = [n for n in needles if n not in msg]
            assert not missing, f"message lacks {missing}: {msg}"
            assert isinstance(self.info.value, sbp.SemiringBackpropError)
            return out

    return _Check()


# -- ops without a rule ----------------------------------------------------------------


def test_unsupported_op_names_op_node_module_and_how_to_register():
    model = Net(Lambda(lambda h: h.cumprod(-1)))
    with raises(sbp.UnsupportedOpError, "aten.cumprod.default", "`cumprod`", "`block.1`",
                "register"):  # fmt: skip
        sbp.backprop(model, args=(x34(),), output=total)


def test_registering_the_missing_rule_as_the_message_says_fixes_it():
    op = aten.cumsum.default  # its own rule is set aside: the test writes one
    builtin = registry._RULES.pop(op)
    assert op not in rules.registered()
    with raises(sbp.UnsupportedOpError, "aten.cumsum.default", "register"):
        sbp.backprop(lambda t: t.cumsum(-1) * t, args=(x34(),), output=total)

    def cumsum_rule(sr, g, op_, x, dim, **kwargs):
        # D(x)[..., i] = ⊕_{j >= i} g[..., j]: a contraction with an upper-triangular mask
        n = x.shape[dim]
        w = torch.ones(n, n, dtype=x.dtype).triu().T  # [j, i] = 1 where j >= i
        g = tuple(f.movedim(dim, -1) for f in g)
        return [tuple(f.movedim(-1, dim) for f in sr.matmul(g, w))]

    try:
        sbp.register(op, "contraction")(cumsum_rule)
        assert sbp.supported_ops()[str(op)] == "contraction"
        x = x34()
        res = sbp.backprop(lambda t: t.cumsum(-1) * t, args=(x,), output=total)
        leaf = x.clone().requires_grad_()
        (want,) = torch.autograd.grad((leaf.cumsum(-1) * leaf).sum(), leaf)
        torch.testing.assert_close(res.at(0, sbp.Real()), want)
    finally:
        registry._RULES[op] = builtin


def test_complex_intermediate_is_unsupported_not_a_missing_path():
    """An FFT makes complex values: paths through them must not silently vanish."""
    with raises(sbp.UnsupportedOpError, "complex", "_fft_r2c"):
        sbp.backprop(lambda x: torch.fft.rfft(x).abs(), args=(x34(),), output=total)


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda x: torch.linalg.qr(x)[0].sum() + x, "aten.linalg_qr.default"),
        (lambda x: torch.frexp(x).mantissa + x, "aten.frexp.Tensor"),
    ],
    ids=["qr", "frexp"],
)
def test_multi_output_op_is_unsupported_not_a_missing_path(fn, op):
    """``values, indices = op(x)``: the values must not silently lose their paths."""
    with raises(sbp.UnsupportedOpError, op, "several tensors"):
        sbp.backprop(fn, args=(x34(),), output=total)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.sort(-1).values + x,
        lambda x: x.topk(2, 0).values.sum() * x,
        lambda x: nn.functional.max_pool1d(x[None], 2)[0].sum() * x,
    ],
    ids=["sort", "topk", "max_pool"],
)
def test_selections_read_their_values_back_at_their_indices(fn):
    """Sort, topk and max pooling give values with edges to the selected elements."""
    x = x34()
    res = sbp.backprop(fn, args=(x,), output=total)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(total(fn(leaf)), leaf)
    torch.testing.assert_close(res.at(0, sbp.Real()), want)


def test_model_that_writes_into_its_input_is_explained_as_it_ran():
    """torch.export returns a mutated input as an extra output: not the user's output."""

    def fn(t):
        t[:, :2].mul_(2)
        return t.tanh()

    x = x34()
    before = x.clone()
    res = sbp.backprop(fn, args=(x,), output=total)
    assert torch.equal(x, before)  # the pass ran on the traced graph, not on x
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(total(fn(leaf.clone())), leaf)
    torch.testing.assert_close(res.at(0, sbp.Real()), want)


def test_multi_output_op_used_only_for_indices_is_fine():
    fn = lambda x: x.gather(-1, x.sort(-1).indices) * 2  # noqa: E731
    res = sbp.backprop(fn, args=(x34(),), output=total)
    torch.testing.assert_close(res.at(0, sbp.Real()), torch.full((3, 4), 2.0, dtype=F64))


def test_duplicate_rule_registration_raises_and_registers_nothing():
    with raises(sbp.SemiringBackpropError, "aten.mm.default", "already registered"):
        sbp.register(aten.mm.default, "contraction")(lambda *a: None)
    # all or nothing: a list with one taken overload registers none of them
    with raises(sbp.SemiringBackpropError, "already registered"):
        sbp.register([aten.cumprod.default, aten.mm.default], "contraction")(lambda *a: None)
    assert aten.cumprod.default not in rules.registered()
    assert rules.registered()[aten.mm.default].fn.__name__ == "_mm"


def test_unknown_rule_kind():
    with raises(sbp.InputError, "'magic'", "pointwise", "routing"):
        sbp.register(aten.cumprod.default, "magic")


# -- the output -----------------------------------------------------------------------------


def test_output_not_a_scalar():
    with raises(sbp.InputError, "(3, 4)", "scalar", "out.sum()", "per_example=True"):
        sbp.backprop(torch.tanh, args=(x34(),), output=lambda y: y)


def test_per_example_output_needs_the_flag():
    with raises(sbp.InputError, "(3,)", "per_example=True"):
        sbp.backprop(torch.tanh, args=(x34(),), output=lambda y: y.sum(-1))


def test_output_not_a_tensor():
    with raises(sbp.InputError, "must return a tensor", "float", "output=lambda out"):
        sbp.backprop(torch.tanh, args=(x34(),), output=lambda y: 3.0)


def test_output_is_a_tuple():
    mha = nn.MultiheadAttention(4, 2).to(F64).eval()
    x = x34()[:, None]
    with raises(sbp.InputError, "2 tensors", "output=lambda out"):
        sbp.backprop(mha, args=(x, x, x))


def test_output_not_float():
    with raises(sbp.InputError, "torch.int64", "float"):
        sbp.backprop(lambda x: x.argmax(), args=(x34(),))


def test_output_that_depends_on_no_input():
    with raises(sbp.InputError, "does not depend on any float input"):
        sbp.backprop(lambda x: torch.ones(3, dtype=F64).sum(), args=(x34(),))


def test_at_an_input_that_does_not_reach_the_output():
    res = sbp.backprop(lambda x, y: (x * 2).sum(), args=(x34(), x34()), output=lambda s: s)
    res.at(0, sbp.Real())
    with raises(sbp.InputError, "1", "does not depend on"):
        res.at(1, sbp.Real())


# -- the model ----------------------------------------------------------------------------


def test_training_mode_is_refused_unless_allowed():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).to(F64)
    with raises(sbp.TrainingModeError, "training mode", "model.eval()", "allow_training=True"):
        sbp.backprop(model, args=(x34(),), output=total)
    # explained as it ran: with the one random dropout mask drawn in the forward pass
    res = sbp.backprop(model, args=(x34(),), output=total, allow_training=True)
    (keep,) = [v for n, v in res.values.items() if getattr(n, "target", None) == aten.ge.Scalar]
    want = (keep.to(F64) * 2.0) @ model[0].weight.detach()
    torch.testing.assert_close(res.at(0, sbp.Real()), want)


def test_nan_in_the_forward_pass_names_the_first_node():
    model = Net(Lambda(lambda h: torch.log(h)))  # tanh output is negative somewhere
    with raises(sbp.NonFiniteError, "NaN", "`log`", "`block.1`"):
        sbp.backprop(model, args=(x34(),), output=total)


def test_nan_input_is_reported_where_it_first_appears():
    x = x34()
    x[1, 2] = float("nan")
    with raises(sbp.NonFiniteError, "input 0 holds NaN", "index (1, 2)"):
        sbp.backprop(lambda t: (t * 2).exp(), args=(x,), output=total)


@pytest.mark.parametrize("semiring", [sbp.Real(), sbp.MaxAbs(), sbp.TopK(2)])
def test_nan_input_that_cannot_reach_the_output_is_refused_too(semiring):
    """Row 1 holds the NaN, the output reads y[0, 0] of x @ x.T: x is still read as an
    edge weight of every row (MaxAbs crashed with an index error inside its kernel)."""
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    with raises(sbp.NonFiniteError, "input 0 holds NaN", "index (1, 2)", "nan_to_num"):
        sbp.backprop(lambda t: t @ t.T, args=(x,), output=lambda y: y[0, 0],
                     semirings=[semiring])  # fmt: skip


def test_nan_in_a_max_plus_contraction_is_an_error_not_an_index_crash():
    from semiring_backprop import kernels

    m = torch.randn(2, 8)
    lwt = torch.randn(3, 8)
    lwt[1, 4] = float("nan")
    with raises(sbp.NonFiniteError, "NaN reached a max-plus contraction"):
        kernels.maxplus(m, lwt)


def test_inf_made_from_finite_inputs():
    with raises(sbp.NonFiniteError, "inf", "`exp`", "finite inputs", "rescale"):
        sbp.backprop(lambda t: (t * 1000).exp(), args=(x34(),), output=total)


def test_inf_from_log_of_zero():
    with raises(sbp.NonFiniteError, "inf", "`log`", "log of 0"):
        sbp.backprop(lambda t: torch.log(t * 0) + t, args=(x34(),), output=total)


def test_masks_may_hold_inf():
    """Routing ops (masked_fill) write -inf on purpose: not an error."""

    def fn(t):
        mask = torch.tensor([True, False, True, True])
        return torch.softmax(t.masked_fill(~mask, float("-inf")), -1)

    res = sbp.backprop(fn, args=(x34(),), output=lambda y: y[0, 0])
    assert res.at(0, sbp.Real())[:, 1].eq(0).all()


def _bucketed_bias(t):
    """T5's relative-position buckets: ``log`` of distances from positions alone (-inf
    at distance 0), turned into integer buckets; only the bias looked up is used."""
    pos = torch.arange(t.shape[-1])
    dist = (pos[None, :] - pos[:, None]).abs().to(t.dtype)
    big = torch.log(dist / 2)  # -inf on the diagonal, masked away by the where below
    bucket = torch.where(dist < 2, dist, 2 + big.clamp(max=1.0)).long()
    return torch.nn.functional.embedding(bucket, torch.arange(4.0, dtype=t.dtype)[:, None])


def test_non_finite_value_that_reaches_no_path_and_no_edge_weight_is_fine():
    fn = lambda t: torch.softmax(t[:3] + _bucketed_bias(t)[:3, :, 0], -1)  # noqa: E731
    x = x34()
    res = sbp.backprop(fn, args=(x,), output=total)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(total(fn(leaf)), leaf)
    torch.testing.assert_close(res.at(0, sbp.Real()), want)


class _Scales(nn.Module):
    """x -> x·1e15 four times: every forward value finite in float32 (1e-30 up to 1e30),
    the gradient at the first product 1e45 (past float32's 3.4e38)."""

    def forward(self, x):
        for i in range(4):
            x = x * 1e15 if i else (x * 1e15).relu()  # the first product named by its op
        return x


@pytest.mark.parametrize(
    ("semirings", "keep"),
    [
        ([sbp.Real()], None),
        ([sbp.MaxProduct()], None),
        ([sbp.Real(), sbp.MaxProduct("tensor")], (0,)),
        ([sbp.Entropy(), sbp.MaxProduct()], None),
    ],
)
def test_reverse_pass_overflow_names_the_first_node(semirings, keep):
    x = torch.full((2, 3), 1e-30)
    with raises(sbp.NonFiniteError, "overflowed", semirings[-1].name if
                len(semirings) == 1 else "", "`relu`", "float64", "MaxAbs"):  # fmt: skip
        sbp.backprop(_Scales().eval(), args=(x,), output=total, semirings=semirings, keep=keep)
    # in float64 the same pass agrees with autograd; in log space float32 suffices
    leaf = x.double().requires_grad_()
    (want,) = torch.autograd.grad(total(_Scales()(leaf)), leaf)
    res = sbp.backprop(_Scales().eval(), args=(x.double(),), output=total,
                       semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip
    torch.testing.assert_close(res.at(0, sbp.Real()), want)
    torch.testing.assert_close(res.at(0, sbp.MaxProduct()).hi, want)  # one path each
    res = sbp.backprop(_Scales().eval(), args=(x,), output=total, semirings=[sbp.MaxAbs()])
    torch.testing.assert_close(res.at(0, sbp.MaxAbs()).log, want.log().float())


class _MovedScales(nn.Module):
    """:class:`_Scales` with moves between the products (a view, a transpose, a slice):
    nodes whose readers only move their elements, which the pass does not check."""

    def forward(self, x):
        x = (x * 1e15).relu()
        x = (x.view(3, 2).t() * 1e15)[:, :3]
        return x.reshape(6)[None] * 1e15 * 1e15


def test_an_overflow_is_named_where_it_first_appears_past_moves():
    from semiring_backprop.engine import forward
    from semiring_backprop.engine.hooks import only_moved
    from semiring_backprop.engine.reverse import reverse

    x = torch.full((2, 3), 1e-30)
    g = sbp.trace(_MovedScales().eval(), (x,), output=total)
    moved_nodes = only_moved(g)
    moved = {str(n.target).split(".")[1] for n in moved_nodes}
    products = [n for n in g.nodes if str(n.target) == "aten.mul.Tensor"]
    assert {"view", "slice", "clone"} <= moved  # (t is a permute in the trace)
    assert not {p.args[0] for p in products} & moved_nodes  # a product's input: checked
    assert next(n for n in g.nodes if str(n.target) == "aten.relu.default") in moved_nodes
    for sr in (sbp.MaxProduct(), sbp.MaxProduct("tensor")):  # (checked at every node)
        # D first overflows at the second product's input (1e45 past float32's range),
        # as a pass that checks every node finds too
        with raises(sbp.NonFiniteError, "overflowed", "node `permute`"):
            sbp.backprop(_MovedScales().eval(), args=(x,), output=total, semirings=[sr])
        with raises(sbp.NonFiniteError, "overflowed", "node `permute`"):
            values = forward.run(g, (x,), {})
            reverse(g, values, [sr], g.output_node, set(), check="every")


class _NarrowInside(nn.Module):
    """A float64 input computed in float32 inside (as LlamaRMSNorm casts), then widened:
    the overflow is in float32 nodes, which float64 weights would not widen."""

    def forward(self, x):
        return _Scales()(x.float()).double()


def test_overflow_inside_a_float64_model_does_not_advise_float64():
    x = torch.full((2, 3), 1e-30, dtype=torch.float64)
    with raises(sbp.NonFiniteError, "overflowed", "computes this node in torch.float32",
                "although it runs in float64", "MaxAbs"):  # fmt: skip
        sbp.backprop(_NarrowInside().eval(), args=(x,), output=total)


def test_an_overflow_that_reaches_no_input_is_refused_where_it_is_read():
    """Every element masked: D at the input is 0 (no path) and finite, D at the masked
    tensor overflowed (1e40 in float32); reading it there is the error."""

    def fn(t):
        z = t.masked_fill(torch.ones_like(t, dtype=torch.bool), 0.0)
        return z * 1e20 * 1e20

    res = sbp.backprop(fn, args=(x34().float(),), output=total)
    assert (res.at(0, sbp.Real()) == 0).all()
    with raises(sbp.NonFiniteError, "Real overflowed at 'where'", "float64"):
        res.at("where", sbp.Real())  # masked_fill, decomposed


def test_non_finite_value_read_by_an_edge_weight_is_an_error():
    """The same -inf made from positions alone, now multiplying the input: the edge
    weights of that product are infinite."""

    def fn(t):
        pos = torch.arange(t.shape[-1], dtype=t.dtype)
        return t * torch.log(pos)

    with raises(sbp.NonFiniteError, "inf", "`log`"):
        sbp.backprop(fn, args=(x34(),), output=total)


def test_untraceable_model_suggests_eager_attention_or_a_plain_function():
    def flow(x):
        if x.sum() > 0:  # data-dependent Python control flow
            return x * 2
        return x * 3

    branch = flow.__code__.co_firstlineno + 1  # the line that reads the tensor's value
    with raises(
        sbp.TracingError, "could not trace", "attn_implementation='eager'", "plain function",
        "uses a tensor's value where torch.export needs a number",
        f"It failed at {__file__}, line {branch} (if x.sum() > 0:",
    ):  # fmt: skip
        sbp.backprop(flow, args=(x34(),), output=total)


class _ReverseGradient(torch.autograd.Function):
    """A gradient-reversal layer: identity forward, -g backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


def test_custom_autograd_function_is_refused_by_name():
    def model(x):
        return _ReverseGradient.apply(x) * 2

    x = x34().requires_grad_()
    (g,) = torch.autograd.grad(total(model(x)), x)
    assert (g == -2).all()  # what autograd says; the forward's ops alone would give +2
    with raises(sbp.TracingError, "custom torch.autograd.Function", "_ReverseGradient", "-g"):
        sbp.backprop(model, args=(x34(),), output=total)
    # the watch is gone after the trace: the Function works as before
    x = x34().requires_grad_()
    (g,) = torch.autograd.grad(total(model(x)), x)
    assert (g == -2).all()


class _Cube(torch.autograd.Function):
    """x ** 3 with a hand-written backward that is its derivative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class _StraightThrough(torch.autograd.Function):
    """round() forward, identity backward (a straight-through estimator)."""

    @staticmethod
    def forward(x):
        return torch.round(x * 4) / 4

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


def test_custom_function_whose_backward_is_its_derivative_is_explained_exactly():
    def model(x):
        return _Cube.apply(x * 0.5).sum(-1) * x[:, 0]

    res = sbp.backprop(model, args=(x34(),), output=total)
    x = x34().requires_grad_()
    (want,) = torch.autograd.grad(total(model(x)), x)
    torch.testing.assert_close(res.at(0, sbp.Real()), want)


def test_straight_through_estimator_is_refused():
    with raises(sbp.TracingError, "_StraightThrough", "not the derivative"):
        sbp.backprop(lambda x: _StraightThrough.apply(x) * x, args=(x34(),), output=total)


def test_model_not_callable():
    with raises(sbp.InputError, "callable", "int"):
        sbp.backprop(3, args=(x34(),))


# -- semirings and keep= ----------------------------------------------------------------------


def test_semiring_not_computed_in_the_pass():
    res = sbp.backprop(torch.tanh, args=(x34(),), output=total, semirings=[sbp.Real()])
    with raises(sbp.InputError, "Entropy()", "not computed", "Real()"):
        res.at(0, sbp.Entropy())
    with raises(sbp.InputError, "TopK(k=3)", "not computed"):
        res.aggregate(0, sbp.TopK(3))


@pytest.mark.parametrize(
    "semirings",
    [[], [sbp.Real(), sbp.Real()], [sbp.Real]],
    ids=["empty", "duplicate", "class-not-instance"],
)
def test_bad_semiring_list(semirings):
    with raises(sbp.InputError, "semirings"):
        sbp.backprop(torch.tanh, args=(x34(),), output=total, semirings=semirings)


def test_keep_an_op_that_cannot_be_kept():
    with raises(sbp.InputError, "'conv'", "softmax", "layer_norm"):
        sbp.backprop(torch.tanh, args=(x34(),), output=total, whole=("conv",))


# -- Result.at --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def net_result():
    return sbp.backprop(Net(nn.Identity()), args=(x34(),), output=total)


def test_at_unknown_module_lists_near_matches(net_result):
    with raises(sbp.NotFoundError, "'blok.0'", "Did you mean", "block.0", "named_modules"):
        net_result.at("blok.0", sbp.Real())


def test_at_unknown_module_without_near_matches(net_result):
    with raises(sbp.NotFoundError, "'encoder'", "named_modules", "':input'"):
        net_result.at("encoder", sbp.Real())
    # a KeyError, as dict lookups are, but printed plainly
    with pytest.raises(KeyError, match=re.escape("no input, module or node named 'encoder'")):
        net_result.at("encoder", sbp.Real())


def test_at_ambiguous_suffix():
    model = nn.Sequential()
    model.add_module("a", nn.Sequential(nn.Linear(4, 4)))
    model.add_module("b", nn.Sequential(nn.Linear(4, 4)))
    res = sbp.backprop(model.to(F64).eval(), args=(x34(),), output=total)
    with raises(sbp.NotFoundError, "several modules", "a.0", "b.0", "full path"):
        res.at("0", sbp.Real())
    res.at("a.0", sbp.Real())


def test_at_unknown_input_position(net_result):
    with raises(sbp.NotFoundError, "args[3]", "tensor inputs: 0"):
        net_result.at(3, sbp.Real())


def test_at_bad_key_type(net_result):
    with raises(sbp.InputError, "1.5"):
        net_result.at(1.5, sbp.Real())


def test_at_integer_input_points_to_the_embeddings():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)).to(F64).eval()
    res = sbp.backprop(model, args=(torch.tensor([1, 2, 3]),), output=total)
    with raises(sbp.InputError, "torch.int64", "token ids", "embeddings"):
        res.at(0, sbp.Real())
    assert res.at("0", sbp.Real()).shape == (3, 4)


class _Scaled(torch.nn.Module):
    """A value of the weights alone (checked once per trace) feeding the input's path."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return (x * torch.sqrt(self.w - 2.0)).sum()


def test_nan_in_a_value_of_the_weights_alone_is_reported_on_every_call():
    model = _Scaled().eval()
    bp = sbp.Backprop(model, lambda y: y, [sbp.Real()])
    for _ in range(2):  # the first call checks it; the second still fails at the output
        with raises(sbp.NonFiniteError, "NaN", "`sqrt`"):
            bp((torch.randn(3),))


def test_nan_weight_is_reported():
    model = torch.nn.Linear(3, 2).eval()
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    with raises(sbp.NonFiniteError, "NaN"):
        sbp.backprop(model, (torch.randn(1, 3),), output=lambda y: y[0, 1])


def test_an_op_that_fails_on_the_given_inputs_names_the_node_and_module():
    """An op that raises while the traced graph runs: a library error naming the node,
    the module and torch's message, not torch's stack trace."""
    from semiring_backprop.engine import forward

    graph = sbp.trace(Net(nn.Identity()), (x34(),), output=total)
    with raises(sbp.ForwardError, "`addmm`", "`lin`", "aten.addmm", "same dtype"):
        forward.run(graph, (x34().float(),), {})  # traced for float64


def test_overflow_checks_read_a_graph_with_symbolic_sizes():
    """A second length traces with symbolic sizes: nodes there hold SymInts (read by
    ``expand``), which the overflow checks' reading of the graph takes as no tensor."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, vocab_size=50)  # fmt: skip
    model = BertModel(cfg, add_pooling_layer=False).eval()
    bp = sbp.Backprop(model, lambda o: o.last_hidden_state[0, -1].sum(), [sbp.MaxProduct()])
    for n in (5, 9):
        x = torch.randn(1, n, 16)
        res = bp(kwargs={"inputs_embeds": x})
        assert res.at("inputs_embeds", sbp.MaxProduct()).hi.shape == (1, n, 16)
