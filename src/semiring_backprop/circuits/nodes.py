"""The nodes of a circuit: every component's max-marginal, per layer and position
(DESIGN §3b).

A site is a set of elements of the graph that no path passes twice: the token
embeddings at one position, one attention head's slice of the attention output at one
position, the MLP's output at one position, the residual stream at one position, the
target. Its score is the ⊕ over its elements of ``alpha ⊗ D`` (:mod:`.marginals`):
the ⊕ over the whole paths (source to output) through it. Sites are found the way
the branch tables find branches (:func:`..analysis.branches.blocks`: the attention blocks and
their fan-out points; :mod:`..analysis.heads`: the head counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..analysis.branches import blocks, on_result
from ..analysis.fanout import CONTRACTIONS, Roles, entries
from ..analysis.heads import head_counts
from ..engine.alpha import sources
from ..engine.marginals import marginal_value, seed_values
from ..errors import InputError, NotFoundError
from ..semirings import MaxProduct

#: the ``role`` column, in the order rows come
SITE_ROLES = ("embedding", "head", "mlp", "residual", "target")


@dataclass(frozen=True)
class Site:
    """One kind of site in one layer: ``nodes`` (⊕-ed together) whose values, viewed as
    (positions, columns), give one site per position (only ``cols`` of the columns)."""

    role: str
    layer: int | None
    nodes: tuple
    head: int | None = None
    cols: slice | None = None


def circuit_nodes(res, semirings=None, seed="structural", baseline=None, tokens=None,
                  heads=None, roles=None):  # fmt: skip
    """Tidy DataFrame, one row per site: ``layer``, ``position``, ``token``, ``head_index``,
    ``role``, ``node`` and one value column per semiring (named by the semiring).

    Sites (``role``): ``"embedding"``, the sources shaped like the residual stream (the
    looked-up token embeddings, or a float input), per position (``layer`` -1);
    ``"residual"``, the input of each layer (the tensor its attention branches read),
    per position: a cut, so its positions ⊕-sum to the target's value; ``"head"``, per
    layer, head and position, that head's columns of the attention output before the
    output projection (the projection's input); ``"mlp"``, per layer and position, the
    MLP's output (what its residual add adds to the stream: every path through the MLP
    passes it once, as it passes the MLP's input once); ``"target"``, the output
    (``layer`` = the number of layers, ``position`` NA).

    A value is the ⊕ over the site's elements of the max-marginal ``alpha ⊗ D``
    (``res.marginal``), with ``seed`` and ``baseline`` as there: under Real the total
    flow through the site, under Entropy the entropy of the paths through it, under TopK
    the best of the k. Under MaxProduct the signed best: the product of the path of
    largest |product| through the site (``hi`` where ``|hi| >= |lo|``, else ``lo``);
    ``-inf`` where no path passes it. ``tokens``: the token strings, for the ``token``
    column (else the position as text). ``heads``, ``roles``: as for ``layer_table``.

    Under Real with ``seed="x"``, the residual sites of one layer are a cut: their values
    sum to the target's (``tests/test_circuit_nodes.py`` checks it on BERT and GPT-2).
    """
    import pandas as pd

    srs = list(semirings) if semirings is not None else list(res.semirings)
    for sr in srs:
        if sr not in res.semirings:
            raise InputError(f"{sr} was not computed in this pass (computed: {res.semirings})")
    sites, positions = find_sites(res, heads, roles)
    labels = site_labels(tokens, positions)
    upto = alpha_upto(sites)
    rows: list[dict] = []
    for site in sites:
        per_sr = [_scores(res, site, sr, seed, baseline, positions, upto) for sr in srs]
        where = [None] if site.role == "target" else range(positions)
        for p in where:
            row = {
                "layer": site.layer,
                "position": p,
                "token": "" if p is None else labels[p],
                "head_index": site.head,
                "role": site.role,
                "node": "+".join(n.name for n in site.nodes),
            }
            for sr, values in zip(srs, per_sr):
                row[sr.name] = float(values[0 if p is None else p])
            rows.append(row)
    frame = pd.DataFrame(rows)
    for col in ("layer", "position", "head_index"):
        frame[col] = frame[col].astype("Int64")
    return frame


def find_sites(res, heads=None, roles=None) -> tuple[list[Site], int]:
    """The sites of every kind, in the order of ``SITE_ROLES`` per layer, and the number
    of positions. Raises InputError naming the kind it cannot find."""
    return on_result(res, ("sites", repr(heads), repr(roles)),
                     lambda: _find_sites(res, heads, roles))  # fmt: skip


def _find_sites(res, heads, roles) -> tuple[list[Site], int]:
    found = blocks(res, roles)
    if not found:
        raise InputError(
            "circuit: found no attention block (a module with query/key/value projections, "
            "a fused qkv projection or an nn.MultiheadAttention), so no attention heads and "
            "no residual stream between layers; pass roles={'module regex': 'query', ...} "
            "if the model names its projections otherwise"
        )
    first = found[0].points["attention"]
    shape = res.values[first].shape
    if len(shape) != 3 or shape[0] != 1:
        raise InputError(
            f"circuit: the residual stream at {found[0].layer!r} has shape {tuple(shape)}; "
            "sites are read per position of one example: pass a batch of one, shaped "
            "(1, positions, hidden)"
        )
    positions, hidden = shape[1], shape[2]
    embeds = tuple(
        n for n in sources(res.graph, res.needed)
        if tuple(res.values[n].shape[-2:]) == (positions, hidden)
        and res.values[n].numel() == positions * hidden
    )  # fmt: skip
    if not embeds:
        raise InputError(
            f"circuit: found no token embedding: no source of the pass (an input or a "
            f"looked-up embedding) has the residual stream's shape {tuple(shape)}"
        )
    out = [Site("embedding", -1, embeds)]
    for i, b in enumerate(found):
        attn_out = _added_to_stream(res, b, "attention", roles)
        proj_in = _projection_input(res, attn_out, b)
        width = res.values[proj_in].numel() // positions
        n = head_counts(res.graph, b.attention, {"query": width}, heads)["query"]
        size = width // n
        out += [Site("head", i, (proj_in,), h, slice(h * size, (h + 1) * size)) for h in range(n)]
        if "mlp" in b.points or not _attention_only(res, b, roles):
            out.append(Site("mlp", i, (_added_to_stream(res, b, "mlp", roles),)))
        out.append(Site("residual", i, (b.points["attention"],)))
    out.append(Site("target", len(found), (res.graph.output_node,)))
    return out, positions


def _attention_only(res, block, roles) -> bool:
    """Whether ``block`` has no MLP: no fan-out point after its attention and no module
    in it that the MLP's names name (TransformerLens' ``attn_only`` models, two-layer
    attention-only transformers). A block that has one and no fan-out point for it
    (attention and MLP in parallel) is not this: its error stays."""
    r = Roles(res, roles)
    inside = f"{block.layer}." if block.layer else ""
    return not any(r.of_module(p) == "mlp" for p in r.types if p.startswith(inside))


def _added_to_stream(res, block, sublayer, roles):
    """The sublayer's output: what the residual add after the fan-out point adds to
    the stream (the add's input that is not the skip connection)."""
    what = "attention output" if sublayer == "attention" else "MLP output"
    point = block.points.get(sublayer)
    if point is None:
        raise InputError(
            f"circuit: found no {what} in {block.layer!r}: no fan-out point for its "
            f"{sublayer} sublayer (a block whose MLP reads the same tensor as its attention, "
            "in parallel, is not supported yet)"
        )
    try:
        _, ents = entries(res, point, roles)
    except NotFoundError:
        ents = []
    skips = [e for e in ents if e.role == "skip"]
    others = [a for e in skips for a in e.op.all_input_nodes if a is not e.via and a in res.needed]
    if len(skips) != 1 or len(others) != 1:
        raise InputError(
            f"circuit: found no {what} in {block.layer!r}: expected one residual add after "
            f"`{point.name}` reading the stream and one other tensor, found "
            f"{[e.op.name for e in skips]}"
        )
    return others[0]


def _projection_input(res, attn_out, block):
    """The input of the attention's output projection (the heads side by side): back
    from the attention output through ops with one path-carrying input to the first
    contraction, whose other inputs are weights."""
    n = attn_out
    for _ in range(16):
        ins = [a for a in n.all_input_nodes if a in res.needed]
        if n.target in CONTRACTIONS and len(ins) == 1:
            return ins[0]
        if len(ins) != 1:
            break
        n = ins[0]
    raise InputError(
        f"circuit: found no output projection in {block.attention!r}: no matmul with a "
        f"weight leads to its output `{attn_out.name}`, so its heads cannot be told apart"
    )


def alpha_upto(sites) -> frozenset:
    """The nodes where a circuit reads alpha (every site's but the target's): the forward
    pass need not go past them (a language model's vocabulary head, for one)."""
    return frozenset(n for s in sites if s.role != "target" for n in s.nodes)


def _scores(res, site, sr, seed, baseline, positions, upto) -> torch.Tensor:
    """One number per position (the target: one number) for ``site`` under ``sr``."""
    if site.role == "target":
        return readout(sr, _total(res, sr, seed, baseline)).detach().cpu().double()
    total = None
    for node in site.nodes:
        value = marginal_value(res, node, sr, seed, baseline, upto)
        like = res.values[node]
        per = tuple(
            f.reshape(positions, -1, *f.shape[like.dim() :])[:, site.cols or slice(None)]
            for f in value
        )
        per = sr.sum(per, (1,))
        total = per if total is None else sr.plus(total, per)
    return readout(sr, total).detach().cpu().double()


def _total(res, sr, seed, baseline):
    """The target's value, of shape (1,): the ⊕ over every path from a seeded node to the
    output, read where the paths start (``⊕`` over the seeded nodes of seed ⊗ D: each
    path once, by its first node) rather than at the output (which would take the
    forward pass through everything before it)."""
    k = res.semirings.index(sr)
    total = None
    for node, s in seed_values(res, sr, seed, baseline).items():
        group = [n for n in res.graph.aliases.get(node, (node,)) if n in res._store]
        for n in group:
            m = sr.mul(s, res._store[n][k])
            like = res.values[n]
            per = sr.sum(m, tuple(range(like.dim()))) if like.dim() else m
            per = tuple(f.reshape(1, *f.shape[like.dim() :]) for f in per)
            total = per if total is None else sr.plus(total, per)
    if total is None:
        like = res.values[res.graph.output_node]
        return sr.zero((1,), like)
    return total


def readout(sr, value) -> torch.Tensor:
    if isinstance(sr, MaxProduct):
        best = sr.finalize(value)
        return torch.where(best.hi.abs() >= best.lo.abs(), best.hi, best.lo)
    return sr.scalar(value)


def site_labels(tokens, positions) -> list[str]:
    if tokens is None:
        return [str(p) for p in range(positions)]
    from ..analysis.tokens import per_example

    return per_example(tokens, 1, positions)[0]
