"""How well each way of scoring a circuit's sites agrees with exact node patching on a
real causal LM, per pair: Pearson and Kendall over the sites and over the heads
(positions summed), and each method's seconds. The sites-only part of the
``faithfulness-lm`` experiment (no edge patching, no curves), for a quick reading of
one method against another on a few pairs.

    python benchmarks/bench_site_agreement.py [--model smol] [--task ioi] [--pairs 1]
        [--methods Real,MaxProduct,EAP,EAP-QK,Real-relevance] [--ig-steps 10[,2,...]]
        [--threads 1] [--out rows.csv]

Methods are the entries of ``semiring_backprop.experiments.faithfulness_lm.methods``
(``Real-IG{n}`` for each ``n`` of ``--ig-steps``). ``--out`` writes the rows (one per
pair and method) as CSV, appending to a file that exists, so runs of several tasks
collect in one table. The ground truth is
``Patching.node_effects()`` (one patched forward per site).
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smol")
    p.add_argument("--task", default="ioi")
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default="Real,MaxProduct,EAP,EAP-QK,Real-relevance")
    p.add_argument("--ig-steps", default="10")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import pandas as pd

    from semiring_backprop._threads import threads
    from semiring_backprop.ablation.faithfulness import agreement
    from semiring_backprop.ablation.patching import Patching
    from semiring_backprop.data.lm_tasks import lm_pairs
    from semiring_backprop.experiments import config as make_config
    from semiring_backprop.experiments import faithfulness_lm as flm
    from semiring_backprop.experiments.faithfulness import complete
    from semiring_backprop.semirings import MaxProduct

    steps = tuple(int(n) for n in args.ig_steps.split(","))
    cfg = make_config("faithfulness-lm", model=args.model, task=(args.task,),
                      pairs=args.pairs, seed=args.seed, ig_steps=steps)  # fmt: skip
    wanted = args.methods.split(",")
    chosen = [m for m in flm.methods(cfg) if m.name in wanted]
    missing = set(wanted) - {m.name for m in chosen}
    if missing:
        raise SystemExit(f"unknown methods {sorted(missing)}: "
                         f"{[m.name for m in flm.methods(cfg)]}")  # fmt: skip
    with threads(args.threads):
        model, tok = flm.load_model(cfg)
        pairs = lm_pairs(args.task, tok, args.pairs, args.seed, half=cfg.half).pairs
        rows = []
        for i, lp in enumerate(pairs):
            pair = flm.Pair(model, lp.kwargs(), lp.kwargs(corrupted=True), flm.output_of(lp),
                            cfg, i)  # fmt: skip
            cm, _ = pair.circuit("MaxProduct", [MaxProduct()])
            pair.pt = pt = Patching(cm.result, pair.corrupted, batch=cfg.batch)
            t = time.perf_counter()
            effects = pt.node_effects(progress=True)
            exact = time.perf_counter() - t
            exact_heads = flm.head_totals(effects, "effect", "")
            print(f"pair {i}: {lp.clean!r} / {lp.corrupted!r}: m(M) {pt.clean:.3f}, "
                  f"m(none) {pt.empty:.3f}; exact node patching {len(effects)} sites "
                  f"in {exact:.0f} s", flush=True)  # fmt: skip
            for m in chosen:
                _, nodes, _, secs = m.score(pair)
                nodes = complete(nodes, effects)
                heads = flm.head_totals(nodes, "score", m.name)
                a, h = agreement(nodes, effects), agreement(heads, exact_heads)
                rows.append({"task": args.task, "pair": i, "method": m.name,
                             "sites_pearson": a["pearson"],
                             "sites_kendall": a["kendall"], "heads_pearson": h["pearson"],
                             "heads_kendall": h["kendall"], "top10": a["top_n_overlap"],
                             "seconds": secs})  # fmt: skip
                print(pd.DataFrame(rows[-1:]).to_string(index=False, header=not i and
                      m is chosen[0], float_format="%.3f"), flush=True)  # fmt: skip
    frame = pd.DataFrame(rows)
    if args.out:
        import os

        frame.to_csv(args.out, mode="a", header=not os.path.exists(args.out), index=False)
    print("\nmeans over the pairs:")
    print(frame.groupby("method", sort=False).mean(numeric_only=True).drop(columns="pair")
          .to_string(float_format="%.3f"))  # fmt: skip


if __name__ == "__main__":
    main()
