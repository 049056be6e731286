"""Seconds of each export and view of a circuit of millions of edges, against the goal of
2 s each: pruning, ``view()`` and ``to_html`` (pruned and whole), ``to_eap_json``,
``to_neuronpedia``, ``to_dot`` and ``to_networkx``. Prints each time and its ratio to
the goal, measured in one run (timings on a shared machine are noisy: compare ratios of
one run, not runs).

Cases: ``synthetic`` (default): frames of SmolLM2's shape (30 layers, 9 heads, 14
positions: every edge of EAP-IG's complete graph at every position, 1.68M edges; random
values, some 0 and some of no path), built in a few seconds. ``smol``: the real IOI
circuit of SmolLM2-135M-Instruct ("When Mary and John went to the store, John gave a
drink to", corrupted "When Alice and Bob ...", log p(Mary) - log p(John)), a few minutes
to build; ``--cache FILE`` keeps it (pickled) for the next run.

    python benchmarks/bench_exports.py [--cases synthetic,smol] [--layers 30 --heads 9
        --positions 14] [--cache /tmp/smol_circuit.pkl] [--skip networkx] [--reps 1]
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import statistics
import tempfile
import time
from dataclasses import replace

import numpy as np

GOAL = 2.0
MP = "MaxProduct(neuron)"
TEXT = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Alice and Bob went to the store, Carl gave a drink to"


def synthetic(layers: int = 30, heads: int = 9, positions: int = 14, seed: int = 0):
    """A circuit of the given shape whose frames have the dtypes of a real one."""
    import pandas as pd

    from semiring_backprop.circuits import Circuit

    rng = np.random.default_rng(seed)
    tokens = [f"Ġw{p}" if p else "When" for p in range(positions)]

    def values(n):
        real = rng.normal(size=n) * (rng.random(n) > 0.08)  # some edges carry 0
        mp = np.where(rng.random(n) > 0.1, rng.normal(size=n), -math.inf)
        return {"Real": real, MP: mp}

    comps = [("embedding", -1, None)]  # (role, layer, head) in order
    rows = []  # (src component, dst component, input): one position's edges
    for layer in range(layers):
        first = len(comps)
        rows += [(s, first + d, q) for s in range(first) for d in range(heads) for q in "qkv"]
        comps += [("head", layer, h) for h in range(heads)]
        mlp = len(comps)
        comps.append(("mlp", layer, None))
        rows += [(s, mlp, "mlp") for s in range(mlp)]
    target = len(comps)
    comps.append(("target", layers, None))
    rows += [(s, target, "target") for s in range(target)]
    src, dst, entry = (np.array(x) for x in zip(*rows))
    n = len(src)
    at = np.tile(np.arange(n), positions)
    pos = np.repeat(np.arange(positions), n)
    role = np.array([c[0] for c in comps], dtype=object)
    layer = np.array([c[1] for c in comps], dtype=float)
    head = np.array([np.nan if c[2] is None else c[2] for c in comps])

    def ints(a):
        return pd.arrays.IntegerArray(np.nan_to_num(a).astype(np.int64), np.isnan(a))

    edges = pd.DataFrame({
        "src_layer": ints(layer[src[at]]), "src_role": pd.array(role[src[at]], dtype="str"),
        "src_head_index": ints(head[src[at]]), "dst_layer": ints(layer[dst[at]]),
        "dst_role": pd.array(role[dst[at]], dtype="str"),
        "dst_head_index": ints(head[dst[at]]), "input": pd.array(entry[at], dtype="str"),
        "position": pd.array(pos, dtype="Int64"),
        "token": pd.array(np.array(tokens, dtype=object)[pos], dtype="str"),
        **values(len(at)),
    })  # fmt: skip
    node_rows = []
    for p in range(positions):
        node_rows.append(("embedding", -1, None, p))
    for layer_ in range(layers):
        for h in range(heads):
            node_rows += [("head", layer_, h, p) for p in range(positions)]
        node_rows += [("mlp", layer_, None, p) for p in range(positions)]
        node_rows += [("residual", layer_, None, p) for p in range(positions)]
    node_rows.append(("target", layers, None, None))
    r, ly, hd, ps = zip(*node_rows)
    nodes = pd.DataFrame({
        "layer": pd.array(ly, dtype="Int64"), "position": pd.array(ps, dtype="Int64"),
        "token": pd.array(["" if p is None else tokens[p] for p in ps], dtype="str"),
        "head_index": pd.array(hd, dtype="Int64"), "role": pd.array(r, dtype="str"),
        "node": pd.array([f"n{i}" for i in range(len(r))], dtype="str"), **values(len(r)),
    })  # fmt: skip
    att = [(layer_, h, q, p) for layer_ in range(layers) for h in range(heads)
           for p in range(positions) for q in range(p + 1)]  # fmt: skip
    ly, hd, q, p = (np.array(x) for x in zip(*att))
    attention = pd.DataFrame({
        "layer": pd.array(ly, dtype="Int64"), "head_index": pd.array(hd, dtype="Int64"),
        "src_position": pd.array(q, dtype="Int64"), "dst_position": pd.array(p, dtype="Int64"),
        "src_token": pd.array(np.array(tokens, dtype=object)[q], dtype="str"),
        "dst_token": pd.array(np.array(tokens, dtype=object)[p], dtype="str"),
        **values(len(ly)),
    })  # fmt: skip
    return Circuit(nodes, edges, attention, ["Real", MP], tokens, what="synthetic",
                   token_ids=list(range(positions)), d_model=576)  # fmt: skip


def smol(cache: str | None):
    """The IOI circuit of SmolLM2-135M-Instruct (pickled to ``cache`` without its pass)."""
    if cache and os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    import semiring_backprop as sbp
    from semiring_backprop.circuits.hf import circuit_of_text

    c = circuit_of_text("smol", TEXT, "Mary", "John", baseline_text=CORRUPT,
                        semirings=[sbp.Real(), sbp.MaxProduct()])  # fmt: skip
    c = replace(c, result=None)
    if cache:
        with open(cache, "wb") as f:
            pickle.dump(c, f)
    return c


def _time(fn, reps: int) -> float:
    """The median seconds of ``fn()``, its result held until timed (a user keeps the
    graph: freeing millions of dicts is not the export's time)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
        del out
    return statistics.median(times)


def _steps(c, out: str, skip: set, reps: int) -> None:
    small = c.prune(cumulative=0.8)
    steps = {
        "prune(cumulative=0.8)": lambda: c.prune(cumulative=0.8),
        "pruned view()": lambda: small.view().html(),
        "pruned to_html": lambda: small.to_html(os.path.join(out, "small.html")),
        "pruned to_eap_json": lambda: small.to_eap_json(os.path.join(out, "small.json")),
        "pruned to_neuronpedia": lambda: small.to_neuronpedia(os.path.join(out, "np.json")),
        "pruned to_dot": lambda: small.to_dot(),
        "view()": lambda: c.view().html(),
        "to_html": lambda: c.to_html(os.path.join(out, "whole.html")),
        "to_eap_json": lambda: c.to_eap_json(os.path.join(out, "whole.json")),
        "to_neuronpedia": lambda: c.to_neuronpedia(os.path.join(out, "whole-np.json")),
        "to_dot": lambda: c.to_dot(),
        "to_networkx": lambda: c.to_networkx(),
    }
    print(f"  (pruned: {small})")
    for name, fn in steps.items():
        if any(s in name for s in skip):
            continue
        t = _time(fn, reps)
        print(f"  {name:24s} {t:7.2f} s   ratio to the {GOAL:g} s goal {t / GOAL:5.2f}",
              flush=True)  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="synthetic")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--positions", type=int, default=14)
    p.add_argument("--cache", help="smol: pickle the circuit here (read it if there)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out")
    p.add_argument("--reps", type=int, default=1)
    args = p.parse_args(argv)
    out = tempfile.mkdtemp()
    skip = set(filter(None, args.skip.split(",")))
    for case in args.cases.split(","):
        start = time.perf_counter()
        if case == "synthetic":
            c = synthetic(args.layers, args.heads, args.positions)
        elif case == "smol":
            c = smol(args.cache)
        else:
            raise SystemExit(f"unknown case {case!r}: synthetic or smol")
        built = time.perf_counter() - start
        print(f"{case}: {c} (built in {built:.1f} s, not timed below)")
        _steps(c, out, skip, args.reps)


if __name__ == "__main__":
    main()
