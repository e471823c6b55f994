"""runtime/step_driver.py: `Runtime` drives a step over its workers; a loss scale multiplies
the gradients, not the loss returned, and is the worker's own for that step only."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from pipecompile.capture.capture import capture
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime.assemble import assemble
from pipecompile.runtime.microbatch import split_microbatches
from pipecompile.runtime.spec import RuntimeSpec
from pipecompile.runtime.step_driver import Runtime
from pipecompile.schedule.schedules import make_schedule

M = 2


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _runtime():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    linear = linearize(capture(model, (x,), method="fx"), granularity="layer")
    program = split(linear, (0, 2, linear.num_blocks), ["cpu", "cpu"])
    schedule = make_schedule("1f1b", 2, M)
    return assemble(program, schedule, RuntimeSpec(microbatches=M, loss_fn=_mse)), schedule, \
        reference, x, y


def test_a_loss_scale_scales_the_gradients_not_the_loss_and_ends_with_the_step():
    runtime, schedule, reference, x, y = _runtime()
    mbs = split_microbatches((x,), {}, y, M)
    result = runtime.run(schedule, mbs, batches=1, loss_scale=8.0)
    chunks = zip(torch.chunk(x, M), torch.chunk(y, M))
    loss = torch.stack([_mse(reference(xc), yc) for xc, yc in chunks]).mean()
    loss.backward()
    torch.testing.assert_close(result.losses[0], loss, rtol=1e-12, atol=0)
    grads = [p.grad for p in runtime.parameters]
    expected = [8.0 * p.grad for p in reference.parameters()]
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=0)
    assert runtime.workers[1].loss.scale == 1.0 / M  # the scale was the step's alone
    assert runtime.workers[1].losses == {}  # the step's losses taken


def test_each_run_counts_peak_in_flight_afresh():
    runtime, schedule, _, x, y = _runtime()
    mbs = split_microbatches((x,), {}, y, M)
    first = runtime.run(schedule, mbs, batches=1)
    second = runtime.run(schedule, mbs, batches=1)
    assert first.peak_inflight == second.peak_inflight == (2, 1)


def test_what_differs_by_where_the_stages_run_is_left_to_the_subclasses():
    runtime, _, _, _, _ = _runtime()
    assert isinstance(runtime, Runtime) and runtime.training
    for name in ("transport", "mean_loss", "forward"):
        assert getattr(type(runtime), name) is not getattr(Runtime, name)
    with pytest.raises(NotImplementedError):
        Runtime.transport(runtime, [])
