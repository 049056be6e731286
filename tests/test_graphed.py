"""What the CUDA-graph replay of a pass relies on, checked where no GPU is needed (the
replays themselves are checked in ``tests/test_cuda.py``).

The reverse pass can hand its overflow statistics to its caller instead of reading them
(a captured pass reads them after each replay): the same error comes out of
``check_flags``; a ``Backprop`` on a CPU never captures (capture is on by default), and the off
switches are read.
"""

from __future__ import annotations

import pytest
import torch

import semiring_backprop as sbp
from battery import TINY, Chain
from semiring_backprop.engine import forward, graphed
from semiring_backprop.engine.hooks import check_flags
from semiring_backprop.engine.reverse import reverse


@pytest.mark.parametrize("semiring", [sbp.Real(), sbp.MaxProduct()], ids=lambda s: s.name)
def test_overflow_statistics_handed_out_give_the_same_error(semiring):
    bp = sbp.Backprop(Chain(), lambda y: y[0, 0], [semiring], keep=(0,))
    x = torch.full((1, 1), TINY)
    with pytest.raises(sbp.NonFiniteError, match="overflowed"):
        bp((x,))
    graph = bp.graph((x,))
    values = forward.run(graph, (x,), {})
    with pytest.raises(sbp.NonFiniteError) as direct:
        reverse(graph, values, [semiring], graph.output_node, set())
    flags: list = []
    store = reverse(graph, values, [semiring], graph.output_node, set(), flags=flags)
    assert store == {} and flags  # nothing raised: the statistics wait in `flags`
    with pytest.raises(sbp.NonFiniteError) as handed:
        check_flags(graph, flags, "pass")
    assert str(handed.value) == str(direct.value)
    assert type(handed.value) is type(direct.value)
    check_flags(graph, [], "pass")  # nothing to read: nothing raised


def test_no_capture_on_a_cpu_and_the_switches(monkeypatch):
    monkeypatch.delenv("SEMIRING_BACKPROP_CUDA_GRAPHS", raising=False)
    bp = sbp.Backprop(Chain(depth=3, scale=2.0), lambda y: y[0, 0], [sbp.Real()], keep=(0,))
    x = torch.ones(1, 1)
    for _ in range(3):
        res = bp((x,))
    assert bp.captured == [] and bp.cuda_graphs  # on by default, but not on a CPU
    bp = sbp.Backprop(bp.model, bp.output, [sbp.Real()], keep=(0,), cuda_graphs=True)
    for _ in range(3):
        res = bp((x,))
    assert bp.captured == [] and bp.cuda_graphs
    assert float(res.at(0, sbp.Real())) == 8.0
    assert graphed._key(bp.graph((x,)), [sbp.Real()], None, (x,), {}) is None  # not CUDA
    assert not sbp.Backprop(Chain(), cuda_graphs=False).cuda_graphs


@pytest.mark.parametrize(
    ("value", "on"), [("0", False), ("off", False), ("", True), ("1", True), ("on", True)]
)
def test_the_environment_variable_sets_the_default(monkeypatch, value, on):
    monkeypatch.setenv("SEMIRING_BACKPROP_CUDA_GRAPHS", value)
    assert sbp.Backprop(Chain()).cuda_graphs is on


@pytest.mark.parametrize("keep", [("inputs_embeds",), None], ids=["keep", "checkpoints"])
def test_the_recorded_step_computes_the_pass(keep):
    """What a capture records (``kept_pass`` / ``checkpointed_pass``), run here once
    without a graph and copied out as a replay's result is, gives the values and top
    paths of the pass run by ``Backprop`` from Python."""
    pytest.importorskip("transformers")
    from semiring_backprop.engine import liveness
    from semiring_backprop.engine.reverse import needed_nodes
    from semiring_backprop.result import Result, resolve_keep
    from test_branches import HF_SPECS

    spec = HF_SPECS["bert"]
    torch.manual_seed(5)
    model = spec.build().double().eval()
    emb = model.get_input_embeddings()(torch.randint(1, 20, (1, 6))).detach()
    semirings = [sbp.Real(), sbp.MaxProduct(), sbp.Entropy()]
    bp = sbp.Backprop(model, spec.output, semirings, keep=keep)
    kwargs = {"inputs_embeds": emb}
    want = bp(kwargs=kwargs)
    graph = bp.graph(kwargs=kwargs)
    needed = needed_nodes(graph, graph.output_node)
    if keep is None:
        step, copy_out = graphed.checkpointed_pass(graph, semirings, needed)
    else:
        kept = resolve_keep(graph, keep)
        step, copy_out = graphed.kept_pass(
            graph, semirings, kept, liveness.unread_values(graph, needed, kept)
        )
    with torch.no_grad():
        out, flags, confirm = step((), kwargs)
    assert graphed._fine(graph, flags, confirm)
    got = copy_out(out)
    if keep is None:
        res = Result(graph, got.values, got.store, semirings)
    else:
        values, store = got
        res = Result(
            graph, {n: v for n, v in values.items() if n in kept}, store, semirings, kept=kept
        )
    for sr in semirings:
        for a, b in zip(
            res.value("inputs_embeds", sr), want.value("inputs_embeds", sr), strict=True
        ):
            assert torch.equal(a, b)
    if keep is None:
        for sign in "+-":
            p, q = (
                res.top_path("inputs_embeds", sign=sign),
                want.top_path("inputs_embeds", sign=sign),
            )
            assert p.value == q.value and len(p) == len(q)


def test_the_second_call_with_one_layout_is_captured(monkeypatch):
    """The first call of a new trace checks it against the model and runs from Python;
    the second call with the same layout is the one captured, a new layout is counted
    apart. (On a CPU: the key is made to accept CPU tensors and the capture is a stand-in
    that runs the recorded step; the GPU's capture is in tests/test_cuda.py.)"""
    made = []

    class StandIn:
        def __init__(self, graph, semirings, kept, step, args, kwargs):
            made.append(tuple(args[0].shape))
            self.step = step

        def replay(self, args, kwargs, copy_out):
            with torch.no_grad():
                out, _flags, _confirm = self.step(args, kwargs)
            return copy_out(out)

        def describe(self):
            return {"input shapes": made[-1:]}

    def cpu_key(graph, semirings, kept, args, kwargs):
        return (id(graph), tuple(semirings), kept, tuple(tuple(a.shape) for a in args))

    monkeypatch.setattr(graphed, "available", lambda: True)
    monkeypatch.setattr(graphed, "_key", cpu_key)
    monkeypatch.setattr(graphed, "CapturedPass", StandIn)
    bp = sbp.Backprop(Chain(depth=3, scale=2.0), lambda y: y.sum(), [sbp.Real()], keep=(0,),
                      cuda_graphs=True)  # fmt: skip
    for n in (1, 2):
        x = torch.ones(n, 1)
        res = bp((x,))
        assert made == [(1, 1)] * (n - 1), "the first call of a layout runs from Python"
        res = bp((x,))
        assert made[-1] == (n, 1) and len(made) == n, "the second one is captured"
        assert torch.equal(res.at(0, sbp.Real()), torch.full((n, 1), 8.0))
    res = bp((torch.ones(2, 1),))
    assert len(made) == 2 and len(bp.captured) == 2
