"""Integrated-gradients steps for a circuit's seed: conductance (DESIGN §3b).

With a baseline ``x'`` at the sources, ``ig_steps=N`` runs the pass again at ``N``
points ``x' + a_t (x - x')`` of the straight line from the baseline to the input, seeds
alpha with ``x - x'`` at each, and sums the Real max-marginals with the quadrature's
weights ``w_t``. For a site's neurons ``y``::

    score = Σ_t w_t Σ_y D_t(y) · alpha_t(y),   alpha_t(y) = Σ_i (x_i - x'_i) ∂y/∂x_i (x_t)

the conductance of those neurons (Dhamdhere et al., "How important is a neuron?",
2018): Captum's ``NeuronConductance`` of each neuron summed over the input features,
with the same points and weights (``tests/test_circuit_ig.py``). At the sources it is
integrated gradients (Captum's ``IntegratedGradients``), and every cut sums to their
total, which tends to ``F(x) - F(x')`` as ``N`` grows (completeness). Captum's
``LayerConductance`` approximates the same integral another way (the layer's activation
differences between ``N + 1`` points times the gradient at the first of each pair), so
the two agree as ``N`` grows, not at each ``N``. Edges and attention edges are sums
over paths as the sites are: their Real values are weighed over the steps the same way.

Only Real is integrated. A selective ⊕ (the best path, the top k, the entropy's
weights) picks among the paths of one graph; an average over steps of those picks is
the value of no path. Every other semiring's column is read at the input ``x`` with
the seed ``x - x'`` (as with ``ig_steps=0``), and the frames' ``attrs["notes"]`` say so
per column.

Each step is a whole pass that holds every value of the graph (a checkpointed pass
would compute the interpolated value again from the model's own input); the steps run
one after the other.
"""

from __future__ import annotations

import torch
from torch.fx.node import map_arg

from ..engine import budget
from ..engine.marginals import seed_node
from ..engine.reverse import reverse
from ..errors import InputError
from ..result import Result
from ..semirings import Real
from ..tracing.trace import mark_op
from .exports import ATTENTION_COLUMNS, EDGE_COLUMNS, NODE_COLUMNS
from .nodes import circuit_nodes, readout

#: the quadratures, by Captum's names (``method=`` of its ``IntegratedGradients``)
METHODS = ("gausslegendre", "riemann_left", "riemann_right", "riemann_middle",
           "riemann_trapezoid")  # fmt: skip


def quadrature(n: int, method: str = "gausslegendre") -> tuple[list[float], list[float]]:
    """``(points, weights)``: the ``n`` values of ``a`` in [0, 1] where the pass runs,
    and their weights (summing to 1). The points are Captum's; so are the weights,
    except ``riemann_trapezoid``'s: Captum weighs its ``n`` points ``1/n`` (halved at
    both ends), which sum to ``1 - 1/n``; here ``1/(n - 1)``, halved at both ends, the
    trapezoid rule on their spacing (Captum's values times ``n / (n - 1)``).

    Examples:
        >>> quadrature(2, "riemann_right")
        ([0.5, 1.0], [0.5, 0.5])
        >>> quadrature(3, "riemann_trapezoid")
        ([0.0, 0.5, 1.0], [0.25, 0.5, 0.25])
        >>> quadrature(1, "riemann_left")       # the baseline itself
        ([0.0], [1.0])
    """
    check_steps(n, method)
    if method == "gausslegendre":
        import numpy as np

        x, w = np.polynomial.legendre.leggauss(n)
        return (0.5 * (1 + x)).tolist(), (0.5 * w).tolist()
    lo, hi = {"riemann_left": (0.0, 1 - 1 / n), "riemann_right": (1 / n, 1.0),
              "riemann_middle": (1 / (2 * n), 1 - 1 / (2 * n)),
              "riemann_trapezoid": (0.0, 1.0)}[method]  # fmt: skip
    points = torch.linspace(lo, hi, n, dtype=torch.float64).tolist()
    if method != "riemann_trapezoid":
        return points, [1 / n] * n
    weights = [1 / (n - 1)] * n
    weights[0] = weights[-1] = 1 / (2 * (n - 1))
    return points, weights


def check_steps(ig_steps, ig_method="gausslegendre") -> None:
    """Raise InputError for a step count that is not a whole number >= 0 or an unknown
    method (``ig_steps=0``: no steps, the seed at the input alone)."""
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 0:
        raise InputError(
            f"ig_steps={ig_steps!r}: give the number of integrated-gradients steps, a whole "
            "number (0: none, the seed x - x' at the input only; 16 to 64 is usual)"
        )
    if ig_method not in METHODS:
        raise InputError(f"ig_method={ig_method!r}: use one of {METHODS} (Captum's names)")
    if ig_method == "riemann_trapezoid" and ig_steps == 1:
        raise InputError(
            "ig_method='riemann_trapezoid' takes both ends of the line: give ig_steps >= 2, "
            "or riemann_left (the baseline) / riemann_right (the input) for one step"
        )


def check_call(ig_steps, ig_method, baseline, seed="x") -> None:
    """:func:`check_steps`, and with steps, a baseline to start from and the seed
    ``"x"`` (the steps integrate ``x - x'``)."""
    check_steps(ig_steps, ig_method)
    if not ig_steps:
        return
    if baseline is None:
        raise InputError(
            "ig_steps needs a baseline x' (baseline={place: tensor}, e.g. the embeddings of "
            "a corrupted input): the steps run from x' to the input x"
        )
    if not (isinstance(seed, str) and seed == "x"):
        raise InputError(f"ig_steps integrates the seed x - x': use seed='x', not {seed!r}")
    if not isinstance(baseline, dict) or not baseline:
        raise InputError(
            f"baseline must be a dict {{place: tensor}}, got {type(baseline).__name__}"
        )


def places(res, baseline) -> dict:
    """``{node: (x, x')}`` for every place of ``baseline``, checked: the steps move
    along the line at the places themselves."""
    if res.kept is not None:
        raise InputError(
            "ig_steps runs the graph again from the model's inputs, which this pass did not "
            "keep (Backprop(keep=...)): make the pass with keep=None"
        )
    out = {}
    for place, b in baseline.items():
        node = seed_node(res, place)  # where the seed starts: the op, not its module's mark
        if node not in res.needed:
            raise InputError(
                f"baseline at {place!r}: no path from there reaches the output, so the "
                "line from the baseline moves nothing"
            )
        x = res.values[node]
        try:
            xb = torch.as_tensor(b).to(x.device, x.dtype).expand(x.shape)
        except RuntimeError:
            raise InputError(
                f"baseline at {place!r} has shape {tuple(torch.as_tensor(b).shape)}; the "
                f"value there has shape {tuple(x.shape)}"
            ) from None
        _check_replaceable(res, place, node)
        out[node] = (x, xb)
    return out


def _check_replaceable(res, place, node) -> None:
    """The step replaces the value at ``node``. Where that is a module's ``mark`` (not
    its op: the op has other readers), those readers would still read the value at
    the input: refused, never half interpolated."""
    if node.op != "call_function" or node.target is not mark_op:
        return
    made = node.args[0]
    if not isinstance(made, torch.fx.Node):
        return
    other = [u.name for u in made.users if u is not node and u in res.needed]
    if other:
        raise InputError(
            f"baseline at {place!r}: the tensor there is also read as {other[:3]} past the "
            "module's output, so moving the output along the line would leave those reads "
            "at the input; give the place where every reader takes it (its consumer's input)"
        )


def pass_at(res, moved: dict, a: float) -> Result:
    """The Real pass at ``x' + a (x - x')`` (``moved``: :func:`places`), every value held."""
    graph = res.graph
    given = {n: xb + a * (x - xb) for n, (x, xb) in moved.items()}
    values = dict(graph.constants)
    values.update((n, res.values[n]) for n in graph.user_inputs.values())
    values.update(given)
    with torch.no_grad():
        for node in graph.nodes:  # the forward of the traced graph, the places given
            if node.op != "call_function" or node in given:
                continue
            args = map_arg(node.args, values.__getitem__)
            kwargs = map_arg(node.kwargs, values.__getitem__)
            values[node] = args[0] if node.target is mark_op else node.target(*args, **kwargs)
        budget.check(graph, values, [Real()], res.needed, None)  # (refuses what cannot fit)
        store = reverse(graph, values, [Real()], graph.output_node)
    return Result(graph, values, store, [Real()])


def integrated(res, semirings, baseline, ig_steps, ig_method="gausslegendre", *, seed="x",
               tokens=None, heads=None, roles=None, edges=None, attention_edges=None):  # fmt: skip
    """``(nodes, edges, attention_edges)`` of the circuit of ``res`` with Real integrated
    over ``ig_steps`` steps (the other semirings at the input); ``edges`` /
    ``attention_edges`` given are kept as they are."""
    from . import attention_edges as ae
    from . import edges as ce

    check_call(ig_steps, ig_method, baseline, seed)
    srs = list(semirings)
    if Real() not in srs:
        raise InputError(
            f"ig_steps integrates the Real column (conductance) and {[s.name for s in srs]} "
            "has no Real: add sbp.Real() to semirings, or leave ig_steps at 0"
        )
    moved = places(res, baseline)
    diff = {n: x - xb for n, (x, xb) in moved.items()}
    others = [s for s in srs if s != Real()]
    kw = {"tokens": tokens, "heads": heads, "roles": roles}
    base = {"seed": "x", "baseline": baseline, **kw}
    todo = {"nodes": (circuit_nodes, NODE_COLUMNS)}
    if edges is None:
        todo["edges"] = (ce.circuit_edges, EDGE_COLUMNS)
    if attention_edges is None:
        todo["attention_edges"] = (ae.attention_edges, ATTENTION_COLUMNS)
    at_input = {k: fn(res, others, **base) if others else None for k, (fn, _) in todo.items()}
    steps = {k: [] for k in todo}
    points, weights = quadrature(ig_steps, ig_method)
    for a in points:
        step = pass_at(res, moved, a)
        for k, (fn, _) in todo.items():
            steps[k].append(fn(step, [Real()], seed=diff, **kw))
    notes = _notes(srs, ig_steps, ig_method)
    out = {k: _combine(steps[k], weights, at_input[k], cols, srs, notes)
           for k, (_, cols) in todo.items()}  # fmt: skip
    return (out["nodes"], out.get("edges", edges),
            out.get("attention_edges", attention_edges))  # fmt: skip


def _notes(srs, n, method) -> dict:
    notes = {"Real": f"conductance: the flow seeded with x - x', summed over {n} points "
                     f"x' + a (x - x') with the {method} quadrature's weights"}  # fmt: skip
    for sr in srs:
        if sr != Real():
            notes[sr.name] = (f"at the input x with the seed x - x', not over the {n} "
                              "integrated-gradients steps (a selective ⊕ has no average "
                              "over steps that is the value of a path)")  # fmt: skip
    return notes


def _keys(frame, cols) -> list[tuple]:
    return list(frame[list(cols)].astype(object).itertuples(index=False, name=None))


def _combine(steps, weights, at_input, cols, srs, notes):
    """One frame: the key columns, Real = Σ_t w_t Real_t (0 at a step without the row:
    no flow there), the other semirings from ``at_input`` (their zero's readout where
    the input has no such row). Rows: the input's, then those only some step has."""
    import pandas as pd

    real: dict = {}
    for frame, w in zip(steps, weights):
        for key, v in zip(_keys(frame, cols), frame["Real"].tolist()):
            real[key] = real.get(key, 0.0) + w * v
    given: dict = {}
    if at_input is not None:
        names = [s.name for s in srs if s != Real()]
        for key, *vals in zip(_keys(at_input, cols), *(at_input[c].tolist() for c in names)):
            given[key] = dict(zip(names, vals))
    like = torch.zeros(1, dtype=torch.float64)
    empty = {s.name: float(readout(s, s.zero((1,), like))[0]) for s in srs if s != Real()}
    rows = []
    for key in [*given, *(k for k in real if k not in given)]:
        row = dict(zip(cols, key))
        for s in srs:
            row[s.name] = real.get(key, 0.0) if s == Real() else given.get(key, empty)[s.name]
        rows.append(row)
    frame = pd.DataFrame(rows, columns=[*cols, *(s.name for s in srs)])
    for c in cols:
        if str(steps[0][c].dtype) == "Int64":
            frame[c] = frame[c].astype("Int64")
    frame.attrs["notes"] = dict(notes)
    return frame
