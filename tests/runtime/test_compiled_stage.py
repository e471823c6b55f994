"""runtime/compiled.py without running inductor (tests/integration/test_compile_stages.py compiles whole
pipelines): the wrapper keeps the graph's own tensors, marks the captured symbolic dims dynamic,
hands dynamo a micro-batch view without its base, and turns a dynamo failure into an error that
names the stage and the way out."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import Unsupported

from pipecompile.capture.capture import capture
from pipecompile.errors import StageExecutionError
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime import compiled


def _stage_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x = torch.randn(8, 5, 4)  # batch and sequence symbolic
    linear = linearize(capture(model, (x,), sizes="all"), granularity="layer")
    return split(linear, (0, 1, linear.num_blocks), ["cpu", "cpu"]).stages[1].module


class _Recorder:
    """Stands in for the torch.compile'd function: records what it is called with."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.fn(*args)


def test_wrapper_keeps_the_graph_tensors_and_finds_the_symbolic_dims():
    module = _stage_module()
    stage = compiled.compile_stage(module, 1)
    assert isinstance(stage, compiled.CompiledStage) and stage.index == 1
    assert compiled.compile_stage(stage, 1) is stage  # wrapping twice is a no-op
    assert [id(p) for p in stage.parameters()] == [id(p) for p in module.parameters()]
    assert [n for n, _ in stage.named_parameters()] == [f"graph.{n}" for n, _ in
                                                          module.named_parameters()]
    # one input (the first stage's output): batch and sequence dims symbolic, features fixed
    assert stage.dynamic == [(0, 1)]
    assert compiled.CompiledStage(torch.nn.Linear(2, 2), 0).dynamic is None  # no fx graph


def test_a_microbatch_view_reaches_the_compiled_function_without_its_base():
    module = _stage_module()
    stage = compiled.compile_stage(module, 1)
    recorder = _Recorder(module)
    stage.__dict__["_compiled"] = recorder
    batch = torch.randn(8, 5, 6)
    piece = batch[:2]  # a micro-batch slice: a view
    out = stage(piece)
    passed = recorder.calls[0][0]
    assert not passed._is_view() and torch.equal(passed, piece)
    assert passed._dynamo_weak_dynamic_indices == {0, 1}  # maybe_mark_dynamic on both
    torch.testing.assert_close(out, module(piece), rtol=0, atol=0)
    # a view that needs its gradient is passed as is (detaching would cut the graph)
    grad_piece = batch.clone().requires_grad_(True)[2:4]
    stage(grad_piece)
    assert recorder.calls[1][0] is grad_piece


def test_a_dynamo_failure_names_the_stage_and_compile_stages_false():
    stage = compiled.compile_stage(_stage_module(), 3)

    def fails(*args):
        raise Unsupported("call_function print in skip_files\nmore detail")

    stage.__dict__["_compiled"] = fails
    with pytest.raises(StageExecutionError) as info:
        stage(torch.randn(2, 5, 6))
    assert str(info.value) == (
        "torch.compile failed for stage 3: Unsupported: call_function print in skip_files; "
        "pass compile_stages=False to run the stage graphs uncompiled")
    assert isinstance(info.value.__cause__, Unsupported)
    assert isinstance(compiled.compiled_graphs(), int)
