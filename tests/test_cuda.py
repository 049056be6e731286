"""On a CUDA device the pass gives what it gives on the CPU (skipped without a GPU).

Every semiring on BERT, GPT-2 and Llama built from small configs, in float64: the values
at the input embeddings, with every value kept and with ``keep=``, the top path and the
top-k paths; ``Real`` against torch.autograd on the device, in float64, float32 and
bfloat16. The compiled max-times kernel runs as a GPU kernel and gives the eager
kernel's values; the pass makes no host synchronization once traced; the memory budget
reads the device's free memory; the CLI's ``--device cuda`` explains on the GPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import oracles
import semiring_backprop as sbp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
pytest.importorskip("transformers")

F64 = torch.float64
SEMIRINGS = oracles.all_semirings()


def _readouts(sr, value):
    ro = sr.finalize(value)
    if isinstance(ro, torch.Tensor):
        return [ro]
    return [getattr(ro, f) for f in ro.__dataclass_fields__]


def _spec_model(name, dtype=F64):
    from test_branches import HF_SPECS

    spec = HF_SPECS[name]
    torch.manual_seed(5)
    model = spec.build().to(dtype).eval()
    emb = model.get_input_embeddings()(torch.randint(1, 20, (1, 6))).detach()
    return spec, model, emb


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_cuda_values_equal_cpu_values(name):
    spec, model, emb = _spec_model(name)
    # Llama's rotary embedding and RMS norm compute in float32 inside the float64 model:
    # the model itself differs between the devices at float32's precision (spec.rtol)
    rtol = max(1e-9, spec.rtol)
    gpu_model = copy.deepcopy(model).cuda()
    gpu_emb = emb.cuda()
    cpu = sbp.Backprop(model, spec.output, SEMIRINGS)(kwargs={"inputs_embeds": emb})
    for keep in (None, ("inputs_embeds",)):
        bp = sbp.Backprop(gpu_model, spec.output, SEMIRINGS, keep=keep)
        gpu = bp(kwargs={"inputs_embeds": gpu_emb})
        for sr in SEMIRINGS:
            got = _readouts(sr, gpu.value("inputs_embeds", sr))
            want = _readouts(sr, cpu.value("inputs_embeds", sr))
            for g, w in zip(got, want, strict=True):
                assert g.device.type == "cuda"
                if g.is_floating_point():
                    torch.testing.assert_close(g.cpu(), w, rtol=rtol, atol=1e-12)

    x = gpu_emb.clone().requires_grad_()
    (grad,) = torch.autograd.grad(spec.output(gpu_model(inputs_embeds=x)), x)
    torch.testing.assert_close(gpu.at("inputs_embeds", sbp.Real()), grad)

    gpu = sbp.Backprop(gpu_model, spec.output, SEMIRINGS)(kwargs={"inputs_embeds": gpu_emb})
    for sign in "+-":
        path = gpu.top_path("inputs_embeds", sign=sign)
        want = cpu.top_path("inputs_embeds", sign=sign)
        assert path.value == pytest.approx(want.value, rel=max(1e-9, 10 * spec.rtol))
        assert len(path) == len(want)
    got = [p.value for p in gpu.top_paths("inputs_embeds", 3)]
    want = [p.value for p in cpu.top_paths("inputs_embeds", 3)]
    assert got == pytest.approx(want, rel=max(1e-9, 10 * spec.rtol))


#: (dtype, tolerance relative to the gradient's largest magnitude): the pass and
#: autograd add the same terms in other orders
LOW_PRECISION = [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)]


@pytest.mark.parametrize(("dtype", "tol"), LOW_PRECISION, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_cuda_low_precision_real_is_autograd(name, dtype, tol):
    spec, model, emb = _spec_model(name, dtype)
    model, emb = model.cuda(), emb.cuda()
    semirings = [sbp.Real(), sbp.MaxProduct(), sbp.MaxProduct("tensor"), sbp.Entropy(),
                 sbp.TopK(3)]  # fmt: skip
    res = sbp.Backprop(model, spec.output, semirings)(kwargs={"inputs_embeds": emb})
    x = emb.clone().requires_grad_()
    (grad,) = torch.autograd.grad(spec.output(model(inputs_embeds=x)), x)
    got = res.at("inputs_embeds", sbp.Real())
    assert got.dtype == dtype and got.device.type == "cuda"
    scale = float(grad.abs().max())
    assert scale > 0
    torch.testing.assert_close(got.float(), grad.float(), rtol=0, atol=tol * scale)
    for sr in semirings[1:]:  # every readout is a number, not NaN
        for field in _readouts(sr, res.value("inputs_embeds", sr)):
            if field.is_floating_point():
                assert not field.isnan().any(), sr
    hi = res.at("inputs_embeds", sbp.MaxProduct()).hi
    assert bool((hi > -float("inf")).all())


def test_compiled_maxtimes_runs_as_a_gpu_kernel(monkeypatch):
    """The compiled kernel is no fallback: its values are the eager kernel's, the key
    says CUDA, and the profiler shows a Triton kernel on the device."""
    from torch.profiler import ProfilerActivity, profile

    from semiring_backprop import kernels

    spec, model, emb = _spec_model("bert")
    model, emb = model.cuda(), emb.cuda()
    semirings = [sbp.MaxProduct()]
    monkeypatch.setattr(kernels, "MIN_WORK", 0)  # the small model's products are compiled too
    kernels.set_compile(False)
    try:
        eager = sbp.Backprop(model, spec.output, semirings)(kwargs={"inputs_embeds": emb})
        kernels.set_compile(True)
        bp = sbp.Backprop(model, spec.output, semirings)
        compiled = bp(kwargs={"inputs_embeds": emb})
        with warnings.catch_warnings():  # the profiler's own notes
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                bp(kwargs={"inputs_embeds": emb})
                torch.cuda.synchronize()
    finally:
        kernels.set_compile("auto")
    # the pass runs the values-only kernel; the arg-max one only when a path is read
    assert ("maxtimes_values", F64, "cuda") in kernels._COMPILED_KEYS
    assert not kernels._state["failed"]
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
    assert any(n.startswith("triton") for n in names), names
    sr = semirings[0]
    got = _readouts(sr, compiled.value("inputs_embeds", sr))
    for f, g in zip(got, _readouts(sr, eager.value("inputs_embeds", sr)), strict=True):
        torch.testing.assert_close(f, g, rtol=1e-12, atol=0)


SYNC_SETS = {
    "Real": [sbp.Real()],
    "MaxProduct(tensor)": [sbp.MaxProduct("tensor")],
    "MaxProduct": [sbp.MaxProduct()],
    "Entropy": [sbp.Entropy()],
    "TopK(3)": [sbp.TopK(3)],
    "three": [sbp.Real(), sbp.MaxProduct(), sbp.Entropy()],
}


#: where a call may wait for the device: the trace lookup, before the call queues
#: anything (it compares samples of the weights with the trace's), and the checks for
#: non-finite values (the forward's and the pass's), read once at the end, after every
#: kernel of the call is queued
END_CHECKS = ("graph", "confirm", "_first_overflow", "_fine")


@pytest.mark.parametrize("replayed", [False, True], ids=["from Python", "CUDA graph"])
@pytest.mark.parametrize("label", list(SYNC_SETS))
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_a_traced_pass_waits_for_the_device_only_at_its_end(name, label, replayed):
    """Once traced, a call (forward values and the reverse pass, ``keep=`` the input)
    queues its work without waiting for the GPU: torch's sync debug mode reports every
    operation that synchronizes, and each must be one of the checks read at the end.
    So it is when the pass runs from Python, and when it is a replayed CUDA graph."""
    import traceback

    spec, model, emb = _spec_model(name, torch.float32)
    model, emb = model.cuda(), emb.cuda()
    bp = sbp.Backprop(
        model, spec.output, SYNC_SETS[label], keep=("inputs_embeds",), cuda_graphs=replayed
    )
    want = bp(kwargs={"inputs_embeds": emb})  # traces and checks the trace (syncs)
    if replayed:
        want = bp(kwargs={"inputs_embeds": emb})  # captured here
        assert len(bp.captured) == 1, bp._traces.passes.why_not
    want = [f.clone() for sr in SYNC_SETS[label]
            for f in _readouts(sr, want.value("inputs_embeds", sr))]  # fmt: skip
    torch.cuda.synchronize()
    waits = []

    def seen(message, *args, **kwargs):
        if "synchroniz" in str(message):
            waits.append([f.name for f in traceback.extract_stack()])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        try:
            torch.cuda.set_sync_debug_mode("warn")  # (it warns that it is a prototype)
            res = bp(kwargs={"inputs_embeds": emb})
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [w for w in waits if "set_sync_debug_mode" not in w]
    elsewhere = [w[-6:] for w in waits if not any(c in w for c in END_CHECKS)]
    assert not elsewhere, elsewhere
    assert len(waits) <= 3, waits
    got = [f for sr in SYNC_SETS[label] for f in _readouts(sr, res.value("inputs_embeds", sr))]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_memory_budget_reads_the_devices_free_memory():
    from semiring_backprop.engine import budget

    device = torch.device("cuda")
    free, total = torch.cuda.mem_get_info(device)
    got = budget.available(device)
    assert 0 < got <= total
    # memory torch holds but does not use counts as free
    hold = torch.empty(2**28, dtype=torch.uint8, device=device)
    del hold
    assert budget.available(device) >= torch.cuda.mem_get_info(device)[0]


def test_a_pass_too_large_for_the_device_is_refused_before_it_starts(monkeypatch):
    spec, model, emb = _spec_model("bert")
    model, emb = model.cuda(), emb.cuda()
    monkeypatch.setenv("SEMIRING_BACKPROP_MEMORY", "1000")
    with pytest.raises(sbp.errors.OutOfMemoryError, match="GiB is free on cuda"):
        sbp.Backprop(model, spec.output, [sbp.TopK(3)])(kwargs={"inputs_embeds": emb})


def test_cli_explain_on_cuda_gives_the_cpu_numbers(tmp_path, _offline_quiet):
    import transformers

    from test_explain import MASKED_TEXT, _explain_argv, _save_bert, run_cli

    model_dir = _save_bert(tmp_path, transformers.BertForMaskedLM)
    runs = {}
    for device in ("cpu", "cuda"):
        run = run_cli(_explain_argv(model_dir, MASKED_TEXT, "are", "is", "--device", device))
        assert run.rc == 0, run.err
        runs[device] = run.ex
    cpu, gpu = runs["cpu"], runs["cuda"]
    maxp = sbp.MaxProduct()  # (explain computes MaxProduct, Entropy and PathCount)
    assert gpu.result.at(gpu.source, maxp).hi.device.type == "cuda"
    assert gpu.tokens == cpu.tokens
    assert gpu.score == pytest.approx(cpu.score, rel=1e-4, abs=1e-6)
    got, want = (r.result.at(r.source, maxp).hi.cpu() for r in (gpu, cpu))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
    assert gpu.path.value == pytest.approx(cpu.path.value, rel=1e-3)


# -- passes replayed as CUDA graphs ---------------------------------------------------------


def _fields(semirings, res, place="inputs_embeds"):
    return [f for sr in semirings for f in _readouts(sr, res.value(place, sr))]


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0, equal_nan=True)


REPLAYED = [(label, ("inputs_embeds",)) for label in SYNC_SETS] + [("three", None)]


@pytest.mark.parametrize(("label", "keep"), REPLAYED, ids=[
    f"{label}-{'keep' if keep else 'checkpoints'}" for label, keep in REPLAYED])  # fmt: skip
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_a_replayed_pass_gives_the_pass_run_from_python(name, label, keep):
    """The second call with inputs of one shape captures the pass, later ones replay it:
    every semiring's values equal those of the same pass run from Python on each new
    input, and a result already returned does not change when the graph replays. With
    ``keep=None`` (checkpoints), top paths read from a replayed result are the same."""
    spec, model, emb = _spec_model(name)
    model, emb = model.cuda(), emb.cuda()
    semirings = SYNC_SETS[label]
    bp = sbp.Backprop(model, spec.output, semirings, keep=keep, cuda_graphs=True)
    ref = sbp.Backprop(model, spec.output, semirings, keep=keep, cuda_graphs=False)
    torch.manual_seed(1)
    inputs = [emb] + [emb + 0.1 * torch.randn_like(emb) for _ in range(3)]
    results = []
    for i, x in enumerate(inputs):
        res = bp(kwargs={"inputs_embeds": x})
        assert len(bp.captured) == (0 if i == 0 else 1), bp._traces.passes.why_not
        _same(_fields(semirings, res), _fields(semirings, ref(kwargs={"inputs_embeds": x})))
        results.append([f.clone() for f in _fields(semirings, res)])
    assert ref.captured == []
    for res_fields, x in zip(results, inputs, strict=True):  # still what they were
        _same(res_fields, _fields(semirings, ref(kwargs={"inputs_embeds": x})))
    (row,) = bp.captured
    assert row["input shapes"] == [tuple(emb.shape)]
    assert row["pool MB"] > 0
    if keep is None:
        res, want = (
            bp(kwargs={"inputs_embeds": inputs[2]}),
            ref(kwargs={"inputs_embeds": inputs[2]}),
        )
        for sign in "+-":
            got, exp = (
                res.top_path("inputs_embeds", sign=sign),
                want.top_path("inputs_embeds", sign=sign),
            )
            assert got.value == pytest.approx(exp.value, rel=1e-12) and len(got) == len(exp)


def test_replays_follow_lengths_weights_and_checks(monkeypatch):
    """A new length is captured apart (at most PER_MODEL kept, least recently used let
    go); a weight written in place is read by the next call (the trace's check sees the
    write and the captured passes are let go); a NaN input of a replayed call is refused
    as it is from Python; ``cuda_graphs=False`` and the environment variable turn it off."""
    from semiring_backprop.engine import graphed

    spec, model, emb = _spec_model("bert")
    model = model.cuda()
    semirings = [sbp.Real(), sbp.MaxProduct()]
    monkeypatch.setattr(graphed, "PER_MODEL", 2)
    bp = sbp.Backprop(model, spec.output, semirings, keep=("inputs_embeds",), cuda_graphs=True)
    torch.manual_seed(2)
    hidden = emb.shape[-1]
    for length in (4, 5, 6, 4):
        x = torch.randn(1, length, hidden, dtype=F64, device="cuda")
        for _ in range(3):
            res = bp(kwargs={"inputs_embeds": x})
        ref = sbp.Backprop(model, spec.output, semirings, keep=("inputs_embeds",),
                           cuda_graphs=False)(kwargs={"inputs_embeds": x})  # fmt: skip
        _same(_fields(semirings, res), _fields(semirings, ref))
    assert [r["input shapes"][0][1] for r in bp.captured] == [6, 4]

    x = emb.cuda()
    for _ in range(3):
        bp(kwargs={"inputs_embeds": x})
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "layer.0" in n and "weight" in n).mul_(1.5)
    res = bp(kwargs={"inputs_embeds": x})
    assert bp.captured == []
    x_ = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(spec.output(model(inputs_embeds=x_)), x_)
    torch.testing.assert_close(res.at("inputs_embeds", sbp.Real()), grad)

    bad = x.clone()
    bad[0, 1, 2] = float("nan")
    for _ in range(2):
        bp(kwargs={"inputs_embeds": x})
    assert len(bp.captured) == 1
    with pytest.raises(sbp.errors.NonFiniteError, match="inputs_embeds"):
        bp(kwargs={"inputs_embeds": bad})

    off = sbp.Backprop(model, spec.output, semirings, keep=("inputs_embeds",), cuda_graphs=False)
    monkeypatch.setenv("SEMIRING_BACKPROP_CUDA_GRAPHS", "0")
    default_off = sbp.Backprop(model, spec.output, semirings, keep=("inputs_embeds",))
    for b in (off, default_off):
        for _ in range(3):
            b(kwargs={"inputs_embeds": x})
        assert b.captured == []
