"""What exact edge patching would cost against one circuit, measured in one run on the
same model and input (the faithfulness experiment's models are too small to show it).

On one traced ``sbp.Backprop`` (``Real`` and ``MaxProduct``): the circuit (the pass and
``Circuit.from_result``: every site and edge); one forward of the traced graph (the unit
of exact patching: one forward per edge ablated); ``Patching(res, corrupted)`` (the clean
and ablated values) and ``edge_effects`` on the first ``--sample`` edges, batched as the
experiment batches them, from which all edges' time is extrapolated linearly (each edge
costs one forward of its own; the extrapolation is labelled as such); and EAP (one
forward and one backward for all edges). The corrupted input is another random
embedding of the same shape.

    python benchmarks/bench_patching.py                      # BERT 6L-512, 20 and 128 tokens
    python benchmarks/bench_patching.py --cases gpt2 --tokens 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_backprop import _bert, _gpt2, _inputs  # noqa: E402

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop.ablation.patching import EDGE_KEY, Patching  # noqa: E402

CASES = {"bert": ("BERT 6L-512H-8A", _bert), "gpt2": ("GPT-2 small", _gpt2)}


def _seconds(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench(case, tokens, sample, dtype):
    label, build = CASES[case]
    torch.manual_seed(0)
    model, output = build(tokens, dtype, "cpu")
    model = model.to(dtype).eval()
    emb = _inputs(model, tokens, dtype, "cpu")
    other = torch.randn_like(emb) * emb.std()
    bp = sbp.Backprop(model, output, [sbp.Real(), sbp.MaxProduct()])
    kwargs = {"inputs_embeds": emb}
    sbp.Circuit.from_result(bp(kwargs=kwargs))  # traces and compiles, untimed
    circuit_s, c = _seconds(lambda: sbp.Circuit.from_result(bp(kwargs=kwargs)))
    res = bp(kwargs=kwargs)
    graph = res.graph

    def forward():
        with torch.no_grad():
            return model(inputs_embeds=emb)

    forward()
    forward_s = min(_seconds(forward)[0] for _ in range(3))
    setup_s, p = _seconds(lambda: Patching(res, {"inputs_embeds": other}))
    edges = p.edges()
    some = edges.head(sample)[list(EDGE_KEY)]
    p.edge_effects(some.head(2))  # warm
    sample_s, _ = _seconds(lambda: p.edge_effects(some))
    per_edge = sample_s / len(some)
    eap_s, _ = _seconds(p.eap)
    all_s = setup_s + per_edge * len(edges)
    print(
        f"{label}, {tokens} tokens ({str(dtype).removeprefix('torch.')}, {len(graph.nodes)} "
        f"graph nodes): {len(edges)} edges | circuit {circuit_s:.2f} s "
        f"({circuit_s / forward_s:.0f} model forwards of {forward_s * 1e3:.1f} ms) | exact "
        f"edge patching: {per_edge * 1e3:.2f} ms per edge over {len(some)} edges, "
        f"all {len(edges)} edges {all_s:.0f} s by extrapolation "
        f"({all_s / circuit_s:.0f}x the circuit) | EAP {eap_s:.2f} s | circuit edges "
        f"{len(c.edges)}",
        flush=True,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["bert"], choices=list(CASES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[20, 128])
    ap.add_argument("--sample", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = ap.parse_args(argv)
    for case in args.cases:
        for tokens in args.tokens:
            bench(case, tokens, args.sample, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
