"""A peer's suite: every op we have a rule for, against torch.autograd on PyTorch's own
OpInfo sample inputs (``torch.testing._internal``), under the ``Real`` semiring.

Which OpInfos: those whose ATen op (``aten.<aten_name>``) has a registered rule or is
tagged pointwise (the generic rule), and the composites in ``COMPOSITES`` that our
decompositions and rules cover (softmax, norms, convolutions, pooling, sorting,
indexing, ...).

Each sample is a function of its differentiable tensors (those OpInfo marks with
``requires_grad=True``; every other argument is a constant), explained through a fixed
random linear functional of its float outputs, ``Σ_k (out_k · R_k).sum()``. Its gradient
at every input must equal ``torch.autograd.grad`` (float64, rtol 1e-7); an input with no
path must have a zero gradient there. A sample may instead be refused with the library's
own error (a ``SemiringBackpropError``: no rule, not traceable, ...); any other exception
fails, as does a mismatch. Skipped, each with its reason in the outcome table: samples
without a differentiable float input or output, non-finite outputs or gradients at the
sample point (log at 0), sparse layouts, and autograd's own refusals (sparse gradients).

Time: tracing costs about half a second per call whatever its size, so the samples of
many ops are traced as one function (their inputs are disjoint, so their gradients are
independent); a group that raises is split in halves until the sample that raised is
alone, and judged alone. Per op, ``MAX_SAMPLES`` samples are taken, evenly spaced over
the first ``SCAN`` that OpInfo generates (deterministic). The file takes about 75 s on 2
busy cores (7 s of it importing op_db). ``torch.testing._internal`` needs the
``expecttest`` package; without it the module is skipped.

Known failures are listed in ``KNOWN`` (one line each, with the diagnosis) and turn the
op's test into an xfail while every other sample of it is still checked; an entry that
no longer fails is an error. Samples refused for a known reason are in ``REFUSED`` (run
alone: cheaper than a search). ``UNSUPPORTED`` lists ops we select but have no rule
for: their samples, traced together, must raise our error, and none may compare (then
the entry is stale). ``python tests/test_opinfo.py`` prints the outcome table per op.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from torch.utils import _pytree as pytree

import semiring_backprop as sbp
from semiring_backprop import rules

pytest.importorskip(
    "expecttest", reason="torch.testing._internal needs expecttest: add it to the test extra"
)
with warnings.catch_warnings():  # where numba-cuda is installed, torch's test helpers
    warnings.simplefilter("ignore", DeprecationWarning)  # import it, and it warns on import
    from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

aten = torch.ops.aten

MAX_SAMPLES = 3
SCAN = 48
RTOL = 1e-7
CHUNK = 24  # ops traced together (one pytest -k run computes only its chunks)

# composites we decompose (decompositions.py, torch's own table) into ops with rules
COMPOSITES = """
    nn.functional.softmin nn.functional.softmin.with_dtype logsumexp
    nn.functional.rms_norm nn.functional.group_norm native_group_norm
    nn.functional.batch_norm nn.functional.instance_norm native_batch_norm
    _native_batch_norm_legit native_layer_norm nn.functional.local_response_norm
    nn.functional.silu nn.functional.elu nn.functional.celu nn.functional.selu
    nn.functional.hardswish nn.functional.hardsigmoid nn.functional.mish
    nn.functional.softplus nn.functional.logsigmoid nn.functional.softsign
    nn.functional.tanhshrink nn.functional.threshold nn.functional.glu nn.functional.prelu
    var var.unbiased var_mean var_mean.unbiased std std_mean nansum nanmean trace
    norm norm.fro norm.inf linalg.norm linalg.norm.subgradients_at_zero
    nn.functional.normalize nn.functional.cosine_similarity nn.functional.pairwise_distance
    nn.functional.linear matmul mv dot outer inner tensordot einsum linalg.multi_dot
    linalg.vecdot addmv addbmm addr
    nn.functional.conv1d nn.functional.conv2d nn.functional.conv3d
    nn.functional.conv_transpose1d nn.functional.conv_transpose2d
    nn.functional.conv_transpose3d
    nn.functional.max_pool1d nn.functional.max_pool2d nn.functional.max_pool3d
    nn.functional.avg_pool1d nn.functional.adaptive_avg_pool1d
    nn.functional.adaptive_avg_pool2d nn.functional.adaptive_avg_pool3d
    nn.functional.adaptive_max_pool1d nn.functional.adaptive_max_pool2d
    nn.functional.adaptive_max_pool3d nn.functional.max_unpool1d.grad
    nn.functional.max_unpool2d.grad nn.functional.max_unpool3d.grad
    topk sort msort kthvalue mode median cummax cummin aminmax
    __getitem__ take take_along_dim index_fill index_copy index_add scatter_add
    masked_select masked_scatter stack hstack vstack column_stack nn.functional.embedding
    split split_with_sizes chunk unbind tensor_split narrow tril triu rot90 movedim
    repeat_interleave tile expand_as broadcast_to diag diag_embed diagonal_scatter
    nn.functional.pixel_shuffle nn.functional.pad.reflect nn.functional.pad.replicate
    nn.functional.pad.circular nn.functional.unfold nn.functional.interpolate.nearest
    nn.functional.interpolate.bilinear nn.functional.interpolate.nearest-exact
    nn.functional.interpolate.linear nn.functional.interpolate.bicubic
    nn.functional.interpolate.trilinear nn.functional.interpolate.area
    cumsum prod nn.functional.scaled_dot_product_attention torch.ops.aten._safe_softmax.default
    nn.functional.cross_entropy nn.functional.nll_loss nn.functional.mse_loss
    nn.functional.binary_cross_entropy_with_logits nn.functional.kl_div
""".split()

# selected by name but not checked at all, with the reason
NOT_CHECKED = {
    # autograd is not an oracle there: with repeated indices the forward keeps one of
    # the values, but autograd's backward gives the gradient to every duplicate (OpInfo
    # skips its own gradient test for these; the ``.grad`` variants, unique indices, run)
    "nn.functional.max_unpool1d": "duplicate indices: autograd's gradient is ill-defined",
    "nn.functional.max_unpool2d": "duplicate indices: autograd's gradient is ill-defined",
    "nn.functional.max_unpool3d": "duplicate indices: autograd's gradient is ill-defined",
}

# ops we select that have no rule yet: their samples, traced together, must raise our error
UNSUPPORTED = {
    "frexp": "two outputs (mantissa, exponent): rules cover single-output ops",
    "native_layer_norm": "three outputs: rules cover single-output ops (layer_norm is fine)",
    "addmv": "no rule for aten.addmv",
    "addbmm": "no rule for aten.addbmm",
    "prod": "no rule for aten.prod",
    "scatter_add": "no rule for aten.scatter_add",
    "masked_select": "data-dependent output shape",
    "diagonal_scatter": "no rule for aten.diagonal_scatter",
}

# samples of supported ops refused with our error, with the reason (run alone: cheaper
# than searching a joint trace for them; a sample not listed here may be refused too)
_STATS = "training with running stats: torch.export refuses the in-place update of a constant"
REFUSED: dict[tuple[str, int], str] = {
    ("_native_batch_norm_legit", 0): _STATS,
    ("_native_batch_norm_legit", 4): _STATS,
    ("native_batch_norm", 0): _STATS,
    ("nn.functional.batch_norm", 0): _STATS,
    ("nn.functional.instance_norm", 0): _STATS,
    ("nn.functional.instance_norm", 4): _STATS,
    ("linalg.norm.subgradients_at_zero", 47): "matrix 2-norm: no rule for aten._linalg_svd",
    ("median", 0): "median of all elements: no rule for aten.median.default",
    ("median", 6): "median of all elements: no rule for aten.median.default",
    ("nanmean", 34): "a NaN input: the forward check refuses it (nanmean would skip it)",
    ("narrow", 9): "start given as a tensor: a data-dependent size, not traceable",
    # torch's decomposition computes both branches of a where; the unused one is
    # log1p(-1) = -inf, an infinite edge weight (autograd runs the fused kernel)
    ("special.log_ndtr", 0): "-inf in the unselected branch of torch's decomposition",
}

# known failures: (op, sample index) -> diagnosis; the op's test xfails on these alone
KNOWN: dict[tuple[str, int], str] = {}


def _name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _has_rule(op) -> bool:
    packet = getattr(aten, (op.aten_name or op.name).replace(".", "_"), None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(
        rules.lookup(getattr(packet, overload)) is not None for overload in packet.overloads()
    )


def _selected() -> dict:
    usable = {
        _name(op): op
        for op in op_db
        if torch.float64 in op.supported_dtypes("cpu") and op.supports_autograd
    }
    missing = set(COMPOSITES) - set(usable)
    # the names are those of the torch that CI installs (2.13); an older torch's OpInfo
    # database lacks some of them (2.11: aminmax, native_group_norm), and those are not run
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        assert not missing, f"COMPOSITES names no OpInfo (torch renamed it?): {sorted(missing)}"
    return {
        name: op
        for name, op in usable.items()
        if (_has_rule(op) or name in COMPOSITES) and name not in NOT_CHECKED
    }


OPS = _selected()
NAMES = sorted(OPS)


# -- one sample -----------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # match | no path | refused | skip | mismatch | raw error
    detail: str = ""


FAILED = ("mismatch", "raw error")
COMPARED = ("match", "no path")


@dataclass
class Case:
    """One sample as ``fn(*inputs)``, its scalar ``output(fn(...))`` and autograd's answer."""

    name: str
    index: int
    fn: object
    inputs: tuple
    output: object
    grads: tuple


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _finite(ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts if _is_float(t))


def _scalar(out):
    """``Σ_k (out_k · R_k).sum()`` over the outputs autograd differentiates (float, and
    requiring grad: not ``native_batch_norm``'s saved statistics), R fixed by a seed."""
    gen = torch.Generator().manual_seed(1234)
    weights = [
        torch.randn(o.shape, generator=gen, dtype=torch.float64)
        if _is_float(o) and o.requires_grad
        else None
        for o in pytree.tree_leaves(out)
    ]
    if all(w is None for w in weights):
        return None

    def output(out):
        pairs = zip(pytree.tree_leaves(out), weights)
        terms = [(o * w).sum() for o, w in pairs if w is not None]
        return sum(terms[1:], terms[0])

    return output


def _case(name: str, index: int, op, sample) -> Case | Outcome:
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if any(t.layout != torch.strided for t in tensors):
        return Outcome("skip", "sparse layout")
    at = [i for i, x in enumerate(leaves) if _is_float(x) and x.requires_grad]
    if not at:
        return Outcome("skip", "no differentiable float input")
    # fresh, distinct tensors: a sample that passes one tensor twice would otherwise be
    # one input to sbp (its slots ⊕-ed) but two leaves to autograd
    inputs = tuple(leaves[i].detach().clone() for i in at)
    consts = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]

    def fn(*xs):
        new = list(consts)
        for i, x in zip(at, xs):
            new[i] = x
        inp, args, kwargs = pytree.tree_unflatten(new, spec)
        return sample.output_process_fn_grad(op(inp, *args, **kwargs))

    x = [t.clone().requires_grad_() for t in inputs]
    torch.manual_seed(0)
    out = fn(*x)
    if any(isinstance(o, torch.Tensor) and o.device.type != "cpu" for o in pytree.tree_leaves(out)):
        return Outcome("skip", "output on another device")  # `to`'s samples where CUDA is
    output = _scalar(out)
    if output is None:
        return Outcome("skip", "no differentiable float output")
    if not _finite([o.detach() for o in pytree.tree_leaves(out) if _is_float(o)]):
        return Outcome("skip", "non-finite output")
    try:
        grads = torch.autograd.grad(output(out), x, allow_unused=True)
    except RuntimeError as e:  # only autograd's own refusals
        if "not supported with sparse gradients" in str(e):
            return Outcome("skip", f"autograd: {str(e).splitlines()[0][:60]}")
        raise
    # embedding(sparse=True) gives a sparse gradient
    grads = tuple(g.to_dense() if g is not None and g.is_sparse else g for g in grads)
    if not _finite([g for g in grads if g is not None]):
        return Outcome("skip", "non-finite gradient")
    return Case(name, index, fn, inputs, output, grads)


def _refusal(e: Exception, case: Case) -> Outcome:
    """How one sample that raised alone is judged."""
    if not isinstance(e, sbp.SemiringBackpropError):
        return Outcome("raw error", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if isinstance(e, sbp.InputError) and "does not depend on any float input" in str(e):
        if all(g is None or not g.any() for g in case.grads):
            return Outcome("no path")
        return Outcome("mismatch", "sbp: no path from any input; autograd: nonzero")
    return Outcome("refused", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def _compare(res, offset: int, case: Case) -> Outcome:
    bad = []
    for j, (x, g) in enumerate(zip(case.inputs, case.grads)):
        try:
            got = res.at(offset + j, sbp.Real())
        except sbp.InputError:  # no path from this input
            if g is not None and g.any():
                bad.append(f"input {j}: sbp has no path, autograd max |g| {g.abs().max():.3g}")
            continue
        if g is None:
            g = torch.zeros_like(x)
        scale = max(1.0, float(g.abs().max()) if g.numel() else 1.0)
        rtol = RTOL if x.dtype == torch.float64 else 1e-5
        try:
            torch.testing.assert_close(got, g, rtol=rtol, atol=rtol * scale, check_dtype=False)
        except AssertionError:
            err = float((got.to(g.dtype) - g).abs().max()) if got.shape == g.shape else math.nan
            bad.append(
                f"input {j} {tuple(x.shape)}: max |sbp - autograd| {err:.3g}, "
                f"max |autograd| {float(g.abs().max()):.3g}, shapes {tuple(got.shape)}"
            )
    return Outcome("mismatch", "; ".join(bad)) if bad else Outcome("match")


def _run(cases: list[Case], together: bool = False) -> dict:
    """``{(name, index): Outcome}``: the cases traced as one function; if that raises,
    split in halves down to the case that raised, judged alone (``together``: cases of
    one op without a rule; our own error refuses them all)."""
    flat = tuple(x for c in cases for x in c.inputs)
    bounds = list(itertools.accumulate([0] + [len(c.inputs) for c in cases]))

    def fn(*xs):
        return tuple(c.fn(*xs[a:b]) for c, a, b in zip(cases, bounds, bounds[1:]))

    def output(outs):
        terms = [c.output(o) for c, o in zip(cases, outs)]
        return sum(terms[1:], terms[0])

    torch.manual_seed(0)
    try:
        res = sbp.backprop(fn, args=flat, output=output, semirings=[sbp.Real()])
    except Exception as e:  # noqa: BLE001  (split to the sample that raised; judged there)
        if len(cases) == 1 or (together and isinstance(e, sbp.SemiringBackpropError)):
            return {(c.name, c.index): _refusal(e, c) for c in cases}
        half = len(cases) // 2
        return _run(cases[:half]) | _run(cases[half:])
    return {(c.name, c.index): _compare(res, a, c) for c, a in zip(cases, bounds)}


def _pick(n: int) -> list[int]:
    if n <= MAX_SAMPLES:
        return list(range(n))
    return sorted({round(k * (n - 1) / (MAX_SAMPLES - 1)) for k in range(MAX_SAMPLES)})


@cache
def _chunk(k: int) -> dict:
    """``{name: [(index, Outcome)]}`` for the k-th chunk of ``NAMES``: the samples of every
    op traced together, those expected to raise (``KNOWN``, ``REFUSED``) alone, and each
    op without a rule on its own, so that one expected error costs one trace, not a
    search."""
    found, joint, alone, unsupported = {}, [], [], {}
    torch.manual_seed(k)  # OpInfo draws sample values from the global generator
    for name in NAMES[k * CHUNK : (k + 1) * CHUNK]:
        op = OPS[name]
        samples = list(
            itertools.islice(op.sample_inputs("cpu", torch.float64, requires_grad=True), SCAN)
        )
        found[name] = []
        for i in _pick(len(samples)):
            c = _case(name, i, op, samples[i])
            found[name].append((i, c))
            if not isinstance(c, Case):
                continue
            if name in UNSUPPORTED:
                unsupported.setdefault(name, []).append(c)
            elif (name, i) in KNOWN or (name, i) in REFUSED:
                alone.append(c)
            else:
                joint.append(c)
    done = _run(joint) if joint else {}
    for c in alone:
        done |= _run([c])
    for cases in unsupported.values():
        done |= _run(cases, together=True)
    return {
        name: [(i, done[(name, i)] if isinstance(c, Case) else c) for i, c in items]
        for name, items in found.items()
    }


def outcomes(name: str) -> list:
    return _chunk(NAMES.index(name) // CHUNK)[name]


# -- the tests ---------------------------------------------------------------------------


def test_lists_name_selected_ops():
    """The selection has not collapsed (a torch rename), and every list here names ops
    and samples that are selected."""
    assert len(NAMES) > 200
    assert set(UNSUPPORTED) <= set(NAMES)
    for name, i in (*KNOWN, *REFUSED):
        assert name in NAMES, (name, i)


@pytest.mark.parametrize("name", NAMES)
def test_op_matches_autograd(name):
    results = outcomes(name)
    kinds = Counter(o.kind for _, o in results)
    failed = {i: o for i, o in results if o.kind in FAILED}
    new = {i: o for i, o in failed.items() if (name, i) not in KNOWN}
    assert not new, "\n".join(f"sample {i}: {o.kind}: {o.detail}" for i, o in new.items())
    fixed = [i for (n, i) in KNOWN if n == name and i not in failed]
    assert not fixed, f"samples {fixed} of {name} no longer fail: remove them from KNOWN"
    if name in UNSUPPORTED:
        assert not any(kinds[k] for k in COMPARED), (
            f"{name} is listed as unsupported ({UNSUPPORTED[name]}) but {kinds}: "
            "remove it from UNSUPPORTED"
        )
    elif not failed:
        assert any(kinds[k] for k in COMPARED), (
            f"no sample of {name} was compared with autograd: {results}; list it in "
            "UNSUPPORTED with the reason, or fix what refuses it"
        )
    if failed:
        pytest.xfail("; ".join(f"sample {i}: {KNOWN[(name, i)]}" for i in failed))


def _table(file=sys.stdout):
    total = Counter()
    for name in NAMES:
        results = outcomes(name)
        kinds = Counter(o.kind for _, o in results)
        total += kinds
        line = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        print(f"{name:50s} {line}", file=file)
        for i, o in results:
            if o.kind not in ("match",) and o.detail:
                print(f"    [{i}] {o.kind}: {o.detail}", file=file)
    print("total:", dict(total), file=file)


if __name__ == "__main__":
    _table()
