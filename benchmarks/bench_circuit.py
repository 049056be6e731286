"""The circuit of a prediction against the reverse pass alone and against torch.autograd,
measured in one run on the same inputs.

Three things are timed on one traced ``sbp.Backprop`` (``Real`` and ``MaxProduct``, the
circuit's defaults): autograd's forward + backward to the input embeddings; our pass
alone (forward values + reverse pass, checkpointed as by default); and the circuit as
``sbp.circuit`` makes it (the same pass, tapped: it hands over every node's value, and
D where the circuits of this trace read it, instead of each segment being computed
again from the checkpoints; then ``Circuit.from_result``: the forward semiring pass,
every site's max-marginal, the edges between components and the heads' token-to-token
edges). The circuit timed is not the trace's first (which finds what is read). They
run in turn, ``--reps`` rounds; ratios are medians of per-round ratios. Peak memory: the
bytes held by tensors during one call, above what was held before (CPU: from the
profiler; CUDA: the allocator's peak), for the pass and for the circuit.

    python benchmarks/bench_circuit.py                        # BERT 6L-512 and GPT-2, 20 tokens
    python benchmarks/bench_circuit.py --tokens 20 512 --reps 3
    python benchmarks/bench_circuit.py --device cuda --tokens 20 512
    python benchmarks/bench_circuit.py --cases smol --tokens 20 --reps 2  # the real LM
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_backprop import _bert, _gpt2, _inputs, _smol, _time, peak_bytes  # noqa: E402

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop.engine import checkpoints  # noqa: E402

CASES = {
    "bert": ("BERT 6L-512H-8A", _bert),
    "gpt2": ("GPT-2 small", _gpt2),
    "smol": ("SmolLM2-135M-Instruct (real weights)", _smol),  # where installed
}


def bench(case, tokens, reps, device, dtype):
    label, build = CASES[case]
    torch.manual_seed(0)
    model, output = build(tokens, dtype, device)
    model = model.to(dtype).to(device).eval()
    emb = _inputs(model, tokens, dtype, device)
    semirings = [sbp.Real(), sbp.MaxProduct()]
    bp = sbp.Backprop(model, output, semirings)
    kwargs = {"inputs_embeds": emb}

    def ref():
        x = emb.clone().requires_grad_()
        (g,) = torch.autograd.grad(output(model(inputs_embeds=x)), x)
        return g

    def pass_only():
        return bp(kwargs=kwargs)

    def circuit():
        with checkpoints.tapped():  # as sbp.circuit
            res = bp(kwargs=kwargs)
        return sbp.Circuit.from_result(res)

    t = time.perf_counter()
    first = circuit()  # traces, and compiles what the pass compiles
    first_s = time.perf_counter() - t
    rounds = {"autograd": [], "pass": [], "circuit": []}
    for _ in range(reps):
        for name, fn in (("autograd", ref), ("pass", pass_only), ("circuit", circuit)):
            rounds[name].append(_time(fn, 1, device))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    to_pass = statistics.median(c / p for c, p in zip(rounds["circuit"], rounds["pass"]))
    to_ag = statistics.median(c / a for c, a in zip(rounds["circuit"], rounds["autograd"]))
    mem = {name: peak_bytes(fn, device) for name, fn in
           (("autograd", ref), ("pass", pass_only), ("circuit", circuit))}  # fmt: skip
    edges = 0 if first.edges is None else len(first.edges)
    t = time.perf_counter()
    with checkpoints.tapped():
        res = bp(kwargs=kwargs)
    tapped = time.perf_counter() - t
    stages = _stages(res)
    floor = (tapped + stages["forward pass"]) / med["pass"]
    print(
        f"{label}, {tokens} tokens ({device}, {str(dtype).removeprefix('torch.')}): "
        f"autograd {med['autograd'] * 1e3:.0f} ms, pass {med['pass'] * 1e3:.0f} ms, "
        f"circuit {med['circuit'] * 1e3:.0f} ms ({len(first.nodes)} sites, {edges} edges; "
        f"first call {first_s:.1f} s) | circuit / pass {to_pass:.2f}x, "
        f"circuit / autograd {to_ag:.1f}x | peak memory: pass {mem['pass'] / 2**20:.0f} MiB, "
        f"circuit {mem['circuit'] / 2**20:.0f} MiB ({mem['circuit'] / max(mem['pass'], 1):.2f}x "
        f"the pass), autograd {mem['autograd'] / 2**20:.0f} MiB | circuit stages: "
        + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in stages.items())
        + f" | the tapped pass ({tapped * 1e3:.0f} ms) and the forward pass alone: "
        f"{floor:.2f}x the pass",
        flush=True,
    )


def _stages(res):
    """Seconds of each stage of ``Circuit.from_result`` on one pass's result, once: the
    forward semiring pass (alpha for each semiring, up to the last site), the sites'
    scores, the edges, the attention edges. The forward pass and the tapped pass are
    what any circuit of max-marginals needs (alpha and D): their sum over the pass is
    the least ratio such a circuit can reach here."""
    from semiring_backprop.circuits import attention_edges as ae
    from semiring_backprop.circuits import edges as ce
    from semiring_backprop.circuits.layout import circuit_alphas, layout, pinned
    from semiring_backprop.circuits.nodes import circuit_nodes

    res = pinned(res)  # as Circuit.from_result: the stages share the pass's segments
    t = time.perf_counter()
    circuit_alphas(res, res.semirings, "x", None, layout(res))
    out = {"forward pass": time.perf_counter() - t}
    for name, fn in (("sites", circuit_nodes), ("edges", ce.circuit_edges),
                     ("attention edges", ae.attention_edges)):  # fmt: skip
        t = time.perf_counter()
        fn(res, seed="x")
        out[name] = time.perf_counter() - t
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[20])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    for case in args.cases:
        for tokens in args.tokens:
            try:
                bench(case, tokens, args.reps, args.device, dtype)
            except LookupError as e:  # a real checkpoint that is not installed
                print(f"skipped {CASES[case][0]}: {e}", flush=True)
                break


if __name__ == "__main__":
    main()
