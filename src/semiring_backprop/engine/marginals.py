"""Max-marginals: the ⊕ over the whole paths (source to output) through a node or an
edge, from the forward pass's alpha and the reverse pass's D (DESIGN §3b).

For a node ``v``: ``alpha(v) ⊗ D(v)``, elementwise. For the edges from ``u`` into the
op ``v`` (every argument slot of ``v`` that reads ``u``): ``alpha(u) ⊗ Rev_u(D(v))``,
where ``Rev_u`` is ``v``'s reverse rule (``⊕_j w(u[i] -> v[j]) ⊗ D(v)[j]``); per element
of ``u``, the ⊕ over the paths that go through ``u[i]`` and then straight into ``v``.
``⊗`` of two values is the semiring's ``mul``: under MaxProduct it takes the best of
``hi·hi``, ``hi·lo``, ``lo·hi`` and ``lo·lo`` (max does not distribute over negative
weights); under Entropy it adds log Z and the expected -log |w|; under TopK it merges
the k x k products.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..tracing.trace import mark_op
from .alpha import alpha as alpha_pass
from .alpha import sources
from .reverse import contributions

SEEDS = ("structural", "x")


def seed_values(res, semiring, seed="structural", baseline=None) -> dict:
    """``{source node: value}`` of ``semiring`` for a seed: ``"structural"`` (the one at
    every element of every source), ``"x"`` (each source's own value as an edge
    weight), or ``{place: tensor | "x" | "structural"}`` (only these places are
    sources). ``baseline`` (``{place: tensor}``, with ``seed="x"``): only these places
    are sources, seeded with ``x - baseline``."""
    graph, values = res.graph, res.values
    if baseline is not None:
        if seed != "x":
            raise InputError(f"baseline= is the x' of the seed x - x': use seed='x', not {seed!r}")
        seed = {
            place: values[res.node(place)] - torch.as_tensor(b) for place, b in baseline.items()
        }
    if isinstance(seed, str):
        if seed not in SEEDS:
            raise InputError(f"seed={seed!r}: use one of {SEEDS} or a dict {{place: tensor}}")
        seed = {n: seed for n in sources(graph, res.needed)}
    elif not isinstance(seed, dict):
        raise InputError(
            f"seed must be 'structural', 'x' or a dict {{place: tensor}}, got {type(seed).__name__}"
        )
    out = {}
    for place, s in seed.items():
        node = seed_node(res, place)
        if node not in res.needed:
            raise InputError(
                f"seed at {place!r}: no path from there reaches the output through the model's "
                "inputs, so it starts no path"
            )
        like = values[node]
        one = semiring.one(like.shape, like)
        if isinstance(s, str) and s == "structural":
            out[node] = one
            continue
        t = like if isinstance(s, str) and s == "x" else s
        if isinstance(s, str) and s != "x":
            raise InputError(f"seed at {place!r} is {s!r}: use a tensor, 'x' or 'structural'")
        t = torch.as_tensor(t).to(like.dtype).to(like.device)
        try:
            t = t.expand(like.shape)
        except RuntimeError:
            raise InputError(
                f"seed at {place!r} has shape {tuple(t.shape)}; the value there has shape "
                f"{tuple(like.shape)}"
            ) from None
        out[node] = semiring.times(one, t)
    return out


def seed_node(res, place):
    """The node where a seed at ``place`` starts its paths. A module's output is a
    ``mark`` (an identity) of the op that made it; where the mark is that op's only
    reader on a path to the output, the seed starts at the op itself (the same paths,
    one weight-1 edge longer), so that the op's own site, such as a looked-up token
    embedding (a source), carries it too."""
    node = res.node(place)
    while node.op == "call_function" and node.target is mark_op:
        made = node.args[0]
        if not isinstance(made, torch.fx.Node) or made not in res.needed:
            break
        if [u for u in made.users if u in res.needed] != [node]:
            break
        node = made
    return node


def alphas(res, semiring, seed="structural", baseline=None, upto=None) -> dict:
    """``{node: alpha value}`` under ``semiring``, kept on ``res`` (the sites of a circuit
    read it once each). With ``upto`` (nodes), only the nodes on a path to one of them
    (the others, such as a vocabulary head after the last layer a circuit reads, are
    not computed and not in the dict)."""
    key = _cache_key(seed, baseline, semiring)
    cache = res.__dict__.setdefault("_alphas", {})
    if key in cache:
        return cache[key][1]
    if upto is not None:
        return _alphas_upto(res, semiring, seed, baseline, key, frozenset(upto))
    seeds = {n: [v] for n, v in seed_values(res, semiring, seed, baseline).items()}
    with torch.no_grad():
        store = alpha_pass(res.graph, res.values, [semiring], seeds, res.needed)
    out = {n: v[0] for n, v in store.items() if v[0] is not None}
    if key is not None:
        if not _named(key):  # one tensor seed per semiring kept: a loop over many
            for old in [k for k in cache if k[-1] == semiring and not _named(k)]:
                del cache[old]  # baselines must not hold every one's alphas
        cache[key] = ((seed, baseline), out)  # (holds the dicts: their ids stay theirs)
    return out


def _alphas_upto(res, semiring, seed, baseline, key, upto: frozenset) -> dict:
    cache = res.__dict__.setdefault("_alphas_upto", {})
    if key is not None and (key, upto) in cache:
        return cache[key, upto][1]
    within, todo = set(), [n for n in upto if n in res.needed]
    while todo:  # closed under inputs: every rule in it sees all of its paths
        n = todo.pop()
        if n not in within:
            within.add(n)
            todo.extend(i for i in n.all_input_nodes if i in res.needed)
    seeds = {n: [v] for n, v in seed_values(res, semiring, seed, baseline).items()
             if n in within}  # fmt: skip
    within = frozenset(within)

    def run(keep=None, reached=None):
        with torch.no_grad():
            store = alpha_pass(res.graph, res.values, [semiring], seeds, within, keep, reached)
        return {n: v[0] for n, v in store.items() if v[0] is not None}

    reads = res.graph.__dict__.setdefault("_alpha_reads", {}).setdefault(upto, set())
    reached: set = set()
    # (nothing read on this graph yet: every node kept, not computed again when read)
    out = _Kept(run(upto | reads if reads else None, reached), reached, run, reads)
    if key is not None:
        for old in [k for k in cache if k[0][-1] == semiring and k[0] != key]:
            del cache[old]  # (one seed's kept per semiring)
        cache[key, upto] = ((seed, baseline), out)
    return out


class _Kept(dict):
    """alpha at the nodes that work on this graph read before (``reads``, which records
    every node read here): the pass lets the others go. A node that the pass reached but
    let go is computed again when read (``again()``: the whole pass, every node kept),
    so a read gives what a pass keeping every node gives."""

    def __init__(self, kept: dict, reached: set, again, reads: set):
        super().__init__(kept)
        self.gone, self.again, self.reads = reached - kept.keys(), again, reads

    def _read(self, node):
        self.reads.add(node)
        if node in self.gone:
            self.update(self.again())
            self.gone = frozenset()

    def get(self, node, default=None):
        self._read(node)
        return super().get(node, default)

    def __getitem__(self, node):
        self._read(node)
        return super().__getitem__(node)

    def __contains__(self, node):
        self._read(node)
        return super().__contains__(node)


def _named(key) -> bool:
    return all(p is None or isinstance(p, str) for p in key[:-1])


def _cache_key(seed, baseline, semiring):
    """Named seeds by name; a dict seed or baseline by its identity and the identity and
    version of each tensor in it (a tensor written in place since is a new key); None
    (not kept) for anything else."""
    parts = []
    for part in (seed, baseline):
        if part is None or isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict):
            parts.append((id(part), *((id(v), getattr(v, "_version", None))
                                      for v in part.values())))  # fmt: skip
        else:
            return None
    return (*parts, semiring)


def alpha_at(res, node, semiring, seed="structural", baseline=None, upto=None):
    """The raw alpha value at ``node`` (the semiring's zero where no path arrives);
    ``upto`` as for :func:`alphas` (``node`` on a path to one of them)."""
    found = alphas(res, semiring, seed, baseline, upto).get(node)
    if found is None:
        like = res.values[node]
        return semiring.zero(like.shape, like)
    return found


def marginal_value(res, node, semiring, seed="structural", baseline=None, upto=None):
    """The raw max-marginal ``alpha ⊗ D`` at ``node`` (⊕ over its alias group: one
    tensor passed as several inputs); the semiring's zero where no path passes it.
    ``upto`` as for :func:`alphas`."""
    group = [n for n in res.graph.aliases.get(node, (node,)) if n in res._store]
    if not group and node in res.needed:  # no path from it reaches the output
        like = res.values[node]
        return semiring.zero(like.shape, like)
    res.value(node, semiring)  # (checks ``semiring``; explains a node without values)
    k = res.semirings.index(semiring)
    pairs = [(alpha_at(res, n, semiring, seed, baseline, upto), res._store[n][k]) for n in group]
    return node_marginal(semiring, pairs)


def node_marginal(semiring, pairs):
    """``⊕`` over ``(alpha, D)`` pairs of ``alpha ⊗ D`` (one pair per node of an alias
    group: one tensor passed as several inputs)."""
    out = None
    for a, b in pairs:
        m = semiring.mul(a, b)
        out = m if out is None else semiring.plus(out, m)
    return out


def edge_marginal(res, u, v, semiring, seed="structural", baseline=None):
    """Per element of ``u``: the ⊕ over the paths through it that enter op ``v`` next."""
    if u not in v.all_input_nodes:
        raise InputError(
            f"no edge from `{u.name}` into `{v.name}`: `{v.name}` reads "
            f"{[n.name for n in v.all_input_nodes]}"
        )
    beta = res.value(v, semiring)
    graph, needed = res.graph, res.needed
    got = None
    with torch.no_grad():
        for inp, _, c in contributions(graph, res.values, [semiring], graph.ids[v], [beta], needed):
            if inp is u:
                got = c
    if got is None:  # no edge carries a path (a non-differentiable slot)
        like = res.values[u]
        return semiring.zero(like.shape, like)
    return semiring.mul(alpha_at(res, u, semiring, seed, baseline), got)


def at_sources(res, baseline):
    """``baseline`` as ``{place: tensor}`` where the paths start. Given as the model's
    own inputs (``{"input_ids": corrupted_ids}``, or any other input of the traced call:
    those not given stay the clean ones), the traced graph runs on them, and the
    baseline is its value at every source the change reaches (the token embeddings of
    the corrupted text): the same ``x'`` the user would compute at those places. A
    dict of places (module paths, nodes) is returned as it is; anything else is left
    to the callers' checks. The same dict gives the same result (kept on ``res``), so
    the alphas it seeds are cached once."""
    if baseline is None:
        return None
    if not isinstance(baseline, dict) or not baseline:
        raise InputError(
            f"baseline is the corrupted input x' of the seed x - x': a dict of the model's "
            "inputs ({'input_ids': corrupted_ids}) or of tensors at places ({place: tensor}), "
            f"not {'an empty dict' if isinstance(baseline, dict) else type(baseline).__name__}"
        )
    inputs = res.graph.user_inputs
    named = [k for k in baseline if not isinstance(k, torch.fx.Node) and _hashable_in(k, inputs)]
    if not named:
        for place, b in baseline.items():
            _check_at_place(res, place, b)
        return baseline
    if len(named) != len(baseline):
        others = [k for k in baseline if k not in named]
        raise InputError(
            f"baseline mixes the model's inputs {named} with places {others}: give the "
            "corrupted input alone ({'input_ids': ids}: its values at the sources are "
            "computed), or tensors at places alone"
        )
    kept = res.__dict__.setdefault("_input_baselines", {})
    if id(baseline) in kept and kept[id(baseline)][0] is baseline:
        return kept[id(baseline)][1]
    out = _run_from_inputs(res, baseline)
    kept[id(baseline)] = (baseline, out)
    return out


def _check_at_place(res, place, b) -> None:
    """A baseline tensor at ``place``: a tensor of the value's shape there (or one that
    broadcasts to it), every element a number."""
    node = seed_node(res, place)
    try:
        like = res.values[node]
    except KeyError:  # a pass that kept few values: the traced shape (checks come later)
        like = node.meta.get("val")
        if not isinstance(like, torch.Tensor):
            return
    try:
        t = None if isinstance(b, str | bytes | dict) else torch.as_tensor(b)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None:
        raise InputError(
            f"baseline at {place!r} is a {type(b).__name__}: give a tensor of the value's "
            f"shape there, {tuple(like.shape)}"
        )
    try:
        torch.broadcast_shapes(t.shape, like.shape)
        fits = torch.broadcast_shapes(t.shape, like.shape) == like.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise InputError(
            f"baseline at {place!r} has shape {tuple(t.shape)}; the value there has shape "
            f"{tuple(like.shape)}: give the corrupted input's values at that place (as many "
            "tokens), or the corrupted input itself ({'input_ids': corrupted_ids})"
        )
    check_finite(t, f"baseline at {place!r}")


def check_finite(t, what: str) -> None:
    """Refuse a float tensor holding NaN or inf: ``x - x'`` (or a patched value) would
    carry it into every table as NaN."""
    from ..errors import NonFiniteError

    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        kind = "NaN" if bool(torch.isnan(t).any()) else "inf"
        raise NonFiniteError(
            f"{what} holds {kind} (first at index {first}, {int(bad.sum())} in all): every "
            "value derived from it would be NaN or inf. Give finite values (a corrupted "
            "input the model can run on)"
        )


def _hashable_in(key, d) -> bool:
    try:
        return key in d
    except TypeError:
        return False


def _run_from_inputs(res, given: dict) -> dict:
    from . import forward

    graph = res.graph
    if res.kept is not None:
        raise InputError(
            "a baseline given as the model's inputs runs the graph again on them, from "
            "values this pass did not keep (Backprop(keep=...)): make the pass with "
            "keep=None, or give the baseline's tensors at places"
        )
    call = {k: res.values[n] for k, n in graph.user_inputs.items()}
    for key, t in given.items():
        clean = call[key]
        if not isinstance(t, torch.Tensor):
            raise InputError(
                f"baseline[{key!r}] is a {type(t).__name__}: give the corrupted input as a "
                f"tensor like the clean one (shape {tuple(clean.shape)}, {clean.dtype})"
            )
        if t.shape != clean.shape or t.dtype != clean.dtype:
            raise InputError(
                f"baseline[{key!r}] has shape {tuple(t.shape)} and dtype {t.dtype}, the input "
                f"{tuple(clean.shape)} and {clean.dtype}: x - x' is taken position by "
                "position, so give a corrupted input of the same shape (as many tokens)"
            )
        check_finite(t, f"baseline[{key!r}]")
        call[key] = t.to(clean.device)
    if any(not isinstance(k, int | str) for k in call):
        raise InputError(
            f"baseline as the model's inputs: this call has nested inputs "
            f"({[k for k in call if not isinstance(k, int | str)]}); give the baseline's "
            "tensors at the places where paths start (e.g. the token embeddings)"
        )
    args = [None] * (1 + max((k for k in call if isinstance(k, int)), default=-1))
    for k, t in call.items():
        if isinstance(k, int):
            args[k] = t
    values = forward.run(graph, tuple(args), {k: t for k, t in call.items() if isinstance(k, str)})
    out = {
        node: values[node]
        for node in sources(graph, res.needed)
        if isinstance(values[node], torch.Tensor)
        and not torch.equal(values[node], res.values[node])
    }
    if not out:
        raise InputError(
            f"the baseline inputs {list(given)} give the same values as the input at every "
            "place where paths start: x - x' is 0 everywhere and no path is seeded. Give a "
            "corrupted input that differs (another name, another token)"
        )
    return out
