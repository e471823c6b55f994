"""measure/stages: the split stages timed as the runtime's workers run them, on one micro-batch,
leaving gradients, buffers and the random state as they were."""

from __future__ import annotations

import torch
import torch.nn as nn

from pipecompile.capture.capture import capture
from pipecompile.measure.stages import loss_runs, measure_stages, thread_efficiency
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime.stage_worker import LossSpec
from pipecompile.schedule.messages import gradient_values


def _program_and_values():
    """A two-stage float64 MLP with a batch-norm buffer, and every value on a micro-batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 32),
                          nn.Tanh(), nn.Linear(32, 4)).double()
    x = torch.randn(16, 8, dtype=torch.float64)
    linear = linearize(capture(model, (x,), method="fx"), granularity="layer")
    program = split(linear, (0, 3, linear.num_blocks), ["cpu", "cpu"])
    values = dict(zip(program.captured.input_names, [x]))
    first = program.stages[0]
    values.update(zip(first.outputs, first.module(*[values[n] for n in first.inputs])))
    return program, values


def test_every_action_is_timed_and_the_loss_only_where_it_runs():
    program, values = _program_and_values()
    loss = LossSpec(program.captured.unflatten_outputs, lambda out, y: ((out - y) ** 2).mean(),
                    1.0)
    target = torch.zeros(16, 4, dtype=torch.float64)
    times = measure_stages(program, values, grad_values=gradient_values(program), loss=loss,
                           target=target, repeats=2)
    assert sorted(times) == [0, 1]
    for t in times.values():
        assert min(t.forward, t.backward, t.backward_input, t.backward_weight) > 0
    assert times[0].loss == 0 and times[1].loss > 0
    only_last = measure_stages(program, values, grad_values=gradient_values(program), loss=loss,
                               target=None, stages=[1], repeats=1)
    assert list(only_last) == [1] and only_last[1].loss == 0  # no target: the loss cannot run
    assert (loss_runs(loss.loss_fn, None), loss_runs(None, None)) == (False, True)


def test_timing_leaves_gradients_buffers_and_the_random_state_alone():
    program, values = _program_and_values()
    params = [p for s in program.stages for p in s.module.parameters()]
    buffers = [b.clone() for s in program.stages for b in s.module.buffers()]
    rng = torch.get_rng_state()
    measure_stages(program, values, grad_values=gradient_values(program), loss=None, repeats=1)
    assert all(p.grad is None for p in params)
    after = [b for s in program.stages for b in s.module.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(after, buffers))  # running statistics
    assert torch.equal(torch.get_rng_state(), rng)


def test_thread_efficiency_is_a_share_of_the_ideal_speed():
    program, values = _program_and_values()
    share = thread_efficiency(program, values, grad_values=gradient_values(program),
                              device_stages=[0, 1], cores=2, repeats=2)
    assert 0.1 <= share <= 1.0
