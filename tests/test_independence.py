"""per_example=True: examples of a batch that interact are refused, never mixed silently.

The oracle is torch.autograd on each example alone: where the check lets a batch
through, every example's gradient equals its own; where examples interact, the batched
pass would not, and the call raises instead.
"""

import pytest
import torch
from torch import nn

import semiring_backprop as sbp


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).eval()


class SharedCapacityMoE(nn.Module):
    """Two experts, each taking at most half of the batch; the rest pass through. Every
    row prefers expert 0, so in a batch of 4 two rows are dropped, alone none is."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.bias.copy_(torch.tensor([1.0, 0.0]))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        choice = torch.nn.functional.one_hot(self.gate(x).argmax(-1), 2)  # (batch, 2)
        capacity = max(1, x.shape[0] // 2)
        slot = choice.cumsum(0) * choice
        taken = ((slot > 0) & (slot <= capacity)).to(x.dtype)
        y = x * (1 - taken.sum(-1, keepdim=True))
        for e, expert in enumerate(self.experts):
            y = y + taken[:, e : e + 1] * expert(x)
        return self.head(y)[:, 0]


def _each_alone(model, out, x):
    grads = []
    for row in x:
        xg = row[None].clone().requires_grad_()
        (g,) = torch.autograd.grad(out(model(xg)).sum(), xg)
        grads.append(g[0])
    return torch.stack(grads)


def test_independent_examples_pass_and_each_gets_its_own_gradient():
    mlp, x = _mlp(), torch.randn(5, 4)
    out = lambda y: y[:, 1]
    r = sbp.backprop(mlp, (x,), output=out, per_example=True)
    torch.testing.assert_close(r.at(0, sbp.Real()), _each_alone(mlp, out, x))


def test_an_output_that_mixes_the_examples_is_refused():
    mlp, x = _mlp(), torch.randn(5, 4)
    with pytest.raises(sbp.InputError) as e:
        sbp.backprop(mlp, (x,), output=lambda y: y[:, 1] - y[:, 1].mean(), per_example=True)
    msg = str(e.value)
    assert "interact" in msg and "example 0" in msg and "batch of 5" in msg
    assert "one example at a time" in msg


def test_a_mixture_of_experts_with_a_capacity_shared_by_the_batch_is_refused():
    moe, x = SharedCapacityMoE().eval(), torch.randn(4, 4)
    # the batched gradient really differs from each example's own: what the check prevents
    xg = x.clone().requires_grad_()
    (together,) = torch.autograd.grad(moe(xg).sum(), xg)
    assert not torch.allclose(together, _each_alone(moe, lambda y: y, x))
    with pytest.raises(sbp.InputError, match="interact"):
        sbp.backprop(moe, (x,), output=lambda y: y, per_example=True)
    r = sbp.backprop(moe, (x[:1],), output=lambda y: y, per_example=True)  # one at a time
    torch.testing.assert_close(r.at(0, sbp.Real()), _each_alone(moe, lambda y: y, x[:1]))


def test_a_batch_norm_in_eval_mode_passes():  # running statistics: no interaction
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1)).train()
    net(torch.randn(32, 4))  # running statistics that are not the defaults
    net.eval()
    x, out = torch.randn(5, 4), lambda y: y[:, 0]
    r = sbp.backprop(net, (x,), output=out, per_example=True)
    torch.testing.assert_close(r.at(0, sbp.Real()), _each_alone(net, out, x))


def test_the_check_stays_out_of_the_way_where_it_cannot_run():
    mlp, x = _mlp(), torch.randn(3, 4)
    # an output function that indexes every row cannot run on one example: not checked
    r = sbp.backprop(mlp, (x,), output=lambda y: y[[0, 1, 2], [0, 1, 2]], per_example=True)
    assert r.at(0, sbp.Real()).shape == (3, 4)
    # a shared input (no row per example) is passed whole to every example
    shift = torch.randn(4)
    r = sbp.backprop(lambda a, s: mlp(a + s), (x, shift), output=lambda y: y[:, 0],
                     per_example=True)  # fmt: skip
    assert r.at(0, sbp.Real()).shape == (3, 4)


def test_backprop_class_checks_every_call():
    mlp = _mlp()
    bp = sbp.Backprop(mlp, output=lambda y: y[:, 0], per_example=True, dynamic=True)
    bp((torch.randn(4, 4),))
    bp((torch.randn(6, 4),))  # another batch size: one trace, checked again
    assert bp.traces == 1
    mixed = sbp.Backprop(mlp, output=lambda y: y[:, 0] - y[:, 0].mean(), per_example=True)
    for n in (4, 6):
        with pytest.raises(sbp.InputError, match=f"batch of {n} interact"):
            mixed((torch.randn(n, 4),))


def test_checked_with_keep_too():  # the pass that frees values as it goes
    mlp, x = _mlp(), torch.randn(3, 4)
    with pytest.raises(sbp.InputError, match="interact"):
        sbp.backprop(mlp, (x,), output=lambda y: y[:, 0] - y[:, 0].mean(), keep=(0,),
                     per_example=True)  # fmt: skip
