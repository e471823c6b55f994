"""Bad input gets a clear PipecompileError naming the problem and what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile import zoo
from pipecompile.ir.formats import format_bytes


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.first(x))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python branch on a tensor value: not capturable
            return self.a(x)
        return -x


def _gpt():
    return zoo.GPT(vocab=32, dim=16, layers=2, heads=2, seq=8), torch.randint(0, 32, (8, 8))


class DataDependentRoot(DataDependent):
    def forward(self, x):
        x = self.first(x)
        if x.sum() > 0:  # in the root's own code: nothing to keep opaque
            return self.gate.a(x)
        return -x


def test_capture_failure_names_the_module_and_suggests_a_fix():
    with pytest.raises(pc.CaptureError) as info:
        pc.compile(DataDependentRoot(), (torch.randn(8, 4),), devices=2, microbatches=2)
    message = str(info.value)
    assert "'<root>'" in message and "DataDependentRoot" in message
    assert "torch.cond" in message


def test_data_dependent_submodule_is_kept_opaque():
    pipe = pc.compile(DataDependent(), (torch.randn(8, 4),), devices=2, microbatches=2,
                      loss_fn=lambda out, y: out.sum())
    assert "opaque module 'gate' (Gate)" in pipe.explain()


def test_fx_capture_failure_is_a_capture_error():
    with pytest.raises(pc.CaptureError, match="symbolic_trace"):
        pc.compile(DataDependent(), (torch.randn(8, 4),), devices=2, capture="fx")


def test_more_devices_than_blocks():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(pc.PartitionError, match=r"only \d+ blocks.*use at most \d+ devices"):
        pc.compile(model, (torch.randn(8, 4),), devices=4, microbatches=2)


def test_batch_smaller_than_microbatches():
    model, x = _gpt()
    with pytest.raises(pc.ConfigError, match="fewer than microbatches=16"):
        pc.compile(model, (x,), devices=2, microbatches=16)


def test_step_batch_smaller_than_microbatches():
    model, x = _gpt()
    pipe = pc.compile(model, (x,), devices=2, microbatches=4, loss_fn=zoo.lm_loss)
    with pytest.raises(pc.ConfigError, match="cannot be split into microbatches=4"):
        pipe.step(x[:2], target=x[:2])


def test_memory_limit_nothing_fits_says_what_would():
    model, x = _gpt()
    with pytest.raises(pc.PartitionMemoryError) as info:
        pc.compile(model, (x,), devices=2, microbatches=2, memory_limit=1000)
    error = info.value
    assert error.memory_needed > 1000
    assert "(each device has 1000 B)" in str(error)
    assert f"the best placement needs {format_bytes(error.memory_needed)}" in str(error)


def test_loss_that_is_not_a_scalar():
    model, x = _gpt()
    pipe = pc.compile(model, (x,), devices=2, microbatches=2,
                      loss_fn=lambda out, y: (out - 1).pow(2))  # forgot .mean()
    with pytest.raises(pc.LossError, match="shape .*not a scalar tensor"):
        pipe.step(x, target=x)


def test_unknown_schedule_and_bad_split_points():
    model, x = _gpt()
    with pytest.raises(pc.ConfigError, match="not supported"):
        pc.compile(model, (x,), devices=2, schedule="wavefront")
    with pytest.raises(pc.ConfigError, match="names no block"):
        pc.compile(model, (x,), devices=2, split_points=["layers.9"])


def test_split_points_override_the_partitioner():
    model = zoo.GPT(vocab=32, dim=16, layers=4, heads=2, seq=8)
    x = torch.randint(0, 32, (8, 8))
    pipe = pc.compile(model, (x,), devices=2, split_points=["layers.3"], loss_fn=zoo.lm_loss)
    names = [pipe.program.linear.blocks[b].name for b in pipe.program.stages[1].blocks]
    assert names[0] == "layers.3"


def test_stage_exception_names_stage_and_action():
    model, x = _gpt()

    def loss_fn(out, y):
        raise RuntimeError("boom")

    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=loss_fn)
    with pytest.raises(pc.StageExecutionError, match=r"stage 1 failed in action 1F0.*boom"):
        pipe.step(x, target=x)
