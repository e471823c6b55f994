"""lazy.Plans: which plan runs a call. A compiled pipeline's one plan checks every call's
inputs; a lazy one plans on its first call, reuses a kept plan for inputs it runs, plans again
for inputs none runs, and refuses to re-plan where that is unsafe (compile's `optimizer=`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile.deferred import Planner
from pipecompile.lazy import Plans


class Scaled(nn.Module):
    """An optional keyword input: two call structures, so two plans."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, scale=None):
        x = self.fc2(torch.tanh(self.fc1(x)))
        return x if scale is None else x * scale


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _planner(model, **options) -> Planner:
    return pc.compile(model, devices=2, schedule="gpipe", microbatches=2, loss_fn=_mse,
                      **options)._plans.planner


def test_a_planner_plans_once_per_call_structure_and_keeps_every_plan():
    model = Scaled().double()
    plans = Plans(planner=_planner(model))
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    first = plans.choose((x,), {}, y, where="pipe.step()")
    assert plans.choose((x[:2],), {}, y[:2], where="pipe.step()") is first  # batch symbolic
    second = plans.choose((x,), {"scale": x}, y, where="pipe.step()")
    assert second is not first and plans.kept == [first, second]
    assert plans.choose((x,), {}, y, where="pipe.step()") is first
    with pytest.raises(pc.ConfigError, match="fewer than microbatches=2"):
        plans.choose((x[:1],), {}, y[:1], where="pipe.step()")  # no plan runs it, none can
    assert len(plans.kept) == 2


def test_a_compiled_plan_is_the_only_one_and_checks_the_inputs():
    model = Scaled().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=2, schedule="gpipe", microbatches=2, loss_fn=_mse)
    plans = Plans(plan=pipe.plan)
    assert plans.choose((x,), {}, None, where="pipe()")[0] is pipe.plan
    with pytest.raises(pc.ConfigError, match="pipe.step"):
        plans.choose((x,), {"scale": x}, None, where="pipe.step()")
    assert len(plans.kept) == 1


def test_replanning_is_refused_when_new_stages_would_get_new_optimizers():
    model = Scaled().double()
    plans = Plans(planner=_planner(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)))
    x = torch.randn(4, 4, dtype=torch.float64)
    plans.choose((x,), {}, x, where="pipe.step()")
    with pytest.raises(pc.ConfigError, match="need a new plan.*optimizer="):
        plans.choose((x,), {"scale": x}, x, where="pipe.step()")
    assert len(plans.kept) == 1
