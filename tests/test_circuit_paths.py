"""``Circuit.top_paths``: the best whole paths as the sites they pass, against brute force.

Oracle: on tiny attention models (one layer, one layer with a pre-norm, two layers;
float64, random weights), every whole path of the scalar gradient graph is listed
(tests/oracles.py) from every element of the token embedding, with its product (times
the source element's value for ``seed="x"``). The sites each path passes are read here
from the listed path's own nodes, by module tags: the embedding, each layer's input
(the residual stream), each head's columns of the output projection's input, each
query / key / value projection (the input the next head is entered by), each MLP's
output, the output. Checked:

- the best path's value is the listed product of largest |product| (sign included), and
  the k best paths' values are the k largest;
- each returned path is one of the listed paths (the same elements, hop by hop), and its
  sites (role, layer, head, position, input, previous position) are the ones read from
  that listed path;
- padding positions start no path (the best from the other positions, by the listing);
- a pass without the semiring asked for, and bad arguments, raise InputError.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

import oracles
import semiring_backprop as sbp
from semiring_backprop.circuits.exports import ATTENTION_COLUMNS, EDGE_COLUMNS
from semiring_backprop.errors import InputError
from test_circuit_edges import TINY, Tiny

F64 = torch.float64
MP = sbp.MaxProduct()
TOPK = sbp.TopK(16)
TOKENS = ["a", "b", "c"]


@functools.cache
def result(name, semirings=(MP, TOPK)):
    layers, h, f, norm, t = TINY[name]
    torch.manual_seed(0)
    model = Tiny(layers, h, f, norm).to(F64).eval()
    ids = torch.tensor([[1, 4, 2][:t]])
    return sbp.backprop(model, (ids,), output=lambda y: y[0, -1, 0] - y[0, 0, 1],
                        semirings=list(semirings))  # fmt: skip


def circuit(res, mask=None):
    """The circuit of ``res`` without its edge tables and with one value column
    (top_paths reads the pass itself)."""
    t = res.values[res.node("emb")].shape[1]  # (the module's output: one per position)
    return sbp.Circuit.from_result(
        res, res.semirings[:1], tokens=TOKENS[:t], mask=mask,
        edges=pd.DataFrame(columns=EDGE_COLUMNS),
        attention_edges=pd.DataFrame(columns=ATTENTION_COLUMNS),
    )  # fmt: skip


def _events(res, name):
    """``{node name: flat -> event}``, read from module tags alone."""
    layers, h, *_ = TINY[name]
    d = h // 2
    (src,) = oracles.sources(res)  # the looked-up embedding: where every path starts
    assert res.graph.module_of(src) == "emb"
    table = {src.name: lambda f: ("embedding", -1, None, f // h)}
    for i in range(layers):
        table[res.node(f"layers.{i}:input").name] = lambda f, i=i: ("residual", i, None, f // h)
        table[res.node(f"layers.{i}.attention.out:input").name] = (
            lambda f, i=i: ("head", i, (f % h) // d, f // h))  # fmt: skip
        table[res.node(f"layers.{i}.mlp").name] = lambda f, i=i: ("mlp", i, None, f // h)
        for n in res.graph.nodes:
            module = res.graph.module_of(n) or ""
            role = module.rsplit(".", 1)[-1]
            if n.target is torch.ops.aten.addmm.default and module.startswith(
                f"layers.{i}.attention."
            ) and role in ("query", "key", "value"):  # fmt: skip
                table[n.name] = lambda f, i=i, role=role: ("in", i, role[0], f // h)
    table[res.graph.output_node.name] = lambda f: ("target", layers, None, None)
    return table


def _sites(events) -> list[tuple]:
    """(role, layer, head, position, input, previous position) per site of a listed
    path's events (the ``in`` events name the next head's input)."""
    out, entered, last = [], None, None
    for e in events:
        if e[0] == "in":
            entered = e[2]
            continue
        role, layer, head, pos = e
        inp = {"head": entered, "mlp": "mlp", "target": "target"}.get(role)
        out.append((role, layer, head, pos, inp, last))
        entered, last = None, pos
    return out


@functools.cache
def listing(name, seed):
    """``(products, groups, dag)``: every whole path's product (seed included), all in
    one array and grouped by the sites read from each path's nodes (:func:`_sites`)."""
    res = result(name)
    dag = oracles.scalar_dag(res)
    (src,) = oracles.sources(res)
    x = res.values[src].double().reshape(-1).numpy()
    seeds = {src: np.ones(x.size) if seed == "structural" else x}
    table = _events(res, name)
    groups = oracles.grouped_paths(res, dag, seeds, lambda n, f: _event(table, n, f))
    groups = {tuple(_sites(sig)): p for sig, p in groups.items()}
    return np.concatenate(list(groups.values())), groups, dag


def _event(table, node, flat):
    fn = table.get(node.name)
    return None if fn is None else fn(flat)


def _listed(res, name, dag, cp) -> tuple[float, list]:
    """``cp``'s element path walked on the listed scalar graph (each hop must be one of
    its edges): the products it can have (one per choice among parallel edges, seed
    included) and the sites read from its nodes."""
    table = _events(res, name)
    nodes = {n.name: n for n in res.graph.nodes}
    hops = [(nodes[s.node], int(np.ravel_multi_index(s.index, res.values[nodes[s.node]].shape))
             if s.index else 0) for s in cp.path.steps]  # fmt: skip
    products = {cp.seed}
    for (u, fu), (v, fv) in zip(hops, hops[1:]):
        ws = [
            w[fv, fu] for dst, _, mask, w in dag.consumers.get(u, []) if dst is v and mask[fv, fu]
        ]
        assert ws, f"{cp}: no edge {u.name}[{fu}] -> {v.name}[{fv}] in the listed graph"
        products = {p * float(w) for p in products for w in ws}
    events = [e for n, f in hops if (e := _event(table, n, f)) is not None]
    return products, _sites(events)


def _check_listed(res, name, groups, dag, cp):
    """``cp`` is a listed path: its hops are edges of the scalar graph with its product,
    its sites are those read from its nodes, and a listed path with those sites has
    its product."""
    products, sites = _listed(res, name, dag, cp)
    assert any(math.isclose(p, cp.value, rel_tol=1e-9) for p in products), (cp, products)
    assert _site_tuples(cp) == sites
    assert np.isclose(groups[tuple(sites)], cp.value, rtol=1e-9, atol=0).any()


def _site_tuples(cp) -> list[tuple]:
    return [(s.role, s.layer, s.head_index, s.position, s.input, s.from_position)
            for s in cp.steps]  # fmt: skip


@pytest.mark.parametrize("seed", ["x", "structural"])
@pytest.mark.parametrize("name", list(TINY))
def test_best_path_matches_enumeration(name, seed):
    res = result(name)
    products, groups, dag = listing(name, seed)
    (best,) = circuit(res).top_paths(seed=seed)
    want = products[np.argmax(np.abs(products))]
    assert math.isclose(best.value, want, rel_tol=1e-9), (best.value, want)
    assert best.rank == 1 and best.semiring == MP.name
    _check_listed(res, name, groups, dag, best)
    assert best.steps[0].role == "embedding" and best.steps[-1].role == "target"


@pytest.mark.parametrize("seed", ["x", "structural"])
@pytest.mark.parametrize("name", list(TINY))
def test_k_best_paths_match_enumeration(name, seed):
    res = result(name)
    products, groups, dag = listing(name, seed)
    k = 4
    got = circuit(res).top_paths(k, seed=seed)
    assert [p.rank for p in got] == list(range(1, k + 1))
    want = products[np.argsort(-np.abs(products), kind="stable")[:k]]
    np.testing.assert_allclose([p.value for p in got], want, rtol=1e-9)
    heads = 0
    for cp in got:
        assert cp.semiring == TOPK.name
        _check_listed(res, name, groups, dag, cp)
        heads += sum(s.role == "head" for s in cp.steps)
    if name == "norm":  # (the others' four best paths skip the heads)
        assert heads


def test_attention_moves_paths_between_positions():
    """The 16 best paths of the one-layer model, each checked against the listing: some
    enter a head by its value input at another position than the head's."""
    res = result("one")
    _, groups, dag = listing("one", "x")
    got = circuit(res).top_paths(16)
    moved = [
        s for cp in got for s in cp.steps if s.role == "head" and s.position != s.from_position
    ]
    assert moved and {s.input for s in moved} <= {"k", "v"}, [cp.compact() for cp in got]
    for cp in got:
        _check_listed(res, "one", groups, dag, cp)


def test_padding_starts_no_path():
    res = result("one")
    _, groups, _ = listing("one", "x")
    mask = [1, 0, 1]
    kept = np.concatenate([p for sites, p in groups.items() if mask[sites[0][3]]])
    got = circuit(res, mask=mask).top_paths(5)
    want = kept[np.argsort(-np.abs(kept), kind="stable")[:5]]
    np.testing.assert_allclose([p.value for p in got], want, rtol=1e-9)
    assert all(cp.steps[0].position != 1 for cp in got)
    tokens = {s.token for cp in got for s in cp.steps if s.position == 1}
    assert tokens <= {""}  # a padding position is never named by its token


def test_table_and_json():
    c = circuit(result("norm"))
    got = c.top_paths(3)
    frame = got.to_frame()
    assert list(frame.columns) == ["rank", "value", "step", "role", "layer", "head_index",
                                   "position", "token", "input", "from_position", "node",
                                   "index", "running"]  # fmt: skip
    assert len(frame) == sum(len(cp.steps) for cp in got)
    assert list(frame.groupby("rank").value.first()) == [cp.value for cp in got]
    back = json.loads(got.to_json())
    assert [d["rank"] for d in back] == [1, 2, 3]
    assert back[0]["steps"][-1]["role"] == "target"
    assert back[0]["value"] == got[0].value
    assert math.isclose(back[0]["path"]["value"] * back[0]["seed"], got[0].value)
    assert "→ target" in repr(got) and got[0].compact().startswith("embedding@")


def test_refusals():
    c = circuit(result("one"))
    with pytest.raises(InputError, match=r"sbp\.TopK\(17\)"):
        c.top_paths(17)  # the pass has TopK(16)
    with pytest.raises(InputError, match="MaxProduct gives one path"):
        c.top_paths(2, semiring=MP)
    with pytest.raises(InputError, match="number of paths"):
        c.top_paths(0)
    with pytest.raises(InputError, match="seed"):
        c.top_paths(seed="baseline")
    only_mp = circuit(result("one", (MP,)))
    with pytest.raises(InputError, match=r"semirings=\[\.\.\., sbp\.TopK\(2\)\]"):
        only_mp.top_paths(2)
    with pytest.raises(InputError, match="not in this circuit's pass"):
        only_mp.top_paths(1, semiring=sbp.TopK(1))
    tables = sbp.Circuit(c.nodes)
    with pytest.raises(InputError, match="made from tables"):
        tables.top_paths()
