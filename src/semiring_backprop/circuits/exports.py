"""A circuit as files other tools read, and as graphs.

* EAP-IG / MIB graph JSON (``Graph.from_json`` of the EAP-IG package): ``cfg``
  (``n_layers``, ``n_heads``, ``parallel_attn_mlp``, ``d_model``; and what EAP-IG does
  not read: ``semiring``, the circuit's ``seed``, ``ig_steps``, ``ig_method`` and
  ``weights``), ``nodes``
  ``{name: {in_graph, score}}`` and ``edges`` ``{"src->dst<q>": {score, in_graph}}``, with
  the node names ``input``, ``a{l}.h{h}``, ``m{l}`` and ``logits``. That graph has no
  positions: a node's or an edge's score is the ⊕ of its sites' values over positions
  (:func:`oplus`). Every edge of the complete graph is written (EAP-IG writes them all);
  ``in_graph`` marks the circuit's.
* The attribution graph JSON of circuit-tracer and Neuronpedia: ``metadata``,
  ``qParams``, ``nodes`` (``node_id``, ``feature``, ``layer``, ``ctx_idx``,
  ``feature_type``, ``jsNodeId``, ``clerp``, ``influence``, ...) and ``links``
  (``source``, ``target``, ``weight``), one node per site (component and position). The
  metadata's schema keeps no other keys, so a seed other than ``x`` and the
  integrated-gradients steps are named in the target's ``clerp``.
* networkx (a ``MultiDiGraph``) and Graphviz DOT, one node per site (:mod:`.graphs`).

Sites and their edges, as every export names them (:func:`site_id`): a site is one
component at one position (``input@3``, ``a0.h1@3``, ``m0@3``; the target ``logits``).
An edge of ``circuit.edges`` runs from its source at its position to its destination at
the same position (the residual stream is per position; ``input`` says which input of
the destination it enters: q, k, v, mlp or target). An edge of
``circuit.attention_edges`` runs inside one head, from the head at ``src_position`` to
the head at ``dst_position``. So a head's node at a position stands for the head there,
reading (q, k, v) and writing its output. In a pruned circuit a kept head also reads
keys and values at positions where it is not kept: :func:`read_sites` lists them, and
the graphs give each a node (``read: True``; no value of its own, since the head's value
there is what it writes there), so that the edges into it and its attention edges to
where the head is kept have both ends. Non-finite values (MaxProduct's ``-inf``: no
path) are written as 0 (EAP-IG scores) or left out (links).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..tokens import readable_tokens
from . import bulk, sites

NODE_COLUMNS = ("layer", "position", "token", "head_index", "role", "node")
EDGE_COLUMNS = ("src_layer", "src_role", "src_head_index", "dst_layer", "dst_role",
                "dst_head_index", "input", "position", "token")  # fmt: skip
ATTENTION_COLUMNS = ("layer", "head_index", "src_position", "dst_position", "src_token",
                     "dst_token")  # fmt: skip
#: roles of the components a circuit keeps or drops (embedding and target always stay)
COMPONENT_ROLES = ("head", "mlp")


def as_int(x) -> int | None:
    """``x`` as an int; None where missing (None, NaN, ``pd.NA``)."""
    if x is None:
        return None
    if type(x) is int:
        return x
    try:
        import pandas as pd

        if pd.isna(x):
            return None
    except (TypeError, ValueError):
        pass
    return int(x)


def as_ints(column) -> list:
    """:func:`as_int` of each value of a column (nullable ints, floats or objects)."""
    return [None if math.isnan(x) else int(x) for x in sites.floats(column).tolist()]


def component_name(role, layer, head=None) -> str:
    """A component's EAP-IG name: ``input``, ``a{l}.h{h}``, ``m{l}``, ``logits`` (and
    ``r{l}`` for a layer's residual stream, which EAP-IG has no name for)."""
    if role == "embedding":
        return "input"
    if role == "target":
        return "logits"
    if role == "head":
        return f"a{as_int(layer)}.h{as_int(head)}"
    if role == "mlp":
        return f"m{as_int(layer)}"
    if role == "residual":
        return f"r{as_int(layer)}"
    raise InputError(f"unknown site role {role!r}: expected one of embedding, head, mlp, "
                     "residual, target")  # fmt: skip


def site_id(role, layer, head=None, position=None) -> str:
    """A site's name: the component's name and the position (``a0.h1@3``); the target is
    ``logits``."""
    name = component_name(role, layer, head)
    p = as_int(position)
    return name if role == "target" or p is None else f"{name}@{p}"


def read_sites(circuit) -> list[dict]:
    """The sites where a kept head of ``circuit`` reads its keys and values but is not
    itself kept (none in a whole circuit): per head and position, ``role`` ("head"),
    ``layer``, ``head_index``, ``position``, ``token``, ``id`` (:func:`site_id`) and
    ``read_by`` (the positions where the head is kept and reads this one, sorted)."""
    a = circuit.attention_edges
    if not len(a):
        return []
    q = a["src_position"].to_numpy(dtype="int64")
    codes = sites.head_codes(a["layer"], a["head_index"], q)
    out = ~sites.member(codes, sites.node_codes(circuit.nodes))
    if not out.any():
        return []
    tokens = circuit.token_list
    found: dict = {}
    cols = (a["layer"], a["head_index"], a["src_position"], a["dst_position"], a["src_token"])
    for layer, head, q, p, tok in zip(*(c.to_numpy(dtype=object)[out] for c in cols)):
        q = int(q)
        sid = site_id("head", layer, head, q)
        site = found.setdefault(sid, {
            "role": "head", "layer": int(layer), "head_index": int(head), "position": q,
            "token": tokens[q] if q < len(tokens) else str(tok), "id": sid, "read_by": set(),
        })  # fmt: skip
        site["read_by"].add(int(p))
    out = sorted(found.values(), key=lambda s: (s["layer"], s["head_index"], s["position"]))
    return [{**s, "read_by": sorted(s["read_by"])} for s in out]


def oplus(name: str, values) -> float:
    """⊕ of readouts (one semiring's column) over sites that no path passes twice:
    Real, the sum; MaxProduct and TopK, the value of largest size (signed); MaxAbs, the
    largest; LogAbs and PathCount, log-sum-exp. Entropy has no ⊕ of readouts (the
    entropy of a union needs each part's total too): refused. (Over many groups at once:
    :func:`.sites.oplus_groups`.)"""
    vals = [float(v) for v in values if v is not None]
    return float(sites.oplus_groups(name, vals, np.zeros(len(vals), np.int64), 1)[0])


def _finite(v) -> float:
    v = float(v)
    return v if math.isfinite(v) else 0.0


# -- EAP-IG / MIB ---------------------------------------------------------------------


def eap_edge_names(n_layers: int, n_heads: int) -> list[str]:
    """Every edge of EAP-IG's complete graph of a sequential (not parallel) transformer,
    in its order: every earlier node into each head's q, k and v, into each MLP (the
    layer's heads included) and into the logits."""
    names, stream = [], ["input"]
    for layer in range(n_layers):
        heads = [f"a{layer}.h{h}" for h in range(n_heads)]
        for src in stream:
            names += [f"{src}->{a}<{q}>" for a in heads for q in "qkv"]
        stream += heads
        names += [f"{src}->m{layer}" for src in stream]
        stream.append(f"m{layer}")
    names += [f"{src}->logits" for src in stream]
    return names


def edge_name(row) -> str:
    """The EAP-IG name of an edge row of ``circuit.edges``."""
    src = component_name(row["src_role"], row["src_layer"], row["src_head_index"])
    dst = component_name(row["dst_role"], row["dst_layer"], row["dst_head_index"])
    return f"{src}->{dst}<{row['input']}>" if row["dst_role"] == "head" else f"{src}->{dst}"


def _eap_components(n_layers: int, n_heads: int) -> tuple[np.ndarray, list[str]]:
    """The component codes of EAP-IG's nodes (and their names), in its order."""
    roles = ["embedding"] + [r for _ in range(n_layers) for r in ["head"] * n_heads + ["mlp"]]
    layers = [-1] + [layer for layer in range(n_layers) for _ in range(n_heads + 1)]
    heads = [0] + [h for _ in range(n_layers) for h in [*range(n_heads), 0]]
    roles = np.array([*roles, "target"], dtype=object)
    codes = sites.site_codes(roles, np.array([*layers, n_layers]), np.array([*heads, 0]), None)
    comps = sites.component_codes(codes)
    return comps, [sites.component_label(c) for c in comps.tolist()]


def eap_edges(frame, n_layers: int, n_heads: int, col: str | None = None) -> dict:
    """The EAP-IG names of the edges of a frame of ``circuit.edges`` (a model of
    ``n_layers`` and ``n_heads``), each once, with (``col`` given) the ⊕ of that column's
    values over each name's rows (over positions: EAP-IG's graph has none), else None.
    InputError for an edge EAP-IG's graph of a sequential transformer does not have."""
    import pandas as pd

    comps, labels = _eap_components(n_layers, n_heads)
    if not len(frame):
        return {}
    src = sites.site_codes(frame["src_role"], frame["src_layer"], frame["src_head_index"], None)
    dst = sites.site_codes(frame["dst_role"], frame["dst_layer"], frame["dst_head_index"], None)
    found_src, s = sites.lookup(sites.component_codes(src), comps)
    found_dst, d = sites.lookup(sites.component_codes(dst), comps)
    entry, inputs = pd.factorize(frame["input"])
    ends = ["", *(f"<{x}>" for x in inputs.tolist())]  # only a head's input is named
    entry = np.where(sites.is_head(dst), entry + 1, 0)
    odd = ~(found_src & found_dst)
    if odd.any():
        i = int(np.flatnonzero(odd)[0])
        a, b = (sites.component_label(sites.component_codes(x[i])) for x in (src, dst))
        name = f"{a}->{b}{ends[entry[i]]}"
        raise _no_eap_edge(name, n_layers, n_heads)
    n, width = len(comps), len(ends)
    key = (s * n + d) * width + entry
    size = n * n * width
    present = np.flatnonzero(np.bincount(key, minlength=size))
    pair, e = np.divmod(present, width)
    names = [f"{labels[a]}->{labels[b]}{ends[c]}" for a, b, c in zip(
        (pair // n).tolist(), (pair % n).tolist(), e.tolist())]  # fmt: skip
    if col is None:
        return dict.fromkeys(names)
    values = sites.oplus_groups(col, sites.floats(frame[col]), key, size)[present]
    return dict(zip(names, values.tolist()))


def _no_eap_edge(name: str, n_layers: int, n_heads: int) -> InputError:
    return InputError(f"edge {name} is no edge of EAP-IG's graph of a sequential transformer "
                      f"with {n_layers} layers and {n_heads} heads")  # fmt: skip


def eap_graph(circuit, semiring=None) -> dict:
    """The circuit as EAP-IG's ``Graph.to_json`` writes a graph (see the module)."""
    col = circuit.column(semiring)
    full = circuit.full
    n_layers, n_heads = circuit.n_layers, circuit.n_heads
    cfg = {"n_layers": n_layers, "n_heads": n_heads, "parallel_attn_mlp": False,
           "d_model": int(circuit.d_model or 0), "semiring": col, "seed": circuit.seed,
           "ig_steps": int(circuit.ig_steps), "ig_method": circuit.ig_method,
           "weights": circuit.weights}  # fmt: skip
    import pandas as pd

    rows = full.nodes[full.nodes.role != "residual"]
    comps, found = pd.factorize(sites.component_codes(sites.node_codes(rows)))
    values = sites.oplus_groups(col, sites.floats(rows[col]), comps, len(found))
    scores = {sites.component_label(c): v for c, v in zip(found.tolist(), values.tolist())}
    kept = {sites.component_label(c)
            for c in np.unique(sites.component_codes(sites.node_codes(circuit.nodes)))}  # fmt: skip
    _, names = _eap_components(n_layers, n_heads)
    empty = oplus(col, [])
    nodes = {
        n: {"in_graph": n in ("input", "logits") or n in kept,
            "score": _finite(scores.get(n, empty))}
        for n in names
    }  # fmt: skip
    all_edges = eap_edge_names(n_layers, n_heads)
    edge_values = eap_edges(full.edges, n_layers, n_heads, col)
    known = set(all_edges)
    odd = [n for n in edge_values if n not in known]
    if odd:
        raise _no_eap_edge(odd[0], n_layers, n_heads)
    whole = circuit.source is None
    in_circuit = edge_values if whole else eap_edges(circuit.edges, n_layers, n_heads)
    scores = np.array([edge_values.get(n, empty) for n in all_edges], dtype="float64")
    scores = np.where(np.isfinite(scores), scores, 0.0).tolist()
    edges = {n: {"score": v, "in_graph": n in in_circuit} for n, v in zip(all_edges, scores)}
    return {"cfg": cfg, "nodes": nodes, "edges": edges}


def eap_json(graph: dict) -> str:
    """``json.dumps(graph)`` of an :func:`eap_graph` graph: its edges (a hundred thousand
    for a model of SmolLM2's size: most of the time in the JSON encoder) written as text
    directly, names being letters, digits and ``.->_<``, scores finite floats."""
    edges = graph["edges"]
    names = "".join(edges)
    plain = names.isascii() and '"' not in names and "\\" not in names and all(
        type(e["score"]) is float and math.isfinite(e["score"]) and type(e["in_graph"]) is bool
        and len(e) == 2 for e in edges.values())  # fmt: skip
    if not plain or not edges or list(graph)[-1] != "edges":
        return json.dumps(graph, allow_nan=False)
    rest = json.dumps({k: v for k, v in graph.items() if k != "edges"}, allow_nan=False)
    truth = {True: "true", False: "false"}
    body = ", ".join([f'"{n}": {{"score": {e["score"]!r}, "in_graph": {truth[e["in_graph"]]}}}'
                      for n, e in edges.items()])  # fmt: skip
    return f'{rest[:-1]}, "edges": {{{body}}}}}'


# -- circuit-tracer / Neuronpedia -----------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """What every node of an attribution graph reads of its circuit (read once)."""

    n_layers: int
    n_heads: int
    last: int
    ids: list | None
    tokens: list
    what: str
    seeding: str


def _shape(circuit) -> _Shape:
    return _Shape(circuit.n_layers, circuit.n_heads, circuit.last_position, circuit.token_ids,
                  readable_tokens(circuit.token_list), circuit.what, circuit.seeding)  # fmt: skip


def _np_node(shape: _Shape, row, col) -> dict:
    role, p = row["role"], as_int(row["position"])
    n_layers, n_heads = shape.n_layers, shape.n_heads
    value = row[col]
    influence = float(value) if math.isfinite(float(value)) else None
    if role == "embedding":
        ids = shape.ids
        vocab = ids[p] if ids is not None and p < len(ids) else p
        node_id, feature, layer = f"E_{vocab}_{p}", p, "E"
        token = shape.tokens[p] if p < len(shape.tokens) else row["token"]
        kind, clerp = "embedding", f"token {token!r} (position {p})"
    elif role == "target":
        p = shape.last
        node_id, feature, layer = f"{n_layers + 1}_0_{p}", 0, str(n_layers + 1)
        kind, clerp = "logit", shape.what or "the target"
    elif role == "head":
        h = as_int(row["head_index"])
        node_id, feature, layer = f"{as_int(row['layer'])}_{h}_{p}", h, str(as_int(row["layer"]))
        kind, clerp = "attention head", f"attention head {as_int(row['layer'])}.{h}"
    else:
        node_id, feature, layer = (
            f"{as_int(row['layer'])}_{n_heads}_{p}",
            n_heads,
            str(as_int(row["layer"])),
        )
        kind, clerp = "mlp", f"MLP {as_int(row['layer'])}"
    said = f"{clerp}: {col} {value:.4g}" if influence is not None else clerp
    if role == "target":
        # the metadata's schema keeps no extra keys: the seed goes in the target's label
        said += f"; {shape.seeding}" if shape.seeding else ""
        # the viewer reads a logit's label as `Output "TOKEN" (p=P)` and stops on any
        # other; the scalar explained is no one token's probability, so p=n/a
        said = 'Output "{}" (p=n/a)'.format(said.replace('"', "'"))
    return {
        "node_id": node_id,
        "feature": int(feature),
        "layer": layer,
        "ctx_idx": int(p),
        "feature_type": kind,
        "token_prob": 0.0,
        "is_target_logit": role == "target",
        "run_idx": 0,
        "reverse_ctx_idx": 0,
        "jsNodeId": f"{layer}_{feature}-{p}",
        "clerp": said,
        "influence": influence,
        "activation": None,
    }


def _neuronpedia(circuit, semiring, slug, scan) -> tuple[dict, tuple]:
    """:func:`neuronpedia_graph`, and its links as arrays: the node ids (an object array),
    the index there of each link's source and target, and each link's weight."""
    col = circuit.column(semiring)
    shape = _shape(circuit)
    rows = circuit.nodes[circuit.nodes.role != "residual"]
    codes = sites.node_codes(rows).tolist()
    columns = {"role": rows["role"].tolist(), "layer": as_ints(rows["layer"]),
               "head_index": as_ints(rows["head_index"]), "position": as_ints(rows["position"]),
               "token": rows["token"].tolist(), col: sites.floats(rows[col]).tolist()}  # fmt: skip
    nodes = [_np_node(shape, dict(zip(columns, row)), col) for row in zip(*columns.values())]
    for site in read_sites(circuit):
        node = _np_node(shape, {**site, col: math.nan}, col)
        where = ", ".join(str(p) for p in site["read_by"])
        head = f"attention head {site['layer']}.{site['head_index']}"
        node["clerp"] = f"{head} reading position {site['position']} (kept at {where})"
        codes.append(int(sites.head_codes([site["layer"]], [site["head_index"]],
                                          [site["position"]])[0]))  # fmt: skip
        nodes.append(node)
    e = sites.edge_arrays(circuit)
    found_src, at_src = sites.lookup(e.src, codes)
    found_dst, at_dst = sites.lookup(e.dst, codes)
    take = found_src & found_dst & (e.src != e.dst)
    k = max(len(codes), 1)
    pairs, first = bulk.factorize(at_src[take] * k + at_dst[take])
    weights = sites.oplus_groups(col, e.value(col)[take], pairs, len(first))
    keep = np.isfinite(weights)
    ids = np.array([n["node_id"] for n in nodes] or [""], dtype=object)
    src, dst, weights = first[keep] // k, first[keep] % k, weights[keep]
    with bulk.gc_paused():  # (a million links: a dict each)
        links = [{"source": s, "target": t, "weight": w} for s, t, w in zip(
            ids[src].tolist(), ids[dst].tolist(), weights.tolist())]  # fmt: skip
    meta = {
        "slug": slug,
        "scan": scan,
        "transcoder_list": [],
        "prompt_tokens": list(shape.tokens),
        "prompt": circuit.prompt,
        "node_threshold": None,
        "schema_version": 1,
    }
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
               "sg_pos": ""}  # fmt: skip
    graph = {"metadata": meta, "qParams": qparams, "nodes": nodes, "links": links}
    return graph, (ids, src, dst, weights)


def neuronpedia_graph(circuit, semiring=None, slug: str = "circuit", scan: str = "") -> dict:
    """The circuit as circuit-tracer's ``create_graph_files`` writes an attribution graph
    (see the module): one node per kept site (``feature_type`` ``embedding``,
    ``attention head``, ``mlp`` or ``logit``; ``influence``: the site's value), one link
    per pair of sites an edge joins (its value; the ⊕ over a head's q, k and v), links of
    no path and a head's attention onto its own position left out. The prompt's tokens
    are written as people read them (`` Mary``, not ``ĠMary``: circuit-tracer writes
    each token decoded); the embeddings' node ids keep the vocabulary ids."""
    return _neuronpedia(circuit, semiring, slug, scan)[0]


def save_neuronpedia(circuit, where, semiring=None, slug: str = "circuit",
                     scan: str = "") -> dict:  # fmt: skip
    """:func:`neuronpedia_graph` written by :func:`write_neuronpedia`; returns the graph.
    The links (a million for a whole circuit: seconds in the JSON encoder) are written
    as text joined from pieces (each node's written once, each weight's ``repr``), the
    same JSON."""
    graph, (ids, src, dst, weights) = _neuronpedia(circuit, semiring, slug, scan)
    rest = json.dumps({k: v for k, v in graph.items() if k != "links"}, allow_nan=False)
    # node ids are letters, digits and underscores; weights finite floats (repr as json)
    heads = np.array([f'{{"source": "{i}", "target": "' for i in ids.tolist()], dtype=object)
    tails = np.array([f'{i}", "weight": ' for i in ids.tolist()], dtype=object)
    pieces = [f'{rest[:-1]}, "links": [']
    for at in sites.chunks(len(src), "attribution graph links"):
        said = list(map(float.__repr__, weights[at].tolist()))
        pieces += bulk.interleaved(heads[src[at]], tails[dst[at]], said, "}, ")
    if len(src):
        pieces[-1] = "}"
    pieces.append("]}")
    write_neuronpedia(graph, where, "".join(pieces))
    return graph


def write_neuronpedia(graph: dict, where, text: str | None = None) -> str:
    """Write ``graph`` to ``where``: a ``.json`` file, or a directory, where it goes to
    ``{slug}.json`` beside ``graph-metadata.json`` (``{"graphs": [metadata, ...]}``,
    which circuit-tracer's local server lists; an entry of the same slug is replaced).
    ``text``: the graph as JSON, where already written (:func:`save_neuronpedia`)."""
    from pathlib import Path

    where = Path(where)
    try:
        return _write_neuronpedia(graph, where, text)
    except OSError as e:  # a file where a directory goes, a read-only place, a full disk
        raise InputError(
            f"cannot write the graph to {str(where)!r} ({e.strerror or type(e).__name__}"
            f"{': ' + str(e.filename) if e.filename else ''}): give a directory you can "
            "write to (or a .json file name), on a disk with room"
        ) from None


def _write_neuronpedia(graph: dict, where, text: str | None) -> str:
    from .._files import atomic_write

    # (not indented: an indented dump runs in Python, seconds for a large graph)
    text = json.dumps(graph, allow_nan=False) if text is None else text
    if where.suffix == ".json":
        where.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(where, lambda tmp: tmp.write_text(text))
        return str(where)
    where.mkdir(parents=True, exist_ok=True)
    file = where / f"{graph['metadata']['slug']}.json"
    atomic_write(file, lambda tmp: tmp.write_text(text))
    index = where / "graph-metadata.json"
    listed = {"graphs": []}
    if index.exists():
        try:
            listed = json.loads(index.read_text())
        except ValueError:
            raise InputError(
                f"{index} is not JSON: move it away or give another directory"
            ) from None
    graphs = [g for g in listed.get("graphs", []) if g.get("slug") != graph["metadata"]["slug"]]
    listed["graphs"] = [*graphs, graph["metadata"]]
    atomic_write(index, lambda tmp: tmp.write_text(json.dumps(listed, indent=2)))
    return str(file)
