"""Ablation on the traced graph: the effect of a site, an edge or a branch on the explained
output when its value is replaced by an ablated one, and a circuit's output when every
edge outside it is ablated (DESIGN §3b, faithfulness).

The graph of ``sbp.backprop``'s Result is run again node by node (as
:mod:`..engine.forward` runs it) with some values replaced:

- a **site** (the token embedding, a head's columns of its output projection's input, an
  MLP's output, at one position): its value for every consumer (:mod:`.sites`);
- an **edge** ``s -> d<input>`` at position ``p`` (the edges of
  :func:`..circuits.edges.circuit_edges`): the destination ``d`` (that head's columns of
  the query, key or value projection, the MLP's entry, or the output) reads its input
  recomputed through the residual stream alone (the nodes between the components and
  its entry: adds, norms, the output projections) from every component's value at each
  position, mixed as ``mu * current + (1 - mu) * ablated`` (``mu`` = 1: kept, 0:
  ablated). A head's query, key or value is its projection applied to its own
  recomputed input, its columns only; every other consumer reads the stream unchanged.
  Where heads share projection columns (grouped-query attention: one K/V head repeated
  for the query heads of its group), a head's key and value are its own copy: the
  shared K/V computed from that head's recomputed input and read by that head alone,
  the other heads of its group keep theirs (:class:`.patching_edges.OwnPass`).
  A kept edge reads its source's value in this patched run, an ablated one the source's
  ablated value (as EAP-IG's ``evaluate_graph`` does);
- a **branch** at a block's fan-out point (skip, query, key, value, mlp): what that
  branch's consumers read, recomputed from the fan-out point with its value at one
  position ablated (:mod:`.sites`).

Ablated values: the values on a corrupted input (``mode="corrupted"``), their mean over
reference inputs (``"mean"``), or zeros (``"zero"``). Since ``mu`` is a tensor, the same
forward is differentiable in it: EAP's score of an edge is ``d m / d mu`` at ``mu = 1``,
i.e. ``(a - a') . g`` with ``g`` the gradient at the destination's input (:mod:`.eap`).

Examples::

    res = sbp.backprop(model, kwargs={"input_ids": ids}, output=margin)
    p = Patching(res, {"input_ids": corrupted_ids})
    p.clean, p.empty                   # m(M), m(nothing kept)
    effects = p.edge_effects()         # one row per edge: m(M) - m(that edge ablated)
    p.faithfulness(kept)               # (m(C) - m(∅)) / (m(M) - m(∅))
"""

from __future__ import annotations

import math

import torch

from ..analysis.fanout import ancestors, descendants
from ..circuits.layout import layout
from ..engine.marginals import check_finite
from ..errors import InputError
from ..tracing.trace import input_tensors
from . import sites
from .patching_edges import args_of, assignment, call, call_order, destinations, own_pass
from .remainder import Remainder, tail
from .sites import BRANCHES, EDGE_KEY, NODE_KEY

__all__ = ["EDGE_KEY", "NODE_KEY", "MODES", "BRANCHES", "Patching"]

MODES = ("corrupted", "mean", "zero")


class Patching:
    """Patching experiments on one example: ``res`` is ``sbp.backprop``'s Result of the
    clean input (a batch of one; its output, a scalar, is the metric ``m``).

    ``corrupted``: the corrupted input's tensors (``{keyword: tensor}`` or a tuple of
    positional ones, as the model was traced; an input it does not name keeps its clean
    value), for ``mode="corrupted"``; ``reference``: a list of such inputs whose values
    are averaged, for ``mode="mean"``; ``mode="zero"``: ablated values are zeros.
    ``heads``, ``roles``: as for ``layer_table``. ``batch``: how many patched forward
    passes run at once (along a new leading dimension, ``torch.vmap``).

    ``evaluations`` counts the forward passes of the graph run so far (one per example
    of a batch; EAP's forward and backward count one, EAP-IG's one per step; the clean
    run and the runs for ablated values count too).

    Examples::

        p = Patching(res, {"input_ids": corrupted_ids})
        p.edge_effects().sort_values("effect", key=abs).tail(5)   # the strongest edges
        p.faithfulness(circuit.prune(top_n=10).edges)             # a pruned circuit
        p.eap_ig(steps=5)                                         # scores, one pass a step
    """

    def __init__(self, res, corrupted: dict | None = None, *, mode: str = "corrupted",
                 reference: list | None = None, heads=None, roles=None,
                 batch: int = 64):  # fmt: skip
        _check_mode(mode, corrupted, reference)
        if not isinstance(batch, int) or batch < 1:
            raise InputError(f"batch={batch!r}: give how many passes run at once, 1 or more")
        graph = res.graph
        self.res, self.graph, self.mode = res, graph, mode
        self.heads, self.roles, self.batch = heads, roles, batch
        out = graph.output_node
        value = res.values[out]
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(
                f"patching needs a scalar output (the metric), got shape {shape}: pass "
                "output= that picks one number, e.g. a logit difference"
            )
        self.lay = layout(res, heads, roles)
        self.evaluations = 0
        self._entries: dict = {}
        self._own: dict = {}
        self._order = call_order(graph, out)
        self._inputs = {k: res.values[n] for k, n in graph.user_inputs.items()}
        self.base = self._values(self._inputs)
        self.clean = float(self.base[out])
        plan = destinations(res, self.lay, self.base)
        self.dests, self._entries, self._regions = plan.dests, plan.entries, plan.regions
        self._own = plan.own
        #: (layer, role, head, input) -> index into ``dests``
        self.dest_index = plan.index
        self._comp_index = {(c.layer, c.role, c.head): i for i, c in enumerate(self.lay.components)}
        keep = set(self.lay.stops) | {b for b in self._points()}
        self.ablated = self._ablated(mode, corrupted, reference, keep)
        self.assign = {n: assignment(self.lay, self.base[n], n) for n in self.lay.stops}
        self._edge_frame = None
        self._empty = None
        self._tail = None
        #: positions the attention mask pads (0 there): no site, no edge is read there
        self.padding = _padding(self._inputs.get("attention_mask"), self.lay.positions)

    def _points(self):
        from ..analysis.branches import blocks

        return [v for b in blocks(self.res, self.roles) for v in b.points.values()]

    def _ablated(self, mode, corrupted, reference, keep) -> dict:
        if mode == "zero":
            return {n: torch.zeros_like(self.base[n]) for n in keep}
        runs = [corrupted] if mode == "corrupted" else list(reference)
        total: dict = {}
        for i, given in enumerate(runs):
            what = "corrupted" if mode == "corrupted" else f"reference[{i}]"
            values = self._values(self._given(given, what))
            for n in keep:
                total[n] = values[n] if n not in total else total[n] + values[n]
        return {n: v / len(runs) if len(runs) > 1 else v for n, v in total.items()}

    def _given(self, given, what) -> dict:
        """The inputs of a run: the clean ones, with those ``given`` names replaced."""
        if isinstance(given, dict):
            found = input_tensors((), given)
        elif isinstance(given, list | tuple):
            found = input_tensors(tuple(given), {})
        else:
            raise InputError(
                f"{what}: give the input's tensors as a dict of keywords (or a tuple of "
                f"positional ones), not {type(given).__name__}"
            )
        if not found:
            raise InputError(
                f"{what}: {given!r} holds no tensor, so nothing would be patched (every "
                "value would be the clean one): give the corrupted input's tensors, e.g. "
                "{'input_ids': corrupted_ids}"
            )
        unknown = [k for k in found if k not in self._inputs]
        if unknown:
            raise InputError(f"{what}: {unknown} are not inputs of the traced model "
                             f"(its inputs: {list(self._inputs)})")  # fmt: skip
        out = dict(self._inputs)
        for k, t in found.items():
            clean = self._inputs[k]
            if t.shape != clean.shape or t.dtype != clean.dtype:
                raise InputError(
                    f"{what}: input {k!r} has shape {tuple(t.shape)} and dtype {t.dtype}, the "
                    f"clean one {tuple(clean.shape)} and {clean.dtype}: patching compares "
                    "values position by position, so give an input of the same shape"
                )
            check_finite(t, f"{what}: input {k!r}")
            out[k] = t.to(clean.device)
        return out

    # -- the patched forward ----------------------------------------------------------

    def _values(self, inputs) -> dict:
        with torch.no_grad():
            values = self._run(inputs)
        self.evaluations += 1
        return values

    def _run(self, inputs, mix=None, replace=None, branch=None, record=None) -> dict:
        """Every value of one forward pass. ``mix``: ``{destination: mu (components,
        positions)}``, the destinations whose input is recomputed; ``replace``: ``{node:
        function of its value}``; ``branch``: ``(fan-out point, position mask, {op:
        tensor it reads})``; ``record``: a list that gets ``(destination, node, mixed
        value)`` for every mixed component value (EAP's gradients are taken there)."""
        graph = self.graph
        vals = {node: inputs[key] for key, node in graph.user_inputs.items()}
        vals.update(graph.constants)
        mix = mix or {}
        replace = replace or {}
        for node in self._order:
            out = call(node, *args_of(node, vals, vals))
            for d, x, cols in self._entries.get(node, ()):
                if d not in mix:
                    continue
                xd = self._input_of(d, x, mix[d], vals, record)
                if x is node:  # the target: the output itself, recomputed
                    out = xd
                    continue
                alt = call(node, *args_of(node, {x: xd}, vals))
                out = alt if cols is None else torch.where(cols, alt, out)
            for own in self._own.get(node, ()):
                reads = [r for r in own.reads if r[0] in mix]
                if reads:
                    xs = [self._input_of(d, x, mix[d], vals, record) for d, _, x, _ in reads]
                    out = own_pass(own, reads, xs, out, vals, self.lay.positions)
            if branch is not None and node in branch[2]:
                out = call(node, *args_of(node, self._branch_input(branch, node, vals), vals))
            if node in replace:
                out = replace[node](out)
            vals[node] = out
        return vals

    def _input_of(self, d, x, mu, vals, record):
        """Destination ``d``'s value of ``x``: the residual region recomputed from the
        components' values mixed with ``mu`` (components, positions)."""
        stops, order = self._regions[x]
        local = {}
        for n in stops:
            a, free = self.assign[n]
            m = (mu.transpose(-1, -2) @ a + free).reshape(vals[n].shape)
            local[n] = m * vals[n] + (1 - m) * self.ablated[n]
            if record is not None:
                record.append((d, n, local[n]))
        for n in order:
            local[n] = call(n, *args_of(n, local, vals))
        return local[x]

    def _branch_input(self, branch, op, vals) -> dict:
        point, keep, reads = branch
        via = reads[op]
        local = {point: keep * vals[point] + (1 - keep) * self.ablated[point]}
        region = ancestors(via, descendants(point)) - {point}
        for n in sorted(region, key=self.graph.ids.__getitem__):
            local[n] = call(n, *args_of(n, local, vals))
        return {via: local[via]}

    def read_input(self, d, x, mu):
        """Destination ``d``'s value of the tensor ``x`` it reads, recomputed through the
        residual stream from the components' values mixed with ``mu`` (components,
        positions; 1: kept, 0: ablated)."""
        return self._input_of(d, x, mu, self.base, None)

    def projection_reads(self, d) -> list:
        """``[(projection op, the tensor it reads, bool mask of its output columns that
        are destination d's)]``: where head ``d``'s query, key or value is computed."""
        out = [(op, x, cols) for op, reads in self._entries.items()
               for dd, x, cols in reads if dd == d and x is not op]  # fmt: skip
        for passes in self._own.values():
            out += [(op, x, cols) for o in passes for dd, op, x, cols in o.reads if dd == d]
        return out

    def output(self, **kw):
        return self._run(self._inputs, **kw)[self.graph.output_node].reshape(())

    def remainder(self, nodes) -> Remainder:
        """The forward from ``nodes`` on (:class:`.remainder.Remainder`): call it with
        ``(self.base, {node: replacement})``."""
        if self._tail is None:
            self._tail = (tail(self._order, self.graph.output_node, self.base),)
        return Remainder(self._order, nodes, self.graph.output_node, self._tail[0])

    def batched(self, fn, variants) -> list[float]:
        """``fn(variant)`` (a scalar tensor) for each row of ``variants``, ``batch`` at a
        time along a new leading dimension."""
        out: list[float] = []
        with torch.no_grad():
            for chunk in variants.split(self.batch):
                got = torch.vmap(fn)(chunk) if len(chunk) > 1 else fn(chunk[0])[None]
                self.evaluations += len(chunk)
                out.extend(float(v) for v in got.reshape(-1).cpu())
        return out

    def all_kept(self):
        like = self.base[self.graph.output_node]
        return torch.ones(len(self.lay.components), self.lay.positions, dtype=_float(like),
                          device=like.device)  # fmt: skip

    # -- edges ------------------------------------------------------------------------

    def edges(self):
        """Every edge (``EDGE_KEY`` columns): the rows of ``Circuit.edges`` of this result,
        in their order (those some path takes, read from a MaxProduct pass; none at a
        position the attention mask pads)."""
        if self._edge_frame is None:
            from ..circuits.edges import circuit_edges

            src, sr = self._path_result()
            frame = circuit_edges(src, [sr], seed="structural", heads=self.heads, roles=self.roles)
            frame = frame[~frame["position"].isin(self.padding)]  # as Circuit.edges
            self._edge_frame = frame[list(EDGE_KEY)].reset_index(drop=True)
        return self._edge_frame.copy()

    def _path_result(self):
        """A pass whose zero means no path (MaxProduct): ``res``'s own, else one run here."""
        from ..engine.reverse import reverse
        from ..result import Result
        from ..semirings import MaxProduct

        for sr in self.res.semirings:
            if isinstance(sr, MaxProduct):
                return self.res, sr
        sr = MaxProduct()
        store = reverse(self.graph, self.base, [sr], self.graph.output_node)
        return Result(self.graph, self.base, store, [sr]), sr

    def edge_index(self, edges=None) -> list[tuple[int, int, int]]:
        """``(component, destination, position)`` of each edge (a frame with ``EDGE_KEY``
        columns or an iterable of ``EDGE_KEY`` tuples; default: every edge)."""
        rows = self.edges() if edges is None else edges
        if hasattr(rows, "columns"):
            missing = [c for c in EDGE_KEY if c not in rows.columns]
            if missing:
                raise InputError(f"edges: missing columns {missing} (expected {list(EDGE_KEY)})")
            rows = rows[list(EDGE_KEY)].itertuples(index=False, name=None)
        out = []
        for row in rows:
            key = tuple(_plain(v) for v in row)
            if len(key) != len(EDGE_KEY):
                raise InputError(f"edge {row!r}: give the {len(EDGE_KEY)} values {EDGE_KEY}")
            c = self._comp_index.get((key[0], key[1], key[2]))
            d = self.dest_index.get((key[3], key[4], key[5], key[6]))
            p = key[7]
            if c is None or d is None or not isinstance(p, int) or not 0 <= p < self.lay.positions:
                raise InputError(
                    f"edge {key}: no such source, destination or position in this model "
                    "(give rows of Patching.edges() or Circuit.edges)"
                )
            out.append((c, d, p))
        return out

    def metric(self, kept) -> float:
        """m(C): the output with the edges ``kept`` (EDGE_KEY tuples or a frame) kept and
        every other edge ablated (one forward pass)."""
        mu = torch.zeros(len(self.dests), *self.all_kept().shape, dtype=self.all_kept().dtype)
        for c, d, p in self.edge_index(kept):
            mu[d, c, p] = 1
        with torch.no_grad():
            got = self.output(mix=dict(enumerate(mu.to(self.all_kept().device))))
        self.evaluations += 1
        return float(got)

    @property
    def empty(self) -> float:
        """m(∅): every edge ablated."""
        if self._empty is None:
            self._empty = self.metric([])
        return self._empty

    def faithfulness(self, kept) -> float:
        """Normalized faithfulness ``(m(C) - m(∅)) / (m(M) - m(∅))``."""
        span = self.clean - self.empty
        if span == 0:
            raise InputError(
                "faithfulness: the output is the same with every edge ablated as with none "
                f"({self.clean}): the ablation changes nothing to explain"
            )
        return (self.metric(kept) - self.empty) / span

    def edge_effects(self, edges=None, progress: bool = False):
        """``EDGE_KEY`` + ``effect``: m(M) - m(that edge alone ablated), one forward pass
        per edge (the edges into one destination batched). ``edges``: a frame with
        ``EDGE_KEY`` columns or ``EDGE_KEY`` tuples (default: every edge)."""
        frame = self.edges() if edges is None else _edge_frame(edges)
        index = self.edge_index(frame)
        by_dest: dict = {}
        for i, (c, d, p) in enumerate(index):
            by_dest.setdefault(d, []).append((i, c, p))
        effect = [math.nan] * len(index)
        groups = list(by_dest.items())
        if progress:
            from tqdm.auto import tqdm

            groups = tqdm(groups, desc="edges, by destination")
        for d, rows in groups:
            mus = self.all_kept().expand(len(rows), -1, -1).clone()
            for k, (_, c, p) in enumerate(rows):
                mus[k, c, p] = 0
            got = self.batched(lambda mu, d=d: self.output(mix={d: mu}), mus)
            for (i, _, _), m in zip(rows, got):
                effect[i] = self.clean - m
        out = frame.copy()
        out["effect"] = effect
        return out

    # -- sites and branches: :mod:`.sites` --------------------------------------------

    def node_effects(self, progress: bool = False):
        """``NODE_KEY`` + ``effect``: m(M) - m(that site ablated for every consumer), one
        forward pass per site (component and position): :func:`.sites.node_effects`."""
        return sites.node_effects(self, progress)

    def branch_effect(self, layer: int, branch: str, position: int,
                      sublayer: str | None = None) -> float:  # fmt: skip
        """m(M) - m(only ``branch``'s consumers of block ``layer``'s fan-out point ablated at
        ``position``): :func:`.sites.branch_effect`."""
        return sites.branch_effect(self, layer, branch, position, sublayer)

    # -- attribution patching ---------------------------------------------------------

    def eap(self):
        """``EDGE_KEY`` + ``score``: attribution patching, ``(a - a') . g`` per edge (one
        forward and one backward pass): :func:`.eap.eap`."""
        from .eap import eap

        return eap(self)

    def eap_ig(self, steps: int = 5, method: str = "riemann_right"):
        """``EDGE_KEY`` + ``score``: EAP-IG (inputs), ``steps`` points placed by ``method``
        (riemann_right: as EAP-IG's code; gausslegendre): :func:`.eap.eap_ig`."""
        from .eap import eap_ig

        return eap_ig(self, steps, method)

    def eap_qk(self):
        """``EDGE_KEY`` + ``score``: EAP with AtP*'s QK fix (each query and key edge's head
        pattern exact, linear after it): :func:`.qk.eap_qk`."""
        from .qk import eap_qk

        return eap_qk(self)

    def node_scores_qk(self):
        """``NODE_KEY`` + ``score``: attribution patching of each site with every later
        head's pattern exact: :func:`.qk.node_scores_qk`."""
        from .qk import node_scores_qk

        return node_scores_qk(self)

    def relevance_qk(self, circuit):
        """``(edges, sites)``: the scores of a relevance-weighted ``circuit`` of this
        pass with each query and key term computed exactly (the pattern, which the rule
        holds constant, recomputed, linear after it): :func:`.relevance_qk.relevance_qk`."""
        from .relevance_qk import relevance_qk

        return relevance_qk(self, circuit)


def _check_mode(mode, corrupted, reference):
    if mode not in MODES:
        raise InputError(f"mode={mode!r}: give one of {MODES}")
    if mode == "corrupted" and corrupted is None:
        raise InputError("mode 'corrupted' needs corrupted= (the corrupted input's tensors)")
    if mode == "mean" and not reference:
        raise InputError("mode 'mean' needs reference= (a list of inputs to average over)")
    if mode != "corrupted" and corrupted is not None:
        raise InputError(f"corrupted= is read in mode 'corrupted' only, not {mode!r}")
    if mode != "mean" and reference is not None:
        raise InputError(f"reference= is read in mode 'mean' only, not {mode!r}")


def _edge_frame(edges):
    """A frame of ``EDGE_KEY`` columns from a frame (extra columns dropped) or tuples."""
    import pandas as pd

    if hasattr(edges, "columns"):
        missing = [c for c in EDGE_KEY if c not in edges.columns]
        if missing:
            raise InputError(f"edges: missing columns {missing} (expected {list(EDGE_KEY)})")
        return edges[list(EDGE_KEY)].reset_index(drop=True)
    frame = pd.DataFrame([tuple(r) for r in edges], columns=list(EDGE_KEY))
    for col in ("src_layer", "src_head_index", "dst_layer", "dst_head_index", "position"):
        frame[col] = frame[col].astype("Int64")
    return frame


def _padding(mask, positions: int) -> frozenset:
    """The positions an attention mask of one example pads (0 there); none without one."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape != (1, positions):
        return frozenset()
    return frozenset(int(p) for p in (mask[0] == 0).nonzero().flatten().tolist())


def _float(t):
    return t.dtype if t.is_floating_point() else torch.get_default_dtype()


def _plain(v):
    """An edge key's value as a plain int, str or None (pandas' NA, numpy ints)."""
    import pandas as pd

    if v is None or v is pd.NA:
        return None
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, str):
        return v
    return int(v)
