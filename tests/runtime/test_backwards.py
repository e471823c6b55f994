"""runtime/backwards: each backward behaviour gives autograd's gradients: the split one's I
holds back the weight gradients until W, the compiled one's I computes them at once, the
versioned one differentiates the micro-batch's weight version and leaves the live weights."""

from __future__ import annotations

import torch
from torch import nn

from pipecompile.runtime.backwards import (
    CompiledBackward,
    FusedBackward,
    SplitBackward,
    VersionedBackward,
)
from pipecompile.runtime.forwards import KeptForward
from pipecompile.runtime.in_flight import InFlight, NoSync
from pipecompile.runtime.stage_call import StageCall
from pipecompile.runtime.stage_loss import StageLoss
from pipecompile.runtime.versions import VersionRule, WeightVersions


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3, bias=False)

    def forward(self, h):
        return (self.b(torch.tanh(self.a(h))),)


def _setup(kind, module, **extra):
    call, held, loss, sync = (StageCall(0, module, ("h",), ("y",), frozenset({"h"})),
                              InFlight(), StageLoss(None), NoSync())
    backward = kind(call, held, loss, sync, **extra)
    return backward, KeptForward(call, held, loss, backward, sync), held


def _graph_and_values():
    torch.manual_seed(0)
    h = torch.randn(5, 4, dtype=torch.float64)
    gm = torch.export.export(_Stage().double(), (h,)).module()
    return gm, h, torch.randn(5, 3, dtype=torch.float64)


def _autograd(gm, h, grad):
    gm.zero_grad(set_to_none=True)
    leaf = h.clone().requires_grad_(True)
    torch.autograd.backward(gm(leaf)[0], grad)
    want = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad(set_to_none=True)
    return leaf.grad, want


def test_split_backward_gives_input_gradients_now_and_weight_gradients_at_w():
    gm, h, grad = _graph_and_values()
    want_input, want = _autograd(gm, h, grad)
    backward, forward, held = _setup(SplitBackward, gm)
    forward(0, {"h": h})
    assert held.saved[0].store is not None  # the forward ran the deferred linears
    got = backward.inputs(0, forward.restore(0), {"y": grad})["h"]
    torch.testing.assert_close(got, want_input, rtol=1e-14, atol=0)
    assert all(p.grad is None for p in gm.parameters())  # W has not run
    backward.weights(0)
    for name, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-13, atol=0)
    assert held.saved == {}


def test_fused_backward_splits_at_the_autograd_frontier_when_asked_for_i_and_w():
    gm, h, grad = _graph_and_values()
    want_input, want = _autograd(gm, h, grad)
    backward, forward, held = _setup(FusedBackward, gm)
    forward(0, {"h": h})
    assert held.saved[0].store is None  # the plain graph ran
    got = backward.inputs(0, forward.restore(0), {"y": grad})["h"]
    assert all(p.grad is None for p in gm.parameters())
    backward.weights(0)
    torch.testing.assert_close(got, want_input, rtol=1e-14, atol=0)
    for name, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-13, atol=0)


def test_compiled_backward_computes_the_weight_gradients_in_i_and_w_only_frees():
    gm, h, grad = _graph_and_values()
    want_input, want = _autograd(gm, h, grad)
    backward, forward, held = _setup(CompiledBackward, gm)
    forward(0, {"h": h})
    got = backward.inputs(0, forward.restore(0), {"y": grad})["h"]
    torch.testing.assert_close(got, want_input, rtol=1e-14, atol=0)
    for name, p in gm.named_parameters():  # already there after I
        torch.testing.assert_close(p.grad, want[name], rtol=1e-13, atol=0)
    backward.weights(0)
    assert held.saved == {} and not held.activations.held


def test_versioned_backward_differentiates_the_stashed_version_and_updates_later():
    gm, h, grad = _graph_and_values()
    want_input, want = _autograd(gm, h, grad)
    before = {n: p.detach().clone() for n, p in gm.named_parameters()}
    versions = WeightVersions(gm, VersionRule("pipedream", 1, 0, 1),
                              lambda ps: torch.optim.SGD(ps, lr=1.0))
    versions.begin_call()
    backward, forward, held = _setup(VersionedBackward, gm, versions=versions)
    forward(0, {"h": h})
    got = backward.full(0, forward.restore(0), {"y": grad})["h"]
    torch.testing.assert_close(got, want_input, rtol=1e-14, atol=0)
    assert all(p.grad is None for p in gm.parameters())  # the live weights wait for STEP
    backward.update()
    for name, p in gm.named_parameters():  # SGD, lr 1: w - dL/dw of version 0
        torch.testing.assert_close(p.detach(), before[name] - want[name], rtol=1e-13, atol=0)
