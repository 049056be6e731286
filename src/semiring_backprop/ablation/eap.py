"""Edge attribution patching on the edges of a :class:`.patching.Patching`: EAP (Syed et
al., 2023) and EAP-IG with interpolated inputs (Hanna et al., 2024).

Both read the gradient of the output with respect to each component's value *as one
destination reads it* (the mixed value of :meth:`.patching.Patching._input_of`, one
tensor per destination and component node), from one backward pass for all edges:

- EAP: at the clean input, ``score(s -> d, p) = (a_s - a'_s)[p] . g_d(s)[p]``, the
  derivative of the output in the edge's ``mu`` at ``mu = 1`` (``a``: the clean value,
  ``a'``: the ablated one);
- EAP-IG (inputs): ``g`` averaged over ``steps`` forward passes whose token embeddings are
  ``x' + (k / steps) (x - x')``, ``k = 1 .. steps`` (as EAP-IG's ``get_scores_eap_ig``
  places them, ``for step in range(1, steps + 1)``: the right Riemann sum from the
  ablated embeddings to the clean ones, the last point the clean input itself), times
  the same ``a - a'``. With ``steps=1`` it is EAP. (Earlier versions of that code ran
  ``range(0, steps)``: the left sum, from the ablated input itself, never the clean
  one.) ``method="gausslegendre"`` places the points as Gauss-Legendre quadrature does
  instead (the integrated-gradients rule of ``Circuit``'s ``ig_steps``).

A score approximates the edge's effect ``m(M) - m(that edge ablated)``
(:meth:`.patching.Patching.edge_effects`), with the same sign.
"""

from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["eap", "eap_ig", "gradients", "edge_scores"]


def eap(p):
    """``EDGE_KEY`` + ``score``: ``(a - a') . g`` per edge of ``p.edges()``."""
    return edge_scores(p, gradients(p))


def eap_ig(p, steps: int = 5, method: str = "riemann_right"):
    """``EDGE_KEY`` + ``score``: EAP-IG (inputs) with ``steps`` points, placed and weighed
    by ``method`` (Captum's names, :func:`..circuits.ig.quadrature`): ``riemann_right``
    (the default) as EAP-IG's own code places them, ``gausslegendre`` where few points
    must integrate well (2 points: exact for a cubic along the line)."""
    from ..circuits.ig import check_steps, quadrature

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps={steps!r}: give the number of interpolation points, 1 or more")
    check_steps(steps, method)
    (emb,) = [c for c in p.lay.components if c.role == "embedding"]
    total: dict = {}
    for t, w in zip(*quadrature(steps, method)):

        def point(value, n, t=t):  # the ablated embeddings moved toward the clean ones
            return p.ablated[n] + t * (p.base[n] - p.ablated[n])

        replace = {n: (lambda v, n=n: point(v, n)) for n in emb.nodes}
        for key, g in gradients(p, replace).items():
            total[key] = w * g if key not in total else total[key] + w * g
    return edge_scores(p, total)


def gradients(p, replace=None) -> dict:
    """``{(destination, component node): gradient of the output}`` at the value that
    destination reads of that node (one forward and one backward pass)."""
    record: list = []
    with torch.enable_grad():
        ones = p.all_kept()
        mix = {d: ones.clone().requires_grad_() for d in range(len(p.dests))}
        out = p.output(mix=mix, replace=replace, record=record)
        grads = torch.autograd.grad(out, [t for _, _, t in record], allow_unused=True)
    p.evaluations += 1
    got: dict = {}
    for (d, n, _), g in zip(record, grads):
        if g is not None:  # (an MLP's entries that read one tensor: each read once)
            got[(d, n)] = g if (d, n) not in got else got[(d, n)] + g
    return got


def edge_scores(p, grads: dict):
    """Per edge, ``Σ (a - a') ⊙ g`` over its source's columns at its position."""
    positions = p.lay.positions
    scores: dict = {}
    for (d, n), g in grads.items():
        a, _ = p.assign[n]
        diff = (p.base[n] - p.ablated[n]).detach()
        per = ((g * diff).reshape(positions, -1) @ a.T).T  # (components, positions)
        scores[d] = per if d not in scores else scores[d] + per
    frame = p.edges()
    out = []
    for c, d, pos in p.edge_index(frame):
        out.append(float(scores[d][c, pos]) if d in scores else 0.0)
    frame["score"] = out
    return frame
