"""Exact attention for queries and keys: AtP*'s QK fix (Kramár et al. 2024, "AtP*: An
efficient and scalable method for localizing LLM behaviour to components"; DESIGN §3c,
last paragraph), on the edges and sites of a :class:`.patching.Patching`.

A saturated softmax hides the effect of a change in a head's query or key from any
first-order score: its derivative is ~0 where the change of the pattern is not. So a score
of an edge or a site that enters a head's query or key recomputes that head's attention
pattern exactly with the patched query or key, and linearizes only what follows the
pattern (``A``: the head's clean pattern, ``A'``: the patched one, ``G = ∂m/∂A`` at the
clean run, one backward pass for every head)::

    score = Σ_{t, j} (A[t, j] - A'[t, j]) · G[t, j]    (≈ m(M) - m(patched), as an effect)

Edges (:func:`eap_qk`), each with only that edge ablated, as
:meth:`.patching.Patching.edge_effects` ablates it:

- ``s -> d<q>`` at ``p``: head ``d``'s query input at ``p`` recomputed through the residual
  stream with the edge ablated (:meth:`.patching.Patching.read_input`), the projection
  on the head's columns, then the graph's own ops from the projections to the softmax's
  input (the logits: rotary embeddings, the scale, the mask); only row ``p`` changes,
  ``A'[p] = softmax(logits'[p])``;
- ``s -> d<k>`` at ``p``: the key likewise (grouped-query attention: head ``d``'s own copy
  of the shared key; the other heads of its group keep theirs); only column ``p``
  changes, and each row's softmax with one entry replaced is in closed form: with
  ``L = log Σ_{j≠p} exp s[t, j]`` and ``W`` the mean of ``G[t]`` over ``j ≠ p`` under
  ``softmax(s[t, j≠p])``, ``A'[t, p] = σ(s' - L)`` and
  ``Σ_j (A' - A)[t, j] G[t, j] = (A'[t, p] - A[t, p]) (G[t, p] - W[t, p])``
  (``L``, ``W`` of the row's largest entry computed apart, without cancellation);
- ``v``, ``mlp``, ``target`` edges: EAP's scores (:func:`.eap.eap`), unchanged.

Since the residual stream is read position by position, ablating a source at every
position at once recomputes each position's query (key) as ablating it there alone does:
one run of the projections and the logits per destination and source gives every
position's row (column).

Sites (:func:`node_scores_qk`): a site ``(component c, position p)`` ablated for every
consumer (:meth:`.patching.Patching.node_effects`) is scored as the sum over its
destinations: EAP's ``(a - a')[p] . g_d[p]`` for every value, MLP and target input, and
for every later head, that head's exact pattern change with *both* its query and its key
recomputed from the site ablated (row ``p`` and column ``p`` at once), linearized after
the pattern. Without heads' queries and keys it is attribution patching (AtP) of the
site; each head's term is what that head's pattern alone contributes (the heads' terms
add, as first-order terms do: a pattern change that moves another head's input is
linearized there).

Cost: two forward and backward passes (EAP's gradients, the patterns' gradients), then
per query or key destination one batched run of its projection and logits per source
(edges), per head one per source and position (sites); no run of the model past the
logits.

Examples::

    p = Patching(res, {"input_ids": corrupted_ids})
    p.eap_qk()                          # EDGE_KEY + score
    p.node_scores_qk()                  # NODE_KEY + score
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..analysis.fanout import ancestors, descendants
from ..errors import InputError
from .eap import edge_scores, gradients
from .patching_edges import args_of, call
from .sites import NODE_KEY

__all__ = ["eap_qk", "node_scores_qk", "attention_heads", "HeadPattern"]

aten = torch.ops.aten
_SHIFT = torch.ops.semiring_backprop.softmax_shift.default


@dataclass(frozen=True)
class HeadPattern:
    """One head's attention pattern: ``index`` along the pattern's head dim, its query and
    key destinations ``q``, ``k`` (indices into ``Patching.dests``), the softmax's input
    ``logits`` and output ``pattern`` (nodes, (batch, heads, query, key)), ``order``: the
    nodes from the projections to ``logits`` (itself included), in graph order."""

    layer: int
    head: int
    index: int
    q: int
    k: int
    logits: torch.fx.Node
    pattern: torch.fx.Node
    order: tuple


def attention_heads(p) -> list[HeadPattern]:
    """Every head's :class:`HeadPattern`: per layer, the one softmax between its query and
    key projections and its heads' slice."""
    lay, graph = p.lay, p.graph
    shifts = [n for n in graph.nodes if n.op == "call_function" and n.target is _SHIFT]
    out = []
    for layer in range(lay.layers):
        comps = lay.heads[layer]
        projs = {x.proj for x in lay.projections[layer] if x.role in ("query", "key")}
        down = set().union(*(descendants(x) for x in projs))
        (site,) = comps[0].nodes
        found = [s for s in shifts if s.args[0] in down and site in descendants(s)]
        if len(found) != 1:
            raise InputError(
                f"layer {layer}: found {len(found)} softmaxes between the query and key "
                "projections and the heads' slice, need one (the attention pattern); the "
                "QK fix needs the softmax decomposed (not kept whole, not paper mode)"
            )
        logits = found[0].args[0]
        pattern = _softmax_output(found[0], layer)
        shape = tuple(p.base[pattern].shape)
        if len(shape) != 4 or shape[1] != len(comps) or shape[2:] != (lay.positions,) * 2:
            raise InputError(
                f"layer {layer}: the attention pattern ({pattern.name}) has shape {shape}, "
                f"expected (1, {len(comps)} heads, {lay.positions}, {lay.positions})"
            )
        ids = graph.ids
        order = tuple(sorted(ancestors(logits, down) - projs, key=ids.__getitem__))
        for i, comp in enumerate(comps):
            q = p.dest_index[(layer, comp.role, comp.head, "q")]
            k = p.dest_index[(layer, comp.role, comp.head, "k")]
            out.append(HeadPattern(layer, comp.head, i, q, k, logits, pattern, order))
    return out


def _softmax_output(shift, layer):
    """``exp(x - shift(x)) / sum``: the div whose numerator is that exp."""
    for sub in shift.users:
        if sub.target is aten.sub.Tensor:
            for e in sub.users:
                if e.target is aten.exp.default:
                    for d in e.users:
                        if d.target is aten.div.Tensor and d.args[0] is e:
                            return d
    raise InputError(f"layer {layer}: the softmax at {shift.name} is not exp / sum")


def _logits(p, hs, reads, mu):
    """The logits of the heads ``hs`` of one block (heads, query, key) with the
    projections of ``reads`` (:func:`_reads`) computed from their inputs recomputed with
    ``mu`` (components, positions) on their columns; the rest as in the clean run."""
    local: dict = {}
    inputs: dict = {}
    for d, proj, x, cols in reads:
        if x not in inputs:
            inputs[x] = p.read_input(d, x, mu)
        alt = call(proj, *args_of(proj, {x: inputs[x]}, p.base))
        local[proj] = torch.where(cols, alt, p.base[proj])
    h0 = hs[0]
    for n in h0.order:
        local[n] = call(n, *args_of(n, local, p.base))
    return local[h0.logits][0, [h.index for h in hs]]


def _reads(p, dests) -> list:
    """``[(a destination, projection, the tensor it reads, bool mask of its output
    columns)]``: where the destinations ``dests`` (queries or keys of one block's heads)
    are computed, one row per projection, its columns all theirs."""
    out: dict = {}
    for d in dests:
        for proj, x, cols in p.projection_reads(d):
            _, _, _, before = out.get(proj, (d, proj, x, torch.zeros_like(cols)))
            out[proj] = (d, proj, x, before | cols)
    return list(out.values())


def blocks(heads) -> list[list[HeadPattern]]:
    """The heads grouped by the softmax they share (one attention block each)."""
    out: dict = {}
    for h in heads:
        out.setdefault(h.logits, []).append(h)
    return list(out.values())


def _pattern_gradients(p, heads) -> dict:
    """``{pattern node: ∂m/∂A}`` at the clean run (one forward and backward pass)."""
    nodes = list(dict.fromkeys(h.pattern for h in heads))
    zeros = {n: torch.zeros_like(p.base[n], requires_grad=True) for n in nodes}
    with torch.enable_grad():
        out = p.output(replace={n: (lambda v, n=n: v + zeros[n]) for n in nodes})
        grads = torch.autograd.grad(out, list(zeros.values()), allow_unused=True)
    p.evaluations += 1
    return {n: torch.zeros_like(p.base[n]) if g is None else g for n, g in zip(nodes, grads)}


def _sources(p, edges) -> dict:
    """``{destination: sorted components}`` with an edge into it."""
    out: dict = {}
    for c, d, _ in p.edge_index(edges):
        out.setdefault(d, set()).add(c)
    return {d: sorted(cs) for d, cs in out.items()}


def _batched(p, fn, variants):
    """``fn(variant)`` stacked, ``p.batch`` variants at a time (``torch.vmap``)."""
    got = []
    with torch.no_grad():
        for chunk in variants.split(p.batch):
            got.append(torch.vmap(fn)(chunk))
            p.evaluations += len(chunk)
    return torch.cat(got)


def _row_stats(s, a, g):
    """``(L, W)`` (query, key): ``L[t, p] = log Σ_{j≠p} exp s[t, j]``, ``W[t, p]`` the mean
    of ``g[t, j≠p]`` under ``softmax(s[t, j≠p])`` (0 where no other entry is left). Where
    ``a[t, p] ≤ 1/2`` from the row's totals; at the row's largest entry (``a`` up to 1:
    ``1 - a`` would lose every digit when saturated) from the row without it."""
    ag = (a * g).sum(-1, keepdim=True)
    lse = torch.logsumexp(s, -1, keepdim=True)
    L = lse + torch.log1p(-a)
    W = (ag - a * g) / (1 - a)
    top = s.argmax(-1, keepdim=True)
    rest = s.scatter(-1, top, -torch.inf)
    L_top = torch.logsumexp(rest, -1, keepdim=True)
    w = torch.softmax(rest, -1)
    W_top = torch.where(torch.isfinite(L_top), (torch.nan_to_num(w) * g).sum(-1, keepdim=True), 0)
    return L.scatter(-1, top, L_top), W.scatter(-1, top, W_top)


def _query_delta(a, g, new):
    """``Σ_j (A - A')[p, j] G[p, j]`` per variant and row ``p``: ``new`` (variants, query,
    key) the logits with every row's query patched."""
    a2 = torch.softmax(new, -1)
    a2 = torch.where(torch.isnan(a2), a, a2)
    return ((a - a2) * g).sum(-1)


def _key_delta(s, a, g, new):
    """``Σ_{t, j} (A - A')[t, j] G[t, j]`` per variant and key ``p`` (column ``p`` of
    ``new`` replaced alone), in closed form (module docstring)."""
    L, W = _row_stats(s, a, g)
    a2 = torch.sigmoid(new - L)
    a2 = torch.where(torch.isnan(a2), a, a2)
    return ((a - a2) * (g - W)).sum(-2)


def eap_qk(p):
    """``EDGE_KEY`` + ``score`` per edge of ``p.edges()``: EAP's score for value, MLP and
    target edges, the QK-fixed score (the head's pattern exact, linear after it) for
    query and key edges."""
    out = edge_scores(p, gradients(p))
    heads = attention_heads(p)
    return fix_edges(p, out, heads, _pattern_gradients(p, heads))


def fix_edges(p, out, heads, grads):
    """``out`` (EDGE_KEY + score, a frame of ``p.edges()``) with each query and key
    edge's score the QK-fixed one under the pattern adjoints ``grads``."""
    sources = _sources(p, out)
    fixed: dict = {}
    ones = p.all_kept()
    for hs in blocks(heads):
        h0, index = hs[0], [h.index for h in hs]
        a = p.base[h0.pattern][0, index]
        g = grads[h0.pattern][0, index]
        s = p.base[h0.logits][0, index]
        for role in ("q", "k"):
            # one source ablated for every head's query (key) of the block at once: each
            # head's logits read its own query (its own copy of the key) alone, so its
            # rows are those of that head's destination ablated alone
            dests = [getattr(h, role) for h in hs]
            cs = sorted(set().union(*(sources.get(d, []) for d in dests)))
            if not cs:
                continue
            mus = ones.expand(len(cs), -1, -1).clone()
            for i, c in enumerate(cs):
                mus[i, c] = 0
            reads = _reads(p, dests)
            new = _batched(p, lambda mu, hs=hs, reads=reads: _logits(p, hs, reads, mu), mus)
            got = _query_delta(a, g, new) if role == "q" else _key_delta(s, a, g, new)
            row = {c: i for i, c in enumerate(cs)}
            for k, d in enumerate(dests):
                for c in sources.get(d, []):
                    fixed[(c, d)] = got[row[c], k]
    out = out.copy()
    score = out["score"].tolist()
    for r, (c, d, pos) in enumerate(p.edge_index(out)):
        if (c, d) in fixed:
            score[r] = float(fixed[(c, d)][pos])
    out["score"] = score
    return out


def node_scores_qk(p):
    """``NODE_KEY`` + ``score``: per site, EAP over its value, MLP and target inputs plus,
    per later head, the head's exact pattern change with its query and key both
    recomputed from the site ablated, linear after it (module docstring)."""
    lay = p.lay
    heads = attention_heads(p)
    qk = {d for h in heads for d in (h.q, h.k)}
    first = torch.zeros(len(lay.components), lay.positions, dtype=p.all_kept().dtype,
                        device=p.all_kept().device)  # fmt: skip
    for (d, n), g in gradients(p).items():
        if d not in qk:
            a, _ = p.assign[n]
            diff = (p.base[n] - p.ablated[n]).detach()
            first += ((g * diff).reshape(lay.positions, -1) @ a.T).T
    return site_frame(p, first + site_terms(p, heads, _pattern_gradients(p, heads)))


def site_terms(p, heads, grads):
    """(components, positions): per site, the sum over later heads of the head's exact
    pattern change (query and key recomputed from the site ablated) under ``grads``."""
    lay = p.lay
    sources = _sources(p, p.edges())
    positions = [q for q in range(lay.positions) if q not in p.padding]
    total = torch.zeros(len(lay.components), lay.positions, dtype=p.all_kept().dtype,
                        device=p.all_kept().device)  # fmt: skip
    for hs in blocks(heads):
        mine = [set(sources.get(h.q, [])) | set(sources.get(h.k, [])) for h in hs]
        cs = sorted(set().union(*mine))
        if not cs:
            continue
        got = _site_deltas(p, hs, cs, positions, grads[hs[0].pattern])
        for k, srcs in enumerate(mine):
            for i, c in enumerate(cs):
                if c in srcs:
                    total[c, positions] += got[i, :, k]
    return total


def site_frame(p, total):
    """``NODE_KEY`` + ``score`` of a (components, positions) tensor, padding left out."""
    import pandas as pd

    rows = []
    for c, comp in enumerate(p.lay.components):
        for q in range(p.lay.positions):
            if q not in p.padding:
                rows.append((comp.layer, q, comp.head, comp.role, float(total[c, q])))
    frame = pd.DataFrame(rows, columns=[*NODE_KEY, "score"])
    for col in ("layer", "position", "head_index"):
        frame[col] = frame[col].astype("Int64")
    return frame


def _site_deltas(p, hs, cs, positions, grad):
    """``Σ_{t, j} (A - A')[t, j] G[t, j]`` (sources ``cs``, ``positions``, heads ``hs`` of
    one block): each head's pattern with its query and key at one position recomputed
    from one source ablated there (one batched run of the logits per site).

    The residual stream is read position by position, so a source ablated at every
    position at once gives each position's query and key input as ablating it there
    alone does: one recomputation of the block's input and its projections per source;
    a site's projections are the clean ones with that position's row taken from them.
    The heads' rows are taken at once (each head's logits read its own columns alone, or
    with shared K/V columns the whole role's, as :func:`_logits` takes them)."""
    reads = _reads(p, [d for h in hs for d in (h.q, h.k)])
    positions_t = torch.tensor(positions, device=grad.device)
    mus = p.all_kept().expand(len(cs), -1, -1).clone()
    for i, c in enumerate(cs):
        mus[i, c] = 0
    inputs: dict = {}
    rows = []
    for d, proj, x, cols in reads:
        if x not in inputs:
            inputs[x] = _batched(p, lambda mu, d=d, x=x: p.read_input(d, x, mu), mus)
        alt = _batched(p, lambda xd, proj=proj, x=x: call(proj, *args_of(proj, {x: xd}, p.base)),
                       inputs[x])  # fmt: skip
        width = _width(p, proj, cols)
        rows.append(alt.reshape(len(cs), p.lay.positions, width)[:, positions_t])
    h0 = hs[0]
    index = [h.index for h in hs]
    a = p.base[h0.pattern][0, index]
    g = grad[0, index]

    def logits(q, *new):
        local = {}
        at = torch.arange(p.lay.positions, device=q.device) == q
        for (_, proj, _, cols), row in zip(reads, new):
            base = p.base[proj]
            flat = base.reshape(p.lay.positions, -1)
            local[proj] = torch.where(at[:, None] & cols, row, flat).reshape(base.shape)
        for n in h0.order:
            local[n] = call(n, *args_of(n, local, p.base))
        return local[h0.logits][0, index]

    qs = positions_t.expand(len(cs), -1).reshape(-1)
    flat = [r.reshape(len(cs) * len(positions), -1) for r in rows]
    out = []
    with torch.no_grad():
        for start in range(0, len(qs), p.batch):
            part = slice(start, start + p.batch)
            new = torch.vmap(logits)(qs[part], *(r[part] for r in flat))
            p.evaluations += len(new)
            a2 = torch.softmax(new, -1)
            a2 = torch.where(torch.isnan(a2), a, a2)
            out.append(((a - a2) * g).sum((-1, -2)))
    return torch.cat(out).reshape(len(cs), len(positions), len(hs))


def _width(p, proj, cols) -> int:
    """The columns of projection ``proj``'s output, checked position-major: (positions,
    columns) with ``cols`` a mask of its last dim."""
    value = p.base[proj]
    width = value.shape[-1]
    if cols.numel() != width or value.numel() != p.lay.positions * width:
        raise InputError(
            f"{proj.name}: the projection's output has shape {tuple(value.shape)}, not "
            f"(positions, columns) with {p.lay.positions} positions; node_scores_qk reads "
            "a site's query and key row by row"
        )
    return width
