"""Lazy compilation: compile(model, devices=N, loss_fn=...) without example inputs plans on the
first call, exactly; a call the plan cannot run is planned again, plans are kept and share the
model's tensors, so the user's optimizer trains through every plan."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import pipecompile as pc
from tests.support.reference import assert_grads_equal, reference_step
from tests.integration.test_sequence_length import Branchy


class Scaled(torch.nn.Module):
    """An MLP whose keyword input `scale` is optional: two call structures."""

    def __init__(self, dim: int = 6, layers: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x if scale is None else x * scale


def _mse(out, y):
    return F.mse_loss(out, y)


def test_first_step_plans_and_matches_the_unsplit_model():
    torch.manual_seed(0)
    model = Scaled().double()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, devices=2, schedule="1f1b", microbatches=2, loss_fn=_mse)
    assert not pipe.planned and "not planned yet" in repr(pipe)
    with pytest.raises(pc.ConfigError, match="not planned yet"):
        pipe.explain()
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)  # before the plan: the same tensors
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    loss = pipe.step(x, target=y)
    assert pipe.planned and pipe.program.num_stages == 2
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, _mse, 2)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
    assert_grads_equal(pipe, ref_grads)
    opt.step()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15, msg=name)


def test_a_call_the_plan_cannot_run_is_planned_again_and_plans_are_kept():
    torch.manual_seed(0)
    model = Scaled().double()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, devices=2, schedule="gpipe", microbatches=2, loss_fn=_mse)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    scale = torch.rand(8, 1, dtype=torch.float64) + 0.5
    calls = [((x,), {}), ((x,), {"scale": scale}), ((x[:6],), {})]
    for args, kwargs in calls:
        loss = pipe.step(*args, target=y[:len(args[0])], **kwargs)
        ref_loss, ref_grads = reference_step(reference, args, kwargs, y[:len(args[0])], _mse, 2)
        assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
        assert_grads_equal(pipe, ref_grads)
        opt.step()
        ref_opt.step()
    assert len(pipe._plans.kept) == 2, ("the keyword input needed a plan; the third call "
                                        "reused the first")
    assert pipe.plan is pipe._plans.kept[0][0]
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14, msg=name)
    torch.testing.assert_close(pipe(x, scale=scale), reference(x, scale=scale))
    assert pipe.plan is pipe._plans.kept[1][0]


def test_a_size_outside_the_captured_range_gets_its_own_plan():
    torch.manual_seed(0)
    model = Branchy().double()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, devices=2, microbatches=2, schedule="1f1b", loss_fn=_mse,
                      symbolic_sizes="all")
    for seq, plans in ((6, 1), (3, 2), (7, 2)):  # 6 and 7 take the branch of lengths > 4
        x = torch.randn(4, seq, 4, dtype=torch.float64)
        y = torch.randn(4, seq, 4, dtype=torch.float64)
        loss = pipe.step(x, target=y)
        ref_loss, ref_grads = reference_step(reference, (x,), {}, y, _mse, 2)
        assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
        assert_grads_equal(pipe, ref_grads)
        assert len(pipe._plans.kept) == plans


def test_bad_options_fail_at_compile_and_replanning_with_optimizer_is_refused():
    model = Scaled().double()
    lazy = pc.compile(model, devices=2, loss_fn=_mse)
    with pytest.raises(pc.ConfigError, match=r"pipe\(\) got no tensor with a batch dimension "
                                             r"\(int\)"):
        lazy(3)
    with pytest.raises(pc.ConfigError, match="schedule='nope'"):
        pc.compile(model, devices=2, schedule="nope", loss_fn=_mse)
    pipe = pc.compile(model, devices=2, microbatches=2, schedule="gpipe", loss_fn=_mse,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    pipe.step(x, target=y)
    with pytest.raises(pc.ConfigError, match="need a new plan.*optimizer="):
        pipe.step(x, target=y, scale=torch.ones(4, 1, dtype=torch.float64))
