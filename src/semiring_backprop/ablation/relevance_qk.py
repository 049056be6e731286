"""Relevance weights with exact queries and keys (DESIGN §3c): the relevance rule holds
every attention pattern constant (CP-LRP), so no relevance reaches a query or a key;
these add those terms exactly, with :mod:`.qk`'s recomputation of each head's pattern,
linearized after the pattern under the relevance adjoint of what reads it.

- :func:`pattern_adjoints`: a pattern's adjoint under any pass's own edge weights;
- :func:`relp_sites`: relevance patching of every site (RelP: ``(a - a') . r``), with or
  without each later head's exact pattern change;
- :func:`relevance_qk`: a relevance circuit's edges and sites with the query and key
  terms exact (``Patching.relevance_qk``).
"""

from __future__ import annotations

import torch

from ..analysis.fanout import ancestors, descendants
from ..errors import InputError
from .patching_edges import args_of, call
from .qk import attention_heads, blocks, fix_edges, site_frame, site_terms
from .sites import EDGE_KEY, NODE_KEY

__all__ = ["pattern_adjoints", "relp_sites", "relevance_qk"]


def pattern_adjoints(p, heads, res=None) -> dict:
    """``{pattern node: G}`` under the edge weights of the pass ``res`` (default
    ``p.res``; another pass of the same model and clean input, e.g. one of relevance
    weights, its nodes found by name): the adjoint its Real semiring holds at each
    block's heads' site, taken back to the pattern through the ops between them (the
    contraction with the values and the moves after it; linear in the pattern, their
    derivative by torch.autograd). Under ``weights="gradient"`` it is ``∂m/∂A``; under
    ``"relevance"``, which holds the pattern constant (no edge into it), it is the
    relevance adjoint of what reads the pattern, times the contraction's derivative in
    it."""
    from ..semirings import Real

    res = p.res if res is None else res
    if Real() not in res.semirings:
        raise InputError(
            f"the pattern adjoints read the pass's Real semiring, and this pass computed "
            f"{res.semirings}: make it with semirings=[Real(), ...]"
        )
    out = {}
    for hs in blocks(heads):
        h0 = hs[0]
        (site,) = p.lay.heads[h0.layer][0].nodes
        between = ancestors(site, descendants(h0.pattern)) - {h0.pattern}
        chain = sorted(between, key=p.graph.ids.__getitem__)
        adj = res.at(site if res is p.res else site.name, Real())
        if adj.shape != p.base[site].shape:
            raise InputError(
                f"{site.name}: the pass given holds an adjoint of shape {tuple(adj.shape)} "
                f"where this Patching's value has {tuple(p.base[site].shape)}: give a pass of "
                "the same model and clean input"
            )
        with torch.enable_grad():
            a = p.base[h0.pattern].detach().clone().requires_grad_()
            local = {h0.pattern: a}
            for n in chain:
                local[n] = call(n, *args_of(n, local, p.base))
            (g,) = torch.autograd.grad(local[site], a, adj.to(a.dtype), allow_unused=True)
        out[h0.pattern] = torch.zeros_like(a) if g is None else g.detach()
    return out


def relevance_qk(p, circuit):
    """``(edges, sites)``: the scores of ``circuit`` (relevance weights,
    ``weights="relevance"``, seeded with ``x - x'`` from the corrupted input ``p``
    ablates from; ``p``: a Patching of a gradient-weighted pass of the same clean input)
    with what the rule leaves out added exactly. The rule holds each attention pattern
    constant, so no path reaches a query or a key; here each query and key edge gets
    the QK-fixed score (the head's pattern exact, linear after it) and each site adds,
    per later head, the head's exact pattern change with its query and key recomputed
    from the site ablated, both under the relevance adjoints of the patterns
    (:func:`pattern_adjoints`). Value, MLP and target edges keep the circuit's scores
    (EDGE_KEY + score, every edge of ``p.edges()``; NODE_KEY + score, every site)."""
    weights = getattr(circuit.result.graph, "weights", "gradient")
    if weights != "relevance" or circuit.seed != "x - x'" or circuit.ig_steps:
        raise InputError(
            f"relevance_qk adds the query and key terms that relevance weights leave out "
            f"to a first-order circuit; this one has weights={weights!r}, seed "
            f"{circuit.seed!r}, ig_steps={circuit.ig_steps}: make it with "
            "weights='relevance' and baseline= the corrupted input (no ig_steps)"
        )
    if getattr(p.graph, "weights", "gradient") != "gradient":
        raise InputError(
            "relevance_qk: this Patching is of a relevance-weighted pass, whose layout has "
            "no query or key to recompute: make it from a pass of gradient weights (the "
            "default) of the same clean input"
        )
    out = circuit.result.values[circuit.result.graph.output_node]
    if abs(float(out) - p.clean) > 1e-6 * max(1.0, abs(p.clean)):
        raise InputError(
            f"relevance_qk: the circuit's output is {float(out):.6g} and this Patching's "
            f"clean run gives {p.clean:.6g}: give a circuit of the same model and input"
        )
    heads = attention_heads(p)
    grads = pattern_adjoints(p, heads, circuit.result)
    col = circuit.column("Real")
    keys = list(EDGE_KEY)
    given = circuit.edges[[*keys, col]].rename(columns={col: "score"})
    edges = _on(p.edges()[keys], given, keys)
    sites = circuit.nodes[circuit.nodes.role.isin(("embedding", "head", "mlp"))]
    terms = site_frame(p, site_terms(p, heads, grads))
    rel = _on(terms[list(NODE_KEY)], sites[[*NODE_KEY, col]].rename(columns={col: "score"}),
              list(NODE_KEY))  # fmt: skip
    terms["score"] = terms["score"].to_numpy() + rel["score"].to_numpy()
    return fix_edges(p, edges, heads, grads), terms


def relp_sites(p, res, exact_qk: bool = True):
    """``NODE_KEY`` + ``score``: relevance patching (RelP, Jafari et al. 2025) of every
    site, ``(a - a')[p] . r[p]``: the site's clean value minus its ablated one (``p``'s
    own runs, as attribution patching takes them) times the adjoint ``r`` of the pass
    ``res`` (relevance weights; another pass of the same model and clean input) at the
    site; with ``exact_qk``, plus per later head the head's exact pattern change with
    its query and key recomputed from the site ablated, linear after the pattern under
    the relevance adjoint (:func:`pattern_adjoints`), which the rule, holding each
    pattern constant, leaves out."""
    from ..semirings import Real

    lay = p.lay
    total = torch.zeros(len(lay.components), lay.positions, dtype=p.all_kept().dtype,
                        device=p.all_kept().device)  # fmt: skip
    for n in lay.stops:
        a, _ = p.assign[n]
        g = res.at(n.name, Real()).to(p.base[n].dtype)
        diff = (p.base[n] - p.ablated[n]).detach()
        total += ((g * diff).reshape(lay.positions, -1) @ a.T).T
    if exact_qk:
        heads = attention_heads(p)
        total += site_terms(p, heads, pattern_adjoints(p, heads, res))
    return site_frame(p, total)


def _on(universe, scores, key):
    """``scores`` on the rows of ``universe`` (0 where it has none: no path)."""
    types = {k: universe[k].dtype for k in key}
    rows = universe.merge(scores.astype(types), on=key, how="left", validate="one_to_one")
    rows["score"] = rows["score"].astype(float).fillna(0.0)
    return rows
