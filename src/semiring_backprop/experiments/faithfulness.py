"""Does the path matter? The circuits of :func:`semiring_backprop.circuit` against
ablation, measured as circuit discovery measures them (DESIGN §3b, last bullet).

Two benchmarks, each a small model trained here (``seeds`` models, seeds ``seed``,
``seed + 1``, ...) and ``pairs`` clean / corrupted inputs per model:

- ``first-token`` and ``first-token-paper``: the §5.1 classifier of
  FirstTokenRepeatedOnce (:mod:`.first_token`), trained as the demo trains it and as
  the paper did (``paper_training``). A pair is a positive validation sequence (its
  first token repeated once) and the same sequence with the repeat replaced by a token
  absent from it; the explained scalar is the logit difference (class "repeated" minus
  "not").
- ``induction``: a two-layer attention-only transformer (:mod:`.models`) trained on
  repeated runs of random tokens (:mod:`semiring_backprop.data.induction`); a pair is a
  clean run and its permuted corruption, the explained scalar the answer's logit minus
  the foil's.

Per pair, the circuit's edges are scored by each method: ``Real`` (the total flow,
seeded with ``x - x'`` at the token embeddings), ``Real-IG{n}`` (its conductance over
``n`` integrated-gradients steps), ``Real-relevance`` (the total flow with relevance
weights, ``weights="relevance"``), ``MaxProduct`` (the best path through each edge),
``EAP`` and ``EAP-IG{n}`` (attribution patching), ``EAP-QK`` (EAP with the attention
pattern recomputed exactly for queries and keys, AtP*'s QK fix), ``Real-relevance-QK``
(relevance weights, each query and key term exact: ``Patching.relevance_qk``), ``patching`` (the
exact effect of ablating that edge alone: the ranking that knows the answer) and
``random``. Each ranking gives a faithfulness curve (the edges outside its top fraction
patched from the corrupted input, :class:`~semiring_backprop.ablation.patching.Patching`),
CPR, CMD and the edges needed for ``f >= level``; scores are also compared with the exact node
and edge effects (:mod:`semiring_backprop.ablation.faithfulness`). ``Entropy`` is
computed and kept in the circuit but ranks nothing: it measures how spread the paths
through an edge are, not how much they carry.

Per benchmark, something more: for the classifier, the §5.1 question (does the first
token's top path leave through the query or the skip connection?) against the
ablation of each branch at the first token (mean and zero ablation: the corrupted
input leaves the first token as it is); for induction, whether each method puts the
previous-token head and the induction head among its top 3 components and the
K-composition edge between them among its top 5 edges (positions summed).

Results go into ``out``: one JSON-lines record per pair (a rerun resumes), the
tables (:mod:`.faithfulness_report`), figures and ``summary.json``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .._threads import threads
from ..ablation.faithfulness import FRACTIONS, agreement, curve
from ..circuits.exports import EDGE_COLUMNS
from ..errors import InputError
from ..runner.records import Records, same_settings
from .faithfulness_benches import Bench, bench

BENCHMARKS = ("first-token", "first-token-paper", "induction")
#: the edge and node keys of :class:`~semiring_backprop.ablation.patching.Patching`
EDGE_KEY = tuple(c for c in EDGE_COLUMNS if c != "token")
NODE_KEY = ("layer", "position", "head_index", "role")
#: the attention input's branches at the first token (§5.1)
BRANCHES = ("skip", "query", "key", "value")
ABLATIONS = ("mean", "zero")


#: settings that count something: whole numbers, 1 or more
_COUNTS = ("seeds", "pairs", "top_n", "reference", "ft_n", "ind_n", "ind_half", "ind_vocab",
           "ind_hidden", "ind_heads", "ind_steps", "eap_ig_steps")  # fmt: skip


@dataclass(frozen=True)
class Config:
    benchmarks: tuple[str, ...] = BENCHMARKS
    seed: int = 0
    seeds: int = 3  #: models per benchmark, seeds seed, seed + 1, ...
    pairs: int = 8  #: clean / corrupted pairs per model
    ig_steps: tuple[int, ...] = (5, 20)  #: Real's integrated-gradients steps (besides none)
    eap_ig_steps: int = 5
    fractions: tuple[float, ...] = FRACTIONS
    level: float = 0.8  #: edges needed for f >= level
    top_n: int = 10  #: the top-n overlap with the exact effects
    reference: int = 32  #: validation inputs averaged for mean ablation (§5.1)
    ft_n: int = 10_000  #: FirstTokenRepeatedOnce examples (train, validation, test)
    ft_epochs: int | None = None  #: None: each setting's own (the demo's cap, the paper's 42)
    ind_n: int = 10_000
    ind_half: int = 8
    ind_vocab: int = 20
    ind_hidden: int = 32
    #: heads per layer: one, so that exact patching confirms the known circuit (with
    #: more, layer-1 heads share the induction role: docs/faithfulness.md)
    ind_heads: int = 1
    ind_steps: int = 3000
    ind_corrupt: str = "permute"  #: the corruption of :func:`~..data.induction.pairs`

    @classmethod
    def quick(cls) -> Config:
        """Tiny models, barely trained (seconds), one seed, two pairs: the machinery,
        not the answer."""
        return replace(cls(), seeds=1, pairs=2, ig_steps=(2,), eap_ig_steps=2, reference=4,
                       ft_n=200, ft_epochs=2, ind_n=100, ind_half=4, ind_vocab=12,
                       ind_hidden=8, ind_heads=1, ind_steps=20)  # fmt: skip

    def check(self) -> None:
        for name in _COUNTS:
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise InputError(f"faithfulness: {name}={n!r}; give a whole number, 1 or more")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.ig_steps):
            raise InputError(f"faithfulness: ig_steps={self.ig_steps!r}; give whole numbers of "
                             "steps, each 1 or more")  # fmt: skip
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InputError(f"faithfulness: seed={self.seed!r}; give a whole number")
        if not 0 < self.level <= 1:
            raise InputError(f"faithfulness: level={self.level!r}; give a share in (0, 1]")
        bad = [b for b in self.benchmarks if b not in BENCHMARKS]
        if bad or not self.benchmarks:
            raise InputError(f"faithfulness: benchmarks={self.benchmarks!r}; give some of "
                             f"{', '.join(BENCHMARKS)}")  # fmt: skip
        fr = self.fractions
        if len(fr) < 2 or any(not 0 < f <= 1 for f in fr) or list(fr) != sorted(set(fr)):
            raise InputError(f"faithfulness: fractions={fr!r}; give at least two increasing "
                             "fractions in (0, 1]")  # fmt: skip
        from ..data.induction import CORRUPTIONS

        if self.ind_corrupt not in CORRUPTIONS:
            raise InputError(f"faithfulness: ind_corrupt={self.ind_corrupt!r}; give one of "
                             f"{', '.join(CORRUPTIONS)}")  # fmt: skip
        if self.ind_hidden % self.ind_heads:
            raise InputError(f"faithfulness: ind_hidden={self.ind_hidden} must be a multiple "
                             f"of ind_heads={self.ind_heads}")  # fmt: skip


def methods(config: Config) -> list[str]:
    """The rankings compared, in the tables' order."""
    return ["Real", *(f"Real-IG{n}" for n in config.ig_steps), "Real-relevance", "MaxProduct",
            "EAP", f"EAP-IG{config.eap_ig_steps}", "EAP-QK", "Real-relevance-QK", "patching",
            "random"]  # fmt: skip


def patching_class():
    """The ablation oracle (a function, so that tests can put a small fake in its place)."""
    from ..ablation.patching import Patching

    return Patching


# -- one pair ----------------------------------------------------------------------------


def edge_scores(frame, column):
    out = frame[list(EDGE_KEY)].copy()
    out["score"] = frame[column].astype(float).to_numpy()
    return out


def node_scores(nodes, column):
    sites = nodes[nodes.role.isin(("embedding", "head", "mlp"))]
    out = sites[list(NODE_KEY)].copy()
    out["score"] = sites[column].astype(float).to_numpy()
    return out.reset_index(drop=True)


def per_source(edges):
    """A node score from edge scores: the sum over the node's out-edges (attribution
    patching of a node is the sum over its consumers: the stream adds them)."""
    key = ["src_layer", "position", "src_head_index", "src_role"]
    summed = edges.groupby(key, dropna=False, sort=False)["score"].sum().reset_index()
    return summed.rename(columns=dict(zip(key, NODE_KEY)))


def complete(scores, universe):
    """``scores`` on every row of ``universe`` (every edge, or every site, the ablation
    knows), in its order: a row a method gives no score (no path reaches it under that
    seed) gets NaN, which ranks last and counts as 0 in the correlations."""
    key = [c for c in universe.columns if c in scores.columns and c not in ("score", "effect")]
    rows = universe[key].merge(scores[[*key, "score"]], on=key, how="left", validate="one_to_one")
    if len(rows) != len(universe):
        raise InputError(f"faithfulness: {len(scores)} scores do not match the "
                         f"{len(universe)} rows the ablation knows on {key}")  # fmt: skip
    return rows


def _scores(c, cm, cr, pt, config: Config, bench: Bench, baseline, pair: int, seconds: dict,
            setup: tuple) -> dict:  # fmt: skip
    """``{method: (edge scores, node scores or None, graph forwards or None, seconds)}``:
    ``c``, ``cm``, ``cr``: the Real, the MaxProduct and the relevance-weighted Real
    circuits (``seconds``: theirs); ``setup``: the forwards and seconds of the
    ablation's clean and corrupted runs, which EAP needs too. A circuit's forwards are
    None: it runs passes of other kinds (a forward, a reverse semiring pass, a forward
    one for alpha and the edge stage's partial reverse passes); its seconds say what they
    cost."""
    import numpy as np

    from ..circuits import Circuit
    from ..semirings import Real

    out = {}
    out["Real"] = (edge_scores(c.edges, "Real"), node_scores(c.nodes, "Real"), None,
                   seconds["Real"])  # fmt: skip
    for n in config.ig_steps:
        t = time.perf_counter()
        ig = Circuit.from_result(c.result, [Real()], "x", baseline, ig_steps=n)
        out[f"Real-IG{n}"] = (edge_scores(ig.edges, "Real"), node_scores(ig.nodes, "Real"), None,
                              seconds["Real"] + time.perf_counter() - t)  # fmt: skip
    out["Real-relevance"] = (edge_scores(cr.edges, "Real"), node_scores(cr.nodes, "Real"), None,
                             seconds["Real-relevance"])  # fmt: skip
    mp = cm.column("MaxProduct")
    out["MaxProduct"] = (edge_scores(cm.edges, mp), node_scores(cm.nodes, mp), None,
                         seconds["MaxProduct"])  # fmt: skip
    steps = config.eap_ig_steps
    for name, call in (("EAP", pt.eap), (f"EAP-IG{steps}", lambda: pt.eap_ig(steps))):
        before, t = pt.evaluations, time.perf_counter()
        e = call()[[*EDGE_KEY, "score"]]
        out[name] = (e, per_source(e), pt.evaluations - before + setup[0],
                     time.perf_counter() - t + setup[1])  # fmt: skip
    # the QK fix: sites by their own score (every later head's pattern exact), not the
    # sum of their edges' (each edge's pattern change alone)
    before, t = pt.evaluations, time.perf_counter()
    e, n = pt.eap_qk()[[*EDGE_KEY, "score"]], pt.node_scores_qk()
    out["EAP-QK"] = (e, n, pt.evaluations - before + setup[0],
                     time.perf_counter() - t + setup[1])  # fmt: skip
    # relevance weights with the queries' and keys' terms the rule leaves out made exact
    before, t = pt.evaluations, time.perf_counter()
    e, n = pt.relevance_qk(cr)
    secs = seconds["Real-relevance"] + time.perf_counter() - t + setup[1]
    out["Real-relevance-QK"] = (e, n, pt.evaluations - before + setup[0], secs)
    # every edge and site the ablation knows (a circuit lists only those its paths take)
    rng = np.random.default_rng([config.seed, bench.seed, pair])
    rand = pt.edges()[list(EDGE_KEY)].copy()
    rand["score"] = rng.standard_normal(len(rand))
    nodes = node_scores(cm.nodes, mp)
    nodes["score"] = rng.standard_normal(len(nodes))
    out["random"] = (rand, nodes, 0, 0.0)
    return out


@torch.no_grad()
def forward_seconds(pt, repeats: int = 5) -> float:
    """The seconds of one forward pass of the traced graph (the unit of the ablations'
    evaluations): the median of ``repeats`` runs of the clean input."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        pt.output()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def _model_output(bench: Bench, kwargs) -> float:
    return float(bench.output(bench.model(**kwargs)))


def explain_pair(bench: Bench, pair: int, config: Config) -> dict:
    """One record: per method its curve (the circuit's metric m(C) per fraction), its
    agreement with the exact effects, evaluations and seconds; m(M), m(∅), the model's
    own outputs; and the benchmark's own question."""
    import semiring_backprop as sbp

    start = time.perf_counter()
    clean, corrupted = bench.pairs[pair]
    with torch.no_grad():
        baseline = {bench.place: bench.embed(corrupted["input_ids"]).detach()}
    # each semiring's circuit on its own, so that each method's seconds are its own
    t = time.perf_counter()
    c = sbp.circuit(bench.model, kwargs=clean, output=bench.output, baseline=baseline,
                    semirings=[sbp.Real()])  # fmt: skip
    seconds = {"Real": time.perf_counter() - t}
    t = time.perf_counter()
    cm = sbp.circuit(bench.model, kwargs=clean, output=bench.output, baseline=baseline,
                     semirings=[sbp.MaxProduct(), sbp.Entropy()])  # fmt: skip
    seconds["MaxProduct"] = time.perf_counter() - t
    t = time.perf_counter()
    cr = sbp.circuit(bench.model, kwargs=clean, output=bench.output, baseline=baseline,
                     semirings=[sbp.Real()], weights="relevance")  # fmt: skip
    seconds["Real-relevance"] = time.perf_counter() - t
    res = cm.result
    Patching = patching_class()
    t = time.perf_counter()
    pt = Patching(res, corrupted)
    setup = (pt.evaluations, time.perf_counter() - t)  # the clean and corrupted forwards
    universe = pt.edges()[list(EDGE_KEY)]  # (the edge list every method ranks: not timed)
    forward = forward_seconds(pt)
    before, t = pt.evaluations, time.perf_counter()
    node_effects = pt.node_effects()
    node_cost = (pt.evaluations - before + setup[0], time.perf_counter() - t + setup[1])
    before, t = pt.evaluations, time.perf_counter()
    edge_effects = complete(pt.edge_effects().rename(columns={"effect": "score"}), universe)
    edge_effects = edge_effects.rename(columns={"score": "effect"})
    exact = (pt.evaluations - before + setup[0], time.perf_counter() - t + setup[1])
    scores = _scores(c, cm, cr, pt, config, bench, baseline, pair, seconds, setup)
    exact_scores = edge_effects[[*EDGE_KEY, "effect"]].rename(columns={"effect": "score"})
    exact_nodes = node_effects.rename(columns={"effect": "score"})
    scores["patching"] = (exact_scores, exact_nodes, *exact)
    rows = []
    for name in methods(config):
        edges, nodes, evaluations, secs = scores[name]
        row = {"method": name, "evaluations": evaluations, "seconds": secs}
        edges = complete(edges, universe)
        for what, s, e in (("edges", edges, edge_effects), ("nodes", nodes, node_effects)):
            if s is None:
                continue
            s = complete(s, e)
            a = agreement(s["score"], e["effect"], top_n=config.top_n)
            row.update({f"{what}_{k}": a[k] for k in ("pearson", "kendall", "top_n_overlap")})
        points = curve(edges, pt.metric, config.fractions)
        row["curve"] = points[["fraction", "n_edges", "f"]].values.tolist()
        rows.append(row)
        if bench.heads is not None:
            row.update(_induction_ranks(bench.heads, edges, nodes, name))
    record = {"key": pair, "clean": float(pt.clean), "empty": float(pt.empty),
              "model_clean": _model_output(bench, clean),
              "model_corrupted": _model_output(bench, corrupted),
              "edges": len(universe), "methods": rows, "heads": bench.heads,
              "forward_seconds": forward, "node_patching": list(node_cost)}  # fmt: skip
    if bench.name != "induction":
        record["branches"] = _branches(bench, res, Patching)
    record["seconds"] = time.perf_counter() - start  # the whole comparison on this pair
    return record


def _branches(bench: Bench, res, Patching) -> dict:
    """§5.1 at the first token: which branch the top path (MaxProduct) leaves through,
    its value per branch, and each branch's ablation effect (mean over the reference
    inputs, and zero)."""
    from ..semirings import MaxProduct

    t = res.layer_table(semirings=[MaxProduct()])
    at = t[(t.layer == 0) & (t.sublayer == "attention") & (t.token == 0)]
    at = at[at.branch.isin(BRANCHES)]
    values = {r.branch: float(r.value) for r in at.itertuples()}
    top = at[at.winner]
    out = {"path": str(top.branch.iloc[0]) if len(top) else None, "path_values": values}
    for mode in ABLATIONS:
        kw = {"reference": bench.reference} if mode == "mean" else {}
        p = Patching(res, mode=mode, **kw)
        out[mode] = {b: float(p.branch_effect(0, b, 0)) for b in BRANCHES}
    return out


# -- induction: which heads ---------------------------------------------------------------


def _ranked(names, scores, method):
    """Names by size, largest first (no path last), scores summed over their rows
    (MaxProduct: the one of largest size, its ⊕)."""
    import pandas as pd

    from ..circuits.exports import oplus

    sr = "MaxProduct" if method == "MaxProduct" else "Real"
    frame = pd.DataFrame({"name": list(names), "score": scores.astype(float).to_numpy()})
    summed = frame.groupby("name", sort=False)["score"].apply(lambda s: oplus(sr, s))
    size = summed.map(lambda v: abs(v) if math.isfinite(v) else -1.0)
    return list(size.sort_values(ascending=False, kind="stable").index)


def _rank(name, ranked) -> int | None:
    return ranked.index(name) + 1 if name in ranked else None


def _induction_ranks(heads: dict, edges, nodes, method) -> dict:
    """Where ``method`` ranks the previous-token head and the induction head among the
    heads (positions summed) and among every site at every position (their best
    position), and the K-composition edge between them among the edges,
    positions summed and per position (its best position's rank among every edge at
    every position); and whether they are in its top 3 and top 5 (EAP-IG's names:
    ``a0.h1``, ``a0.h1->a1.h2<k>``)."""
    from ..circuits.exports import component_name

    prev = component_name("head", 0, heads["previous_head"])
    ind = component_name("head", 1, heads["induction_head"])
    out = {}
    if nodes is not None:
        comp = nodes[nodes.role.isin(("head", "mlp"))]
        names = [component_name(r.role, r.layer, r.head_index) for r in comp.itertuples()]
        ranked = _ranked(names, comp["score"], method)
        out["previous_rank"], out["induction_rank"] = _rank(prev, ranked), _rank(ind, ranked)
        # per position: among every site (token embeddings and heads at each position)
        sites = [f"{component_name(r.role, r.layer, r.head_index)}@{r.position}"
                 for r in nodes.itertuples()]  # fmt: skip
        at = _ranked(sites, nodes["score"], method)
        for key, name in (("previous", prev), ("induction", ind)):
            out[f"{key}_rank_position"] = next(
                (i + 1 for i, n in enumerate(at) if n.startswith(name + "@")), None
            )
        out["previous_in_top3"] = prev in ranked[:3]
        out["induction_in_top3"] = ind in ranked[:3]
    names = [f"{component_name(r.src_role, r.src_layer, r.src_head_index)}->"
             f"{component_name(r.dst_role, r.dst_layer, r.dst_head_index)}<{r.input}>"
             for r in edges.itertuples()]  # fmt: skip
    k_edge = f"{prev}->{ind}<k>"
    summed = _ranked(names, edges["score"], method)
    at = _ranked([f"{n}@{p}" for n, p in zip(names, edges["position"])], edges["score"], method)
    out["kcomposition_rank"] = _rank(k_edge, summed)
    out["kcomposition_rank_position"] = next(
        (i + 1 for i, n in enumerate(at) if n.startswith(k_edge + "@")), None
    )
    out["kcomposition_in_top5"] = k_edge in summed[:5]
    return out


# -- the run -----------------------------------------------------------------------------


@threads()
def run(out, config: Config | None = None, progress: bool = True) -> dict:
    """Train (or reload) every benchmark's models, explain and ablate each pair (one
    record per pair, written as it comes: a rerun resumes), then write the tables,
    figures and summary (:mod:`.faithfulness_report`)."""
    from tqdm.auto import tqdm

    from . import faithfulness_report as report

    config = config or Config()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    same_settings(out, config, free=("benchmarks", "seeds", "pairs"))
    records, models = {}, []
    for name in config.benchmarks:
        for seed in range(config.seed, config.seed + config.seeds):
            where = out / name / f"seed{seed}"
            b = bench(name, config, seed, where, progress)
            models.append({"benchmark": name, "seed": seed, **b.trained, "heads": b.heads})
            rec = Records(where / "pairs.jsonl", fields=report.RECORD_FIELDS)
            report.check_methods(rec)
            todo = [i for i in range(config.pairs) if not rec.has(i)]
            for i in tqdm(todo, desc=f"{name} (seed {seed})", disable=not progress, leave=False):
                rec.add(explain_pair(b, i, config))
            records[name, seed] = [r for r in rec.rows if r["key"] < config.pairs]
    return report.write(out, config, records, models)
