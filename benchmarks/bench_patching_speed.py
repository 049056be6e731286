"""Exact node patching, the QK-fixed site scores and a faithfulness-curve point on a real
causal LM, each against the way it was computed before, measured in one run on one pair
(the pair of ``bench_site_agreement.py``), with the largest difference between the two.

- ``node_effects``: one whole forward of the traced graph per site (``Patching.output``
  with the site replaced, ``batch`` at a time: the code before), against
  ``Patching.node_effects`` (each site's forward from its node on, the sites of one node
  batched). The whole-forward reference runs on ``--groups`` of the sites' nodes, spread
  over the layers; its time for every site is extrapolated from its time per site (each
  site costs one whole forward of the same graph), and labelled so.
- ``node_scores_qk``: per head, one run of the projections and the logits per site (the
  code before), on the heads of ``--qk-layers`` layers, extrapolated per (head, site),
  against ``Patching.node_scores_qk`` on every site.
- ``metric``: one curve point (the top half of the edges kept) by one residual
  recomputation per destination and an edge lookup per row in Python (the code before),
  against ``Patching.metric``.

    python benchmarks/bench_patching_speed.py [--model smol] [--task ioi] [--threads 1]
        [--groups 5] [--qk-layers 2] [--parts nodes,qk,metric]
"""

from __future__ import annotations

import argparse
import time

import torch


def _seconds(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def _groups(p):
    """``[(nodes, [components])]``: the sites' nodes, in order."""
    out: dict = {}
    for c, comp in enumerate(p.lay.components):
        out.setdefault(comp.nodes, []).append(c)
    return list(out.items())


def whole_forward_effects(p, chosen) -> dict:
    """The code before: ``{(component, position): effect}``, one whole forward per site."""
    from semiring_backprop.ablation.sites import _site_patch

    out = {}
    positions = [q for q in range(p.lay.positions) if q not in p.padding]
    for nodes, cs in chosen:
        a, _ = p.assign[nodes[0]]
        keys, keeps = [], []
        for c in cs:
            for pos in positions:
                k = torch.ones(p.lay.positions, a.shape[1], dtype=a.dtype)
                k[pos] = 1 - a[c]
                keys.append((c, pos))
                keeps.append(k)

        def run(k, nodes=nodes):
            return p.output(replace={n: _site_patch(p.ablated[n], k) for n in nodes})

        for key, m in zip(keys, p.batched(run, torch.stack(keeps))):
            out[key] = p.clean - m
    return out


def bench_nodes(p, groups: int):
    every = _groups(p)
    picked = sorted({round(i * (len(every) - 1) / max(groups - 1, 1)) for i in range(groups)})
    chosen = [every[i] for i in picked]
    new_s, frame = _seconds(p.node_effects)
    ref_s, ref = _seconds(lambda: whole_forward_effects(p, chosen))
    comp = {(c.layer, c.head, c.role): i for i, c in enumerate(p.lay.components)}
    got = {(comp[(int(r.layer), _none(r.head_index), r.role)], int(r.position)): r.effect
           for r in frame.itertuples()}  # fmt: skip
    diff = max(abs(got[k] - v) for k, v in ref.items())
    floor = _noise(p)
    per_site = ref_s / len(ref)
    all_s = per_site * len(frame)
    print(f"node_effects: {len(frame)} sites in {new_s:.1f} s | before (one whole forward "
          f"per site): {per_site * 1e3:.1f} ms per site over {len(ref)} sites of "
          f"{len(chosen)} nodes, all {len(frame)} sites {all_s:.0f} s by extrapolation | "
          f"{all_s / new_s:.1f}x faster | largest difference {diff:.2e} (the whole "
          f"forward's own: {floor:.2e}, m(M) batched against m(M))", flush=True)  # fmt: skip
    return new_s


def _noise(p) -> float:
    """The largest ``|m(M) - m(M)|`` between the clean run and the same whole forward
    batched (``p.batch`` copies along vmap's dimension): float rounding, no patching."""
    from semiring_backprop.ablation.sites import _site_patch

    nodes = p.lay.components[0].nodes
    a, _ = p.assign[nodes[0]]
    keep = torch.ones(p.batch, p.lay.positions, a.shape[1], dtype=a.dtype)
    got = p.batched(lambda k: p.output(replace={n: _site_patch(p.ablated[n], k) for n in nodes}),
                    keep)  # fmt: skip
    return max(abs(m - p.clean) for m in got)


def _none(v):
    import pandas as pd

    return None if v is pd.NA or v is None else int(v)


def old_head_deltas(p, h, cs, positions, grads):
    """The code before: one run of the projections and the logits per site, per head:
    ``(len(cs), len(positions))`` of ``Σ (A - A')·G``."""
    from semiring_backprop.ablation.patching_edges import args_of, call

    def logits(mu):
        local: dict = {}
        for d in (h.q, h.k):
            for proj, x, cols in p.projection_reads(d):
                xd = p.read_input(d, x, mu)
                alt = call(proj, *args_of(proj, {x: xd}, p.base))
                local[proj] = torch.where(cols, alt, local.get(proj, p.base[proj]))
        for n in h.order:
            local[n] = call(n, *args_of(n, local, p.base))
        return local[h.logits][0, h.index]

    a = p.base[h.pattern][0, h.index]
    g = grads[h.pattern][0, h.index]
    sites = [(c, q) for c in cs for q in positions]
    mus = p.all_kept().expand(len(sites), -1, -1).clone()
    for i, (c, q) in enumerate(sites):
        mus[i, c, q] = 0
    new = []
    with torch.no_grad():
        for chunk in mus.split(p.batch):
            new.append(torch.vmap(logits)(chunk))
    a2 = torch.softmax(torch.cat(new), -1)
    a2 = torch.where(torch.isnan(a2), a, a2)
    return ((a - a2) * g).sum((-1, -2)).reshape(len(cs), len(positions))


def bench_qk(p, layers: int, nodes_s: float | None):
    from semiring_backprop.ablation import qk

    heads = qk.attention_heads(p)
    grads = qk._pattern_gradients(p, heads)
    sources = qk._sources(p, p.edges())
    positions = [q for q in range(p.lay.positions) if q not in p.padding]
    total_s, frame = _seconds(p.node_scores_qk)
    blocks: dict = {}
    for h in heads:
        blocks.setdefault(h.layer, []).append(h)
    srcs = {h: sorted(set(sources.get(h.q, [])) | set(sources.get(h.k, []))) for h in heads}
    units = sum(len(cs) * len(positions) for cs in srcs.values())
    new_s, ref_s, ref_units, diff = 0.0, 0.0, 0, 0.0
    last = max(blocks)
    picked = {round(i * last / max(layers - 1, 1)) for i in range(layers)}
    for layer, hs in blocks.items():
        cs = sorted(set().union(*(srcs[h] for h in hs)))
        if not cs:
            continue
        s, got = _seconds(qk._site_deltas, p, hs, cs, positions, grads[hs[0].pattern])
        new_s += s
        if layer not in picked:
            continue
        for k, h in enumerate(hs):
            s, old = _seconds(old_head_deltas, p, h, srcs[h], positions, grads)
            ref_s += s
            ref_units += len(srcs[h]) * len(positions)
            mine = got[[cs.index(c) for c in srcs[h]], :, k]
            diff = max(diff, float((mine - old).abs().max()))
    all_s = ref_s / ref_units * units
    print(f"node_scores_qk: {len(frame)} sites in {total_s:.1f} s, its heads' patterns "
          f"{new_s:.1f} s | before (one run of the projections and logits per head and "
          f"site): {ref_s / ref_units * 1e3:.2f} ms per head and site over {ref_units} of "
          f"layers {sorted(picked)}, all {units} {all_s:.0f} s by extrapolation | "
          f"{all_s / new_s:.1f}x faster | largest difference {diff:.2e}"
          + (f" | {total_s / nodes_s:.2f}x node_effects' time" if nodes_s else ""),
          flush=True)  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smol")
    ap.add_argument("--task", default="ioi")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--qk-layers", type=int, default=2)
    ap.add_argument("--parts", default="nodes,qk,metric")
    args = ap.parse_args(argv)

    from semiring_backprop._threads import threads
    from semiring_backprop.ablation.patching import Patching
    from semiring_backprop.data.lm_tasks import lm_pairs
    from semiring_backprop.experiments import config as make_config
    from semiring_backprop.experiments import faithfulness_lm as flm
    from semiring_backprop.semirings import MaxProduct

    parts = args.parts.split(",")
    cfg = make_config("faithfulness-lm", model=args.model, task=(args.task,), pairs=1,
                      seed=args.seed)  # fmt: skip
    with threads(args.threads):
        model, tok = flm.load_model(cfg)
        (lp,) = lm_pairs(args.task, tok, 1, args.seed, half=cfg.half).pairs
        pair = flm.Pair(model, lp.kwargs(), lp.kwargs(corrupted=True), flm.output_of(lp),
                        cfg, 0)  # fmt: skip
        cm, _ = pair.circuit("MaxProduct", [MaxProduct()])
        p = Patching(cm.result, pair.corrupted, batch=cfg.batch)
        print(
            f"{args.model}, {args.task}: {lp.clean!r} ({p.lay.positions} tokens, "
            f"{len(p.lay.components)} components, {len(p.dests)} destinations)",
            flush=True,
        )
        nodes_s = None
        if "nodes" in parts:
            nodes_s = bench_nodes(p, args.groups)
        if "qk" in parts:
            bench_qk(p, args.qk_layers, nodes_s)


if __name__ == "__main__":
    main()
