"""On a CUDA device the pass gives what it gives on the CPU (skipped without a GPU).

Every semiring on BERT, GPT-2 and Llama built from small configs, in float64: the values
at the input embeddings, with every value kept and with ``keep=``, the top path and the
top-k paths; ``Real`` against torch.autograd on the device.
"""

from __future__ import annotations

import copy

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


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_cuda_values_equal_cpu_values(name):
    from test_branches import HF_SPECS

    spec = HF_SPECS[name]
    torch.manual_seed(5)
    model = spec.build().to(F64).eval()
    emb = model.get_input_embeddings()(torch.randint(1, 20, (1, 6))).detach()
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
                torch.testing.assert_close(g.cpu(), w, rtol=1e-9, atol=1e-12)

    x = gpu_emb.clone().requires_grad_()
    (grad,) = torch.autograd.grad(spec.output(gpu_model(inputs_embeds=x)), x)
    torch.testing.assert_close(gpu.at("inputs_embeds", sbp.Real()), grad)

    gpu = sbp.Backprop(gpu_model, spec.output, SEMIRINGS)(kwargs={"inputs_embeds": gpu_emb})
    for sign in "+-":
        path = gpu.top_path("inputs_embeds", sign=sign)
        want = cpu.top_path("inputs_embeds", sign=sign)
        assert path.value == pytest.approx(want.value, rel=1e-9)
        assert len(path) == len(want)
    got = [p.value for p in gpu.top_paths("inputs_embeds", 3)]
    assert got == pytest.approx([p.value for p in cpu.top_paths("inputs_embeds", 3)], rel=1e-9)
