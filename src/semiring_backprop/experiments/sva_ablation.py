"""The ablation half of ``sva`` on a causal LM: is the key or the value the route by
which the subject's number reaches the verb, cause for cause?

For every pair and every layer, the subject's key edge and its value edge into the last
position (every head of that layer, the last query only:
:class:`~semiring_backprop.ablation.reads.LastQueryReads`) are replaced, each alone, by

- ``mean``: the mean over the data set of that layer's key (value) at the subject
  positions of all pairs (the projections' outputs; the key rotated at the pair's
  own subject position), and
- ``patch``: the key (value) at the subject of the pair's counterpart, the same frame
  with a subject of the other number (:func:`~semiring_backprop.data.agreement_pairs.
  counterpart`); only where both have as many tokens and the subject ends at the same
  token, the other pairs counted as skipped.

Each pair's variants (``1 + layers x 2 x 2``) run as one batch of one token each, from
one run of the prefix. One JSON line per pair in ``ablation.jsonl`` (a rerun resumes);
the means are kept in ``ablation_means.pt`` with the ids they were taken over.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..runner.records import Records
from .causal_inputs import prefix_inputs

METHODS = ("mean", "patch")
BRANCHES = ("key", "value")


def pairs(located, tokenizer, max_len) -> tuple[list[dict], dict]:
    """``(pairs, skipped)``: per pair its id, inputs (``ids``, ``source``, ``good``,
    ``bad``), attractor count and the counterpart's ids (None where it cannot be
    patched); ``skipped``: reason -> count of the pairs left out of patching."""
    from ..data.agreement_pairs import counterpart
    from ..runner import from_agreement

    out, skipped = [], {}
    for ex in located:
        got = prefix_inputs(ex, tokenizer, max_len)
        if "skipped" in got:
            continue  # the runner's skips: counted in the summary already
        other, why = counterpart(ex), None
        if other is None:
            why = "the subject is no noun of the generator's vocabulary (no counterpart)"
        else:
            twin = prefix_inputs(other, tokenizer, max_len)
            if "skipped" in twin:
                why = f"the counterpart is skipped: {twin['skipped']}"
            elif len(twin["ids"]) != len(got["ids"]) or twin["source"] != got["source"]:
                why = "the counterpart has another number of tokens (or the subject ends elsewhere)"
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
        count = ex.attractors if ex.attractors is not None else len(ex.attractor_positions or ())
        out.append({"id": from_agreement(ex).id, "ids": got["ids"], "source": got["source"],
                    "good": got["good"], "bad": got["bad"], "attractors": count,
                    "other": None if why else twin["ids"]})  # fmt: skip
    return out, skipped


def run(model, todo: list[dict], out: Path, progress: bool = True) -> Records:
    """Ablate every pair of ``todo`` (:func:`pairs`) not yet in ``out/ablation.jsonl``;
    the records."""
    from tqdm.auto import tqdm

    from ..ablation.reads import LastQueryReads, Variant

    reads = LastQueryReads(model)
    means = _means(reads, todo, out, progress)
    records = Records(out / "ablation.jsonl")
    left = [p for p in todo if not records.has(p["id"])]
    for p in tqdm(left, desc="ablation", unit="pair", disable=not progress, leave=False):
        twin = reads.states(p["other"], p["source"]) if p["other"] is not None else None
        sources = {"mean": means, "patch": twin}
        plan = [(None, None, None)]  # the clean run first
        for method in METHODS:
            if sources[method] is not None:
                plan += [(method, b, layer) for layer in range(reads.layers) for b in BRANCHES]
        variants = [Variant() if m is None else Variant(layer, b, sources[m][b][layer])
                    for m, b, layer in plan]  # fmt: skip
        logits = reads.logits(p["ids"], p["source"], variants).double()
        margin = (logits[:, p["good"]] - logits[:, p["bad"]]).tolist()
        row = {"key": p["id"], "attractors": p["attractors"], "clean": margin[0]}
        for method in METHODS:
            for b in BRANCHES:
                got = [m for (mm, bb, _), m in zip(plan, margin) if mm == method and bb == b]
                row[f"{method}_{b}"] = got or None
        records.add(row)
    return records


def _means(reads, todo: list[dict], out: Path, progress: bool) -> dict:
    """``{"key": (layers, kv_dim), "value": ...}``: the mean over the pairs of each
    layer's projections at the subject; kept in ``out/ablation_means.pt`` with a hash of
    the pairs' ids and inputs, and computed again where they changed."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256(json.dumps([[p["id"], p["ids"], p["source"]] for p in todo])
                            .encode()).hexdigest()  # fmt: skip
    path = out / "ablation_means.pt"
    if path.exists():
        kept = torch.load(path, weights_only=True)
        if kept.get("digest") == digest:
            return {b: kept[b] for b in BRANCHES}
    total = {b: 0.0 for b in BRANCHES}
    for p in tqdm(todo, desc="mean keys and values", unit="pair", disable=not progress,
                  leave=False):  # fmt: skip
        got = reads.states(p["ids"], p["source"])
        for b in BRANCHES:
            total[b] = total[b] + got[b].double()
    dtype = next(reads.model.parameters()).dtype
    means = {b: (total[b] / max(len(todo), 1)).to(dtype) for b in BRANCHES}
    from .._files import atomic_write

    atomic_write(path, lambda tmp: torch.save({**means, "digest": digest}, tmp))
    return means


def table(rows: list[dict], top: dict | None = None):
    """``ablation.csv``: per method, layer and branch, the pairs, the mean change of
    the margin (ablated minus clean) and its standard error, the accuracy before and
    after; ``top``: ``{layer: branch}`` the top path names for the subject there."""
    import pandas as pd

    out = []
    frame = pd.DataFrame(rows)
    for method in METHODS:
        for b in BRANCHES:
            col = f"{method}_{b}"
            have = frame[frame[col].notna()] if col in frame else frame.iloc[:0]
            if not len(have):
                continue
            values = torch.tensor(have[col].tolist(), dtype=torch.float64)  # (pairs, layers)
            clean = torch.tensor(have["clean"].tolist(), dtype=torch.float64)[:, None]
            delta = values - clean
            for layer in range(values.shape[1]):
                d = delta[:, layer]
                out.append({
                    "method": method, "layer": layer, "branch": b, "pairs": len(d),
                    "margin_change": float(d.mean()),
                    "margin_change_se": float(d.std() / len(d) ** 0.5) if len(d) > 1 else None,
                    "clean_margin": float(clean.mean()),
                    "accuracy_clean": float((clean > 0).double().mean()),
                    "accuracy_ablated": float((values[:, layer] > 0).double().mean()),
                    "top_path_branch": (top or {}).get(layer),
                })  # fmt: skip
    return pd.DataFrame(out)
