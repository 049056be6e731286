"""A circuit's pass and forward pass hold only what the circuit reads.

The tapped pass of a circuit hands over D only at the nodes the circuits of its trace
read before (every node's the first time), and the forward semiring pass keeps alpha
only there; a node read that was not kept is computed again (D from the checkpoints,
alpha by the whole forward pass). Oracle: the circuit of a pass that holds every node
(the first of a trace, and one with the records emptied): every table the same bits.
"""

from __future__ import annotations

import pytest
import torch

import semiring_backprop as sbp
from semiring_backprop.engine import checkpoints

transformers = pytest.importorskip("transformers")

F64 = torch.float64
SEMIRINGS = [sbp.Real(), sbp.MaxProduct(), sbp.Entropy(), sbp.TopK(2)]


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertForMaskedLM(cfg).to(F64).eval()


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=30, n_embd=8, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).to(F64).eval()


def _lm(out):
    lp = out.logits[0, 2].log_softmax(-1)
    return lp[7] - lp[9]


def _circuit(bp, kw):
    with checkpoints.tapped():
        res = bp(kwargs=kw)
    taps = checkpoints.taps(res.values)
    held = {n for n, d in taps[1].items() if d is not None}
    reached = set(res.values.ckpt.reached)
    c = sbp.Circuit.from_result(res)
    return c, held, reached


def _equal(a, b):
    for x, y in ((a.nodes, b.nodes), (a.edges, b.edges),
                 (a.attention_edges, b.attention_edges)):  # fmt: skip
        assert x.equals(y)


def _close(x, y):
    """The same rows and labels; each semiring's values to 1e-12 (another route to the
    same sums: the last bits)."""
    values = [s.name for s in SEMIRINGS]
    assert x.drop(columns=values).equals(y.drop(columns=values))
    torch.testing.assert_close(
        torch.tensor(x[values].to_numpy()),
        torch.tensor(y[values].to_numpy()),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("build", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_later_circuits_hold_what_the_first_read_and_give_the_same_bits(build):
    model = build()
    bp = sbp.Backprop(model, _lm, SEMIRINGS)
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    first, held1, reached = _circuit(bp, kw)
    assert held1 == reached  # nothing read yet: every node's D
    second, _, _ = _circuit(bp, kw)
    third, held3, reached3 = _circuit(bp, kw)
    assert reached3 == reached
    assert len(held3) < len(reached) / 3, (len(held3), len(reached))
    _equal(second, third)
    # the first circuit of a trace finds the heads' D by another route: the last bits
    for x, y in ((first.nodes, third.nodes), (first.edges, third.edges)):
        _close(x, y)
    graph = third.result.graph
    # the forward pass kept alpha only where read: far fewer nodes than it reached
    alphas = [v[1] for v in third.result.__dict__.get("_alphas_upto", {}).values()]
    assert not alphas  # (a circuit keeps its checkpoints alone, not its stages' alphas)
    reads = graph.__dict__["_alpha_reads"]
    assert reads and all(len(r) < len(reached) / 3 for r in reads.values())


@pytest.mark.parametrize("build", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_a_node_read_that_was_not_kept_is_computed_again(build):
    """With the records emptied (the pass then holds the inputs' D alone) and alpha's
    cut to one node (the forward pass keeps alpha at the sites and that node): every
    other read is computed again, and the circuit is the same bits (a read taken as "no
    path" would zero edges and marginals). (An empty alpha record keeps every node.)"""
    model = build()
    bp = sbp.Backprop(model, _lm, SEMIRINGS)
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    _circuit(bp, kw)
    ref, _, _ = _circuit(bp, kw)
    graph = ref.result.graph
    for v in graph.__dict__["_tap_reads"].values():
        v.clear()
    for v in graph.__dict__["_alpha_reads"].values():
        one = next(iter(v))
        v.clear()
        v.add(one)
    again, held, reached = _circuit(bp, kw)
    assert len(held) < len(reached) / 3
    _equal(ref, again)
    for record in (graph.__dict__["_tap_reads"], graph.__dict__["_alpha_reads"]):
        assert all(record.values())  # read again, recorded again


@pytest.mark.parametrize("build", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_components_in_pieces_give_the_edges_of_all_at_once(build, monkeypatch):
    """The components go forward together in pieces under a budget of held values
    (``HELD_BUDGET``): one piece for all of them on this small model; one component per
    piece (a budget of 1), or two (a group cut between pieces), gives the same edges."""
    from semiring_backprop.circuits import edge_sources

    model = build()
    bp = sbp.Backprop(model, _lm, SEMIRINGS)
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    _circuit(bp, kw)
    cut = []
    real = edge_sources._pieces

    def pieces(*args):
        out = real(*args)
        cut.append([sum(len(u.comps) for u in p) for p in out])
        return out

    monkeypatch.setattr(edge_sources, "_pieces", pieces)
    whole, _, _ = _circuit(bp, kw)
    assert cut == [[7]]  # the embedding, two blocks of two heads and an MLP
    monkeypatch.setattr(edge_sources, "HELD_BUDGET", 1)
    apart, _, _ = _circuit(bp, kw)
    assert cut[1] == [1] * 7
    _close(whole.edges, apart.edges)

    def two_rows(res, srs, units):  # (pieces of two rows: the heads of a block cut)
        per = max(res.values[n].numel() for u in units for n in u.region) * 2 * len(srs)
        monkeypatch.setattr(edge_sources, "HELD_BUDGET", 2 * per)
        return pieces(res, srs, units)

    monkeypatch.setattr(edge_sources, "_pieces", two_rows)
    paired, _, _ = _circuit(bp, kw)
    assert cut[2] == [2, 2, 2, 1]  # (embedding + head; head + MLP; two heads; MLP)
    _close(whole.edges, paired.edges)


@pytest.mark.parametrize("build", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_a_new_length_on_a_symbolic_trace_reuses_which_columns_are_each_heads(build, monkeypatch):
    """Whether the heads of a block are apart (and their columns) depends on the graph,
    not on the length: on a trace with symbolic sizes, a circuit at a new length reads
    it instead of passing back from each head again, and equals a circuit that found it
    anew."""
    from semiring_backprop.circuits import edge_entries

    model = build()
    bp = sbp.Backprop(model, _lm, SEMIRINGS, dynamic=True)
    _circuit(bp, {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])})
    found = []
    real = edge_entries._heads_apart

    def counted(*args):
        found.append(1)
        return real(*args)

    monkeypatch.setattr(edge_entries, "_heads_apart", counted)
    kw = {"input_ids": torch.tensor([[3, 1, 5, 4, 8, 2, 6, 7, 9]])}
    reused, _, _ = _circuit(bp, kw)
    assert bp.traces == 1 and not found
    reused.result.graph.__dict__["_heads_apart"].clear()
    anew, _, _ = _circuit(bp, kw)
    assert found
    for x, y in ((reused.edges, anew.edges), (reused.nodes, anew.nodes)):
        _close(x, y)


def test_a_circuit_finds_its_blocks_sites_and_layout_once(monkeypatch):
    """The stages of a circuit (sites, edges, attention edges) read the blocks, sites and
    layout of one pass: each is found once per pass and options, and found anew for
    other options (``heads``) or another pass."""
    from semiring_backprop.analysis import branches
    from semiring_backprop.circuits import layout as circuit_layout
    from semiring_backprop.circuits import nodes as circuit

    model = _bert()
    bp = sbp.Backprop(model, _lm, SEMIRINGS[:2])
    kw = {"input_ids": torch.tensor([[1, 5, 4, 8, 2, 6]])}
    calls = []
    for mod, name in ((branches, "_blocks"), (circuit, "_find_sites"),
                      (circuit_layout, "_layout")):  # fmt: skip
        real = getattr(mod, name)

        def counted(*args, real=real, name=name):
            calls.append(name)
            return real(*args)

        monkeypatch.setattr(mod, name, counted)
    c, _, _ = _circuit(bp, kw)
    assert sorted(calls) == ["_blocks", "_find_sites", "_layout"]
    res = c.result  # (the pass itself: the stages read a copy of it, found on the copy)
    calls.clear()
    first = circuit.find_sites(res)
    assert circuit.find_sites(res) is first and calls == ["_find_sites", "_blocks"]
    assert circuit.find_sites(res, heads=2) is not first  # (other options: found anew)
    assert calls.count("_find_sites") == 2
    _circuit(bp, kw)  # another pass: found again
    assert calls.count("_layout") == 1
