"""Where the time and the memory of one pass go (``bench_passes.py --profile``).

Time: one call under torch.profiler (shapes recorded), with each rule call inside
``record_function("rule <kind>")`` and the forward inside ``record_function("forward")``;
per part (the forward, each rule kind, the engine around them), its time, the ops' self
time in it and the rest (Python), and its costliest ops by shape. Python overhead of
the call: its wall time less every op's self time. Memory: what the forward holds for the
reverse pass (by op and shape) against what autograd saves for its backward.

    python benchmarks/profile_passes.py --cases bert --tokens 128 512 --sets Real
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_backprop import _inputs, _time  # noqa: E402
from pass_cases import CASES, SETS, Skip, arguments, build, prepare, sync  # noqa: E402

import semiring_backprop as sbp  # noqa: E402
from semiring_backprop import rules  # noqa: E402
from semiring_backprop.engine import forward, liveness  # noqa: E402
from semiring_backprop.engine.reverse import needed_nodes  # noqa: E402
from semiring_backprop.places import resolve_keep  # noqa: E402

FORWARD = "forward"
ENGINE = "engine (outside rules and forward: ⊕, reshapes, liveness, checks)"


@contextlib.contextmanager
def _labelled():
    """Each rule call inside ``record_function("rule <kind>")`` and the forward inside
    ``record_function("forward")`` (reshaping ops run no rule: they count as engine)."""
    from semiring_backprop.rules.routing import reshape_back

    plain_lookup, plain_forward, wrapped = rules.lookup, forward.run_deferred, {}

    def lookup(target):
        rule = plain_lookup(target)
        if rule is None or rule.fn is reshape_back:
            return rule
        if (rule.fn, rule.kind) not in wrapped:

            def fn(*args, _fn=rule.fn, _label=f"rule {rule.kind}", **kwargs):
                with torch.profiler.record_function(_label):
                    return _fn(*args, **kwargs)

            wrapped[rule.fn, rule.kind] = fn
        return dataclasses.replace(rule, fn=wrapped[rule.fn, rule.kind])

    def run_deferred(*args, **kwargs):
        with torch.profiler.record_function(FORWARD):
            return plain_forward(*args, **kwargs)

    rules.lookup, forward.run_deferred = lookup, run_deferred
    try:
        yield
    finally:
        rules.lookup, forward.run_deferred = plain_lookup, plain_forward


def _profiled(fn, device):
    """``(wall seconds, events)`` of one call under torch.profiler (shapes recorded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    return wall, prof.events()


def where_time_goes(events, wall: float) -> dict:
    """Per owner (``forward``, ``rule <kind>``, the engine): ``[seconds in all, in ops'
    self time, {(op, shapes): [calls, seconds]}]``; the rest of an owner's time is
    Python. Op time is every profiler event's self time but our labels'."""
    labels = {FORWARD} | {f"rule {k}" for k in rules.registry.KINDS}
    out = collections.defaultdict(lambda: [0.0, 0.0, collections.defaultdict(lambda: [0, 0.0])])
    for e in events:
        owner, p = ENGINE, e.cpu_parent
        while p is not None and owner == ENGINE:
            owner = p.name if p.name in labels else owner
            p = p.cpu_parent
        if e.name in labels:
            if owner == ENGINE:  # a top-level label (not one nested inside the forward)
                out[e.name][0] += e.cpu_time_total / 1e6
            continue
        out[owner][1] += e.self_cpu_time_total / 1e6
        ops = out[owner][2][e.name, str(e.input_shapes)]
        ops[0] += 1
        ops[1] += e.self_cpu_time_total / 1e6
    out[ENGINE][0] = wall - sum(v[0] for k, v in out.items() if k != ENGINE)
    return out


def profile_case(case, tokens, label, args):
    """Where one call's time goes, against autograd's profile."""
    device, dtype = args.device, getattr(torch, args.dtype)
    model, output = build(case, dtype, device)
    emb = _inputs(model, tokens, dtype, device)
    semirings, keep = SETS[label]
    bp = sbp.Backprop(model, output, list(semirings), keep=keep)
    call = lambda: bp(kwargs={"inputs_embeds": emb})  # noqa: E731

    def autograd():
        x = emb.clone().requires_grad_()
        return torch.autograd.grad(output(model(inputs_embeds=x)), x)

    call(), autograd()
    t_ref, t = _time(autograd, args.reps, device), _time(call, args.reps, device)
    ref_wall, ref_events = _profiled(autograd, device)
    ref_ops = sum(e.self_cpu_time_total for e in ref_events) / 1e6
    ref_mm = sum(e.self_cpu_time_total for e in ref_events
                 if e.name in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6  # fmt: skip
    with _labelled():
        call()
        wall, events = _profiled(call, device)
    parts = where_time_goes(events, wall)
    ops = sum(v[1] for v in parts.values())
    print(f"\n### {CASES[case][0]}, {tokens} tokens, {label}\n")
    print(
        f"call {t * 1e3:.0f} ms unprofiled, {wall * 1e3:.0f} ms profiled; autograd "
        f"{t_ref * 1e3:.0f} ms unprofiled ({t / t_ref:.2f}x), {ref_wall * 1e3:.0f} ms profiled, "
        f"of which ops {ref_ops * 1e3:.0f} ms (mm, addmm, bmm {ref_mm * 1e3:.0f} ms)."
    )
    print(
        f"ops' self time {ops * 1e3:.0f} ms; Python (profiled wall - ops) "
        f"{(wall - ops) * 1e3:.0f} ms, (unprofiled wall - ops) {(t - ops) * 1e3:.0f} ms.\n"
    )
    print("| part | ms | ops' self ms | Python ms | top ops (calls, ms) |")
    print("|---|---|---|---|---|")
    for owner, (total, self_ops, by_op) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        top = sorted(by_op.items(), key=lambda kv: -kv[1][1])[: args.top]
        tops = "; ".join(f"{name.removeprefix('aten::')} {shapes} ({n}, {s * 1e3:.1f})"
                         for (name, shapes), (n, s) in top)  # fmt: skip
        print(f"| {owner} | {total * 1e3:.0f} | {self_ops * 1e3:.0f} | "
              f"{(total - self_ops) * 1e3:.0f} | {tops} |", flush=True)  # fmt: skip
    print("\nMemory held when the reverse pass starts (values, MB):")
    _show_held("the pass's forward", held_by_forward(bp, emb, keep), args.top)
    _show_held("autograd's saved tensors", saved_by_autograd(model, output, emb), args.top)


def _storage_key(t):
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def held_by_forward(bp, emb, keep) -> dict:
    """``{(op, shape): [values, bytes]}`` that the forward of ``bp``'s pass holds when
    the reverse pass starts (weights and the input left out; one count per storage)."""
    kwargs = {"inputs_embeds": emb}
    graph = bp.graph(kwargs=kwargs)
    needed = needed_nodes(graph, graph.output_node)
    drop = None
    if keep is not None:
        drop = liveness.unread_values(graph, needed, set(resolve_keep(graph, keep)))
    with torch.no_grad():
        values = forward.run(graph, (), kwargs, drop)
    skip = {_storage_key(v) for v in graph.constants.values() if isinstance(v, torch.Tensor)}
    skip.add(_storage_key(emb))
    return _by_shape(((str(n.target), v) for n, v in values.items()), skip)


def _by_shape(pairs, skip=frozenset()) -> dict:
    out, seen = collections.defaultdict(lambda: [0, 0]), set(skip)
    for name, t in pairs:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            continue
        key = _storage_key(t)
        if key in seen or key[1] == 0:
            continue
        seen.add(key)
        out[name.removeprefix("aten."), tuple(t.shape)][0] += 1
        out[name.removeprefix("aten."), tuple(t.shape)][1] += key[1]
    return out


def saved_by_autograd(model, output, emb) -> dict:
    """What autograd saves for the backward, as :func:`held_by_forward` counts it."""
    saved = []
    x = emb.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = output(model(inputs_embeds=x))
    skip = {_storage_key(p) for p in model.parameters()} | {_storage_key(x)}
    held = _by_shape((("saved", t) for t in saved), skip)
    del out
    return held


def _show_held(title, held, top):
    total = sum(b for _, b in held.values())
    rows = sorted(held.items(), key=lambda kv: -kv[1][1])[:top]
    parts = "; ".join(
        f"{op} {list(shape)} ({n}, {b / 2**20:.0f} MB)" for (op, shape), (n, b) in rows
    )
    print(f"- {title}: {total / 2**20:.0f} MB; largest: {parts}")


def profile_all(args):
    """:func:`profile_case` for every case, length and set of ``args``."""
    for case, tokens, label in itertools.product(args.cases, args.tokens, args.sets):
        try:
            profile_case(case, tokens, label, args)
        except Skip as e:
            print(f"skipped {CASES[case][0]}: {e}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    arguments(p)
    args = p.parse_args(argv)
    prepare(args)
    profile_all(args)


if __name__ == "__main__":
    main()
