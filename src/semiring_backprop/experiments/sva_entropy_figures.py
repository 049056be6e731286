"""The figures of the ``entropy`` experiment (:mod:`.sva_entropy`): Fig. 6a, the path
entropy against the sentence's length, and Fig. 7, against its attractors per length
bin. Both read ``entropy.csv``'s rows and the summary; matplotlib is imported lazily
(the ``plots`` extra)."""

from __future__ import annotations


def _save(fig, path) -> str:
    import matplotlib.pyplot as plt

    from .._files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return str(path)


def length_figure(frame, summary: dict, path) -> str:
    """Fig. 6a: each sentence's mean path entropy against its token count, with the
    mean per length bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.scatter(frame["tokens"], frame["entropy"], s=6, alpha=0.35, color="#0173b2",
               label="one sentence")  # fmt: skip
    bins = summary["length"]["by_tokens"]
    mids = [(int(k.split("-")[0]) + int(k.split("-")[1])) / 2 for k in bins]
    ax.plot(mids, [b["entropy"] for b in bins.values()], marker="o", color="black",
            label="mean per bin")  # fmt: skip
    rho = summary["length"].get("spearman_rho")
    ax.set_xlabel("tokens in the sentence (before the verb)")
    ax.set_ylabel("mean path entropy (nats)")
    ax.set_title(f"{summary.get('model', 'the model')}: entropy against length, "
                 f"{summary['explained']} sentences, Spearman ρ = "
                 f"{'n/a' if rho is None else f'{rho:.2f}'}", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def attractor_figure(frame, summary: dict, path) -> str:
    """Fig. 7: per length bin, each sentence's entropy against its attractor count, with
    the bin's Spearman ρ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bins = summary["attractors"]
    cols = 2 if len(bins) > 1 else 1
    rows = -(-len(bins) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, (label, stats) in zip(axes.flat, bins.items()):
        lo, hi = (int(x) for x in label.split("-"))
        part = frame[(frame["tokens"] >= lo) & (frame["tokens"] < hi)]
        jitter = np.random.default_rng(0).uniform(-0.12, 0.12, len(part))
        ax.scatter(part["attractors"] + jitter, part["entropy"], s=6, alpha=0.4)
        means = stats["mean_entropy"]
        ax.plot(list(means), list(means.values()), marker="o", color="black")
        rho = stats.get("spearman_rho")
        ax.set_title(f"{lo}-{hi} tokens: ρ = {'n/a' if rho is None else f'{rho:.2f}'}, "
                     f"n = {stats['n']}", fontsize=9)  # fmt: skip
        ax.set_xlabel("attractors")
        ax.set_ylabel("mean path entropy")
    for ax in list(axes.flat)[len(bins) :]:
        ax.axis("off")
    fig.suptitle(f"{summary.get('model', 'the model')}: entropy against attractors, by "
                 f"sentence length ({summary['explained']} sentences)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return _save(fig, path)
