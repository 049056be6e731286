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


def _seconds(fn):
    t = time.perf_counter()
    out = fn()
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
    return frame


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
        if "nodes" in parts:
            bench_nodes(p, args.groups)


if __name__ == "__main__":
    main()
