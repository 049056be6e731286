"""A pass with ``keep=None`` holds checkpoints, not every node (:mod:`checkpoints`).

Oracle: the same pass holding every node (``checkpoints.ENABLED = False``, how every
pass ran before checkpoints). Every node's forward value and every semiring's D, read
through the checkpoints (each segment computed again), must be the same bits; so must
top paths, top-k paths and branch tables. And what the checkpointed result holds must
be a fraction of what the full one does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import semiring_backprop as sbp
from semiring_backprop.engine import checkpoints

transformers = pytest.importorskip("transformers")

F64 = torch.float64
SEMIRINGS = [
    sbp.Real(),
    sbp.MaxProduct(),
    sbp.MaxProduct("tensor"),
    sbp.Entropy(),
    sbp.MaxAbs(),
    sbp.LogAbs(),
    sbp.TopK(2),
]


def _bert(layers=2, hidden=8):
    cfg = transformers.BertConfig(
        vocab_size=30, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertForMaskedLM(cfg).to(F64).eval()


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=30, n_embd=8, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).to(F64).eval()


def _lm(out):
    lp = out.logits[0, 2].log_softmax(-1)
    return lp[7] - lp[9]


def _pair(build, semirings, monkeypatch, ids=None):
    model = build()
    ids = torch.tensor([[1, 5, 4, 8, 2, 6]]) if ids is None else ids
    kw = {"input_ids": ids}
    ck = sbp.backprop(model, kwargs=kw, output=_lm, semirings=semirings, reuse=False)
    monkeypatch.setattr(checkpoints, "ENABLED", False)
    full = sbp.backprop(model, kwargs=kw, output=_lm, semirings=semirings, reuse=False)
    monkeypatch.setattr(checkpoints, "ENABLED", True)
    assert isinstance(ck._store, checkpoints._Store) and isinstance(full._store, dict)
    return ck, full


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, list | tuple | checkpoints._Row):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("build", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_every_value_and_d_is_the_full_passs(build, monkeypatch):
    ck, full = _pair(build, SEMIRINGS, monkeypatch)
    lay = ck._store.ckpt.layout
    assert len(lay.bounds) > 3  # really cut into segments
    # two traces of one model: the same nodes in the same order
    for mine, node in zip(ck.graph.nodes, full.graph.nodes, strict=True):
        assert mine.name == node.name
        assert (node in full.values) == (mine in ck.values), node
        if node in full.values:
            _same(ck.values[mine], full.values[node])
        assert (node in full._store) == (mine in ck._store), node
        if node in full._store:
            _same(ck._store[mine], full._store[node])


def test_paths_and_branch_tables_are_the_full_passs(monkeypatch):
    ck, full = _pair(_bert, [sbp.Real(), sbp.MaxProduct(), sbp.Entropy(), sbp.TopK(3)],
                     monkeypatch)  # fmt: skip
    for token in range(6):
        src = ("bert.embeddings", (0, token))
        assert ck.top_path(src).to_dict() == full.top_path(src).to_dict()
        assert ck.top_path(src, sign="-").to_dict() == full.top_path(src, sign="-").to_dict()
        mine = [p.to_dict() for p in ck.top_paths(src, 3)]
        assert mine == [p.to_dict() for p in full.top_paths(src, 3)]
    for sr in (sbp.MaxProduct(), sbp.Entropy()):
        a = ck.branches("bert.encoder.layer.1:input", sr)
        b = full.branches("bert.encoder.layer.1:input", sr)
        assert a.equals(b)
    assert ck.layer_table().equals(full.layer_table())


def _held_bytes(*objs) -> int:
    seen, total, todo = set(), 0, list(objs)
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            key = o.untyped_storage().data_ptr()
            if key not in seen and o.numel() and o.stride() != (0,) * o.dim():
                seen.add(key)
                total += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, list | tuple):
            todo.extend(o)
    return total


def test_a_checkpointed_pass_holds_a_fraction_of_every_node(monkeypatch):
    sr = [sbp.Real(), sbp.MaxProduct(), sbp.Entropy()]
    ck, full = _pair(lambda: _bert(layers=4, hidden=32), sr, monkeypatch,
                     ids=torch.randint(1, 30, (1, 40)))  # fmt: skip
    params = {id(t) for t in full.graph.constants.values()}
    c = ck._store.ckpt
    held = {n: v for n, v in c.held.items() if id(v) not in params}
    mine = _held_bytes(held, c.held_store, c.snaps)
    every = _held_bytes({n: v for n, v in full.values.items() if id(v) not in params},
                        full._store)  # fmt: skip
    assert mine < every / 4, (mine, every)


def test_random_ops_hold_every_node():
    """A training-mode model draws random numbers: computing a value again would give
    another one, so such a pass holds every node."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)).to(F64).train()
    x = torch.randn(3, 4, dtype=F64)
    res = sbp.backprop(model, (x,), output=lambda y: y.sum(), semirings=[sbp.MaxProduct()],
                       allow_training=True)  # fmt: skip
    assert isinstance(res._store, dict)
    assert res.top_path((0, (1,))).steps


@pytest.mark.parametrize("keep", [None, (0,)], ids=["checkpoints", "keep"])
def test_an_overflow_in_a_dropped_value_is_still_refused(keep):
    """log_ndtr's decomposition computes a branch that overflows and is then not
    selected; a pass that drops values no rule reads must still name it, as one that
    holds every value does."""
    x = torch.linspace(-50, 5, 8, dtype=F64)
    with pytest.raises(sbp.NonFiniteError, match="log1p"):
        sbp.backprop(torch.special.log_ndtr, (x,), output=lambda y: y.sum(), keep=keep)


def test_a_nodes_d_reads_as_a_list(monkeypatch):
    ck, full = _pair(_bert, [sbp.Real(), sbp.MaxProduct()], monkeypatch)
    node = next(n for n in ck._store if n.op == "call_function")
    real, maxp = ck._store[node]  # unpacks: one value per semiring
    assert len(ck._store[node]) == 2 and ck._store[node][-1] is maxp
    with pytest.raises(IndexError):
        ck._store[node][2]


def test_a_finished_checkpointed_pass_is_freed_without_the_cycle_collector():
    """Nothing of a checkpointed pass points back at itself: once its result is gone, its
    values and D are freed at once (a loop over a data set held every finished pass until
    a full garbage collection, GBs on a BERT 6L-512)."""
    import gc
    import weakref

    model = _bert()
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    gc.collect()
    gc.disable()
    try:
        res = sbp.backprop(model, kwargs=kw, output=_lm, semirings=[sbp.MaxProduct()],
                           reuse=False)  # fmt: skip
        assert isinstance(res._store, checkpoints._Store)  # the checkpointed path ran
        held = weakref.ref(res._store.ckpt)
        del res
        assert held() is None
    finally:
        gc.enable()


def test_a_tapped_pass_hands_over_the_full_passs_nodes_and_then_keeps_its_checkpoints(
    monkeypatch,
):
    """``checkpoints.tapped()`` (how ``sbp.circuit`` runs its pass): every node's value
    and D handed over are the full pass's bits; the result is still a checkpointed one
    (its segments computed again give the same), and ``untap`` lets the taps go."""
    model = _bert()
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    semirings = [sbp.Real(), sbp.MaxProduct(), sbp.TopK(2)]
    monkeypatch.setattr(checkpoints, "ENABLED", False)
    full = sbp.backprop(model, kwargs=kw, output=_lm, semirings=semirings, reuse=False)
    monkeypatch.setattr(checkpoints, "ENABLED", True)
    with checkpoints.tapped():
        tap = sbp.backprop(model, kwargs=kw, output=_lm, semirings=semirings, reuse=False)
    assert not checkpoints.tapping()
    values, store = checkpoints.taps(tap.values)
    for mine, node in zip(tap.graph.nodes, full.graph.nodes, strict=True):
        assert (node in full.values) == (mine in values), node
        if node in full.values:
            _same(values[mine], full.values[node])
        assert (node in full._store) == (mine in store), node
        if node in full._store:
            _same(store[mine], full._store[node])
            _same(tap._store[mine], full._store[node])  # through the checkpoints
    checkpoints.untap(tap.values)
    assert checkpoints.taps(tap.values) is None
    node = next(n for n in reversed(tap.graph.nodes) if n in tap._store and n in values)
    _same(tap._store[node], full._store[full.graph.nodes[tap.graph.ids[node]]])


def test_only_the_passes_of_the_tapping_thread_are_tapped():
    """A pass another thread runs while one thread is inside ``tapped()`` is not tapped
    (it holds its checkpoints alone, not every node's value); the tapping thread's is."""
    import threading

    model = _bert()
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    got = {}

    def other():
        got["tapping"] = checkpoints.tapping()
        res = sbp.backprop(model, kwargs=kw, output=_lm, semirings=[sbp.Real()], reuse=False)
        got["taps"] = checkpoints.taps(res.values)

    with checkpoints.tapped():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        mine = sbp.backprop(model, kwargs=kw, output=_lm, semirings=[sbp.Real()], reuse=False)
    assert got["tapping"] is False and got["taps"] is None
    assert checkpoints.taps(mine.values) is not None  # (a checkpointed pass: it could be)
    checkpoints.untap(mine.values)


def test_a_circuit_keeps_its_passs_checkpoints_alone():
    """``sbp.circuit`` taps its pass; the circuit it returns holds the checkpoints, not
    every node (the taps are let go), and equals the circuit of an untapped pass."""
    model = _bert()
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    c = sbp.circuit(model, kwargs=kw, output=_lm)
    assert isinstance(c.result.values, checkpoints._Values)
    assert checkpoints.taps(c.result.values) is None
    res = sbp.backprop(model, kwargs=kw, output=_lm, semirings=[sbp.Real(), sbp.MaxProduct()])
    ref = sbp.Circuit.from_result(res)
    for a, b in ((c.nodes, ref.nodes), (c.edges, ref.edges),
                 (c.attention_edges, ref.attention_edges)):  # fmt: skip
        assert a.drop(columns=["Real"]).equals(b.drop(columns=["Real"]))
        torch.testing.assert_close(torch.tensor(a.Real.to_numpy()), torch.tensor(b.Real.to_numpy()),
                                   rtol=1e-12, atol=1e-15)  # fmt: skip


def test_a_circuit_too_large_for_the_memory_is_refused_with_what_uses_less(monkeypatch):
    """The tapped pass of a circuit holds every node: where the budget cannot hold that
    it is refused before the reverse pass, saying so and what uses less (not keep=,
    which a circuit cannot use)."""
    model = _bert()
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    monkeypatch.setenv("SEMIRING_BACKPROP_MEMORY", "1000")
    with pytest.raises(sbp.OutOfMemoryError, match=r"^a circuit reads every node") as got:
        sbp.circuit(model, kwargs=kw, output=_lm)
    assert "keep=" not in str(got.value) and "one semiring" in str(got.value)
    assert not checkpoints.tapping()
