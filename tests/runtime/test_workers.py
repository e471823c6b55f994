"""runtime/workers.py: one worker per stage this process runs, its behaviours chosen from the
spec once; one optimizer per stage over the parameters it owns."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pipecompile
from pipecompile.capture.capture import capture
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime.spec import RuntimeSpec
from pipecompile.runtime.workers import stage_optimizers, stage_workers
from pipecompile.schedule.messages import gradient_values
from pipecompile.schedule.schedules import make_schedule

M = 2


def _program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                          nn.Linear(6, 2))
    linear = linearize(capture(model, (torch.randn(4, 4),), method="fx"), granularity="layer")
    return split(linear, (0, 2, linear.num_blocks), ["cpu", "cpu"])


def test_each_own_stage_gets_a_worker_with_its_recomputation_and_the_last_the_loss():
    program = _program()
    spec = RuntimeSpec(microbatches=M, loss_fn=lambda out, y: out.sum(),
                       checkpoint=frozenset({0}))
    workers = stage_workers(program, make_schedule("1f1b", 2, M), spec, (0, 1),
                            gradient_values(program))
    assert sorted(workers) == [0, 1]
    assert [workers[s].checkpoint for s in (0, 1)] == [True, False]
    assert workers[0].loss is None and workers[1].loss is not None
    assert workers[1].loss.scale == 1.0 / M  # the mean over a step's micro-batches
    only_last = stage_workers(program, make_schedule("1f1b", 2, M), spec, (1,),
                              gradient_values(program))
    assert sorted(only_last) == [1]


def test_a_zero_bubble_schedule_splits_the_workers_backward():
    program = _program()
    workers = stage_workers(program, make_schedule("zb-h1", 2, M),
                            RuntimeSpec(microbatches=M, loss_fn=lambda out, y: out.sum()),
                            (0, 1), gradient_values(program))
    assert all(w.split_weights for w in workers.values())


def test_compiled_stages_with_an_asynchronous_schedule_are_refused():
    program = _program()
    spec = RuntimeSpec(microbatches=M, loss_fn=lambda out, y: out.sum(), compile_stages=True,
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(pipecompile.ConfigError, match="compile_stages=False"):
        stage_workers(program, make_schedule("pipedream", 2, M), spec, (0, 1),
                      gradient_values(program))


def test_one_optimizer_per_own_stage_over_its_parameters():
    program = _program()
    made = []

    def sgd(params):
        made.append(len(params))
        return torch.optim.SGD(params, lr=0.1)

    assert stage_optimizers(program, None, (0, 1)) == {}
    optimizers = stage_optimizers(program, sgd, (0, 1))
    assert sorted(optimizers) == [0, 1] and made == [2, 4]  # one Linear, then two
    assert sorted(stage_optimizers(program, sgd, (1,))) == [1]
