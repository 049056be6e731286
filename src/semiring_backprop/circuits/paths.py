"""The best whole paths of a circuit, described by the components they pass.

A circuit's edges do not chain into paths (a path enters and leaves a site through one
element, an edge's value is the best path through that edge alone), so the paths are
read element by element, exactly, from the pass's back-pointers (``Result.top_path``
under MaxProduct, ``Result.top_paths`` under TopK), starting from every source element
(every non-padding position of the token embeddings), and then projected onto the sites
of :func:`.nodes.find_sites`: a path passes a site where one of its steps is
at the site's node, at an element of the site's position (and, for a head, of the
head's columns). Each site on the way gets

- ``input``: how the path entered it: ``"q"``, ``"k"`` or ``"v"`` for a head (the
  projection it passed last before the head's slice), ``"mlp"``, ``"target"``; None for
  the embedding and the residual stream;
- ``from_position``: the position of the site before it. Only attention moves a path
  between positions (from the key or value position to the head's own).

What comes back is the ``k`` best element paths, each with its sequence of sites;
several may share one sequence (they differ inside a component, e.g. in the hidden unit
they pass, or start at two sources that the embedding site sums, such as the word and
the token-type embedding): nothing is merged.

For example (``Circuit.top_paths``'s own examples run on docs/api.md's BERT)::

    c = sbp.Circuit.from_result(res, [sbp.MaxProduct()], tokens=tokens)
    best = c.top_paths()
    best[0].compact()                       # "embedding@6 '[MASK]' → target"
    best.to_frame().columns[:6].tolist()    # ['rank', 'value', 'step', 'role', ...]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError, NotFoundError
from ..semirings import MaxProduct, TopK
from ..tokens import readable_tokens

__all__ = ["CircuitPath", "CircuitPaths", "SiteStep", "top_paths"]

#: the columns of :meth:`CircuitPaths.to_frame`
PATH_COLUMNS = ("rank", "value", "step", "role", "layer", "head_index", "position", "token",
                "input", "from_position", "node", "index", "running")  # fmt: skip


@dataclass(frozen=True)
class SiteStep:
    """One site a path passes: as the rows of ``Circuit.nodes`` name it (``role``,
    ``layer``, ``head_index``, ``position``, ``token``), how the path entered it
    (``input``: q / k / v / mlp / target; None for the embedding and the residual stream)
    and from which position (``from_position``: the previous site's), the element of the
    graph (``node``, ``index``) and the path's product from its source up to here
    (``running``, the seed included)."""

    role: str
    layer: int | None
    head_index: int | None
    position: int | None
    token: str
    input: str | None
    from_position: int | None
    node: str
    index: tuple
    running: float

    def label(self) -> str:
        """``embedding@3 'cat'``, ``head 0.1@7 (v)``, ``mlp 1@7``, ``target``."""
        if self.role == "target":
            return "target"
        name = f"head {self.layer}.{self.head_index}" if self.role == "head" else self.role
        if self.role in ("mlp", "residual"):
            name = f"{self.role} {self.layer}"
        name += f"@{self.position}"
        if self.role == "embedding" and self.token:
            name += f" {self.token!r}"
        if self.role == "head":
            name += f" ({self.input})"
        return name


@dataclass(frozen=True)
class CircuitPath:
    """One whole path (source element to the output) as the sites it passes.

    ``rank`` (1: the best), ``value`` (its product, signed, the seed included), ``steps``
    (:class:`SiteStep`, the residual stream's included), ``path`` (the element path,
    a :class:`~semiring_backprop.Path`, whose product is ``value / seed``), ``seed``
    (the factor at its source: 1 for ``seed="structural"``, the source element's value
    for ``seed="x"``), ``semiring`` (the one it was read from)."""

    rank: int
    value: float
    steps: tuple
    path: object
    seed: float
    semiring: str

    @property
    def components(self) -> list[SiteStep]:
        """The steps without the residual stream (every path passes each layer's once)."""
        return [s for s in self.steps if s.role != "residual"]

    def compact(self) -> str:
        """One line: the components joined by arrows."""
        return " → ".join(s.label() for s in self.components)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "value": _json_float(self.value),
            "seed": _json_float(self.seed),
            "semiring": self.semiring,
            "steps": [_step_dict(s) for s in self.steps],
            "path": self.path.to_dict(),
        }

    def __repr__(self) -> str:
        return f"<CircuitPath {self.rank}: {self.value:.6g}, {self.compact()}>"


class CircuitPaths(list):
    """The paths of :meth:`Circuit.top_paths`, best first: a list of
    :class:`CircuitPath`, with a table and JSON of them all."""

    def to_frame(self):
        """Tidy DataFrame, one row per path and site (columns: ``PATH_COLUMNS``)."""
        import pandas as pd

        rows = [{"rank": p.rank, "value": p.value, "step": i, **_step_dict(s)}
                for p in self for i, s in enumerate(p.steps)]  # fmt: skip
        frame = pd.DataFrame(rows, columns=list(PATH_COLUMNS))
        frame["index"] = [tuple(i) for i in frame["index"]]
        for col in ("layer", "head_index", "position", "from_position"):
            frame[col] = frame[col].astype("Int64")
        return frame

    def to_dict(self) -> list[dict]:
        return [p.to_dict() for p in self]

    def to_json(self, file=None, **kwargs) -> str:
        """The paths as JSON text (a list of :meth:`CircuitPath.to_dict`), also written
        to ``file`` when one is given."""
        text = json.dumps(self.to_dict(), allow_nan=False, **kwargs)
        if file is not None:
            from .._files import write_user_file

            write_user_file(file, lambda tmp: tmp.write_text(text), "paths.json")
        return text

    def __repr__(self) -> str:
        return "[" + ",\n ".join(repr(p) for p in self) + "]"


def _step_dict(s: SiteStep) -> dict:
    return {
        "role": s.role, "layer": s.layer, "head_index": s.head_index,
        "position": s.position, "token": s.token, "input": s.input,
        "from_position": s.from_position, "node": s.node, "index": list(s.index),
        "running": _json_float(s.running),
    }  # fmt: skip


def _json_float(x):
    return x if x is None or math.isfinite(x) else str(x)


# -- choosing the semiring -------------------------------------------------------------


def _semiring(res, k: int, semiring):
    """The selective semiring of the pass that gives ``k`` paths."""
    have = list(res.semirings)
    fix = f"pass semirings=[..., sbp.TopK({k})] to sbp.circuit"
    if semiring is None:
        if k == 1:
            found = [s for s in have if isinstance(s, MaxProduct) and s.neuron]
        else:
            found = []
        found = found or sorted((s for s in have if isinstance(s, TopK) and s.k >= k),
                                key=lambda s: s.k)  # fmt: skip
        if not found:
            need = "MaxProduct() or TopK(k)" if k == 1 else f"TopK(k) with k >= {k}"
            raise InputError(
                f"circuit top_paths(k={k}) reads the back-pointers of {need}, which this "
                f"circuit's pass did not compute (it has {have}); {fix}"
            )
        return found[0]
    if semiring not in have:
        raise InputError(f"top_paths: {semiring} is not in this circuit's pass ({have}); {fix}")
    if isinstance(semiring, MaxProduct):
        if not semiring.neuron:
            raise InputError(
                f"top_paths: {semiring.name} has no element paths (tensor granularity); "
                "use MaxProduct() or TopK(k)"
            )
        if k != 1:
            raise InputError(f"top_paths: MaxProduct gives one path, not k={k}; {fix}")
        return semiring
    if isinstance(semiring, TopK):
        if semiring.k < k:
            raise InputError(f"top_paths: asked for {k} paths but the pass computed "
                             f"{semiring.name}; {fix}")  # fmt: skip
        return semiring
    raise InputError(f"top_paths reads MaxProduct() or TopK(k) back-pointers, not {semiring}")


# -- the best element paths from every source ----------------------------------------------


def _seed(res, node, seed) -> torch.Tensor:
    x = res.values[node].detach()
    if seed == "structural":
        return torch.ones_like(x, dtype=torch.float64).cpu()
    if seed == "x":
        return x.double().cpu()
    raise InputError(f"top_paths: seed={seed!r}; use 'x' (as sbp.circuit's default) or "
                     "'structural'")  # fmt: skip


def _allowed(res, node, positions, mask) -> torch.Tensor:
    """Bool per element of the embedding ``node``: at a position that is not padding."""
    shape = res.values[node].shape
    ok = torch.ones(positions, dtype=torch.bool)
    if mask is not None:
        ok = torch.tensor([bool(m) for m in mask], dtype=torch.bool)
    width = res.values[node].numel() // positions
    return ok.repeat_interleave(width).reshape(shape)


def _best_maxproduct(res, sr, embeds, positions, mask, seed):
    """[(element Path, seed factor)]: the one path of largest |seed × product|."""
    best = None  # (|value|, node, flat, sign)
    for node in embeds:
        at = res.at(node.name, sr)
        s = _seed(res, node, seed)
        ok = _allowed(res, node, positions, mask)
        for field, sign in ((at.hi, "+"), (at.lo, "-")):
            score = (field.detach().double().cpu() * s).abs()
            score = torch.where(ok & field.isfinite().cpu(), score, -math.inf).reshape(-1)
            flat = int(score.argmax())
            if best is None or float(score[flat]) > best[0]:
                best = (float(score[flat]), node, flat, sign)
    if best is None or best[0] == -math.inf:
        raise NotFoundError("top_paths: no path leads from the token embeddings to the output")
    _, node, flat, sign = best
    index = _unravel(flat, res.values[node].shape)
    path = res.top_path((node.name, index), sr, sign)
    return [(path, float(_seed(res, node, seed).reshape(-1)[flat]))]


def _best_topk(res, sr, k, embeds, positions, mask, seed):
    """[(element Path, seed factor)]: the ``k`` paths of largest |seed × product|."""
    cands = []  # (log |value|, node, flat, rank)
    for node in embeds:
        at = res.at(node.name, sr)
        s = _seed(res, node, seed)
        ok = _allowed(res, node, positions, mask)
        log_s = torch.where(s != 0, s.abs().log(), -math.inf)
        score = at.log_abs.detach().double().cpu() + log_s[..., None]
        score = torch.where(ok[..., None], score, -math.inf).reshape(-1)
        top, j = score.topk(min(k, score.numel()))
        cands += [(v, node, i // sr.k, i % sr.k) for v, i in zip(top.tolist(), j.tolist())]
    cands = [c for c in sorted(cands, key=lambda c: -c[0])[:k] if c[0] > -math.inf]
    if not cands:
        raise NotFoundError("top_paths: no path leads from the token embeddings to the output")
    ranks: dict = {}
    for _, node, flat, r in cands:
        ranks[node, flat] = max(ranks.get((node, flat), 0), r + 1)
    read = {}
    for (node, flat), n in ranks.items():  # each source element read once
        index = _unravel(flat, res.values[node].shape)
        read[node, flat] = res.top_paths((node.name, index), n, sr)
    out = [(read[node, flat][r], float(_seed(res, node, seed).reshape(-1)[flat]))
           for _, node, flat, r in cands]  # fmt: skip
    return sorted(out, key=lambda ps: -abs(ps[0].value * ps[1]))


def _unravel(flat: int, shape) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, tuple(shape)))


def _ravel(index, shape) -> int:
    return int(np.ravel_multi_index(tuple(index), tuple(shape)))


# -- projecting an element path onto the sites ------------------------------------------


class _Sites:
    """Where each site and each query / key / value projection sits in the graph."""

    def __init__(self, res, sites, projections, positions, tokens, mask):
        self.res, self.positions = res, positions
        self.tokens = [t if mask is None or mask[p] else "" for p, t in enumerate(tokens)]
        self.named = {n.name: n for n in res.graph.nodes}
        self.sites: dict = {}  # node name -> [Site]
        for site in sites:
            for n in site.nodes:
                for a in res.graph.aliases.get(n, (n,)):
                    self.sites.setdefault(a.name, []).append(site)
        self.projections: dict = {}  # node name -> [(column set, "q" / "k" / "v")]
        for ps in projections.values():
            for p in ps:
                self.projections.setdefault(p.proj.name, []).append((set(p.cols), p.role[0]))

    def project(self, path, seed: float, rank: int, semiring: str) -> CircuitPath:
        res = self.res
        steps, entered, last = [], None, None
        for st in path.steps:
            if st.node in self.projections:
                entered = next(r for cols, r in self.projections[st.node] if st.index[-1] in cols)
                continue
            if st.node not in self.sites:
                continue
            site, pos = self._site(st, res.values[self.named[st.node]].shape)
            if site is None:
                continue
            inp = {"head": entered, "mlp": "mlp", "target": "target"}.get(site.role)
            steps.append(SiteStep(
                site.role, site.layer, site.head, pos,
                "" if pos is None else self.tokens[pos], inp, last, st.node, st.index,
                st.running * seed,
            ))  # fmt: skip
            entered, last = None, pos
        return CircuitPath(rank, path.value * seed, tuple(steps), path, seed, semiring)

    def _site(self, st, shape):
        numel = math.prod(shape)
        for site in self.sites[st.node]:
            if site.role == "target":
                return site, None
            width = numel // self.positions
            flat = _ravel(st.index, shape)
            pos, col = divmod(flat, width)
            if site.cols is None or site.cols.start <= col < site.cols.stop:
                return site, pos
        return None, None


def _check_sites(circuit, sites):
    """The sites found again must be those the circuit was built with (a circuit made
    with ``heads=`` or ``roles=`` needs them here too)."""
    import pandas as pd

    n = circuit.full.nodes
    want = {(r, None if pd.isna(h) else int(h), x)
            for r, h, x in zip(n.role, n.head_index, n.node)}  # fmt: skip
    got = {(s.role, s.head, "+".join(x.name for x in s.nodes)) for s in sites}
    if not want <= got:
        raise InputError(
            "top_paths: the sites found in the pass are not this circuit's (it was built with "
            "heads= or roles= that this call was not given); pass the same heads= and roles="
        )


def top_paths(circuit, k: int = 1, semiring=None, seed="x", heads=None, roles=None):
    """The ``k`` best whole paths of ``circuit`` (see :meth:`Circuit.top_paths`)."""
    from .layout import layout
    from .nodes import find_sites

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"top_paths: k={k!r} is the number of paths to return: 1 or more")
    res = circuit.full.result
    if res is None:
        raise InputError(
            "top_paths reads the paths from the circuit's pass, and this circuit has none "
            "(it was made from tables); build it with sbp.circuit or Circuit.from_result"
        )
    sr = _semiring(res, k, semiring)
    _seed_check(seed)
    if heads is None and circuit.full.n_heads:
        heads = circuit.full.n_heads
    sites, positions = find_sites(res, heads, roles)
    _check_sites(circuit, sites)
    lay = layout(res, heads, roles)
    embeds = next(s.nodes for s in sites if s.role == "embedding")
    mask = circuit.mask
    if isinstance(sr, MaxProduct):
        found = _best_maxproduct(res, sr, embeds, positions, mask, seed)
    else:
        found = _best_topk(res, sr, k, embeds, positions, mask, seed)
    shown = readable_tokens(circuit.token_list)  # ' Mary', not 'ĠMary'
    index = _Sites(res, sites, lay.projections, positions, shown, mask)
    return CircuitPaths(index.project(p, s, i + 1, sr.name) for i, (p, s) in enumerate(found))


def _seed_check(seed):
    if not isinstance(seed, str) or seed not in ("x", "structural"):
        raise InputError(f"top_paths: seed={seed!r}; use 'x' (as sbp.circuit's default) or "
                         "'structural' (each path's product alone)")  # fmt: skip
