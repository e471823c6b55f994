"""runtime/stage_modes.py: train mode runs the stage graphs, eval mode their eval-mode forms,
built once and handed to each worker through its own method."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pipecompile
from pipecompile.capture.capture import capture
from pipecompile.passes.eval_mode import eval_graph
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime.spec import RuntimeSpec
from pipecompile.runtime.stage_modes import StageModes
from pipecompile.runtime.workers import stage_workers
from pipecompile.schedule.messages import gradient_values
from pipecompile.schedule.schedules import make_schedule


def _modes(**spec):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 2))
    linear = linearize(capture(model, (torch.randn(4, 4),), method="fx"), granularity="layer")
    program = split(linear, (0, 2, linear.num_blocks), ["cpu", "cpu"])
    workers = stage_workers(program, make_schedule("1f1b", 2, 2),
                            RuntimeSpec(microbatches=2, **spec), (0, 1),
                            gradient_values(program))
    return StageModes(program, workers, RuntimeSpec(microbatches=2, **spec)), workers


def test_eval_mode_swaps_in_the_eval_graphs_once_and_train_mode_swaps_back():
    modes, workers = _modes(eval_graph=eval_graph)
    train = {i: w.module for i, w in workers.items()}
    assert modes.training
    modes.set(False)
    assert not modes.training
    evals = {i: w.module for i, w in workers.items()}
    assert all(evals[i] is not train[i] for i in train)
    x = torch.randn(3, 4)
    assert torch.equal(evals[0](x)[0], evals[0](x)[0])  # dropout off: the same twice
    modes.set(True)
    assert {i: w.module for i, w in workers.items()} == train
    modes.set(False)
    assert {i: w.module for i, w in workers.items()} == evals  # built once, kept


def test_the_mode_context_returns_to_the_mode_before():
    modes, workers = _modes(eval_graph=eval_graph)
    train = workers[1].module
    with modes.mode(training=False):
        assert not modes.training and workers[1].module is not train
    assert modes.training and workers[1].module is train


def test_eval_mode_without_the_eval_graph_pass_is_refused():
    modes, _ = _modes()
    with pytest.raises(pipecompile.ConfigError, match="eval_graph"):
        modes.set(False)
    modes.set(True)  # already in train mode: nothing to build
