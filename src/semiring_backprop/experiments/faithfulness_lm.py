"""The faithfulness benchmark on a real causal LM (DESIGN §3b last bullet, §3c): how well
each way of scoring sites and edges agrees with exact activation patching.

Any causal LM (a hub id, a local directory, a ``.gguf`` file; ``smol``: SmolLM2-135M)
on the tasks of :mod:`semiring_backprop.data.lm_tasks` (``ioi``, ``sva``,
``induction``, ``fact``, ``pronoun``), ``pairs`` clean / corrupted prompts each; the
scalar explained is ``logit(answer) - logit(foil)`` at the last position.

Per pair, the ground truth is exact patching from the corrupted prompt
(:class:`~semiring_backprop.ablation.Patching`): every site (``node_effects``, one
forward each) and a stratified sample of the edges (each method's ``edge_top`` edges
of largest |score|, and ``edge_random`` edges drawn at random). Each method of
:func:`methods` scores every site and edge; per method the record holds Pearson and
Kendall against the exact effects over the sites, over the heads (positions summed)
and over the sampled edges, the top-n overlaps, the faithfulness curve (every edge
outside the method's top fraction patched), and its cost (graph forwards and seconds).
The scores are those of the toy-model experiment (:mod:`.faithfulness`, whose helpers
are reused); a method is one entry of :func:`methods`.

Results go into ``out``: ``TASK/pairs.jsonl`` (one record per pair, a rerun resumes),
the toy experiment's tables, figure and ``table.md`` (:mod:`.faithfulness_report`,
benchmark = task), ``lm_methods.csv`` (per task and method, means over the pairs) and
``summary.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .._threads import threads
from ..ablation.faithfulness import FRACTIONS, agreement, curve
from ..errors import InputError
from ..runner.records import Records, same_settings
from .faithfulness import (
    EDGE_KEY,
    NODE_KEY,
    complete,
    edge_scores,
    forward_seconds,
    node_scores,
    per_source,
)

__all__ = ["Config", "Method", "methods", "explain_pair", "run"]

TASK_NAMES = ("ioi", "sva", "induction", "fact", "pronoun")
DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class Config:
    model: str = "smol"  #: a hub id, a local directory or a .gguf file; smol: SmolLM2-135M
    task: tuple[str, ...] = TASK_NAMES  #: the tasks (``--set task=ioi,sva``)
    pairs: int = 16
    seed: int = 0
    ig_steps: tuple[int, ...] = (5, 10, 30)  #: Real's integrated-gradients steps
    eap_ig_steps: int = 5
    #: EAP-IG with Gauss-Legendre points (``EAP-IG-GL{n}``: n passes, as few as a budget allows)
    eap_ig_gl: tuple[int, ...] = (2,)
    edge_top: int = 100  #: each method's top edges patched exactly
    edge_random: int = 1000  #: random edges patched exactly
    fractions: tuple[float, ...] = FRACTIONS
    level: float = 0.8  #: edges needed for f >= level
    top_n: int = 10  #: the top-n overlap with the exact effects
    half: int = 8  #: the induction run's length in words
    dtype: str = "float32"
    batch: int = 64  #: patched forwards run at once
    threads: int = 1  #: torch's threads during the run (0: leave torch's count)
    #: the methods scored, by name (``--set methods=Real,EAP-QK``); empty: every one
    methods: tuple[str, ...] = ()

    @classmethod
    def quick(cls) -> Config:
        """Two pairs of one task, few steps and sampled edges: the machinery."""
        return replace(cls(), task=("ioi",), pairs=2, ig_steps=(2,), eap_ig_steps=2,
                       edge_top=5, edge_random=20, fractions=(0.01, 0.1, 0.5, 1.0),
                       half=4)  # fmt: skip

    def check(self) -> None:
        bad = [t for t in self.task if t not in TASK_NAMES]
        if bad or not self.task or len(set(self.task)) != len(self.task):
            raise InputError(f"faithfulness-lm: task={self.task!r}; give some of "
                             f"{', '.join(TASK_NAMES)}, each once")  # fmt: skip
        if self.dtype not in DTYPES:
            raise InputError(f"faithfulness-lm: dtype={self.dtype!r}; give one of {DTYPES}")
        if not 0 < self.level <= 1:
            raise InputError(f"faithfulness-lm: level={self.level!r}; give a share in (0, 1]")
        fr = self.fractions
        if len(fr) < 2 or any(not 0 < f <= 1 for f in fr) or list(fr) != sorted(set(fr)):
            raise InputError(f"faithfulness-lm: fractions={fr!r}; give at least two "
                             "increasing fractions in (0, 1]")  # fmt: skip
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.eap_ig_gl):
            raise InputError(f"faithfulness-lm: eap_ig_gl={self.eap_ig_gl!r}; give numbers of "
                             "Gauss-Legendre points, each 1 or more")  # fmt: skip
        if self.half < 2:
            raise InputError(f"faithfulness-lm: half={self.half}; give 2 words or more")
        names = [m.name for m in all_methods(self)]
        bad = [m for m in self.methods if m not in names]
        if bad or len(set(self.methods)) != len(self.methods):
            raise InputError(f"faithfulness-lm: methods={self.methods!r}; give some of "
                             f"{', '.join(names)}, each once (none: all)")  # fmt: skip
        if not self.model.strip():
            raise InputError("faithfulness-lm: model=''; give a hub id, a directory, a .gguf "
                             "file or smol")  # fmt: skip


# -- one pair's context: what the methods share ------------------------------------------


@dataclass
class Pair:
    """One pair's model, inputs and patching (``pt``), and what the methods share: the
    circuits computed once (``cache``) and the seconds of the patching's own clean and
    corrupted runs (``setup``, which EAP needs too)."""

    model: object
    clean: dict
    corrupted: dict
    output: object
    config: Config
    index: int
    pt: object = None
    setup: tuple = (0, 0.0)
    cache: dict = field(default_factory=dict)

    def circuit(self, name: str, semirings, **kw):
        """``sbp.circuit`` of the clean prompt seeded with ``x - x'`` (the corrupted
        prompt), once per ``name``: ``(circuit, seconds)``."""
        if name not in self.cache:
            import semiring_backprop as sbp

            t = time.perf_counter()
            c = sbp.circuit(self.model, kwargs=self.clean, output=self.output,
                            baseline=self.corrupted, semirings=semirings, **kw)  # fmt: skip
            self.cache[name] = (c, time.perf_counter() - t)
        return self.cache[name]


#: a method's scores: (edge scores, site scores or None, graph forwards or None, seconds)
Scores = tuple


@dataclass(frozen=True)
class Method:
    """One way of scoring: ``name`` (the tables' row) and ``score(pair) -> Scores``."""

    name: str
    score: Callable[[Pair], Scores]


def _real(p: Pair) -> Scores:
    from ..semirings import Real

    c, s = p.circuit("Real", [Real()])
    return edge_scores(c.edges, "Real"), node_scores(c.nodes, "Real"), None, s


def _real_ig(n: int):
    def score(p: Pair) -> Scores:
        from ..circuits import Circuit
        from ..semirings import Real

        c, s = p.circuit("Real", [Real()])  # IG reads Real's pass
        t = time.perf_counter()
        ig = Circuit.from_result(c.result, [Real()], "x", p.corrupted, ig_steps=n)
        return (edge_scores(ig.edges, "Real"), node_scores(ig.nodes, "Real"), None,
                s + time.perf_counter() - t)  # fmt: skip

    return score


def _maxproduct(p: Pair) -> Scores:
    c, s = p.cache["MaxProduct"]  # the patching's own pass (explain_pair makes it)
    col = c.column("MaxProduct")
    return edge_scores(c.edges, col), node_scores(c.nodes, col), None, s


def _relevance(p: Pair) -> Scores:
    from ..semirings import Real

    c, s = p.circuit("relevance", [Real()], weights="relevance")
    return edge_scores(c.edges, "Real"), node_scores(c.nodes, "Real"), None, s


def _eap(steps: int | None, method: str = "riemann_right"):
    def score(p: Pair) -> Scores:
        pt = p.pt
        before, t = pt.evaluations, time.perf_counter()
        e = (pt.eap() if steps is None else pt.eap_ig(steps, method))[[*EDGE_KEY, "score"]]
        return (e, per_source(e), pt.evaluations - before + p.setup[0],
                time.perf_counter() - t + p.setup[1])  # fmt: skip

    return score


def _eap_qk(p: Pair) -> Scores:
    """EAP with AtP*'s QK fix (:mod:`..ablation.qk`): each query and key edge's head
    pattern computed exactly, linear after it; sites by ``node_scores_qk``."""
    pt = p.pt
    before, t = pt.evaluations, time.perf_counter()
    e = pt.eap_qk()[[*EDGE_KEY, "score"]]
    n = pt.node_scores_qk()
    return (e, n[[*NODE_KEY, "score"]], pt.evaluations - before + p.setup[0],
            time.perf_counter() - t + p.setup[1])  # fmt: skip


def _relevance_qk(p: Pair) -> Scores:
    """Relevance weights with each query and key term exact (:mod:`..ablation.qk`)."""
    from ..semirings import Real

    c, s = p.circuit("relevance", [Real()], weights="relevance")
    pt = p.pt
    before, t = pt.evaluations, time.perf_counter()
    e, n = pt.relevance_qk(c)
    return (e, n, pt.evaluations - before + p.setup[0],
            s + time.perf_counter() - t + p.setup[1])  # fmt: skip


def _relp(exact_qk: bool):
    def score(p: Pair) -> Scores:
        """RelP's sites (the activation difference times the relevance adjoint); its
        edges are Real-relevance's (-QK's)."""
        from ..ablation.relevance_qk import relp_sites
        from ..semirings import Real

        c, s = p.circuit("relevance", [Real()], weights="relevance")
        pt = p.pt
        before, t = pt.evaluations, time.perf_counter()
        n = relp_sites(pt, c.result, exact_qk)
        e = pt.relevance_qk(c)[0] if exact_qk else edge_scores(c.edges, "Real")
        return (e, n, pt.evaluations - before + p.setup[0],
                s + time.perf_counter() - t + p.setup[1])  # fmt: skip

    return score


def _random(p: Pair) -> Scores:
    import numpy as np

    rng = np.random.default_rng([p.config.seed, p.index, 7])
    edges = p.pt.edges()[list(EDGE_KEY)].copy()
    edges["score"] = rng.standard_normal(len(edges))
    c, _ = p.cache["MaxProduct"]
    nodes = node_scores(c.nodes, c.column("MaxProduct"))
    nodes["score"] = rng.standard_normal(len(nodes))
    return edges, nodes, 0, 0.0


def methods(config: Config) -> list[Method]:
    """The methods compared (``config.methods``, or every one), in the tables' order."""
    chosen = set(config.methods)
    return [m for m in all_methods(config) if not chosen or m.name in chosen]


def all_methods(config: Config) -> list[Method]:
    """Every method, in the tables' order; each is one entry (a new scoring is one more
    ``Method``)."""
    out = [Method("Real", _real),
           *(Method(f"Real-IG{n}", _real_ig(n)) for n in config.ig_steps),
           Method("MaxProduct", _maxproduct), Method("EAP", _eap(None)),
           Method(f"EAP-IG{config.eap_ig_steps}", _eap(config.eap_ig_steps)),
           *(Method(f"EAP-IG-GL{n}", _eap(n, "gausslegendre")) for n in config.eap_ig_gl),
           Method("EAP-QK", _eap_qk)]  # fmt: skip
    out += [Method("Real-relevance", _relevance), Method("Real-relevance-QK", _relevance_qk),
            Method("RelP", _relp(False)), Method("RelP-QK", _relp(True)),
            Method("random", _random)]  # fmt: skip
    return out


# -- one pair ----------------------------------------------------------------------------


def output_of(pair):
    from ..targets import WordChoice

    last = len(pair.clean_ids) - 1
    return WordChoice(((0, last, pair.answer_id, 1), (0, last, pair.foil_id, -1)), logits=True)


def head_totals(frame, column, method: str):
    """Per head (layer, head_index), positions summed (MaxProduct: its ⊕, the value of
    largest size)."""
    from ..circuits.exports import oplus

    heads = frame[frame.role == "head"]
    sr = "MaxProduct" if method == "MaxProduct" else "Real"
    how = (lambda s: oplus(sr, s)) if column == "score" else "sum"
    return heads.groupby(["layer", "head_index"], sort=True)[column].agg(how).reset_index()


def _sample(universe, scored: dict, config: Config, index: int):
    """The edges patched exactly: each method's ``edge_top`` of largest |score| and
    ``edge_random`` drawn at random (one set, in the universe's order)."""
    import numpy as np

    from ..ablation.faithfulness import ranking

    chosen = set()
    for edges in scored.values():
        chosen.update(ranking(edges)[: config.edge_top])
    rng = np.random.default_rng([config.seed, index, 11])
    k = min(config.edge_random, len(universe))
    chosen.update(int(i) for i in rng.choice(len(universe), size=k, replace=False))
    return universe.iloc[sorted(chosen)].reset_index(drop=True)


def _agree(row, what, scores, effects, top_n):
    a = agreement(scores, effects, top_n=top_n)
    row.update({f"{what}_{k}": a[k] for k in ("pearson", "kendall", "top_n_overlap")})


@torch.no_grad()
def _value(model, kwargs, output) -> float:
    return float(output(model(**kwargs)))


def explain_pair(model, lm_pair, index: int, config: Config, where=None,
                 progress: bool = False) -> dict:  # fmt: skip
    """One record: the pair, m(M) and m(∅), the exact patching's cost, and per method
    its agreement with the exact effects (sites, heads, sampled edges), its curve and
    its cost. ``where``: a directory for ``sites{index}.csv`` and ``edges{index}.csv``
    (the exact effects beside every method's scores, per site and per sampled edge)."""
    from ..ablation.patching import Patching
    from ..semirings import MaxProduct

    start = time.perf_counter()
    p = Pair(model, lm_pair.kwargs(), lm_pair.kwargs(corrupted=True), output_of(lm_pair), config,
             index)  # fmt: skip
    cm, _ = p.circuit("MaxProduct", [MaxProduct()])
    t = time.perf_counter()
    p.pt = pt = Patching(cm.result, p.corrupted, batch=config.batch)
    p.setup = (pt.evaluations, time.perf_counter() - t)
    t = time.perf_counter()
    universe = pt.edges()[list(EDGE_KEY)]
    listing = time.perf_counter() - t
    forward = forward_seconds(pt)
    before, t = pt.evaluations, time.perf_counter()
    node_effects = pt.node_effects(progress=progress)
    node_cost = [pt.evaluations - before, time.perf_counter() - t]
    scores = {m.name: m.score(p) for m in methods(config)}
    edges = {name: complete(s[0], universe) for name, s in scores.items()}
    sample = _sample(universe, edges, config, index)
    before, t = pt.evaluations, time.perf_counter()
    edge_effects = pt.edge_effects(sample, progress=progress)
    edge_cost = [pt.evaluations - before, time.perf_counter() - t]
    exact_heads = head_totals(node_effects, "effect", "")
    rows, site_table, edge_table = [], node_effects.copy(), edge_effects.copy()
    curves = 0.0
    for name, (_, nodes, evaluations, secs) in scores.items():
        row = {"method": name, "evaluations": evaluations, "seconds": secs}
        nodes = complete(nodes, node_effects)
        site_table[name] = nodes["score"].to_numpy()
        edge_table[name] = complete(edges[name], sample)["score"].to_numpy()
        _agree(row, "nodes", nodes, node_effects, config.top_n)
        heads = head_totals(nodes, "score", name)
        _agree(row, "heads", heads, exact_heads, config.top_n)
        _agree(row, "edges", complete(edges[name], sample), edge_effects, config.top_n)
        t = time.perf_counter()
        points = curve(edges[name], pt.metric, config.fractions)
        curves += time.perf_counter() - t
        row["curve"] = points[["fraction", "n_edges", "f"]].values.tolist()
        rows.append(row)
    if where is not None:
        from .common import write_csv

        write_csv(site_table, Path(where) / f"sites{index}.csv")
        write_csv(edge_table, Path(where) / f"edges{index}.csv")
    return {"key": index, "clean_text": lm_pair.clean, "corrupted_text": lm_pair.corrupted,
            "answer": lm_pair.answer, "foil": lm_pair.foil, "tokens": len(lm_pair.clean_ids),
            "clean": float(pt.clean), "empty": float(pt.empty),
            "model_clean": _value(model, p.clean, p.output),
            "model_corrupted": _value(model, p.corrupted, p.output),
            "edges": len(universe), "sites": len(node_effects), "sampled_edges": len(sample),
            "methods": rows, "heads": None, "forward_seconds": forward,
            "node_patching": node_cost, "edge_patching": edge_cost,
            "edge_list_seconds": listing, "curve_seconds": curves,
            "seconds": time.perf_counter() - start}  # fmt: skip


# -- the run -----------------------------------------------------------------------------


def load_model(config: Config):
    """``(model, tokenizer)``: the causal LM ``config.model`` in ``config.dtype``, eval."""
    from ..hf.loading import load

    model, tok, _ = load(config.model, kind="causal", dtype=getattr(torch, config.dtype))
    return model.eval(), tok


def _check_pair(rec, row, lm_pair) -> None:
    if row.get("clean_text") != lm_pair.clean or row.get("corrupted_text") != lm_pair.corrupted:
        raise InputError(
            f"{rec.path}: pair {row['key']} was computed for {row.get('clean_text')!r}, but "
            f"this run's pair {row['key']} is {lm_pair.clean!r} (another tokenizer or "
            "version of the task): write into another directory, or delete the file"
        )


def run(out, config: Config | None = None, progress: bool = True, model=None) -> dict:
    """Load the model, then per task make the pairs and explain and patch each (one
    record per pair, written as it comes: a rerun resumes), then write the tables, the
    figure and the summary. ``model``: a ``(model, tokenizer)`` already loaded (then
    ``config.model`` only names it)."""
    from tqdm.auto import tqdm

    from ..data.lm_tasks import lm_pairs
    from . import faithfulness_lm_report as report

    config = config or Config()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    same_settings(out, config, free=("task", "pairs", "threads", "batch"))
    with threads(config.threads):
        net, tok = model if model is not None else load_model(config)
        records, tasks = {}, {}
        for task in config.task:
            made = lm_pairs(task, tok, config.pairs, config.seed, half=config.half)
            tasks[task] = {"dropped": made.dropped, "left_out": made.left_out}
            rec = Records(out / task / "pairs.jsonl", fields=report.RECORD_FIELDS)
            report.check_methods(rec)
            for row in rec.rows:
                if row["key"] < config.pairs:
                    _check_pair(rec, row, made.pairs[row["key"]])
            todo = [i for i in range(config.pairs) if not rec.has(i)]
            for i in tqdm(todo, desc=task, disable=not progress):
                rec.add(explain_pair(net, made.pairs[i], i, config, out / task, progress))
            records[task, config.seed] = [r for r in rec.rows if r["key"] < config.pairs]
        return report.write(out, config, records, tasks)
