"""A circuit as files other tools read, and as graphs.

* EAP-IG / MIB graph JSON (``Graph.from_json`` of the EAP-IG package): ``cfg``
  (``n_layers``, ``n_heads``, ``parallel_attn_mlp``, ``d_model``; and what EAP-IG does
  not read: ``semiring``, the circuit's ``seed``, ``ig_steps`` and ``ig_method``), ``nodes``
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
* networkx (a ``MultiDiGraph``) and Graphviz DOT, one node per site.

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

from ..errors import InputError

NODE_COLUMNS = ("layer", "position", "token", "head_index", "role", "node")
EDGE_COLUMNS = ("src_layer", "src_role", "src_head_index", "dst_layer", "dst_role",
                "dst_head_index", "input", "position", "token")  # fmt: skip
ATTENTION_COLUMNS = ("layer", "head_index", "src_position", "dst_position", "src_token",
                     "dst_token")  # fmt: skip
#: roles of the components a circuit keeps or drops (embedding and target always stay)
COMPONENT_ROLES = ("head", "mlp")


def _int(x) -> int | None:
    if x is None:
        return None
    try:
        import pandas as pd

        if pd.isna(x):
            return None
    except (TypeError, ValueError):
        pass
    return int(x)


def component_name(role, layer, head=None) -> str:
    """A component's EAP-IG name: ``input``, ``a{l}.h{h}``, ``m{l}``, ``logits`` (and
    ``r{l}`` for a layer's residual stream, which EAP-IG has no name for)."""
    if role == "embedding":
        return "input"
    if role == "target":
        return "logits"
    if role == "head":
        return f"a{_int(layer)}.h{_int(head)}"
    if role == "mlp":
        return f"m{_int(layer)}"
    if role == "residual":
        return f"r{_int(layer)}"
    raise InputError(f"unknown site role {role!r}: expected one of embedding, head, mlp, "
                     "residual, target")  # fmt: skip


def site_id(role, layer, head=None, position=None) -> str:
    """A site's name: the component's name and the position (``a0.h1@3``); the target is
    ``logits``."""
    name = component_name(role, layer, head)
    p = _int(position)
    return name if role == "target" or p is None else f"{name}@{p}"


def read_sites(circuit) -> list[dict]:
    """The sites where a kept head of ``circuit`` reads its keys and values but is not
    itself kept (none in a whole circuit): per head and position, ``role`` ("head"),
    ``layer``, ``head_index``, ``position``, ``token``, ``id`` (:func:`site_id`) and
    ``read_by`` (the positions where the head is kept and reads this one, sorted)."""
    kept = {site_id(r["role"], r["layer"], r["head_index"], r["position"])
            for r in circuit.nodes.to_dict("records")}  # fmt: skip
    tokens = circuit.token_list
    found: dict = {}
    for r in circuit.attention_edges.to_dict("records"):
        q, p = _int(r["src_position"]), _int(r["dst_position"])
        sid = site_id("head", r["layer"], r["head_index"], q)
        if sid in kept:
            continue
        site = found.setdefault(sid, {
            "role": "head", "layer": _int(r["layer"]), "head_index": _int(r["head_index"]),
            "position": q, "token": tokens[q] if q < len(tokens) else str(r["src_token"]),
            "id": sid, "read_by": set(),
        })  # fmt: skip
        site["read_by"].add(p)
    out = sorted(found.values(), key=lambda s: (s["layer"], s["head_index"], s["position"]))
    return [{**s, "read_by": sorted(s["read_by"])} for s in out]


def oplus(name: str, values) -> float:
    """⊕ of readouts (one semiring's column) over sites that no path passes twice:
    Real, the sum; MaxProduct and TopK, the value of largest size (signed); MaxAbs, the
    largest; LogAbs and PathCount, log-sum-exp. Entropy has no ⊕ of readouts (the
    entropy of a union needs each part's total too): refused."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if name == "Real":
        return float(sum(vals))
    finite = [v for v in vals if math.isfinite(v)]
    if name.startswith(("MaxProduct", "TopK")):
        return max(finite, key=abs) if finite else -math.inf
    if name == "MaxAbs":
        return max(vals, default=-math.inf)
    if name in ("LogAbs", "PathCount"):
        if not finite:
            return -math.inf
        m = max(finite)
        return m + math.log(sum(math.exp(v - m) for v in finite))
    raise InputError(
        f"{name}: its values of several sites do not combine into one (no ⊕ of readouts); "
        "export under Real or MaxProduct"
    )


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


def eap_graph(circuit, semiring=None) -> dict:
    """The circuit as EAP-IG's ``Graph.to_json`` writes a graph (see the module)."""
    col = circuit.column(semiring)
    full = circuit.full
    n_layers, n_heads = circuit.n_layers, circuit.n_heads
    cfg = {"n_layers": n_layers, "n_heads": n_heads, "parallel_attn_mlp": False,
           "d_model": int(circuit.d_model or 0), "semiring": col, "seed": circuit.seed,
           "ig_steps": int(circuit.ig_steps), "ig_method": circuit.ig_method}  # fmt: skip
    scores: dict[str, list] = {}
    for row in full.nodes.to_dict("records"):
        if row["role"] != "residual":
            scores.setdefault(component_name(row["role"], row["layer"], row["head_index"]),
                              []).append(row[col])  # fmt: skip
    kept = {component_name(r["role"], r["layer"], r["head_index"])
            for r in circuit.nodes.to_dict("records")}  # fmt: skip
    names = ["input"] + [
        n for layer in range(n_layers)
        for n in [*(f"a{layer}.h{h}" for h in range(n_heads)), f"m{layer}"]
    ] + ["logits"]  # fmt: skip
    nodes = {
        n: {"in_graph": n in ("input", "logits") or n in kept,
            "score": _finite(oplus(col, scores.get(n, [])))}
        for n in names
    }  # fmt: skip
    all_edges = eap_edge_names(n_layers, n_heads)
    known = set(all_edges)
    edge_values: dict[str, list] = {}
    for row in full.edges.to_dict("records"):
        name = edge_name(row)
        if name not in known:
            raise InputError(
                f"edge {name} is no edge of EAP-IG's graph of a sequential transformer with "
                f"{n_layers} layers and {n_heads} heads"
            )
        edge_values.setdefault(name, []).append(row[col])
    in_circuit = {edge_name(r) for r in circuit.edges.to_dict("records")}
    edges = {
        n: {"score": _finite(oplus(col, edge_values.get(n, []))), "in_graph": n in in_circuit}
        for n in all_edges
    }
    return {"cfg": cfg, "nodes": nodes, "edges": edges}


# -- circuit-tracer / Neuronpedia -----------------------------------------------------


def _np_node(circuit, row, col) -> dict:
    role, p = row["role"], _int(row["position"])
    n_layers, n_heads = circuit.n_layers, circuit.n_heads
    value = row[col]
    influence = float(value) if math.isfinite(float(value)) else None
    if role == "embedding":
        ids = circuit.token_ids
        vocab = ids[p] if ids is not None and p < len(ids) else p
        node_id, feature, layer = f"E_{vocab}_{p}", p, "E"
        kind, clerp = "embedding", f"token {row['token']!r} (position {p})"
    elif role == "target":
        p = circuit.last_position
        node_id, feature, layer = f"{n_layers + 1}_0_{p}", 0, str(n_layers + 1)
        kind, clerp = "logit", circuit.what or "the target"
    elif role == "head":
        h = _int(row["head_index"])
        node_id, feature, layer = f"{_int(row['layer'])}_{h}_{p}", h, str(_int(row["layer"]))
        kind, clerp = "attention head", f"attention head {_int(row['layer'])}.{h}"
    else:
        node_id, feature, layer = (
            f"{_int(row['layer'])}_{n_heads}_{p}",
            n_heads,
            str(_int(row["layer"])),
        )
        kind, clerp = "mlp", f"MLP {_int(row['layer'])}"
    said = f"{clerp}: {col} {value:.4g}" if influence is not None else clerp
    if role == "target":
        # the metadata's schema keeps no extra keys: the seed goes in the target's label
        said += f"; {circuit.seeding}" if circuit.seeding else ""
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


def neuronpedia_graph(circuit, semiring=None, slug: str = "circuit", scan: str = "") -> dict:
    """The circuit as circuit-tracer's ``create_graph_files`` writes an attribution graph
    (see the module): one node per kept site (``feature_type`` ``embedding``,
    ``attention head``, ``mlp`` or ``logit``; ``influence``: the site's value), one link
    per pair of sites an edge joins (its value; the ⊕ over a head's q, k and v), links of
    no path and a head's attention onto its own position left out."""
    col = circuit.column(semiring)
    ids, nodes = {}, []
    for row in circuit.nodes.to_dict("records"):
        if row["role"] == "residual":
            continue
        node = _np_node(circuit, row, col)
        ids[site_id(row["role"], row["layer"], row["head_index"], row["position"])] = node
        nodes.append(node)
    for site in read_sites(circuit):
        node = _np_node(circuit, {**site, col: math.nan}, col)
        where = ", ".join(str(p) for p in site["read_by"])
        head = f"attention head {site['layer']}.{site['head_index']}"
        node["clerp"] = f"{head} reading position {site['position']} (kept at {where})"
        ids[site["id"]] = node
        nodes.append(node)
    weights: dict = {}
    for src, dst, _key, attrs in graph_edges(circuit):
        if src in ids and dst in ids and src != dst:
            weights.setdefault((src, dst), []).append(attrs[col])
    links = []
    for (src, dst), values in weights.items():
        w = oplus(col, values)
        if math.isfinite(w):
            links.append({"source": ids[src]["node_id"], "target": ids[dst]["node_id"],
                          "weight": float(w)})  # fmt: skip
    meta = {
        "slug": slug,
        "scan": scan,
        "transcoder_list": [],
        "prompt_tokens": [str(t) for t in circuit.token_list],
        "prompt": circuit.prompt,
        "node_threshold": None,
        "schema_version": 1,
    }
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
               "sg_pos": ""}  # fmt: skip
    return {"metadata": meta, "qParams": qparams, "nodes": nodes, "links": links}


def write_neuronpedia(graph: dict, where) -> str:
    """Write ``graph`` to ``where``: a ``.json`` file, or a directory, where it goes to
    ``{slug}.json`` beside ``graph-metadata.json`` (``{"graphs": [metadata, ...]}``,
    which circuit-tracer's local server lists; an entry of the same slug is replaced)."""
    from pathlib import Path

    from .._files import atomic_write

    where = Path(where)
    text = json.dumps(graph, indent=2, allow_nan=False)
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


# -- networkx and DOT -------------------------------------------------------------------


def graph_nodes(circuit):
    """``(site id, attributes)`` of every row of ``circuit.nodes`` (``read`` False) and
    of every :func:`read_sites` site (``read`` True, its values NaN)."""
    names = circuit.names
    for row in circuit.nodes.to_dict("records"):
        attrs = {k: row[k] for k in ("role", "layer", "head_index", "position", "token")}
        attrs = {k: (_int(v) if k in ("layer", "head_index", "position") else v)
                 for k, v in attrs.items()}  # fmt: skip
        attrs.update({n: float(row[n]) for n in names}, read=False)
        yield site_id(row["role"], row["layer"], row["head_index"], row["position"]), attrs
    for site in read_sites(circuit):
        attrs = {k: site[k] for k in ("role", "layer", "head_index", "position", "token")}
        attrs.update({n: math.nan for n in names}, read=True, read_by=site["read_by"])
        yield site["id"], attrs


def graph_edges(circuit):
    """``(source id, destination id, key, attributes)`` of every row of ``circuit.edges``
    (key: the input entered, q, k, v, mlp or target) and of
    ``circuit.attention_edges`` (key ``attention``)."""
    names = circuit.names
    for row in circuit.edges.to_dict("records"):
        p = row["position"]
        src = site_id(row["src_role"], row["src_layer"], row["src_head_index"], p)
        dst = site_id(row["dst_role"], row["dst_layer"], row["dst_head_index"], p)
        attrs = {"kind": "residual", "input": row["input"], "position": _int(p)}
        attrs.update({n: float(row[n]) for n in names})
        yield src, dst, str(row["input"]), attrs
    for row in circuit.attention_edges.to_dict("records"):
        src = site_id("head", row["layer"], row["head_index"], row["src_position"])
        dst = site_id("head", row["layer"], row["head_index"], row["dst_position"])
        attrs = {"kind": "attention", "input": "attention",
                 "src_position": _int(row["src_position"]),
                 "dst_position": _int(row["dst_position"])}  # fmt: skip
        attrs.update({n: float(row[n]) for n in names})
        yield src, dst, "attention", attrs


def to_networkx(circuit):
    """A ``networkx.MultiDiGraph``: a node per row of ``circuit.nodes`` (its columns as
    attributes), an edge per row of ``circuit.edges`` and ``circuit.attention_edges``."""
    try:
        import networkx as nx
    except ImportError:
        raise InputError("Circuit.to_networkx needs networkx: pip install networkx") from None
    g = nx.MultiDiGraph(semirings=list(circuit.names), tokens=list(circuit.token_list))
    for node, attrs in graph_nodes(circuit):
        g.add_node(node, **attrs)
    for src, dst, key, attrs in graph_edges(circuit):
        g.add_edge(src, dst, key=key, **attrs)
    return g


def _q(s) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(circuit, semiring=None) -> str:
    """Graphviz DOT: a box per site (filled by its value under ``semiring``: red
    positive, blue negative), an edge per edge row (pen width by |value|), layers as
    ranks from the embeddings (bottom) to the target (top); residual sites left out."""
    from ..views.colors import Scale

    col = circuit.column(semiring)
    rows = [(n, a) for n, a in graph_nodes(circuit) if a["role"] != "residual"]
    scale = Scale([a[col] for _, a in rows if not a["read"]], signed=True)
    edges = [e for e in graph_edges(circuit)]
    top = max((abs(a[col]) for *_, a in edges if math.isfinite(a[col])), default=0.0) or 1.0
    out = [
        "digraph circuit {",
        "  rankdir=BT;",
        '  node [shape=box, style=filled, fontname="Helvetica"];',
    ]
    ranks: dict = {}
    for name, a in rows:
        ranks.setdefault(a["layer"], []).append(name)
        what = name if a["role"] == "target" else f"{name}\\n{a['token']}"
        if a["read"]:  # a kept head reads here; its value belongs to where it writes
            out.append(f'  {_q(name)} [label="{what}\\nread", style=dashed];')
            continue
        out.append(
            f'  {_q(name)} [label="{what}\\n{a[col]:.3g}", fillcolor="{scale.color(a[col])}"];'
        )
    for layer in sorted(ranks, key=lambda x: -2 if x is None else x):
        out.append("  { rank=same; " + "; ".join(_q(n) for n in ranks[layer]) + "; }")
    for src, dst, key, a in edges:
        v = a[col]
        width = 0.3 + 3.7 * abs(v) / top if math.isfinite(v) else 0.3
        color = "#B2182B" if v > 0 else "#2166AC" if v < 0 else "#999999"
        style = ", style=dashed" if key == "attention" else ""
        out.append(f'  {_q(src)} -> {_q(dst)} [label={_q(key)}, penwidth={width:.2f}, '
                   f'color="{color}"{style}];')  # fmt: skip
    out.append("}")
    return "\n".join(out) + "\n"
