"""deferred.py: what a lazily compiled pipeline plans from (a call's inputs), when a kept plan
cannot run a call, and the check that an early optimizer holds the tensors the plan trains."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipecompile.capture.capture import capture
from pipecompile.deferred import Planner, cannot_run, check_same_tensors
from pipecompile.errors import ConfigError


def test_planner_plans_from_the_call_with_the_shared_table():
    model = torch.nn.Linear(4, 2)
    seen = []
    planner = Planner(model, plan_for=lambda example: seen.append(example) or "plan")
    x, y = torch.randn(3, 4), torch.zeros(3, 2)
    assert planner.plan((x,), {"scale": 2.0}, y, where="pipe.step()") == "plan"
    example = seen[0]
    assert example.model is model and example.args == (x,) and example.target is y
    assert example.kwargs == {"scale": 2.0}
    assert example.placed is planner.placed  # every plan places tensors through one table
    with pytest.raises(ConfigError, match=r"pipe\(\) got no tensor with a batch dimension "
                                          r"\(float, scale=str\)"):
        planner.plan((1.5,), {"scale": "x"}, None, where="pipe()")
    assert len(seen) == 1


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.proj(x)


class _PerSample(torch.nn.Module):
    """Adds a table of one row per sample: the batch size is fixed (a static capture)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 2)
        self.register_buffer("rows", torch.zeros(4, 2))

    def forward(self, x):
        return self.proj(x) + self.rows


def _plan(microbatches, model=None, batch=8, **capture_options):
    captured = capture(model or _Model(), (torch.randn(batch, 4),), **capture_options)
    return SimpleNamespace(program=SimpleNamespace(captured=captured),
                           resolved=SimpleNamespace(microbatches=microbatches))


def test_cannot_run_says_why_a_kept_plan_does_not_fit_a_call():
    plan = _plan(4)
    where = "pipe.step()"
    assert cannot_run(plan, (torch.randn(8, 4),), {}, where=where) is None
    assert cannot_run(plan, (torch.randn(12, 4),), {}, where=where) is None  # 4 pieces of 3
    # torch.chunk cuts 6 rows into 3 pieces of 2, not 4
    assert cannot_run(plan, (torch.randn(6, 4),), {}, where=where) == (
        "a batch of 6 does not split into its 4 micro-batches")
    assert cannot_run(plan, (torch.randn(3, 4),), {}, where=where) == (
        "a batch of 3 does not split into its 4 micro-batches")
    # a forward-only call is not split: any batch runs
    assert cannot_run(plan, (torch.randn(3, 4),), {}, where="pipe()", microbatched=False) is None
    assert "has 1 dimensions" in cannot_run(plan, (torch.randn(4),), {}, where=where)


def test_a_static_capture_runs_only_its_microbatch_size():
    plan = _plan(2, _PerSample(), batch=4, static_batch_size=4)  # micro-batches of 4
    assert not plan.program.captured.dynamic_batch
    assert cannot_run(plan, (torch.randn(8, 4),), {}, where="pipe.step()") is None
    assert cannot_run(plan, (torch.randn(12, 4),), {}, where="pipe.step()") == (
        "it was captured with static shapes for micro-batches of 4, not 6")


def test_check_same_tensors_names_the_first_moved_tensor_and_counts_the_rest():
    a, b, c = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    check_same_tensors({"a": a, "b": b}, {"a": a, "b": b, "c": c})
    with pytest.raises(ConfigError, match=r"keeps 'b' and 1 more as another tensor"):
        check_same_tensors({"a": a, "b": b, "c": c}, {"a": a, "b": b.clone()})
    with pytest.raises(ConfigError, match=r"keeps 'a' as another tensor"):
        check_same_tensors({"a": a}, {"a": None})
