"""What the CUDA-graph replay of a pass relies on, checked where no GPU is needed (the
replays themselves are checked in ``tests/test_cuda.py``).

The reverse pass can hand its overflow statistics to its caller instead of reading them
(a captured pass reads them after each replay): the same error comes out of
``check_flags``; a ``Backprop`` on a CPU never captures, and the off switches are read.
"""

from __future__ import annotations

import pytest
import torch

import semiring_backprop as sbp
from battery import TINY, Chain
from semiring_backprop.engine import forward, graphed
from semiring_backprop.engine.reverse import check_flags, reverse


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


def test_no_capture_on_a_cpu_and_the_switches():
    bp = sbp.Backprop(Chain(depth=3, scale=2.0), lambda y: y[0, 0], [sbp.Real()], keep=(0,))
    x = torch.ones(1, 1)
    for _ in range(3):
        res = bp((x,))
    assert bp.captured == [] and bp.cuda_graphs
    assert float(res.at(0, sbp.Real())) == 8.0
    assert graphed._key(bp.graph((x,)), [sbp.Real()], None, (x,), {}) is None  # not CUDA
    assert not sbp.Backprop(Chain(), cuda_graphs=False).cuda_graphs


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("1", True), ("", True)])
def test_the_environment_variable_sets_the_default(monkeypatch, value, on):
    monkeypatch.setenv("SEMIRING_BACKPROP_CUDA_GRAPHS", value)
    assert sbp.Backprop(Chain()).cuda_graphs is on
