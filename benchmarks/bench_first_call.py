"""The first call of ``sbp.backprop`` in a fresh process, at 20, 128 and 512 tokens.

Each length runs in a subprocess of its own (nothing traced, compiled or cached before
it), the model loaded before the clock starts: the first call (trace, forward, the check
of the trace against the model's own forward, the pass), the part of it spent tracing,
and a second call with the same inputs (the pass alone). The scalar explained is
log p(" Mary") - log p(" John") at the last position (``sbp.WordChoice``), with the
``Real`` semiring, as in a user's first call. ``--cases smol``: SmolLM2-135M-Instruct
(30 layers, real weights, from its GGUF file); ``tiny`` (the default): a random 4-layer
Llama. ``--against DIR`` runs the same with the package imported from ``DIR`` (another
checkout's ``src``), in turn with this one, and prints the ratio of the first calls: on
a busy machine timings drift, and the two are measured in the same run. Seconds are
wall-clock; ``cpu`` is the process's CPU time (it counts every thread).

    python benchmarks/bench_first_call.py --cases smol
    python benchmarks/bench_first_call.py --cases smol --tokens 20 512 --against ../base/src
    python benchmarks/bench_first_call.py --cases smol --threads 1 --repeat 2   # a busy machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_RUN = r"""
import json, time, torch
import semiring_backprop as sbp
from semiring_backprop.tracing import trace as T

case, tokens = {case!r}, {tokens!r}
if case == "smol":
    import transformers
    from semiring_backprop.hf.gguf import parts, smollm2
    where, how = parts(smollm2())
    tok = transformers.AutoTokenizer.from_pretrained(where, **how)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        where, dtype=torch.float32, **how).eval()
    text = "When Mary and John went to the store, John gave a drink to"
    ids = tok(" ".join([text] * (tokens // 8 + 1)), return_tensors="pt")["input_ids"]
    ids = ids[:, -tokens:]
    mary = tok(" Mary", add_special_tokens=False)["input_ids"][0]
    john = tok(" John", add_special_tokens=False)["input_ids"][0]
else:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)).eval()
    ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(1))
    mary, john = 5, 7
kwargs = {{"input_ids": ids, "attention_mask": torch.ones_like(ids)}}
last = ids.shape[1] - 1
output = sbp.WordChoice(((0, last, mary, 1), (0, last, john, -1)))
traced = [0.0]
real = T._trace
def timed(*args):
    t = time.perf_counter()
    try:
        return real(*args)
    finally:
        traced[0] += time.perf_counter() - t
T._trace = timed

def call():
    return sbp.backprop(model, kwargs=kwargs, semirings=[sbp.Real()], output=output)

t0, c0 = time.perf_counter(), time.process_time()
call()
t1, c1 = time.perf_counter(), time.process_time()
call()
t2 = time.perf_counter()
print(json.dumps({{"first": t1 - t0, "cpu": c1 - c0, "trace": traced[0], "second": t2 - t1}}))
"""


def run(case: str, tokens: int, src: str | None = None, threads: int = 0) -> dict:
    """One fresh process: the first and second call's seconds (``src``: import the
    package from there; ``threads``: torch's threads, 0 for its default)."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _RUN.format(case=case, tokens=tokens)],
                         capture_output=True, text=True, env=env, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=["tiny"], choices=["tiny", "smol"])
    p.add_argument("--tokens", nargs="+", type=int, default=[20, 128, 512])
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each; the least is kept, every run printed")  # fmt: skip
    p.add_argument("--against", metavar="DIR", help="another checkout's src to compare with")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's threads (1 on a busy machine: timings steadier)")  # fmt: skip
    args = p.parse_args(argv)
    trees = [("this", None)] + ([("against", args.against)] if args.against else [])
    for case in args.cases:
        threads = f", {args.threads} thread(s)" if args.threads else ""
        print(f"{case}: seconds of the first call in a fresh process (least of {args.repeat}"
              f"{threads})")  # fmt: skip
        head = f"{'tokens':>6} {'tree':>8} {'first':>7} {'cpu':>7} {'trace':>7} {'second':>7}"
        print(head + ("  against/this" if args.against else ""))
        for tokens in args.tokens:
            best: dict = {}
            firsts: dict = {name: [] for name, _ in trees}
            for _ in range(args.repeat):
                for name, src in trees:  # (in turn: a drift of the machine hits both)
                    r = run(case, tokens, src, args.threads)
                    firsts[name].append(r["first"])
                    if name not in best or r["first"] < best[name]["first"]:
                        best[name] = r
            for name, _ in trees:
                r = best[name]
                line = (f"{tokens:>6} {name:>8} {r['first']:7.2f} {r['cpu']:7.2f} "
                        f"{r['trace']:7.2f} {r['second']:7.2f}")  # fmt: skip
                if name == "against":
                    line += f"  {r['first'] / best['this']['first']:12.2f}"
                if args.repeat > 1:  # (every run's first call, not only the least)
                    line += "  runs: " + " ".join(f"{t:.2f}" for t in firsts[name])
                print(line, flush=True)


if __name__ == "__main__":
    main()
