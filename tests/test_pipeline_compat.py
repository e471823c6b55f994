"""pipe.stages is public again, and every name an earlier release removed answers with a
DeprecationWarning that names its new home."""

import pytest
import torch

import pipecompile as pc
from pipecompile.pipeline_compat import MOVED


@pytest.fixture(scope="module")
def pipe() -> pc.Pipeline:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    pipe = pc.compile(model, example_inputs=(torch.randn(8, 8),), devices=2, schedule="1f1b",
                      microbatches=2, loss_fn=lambda out, _: out.pow(2).mean())
    pipe.step(torch.randn(8, 8))
    return pipe


def test_stages_are_the_programs_graphs_with_names_devices_and_costs(pipe):
    stages = pipe.stages
    assert [s.index for s in stages] == [0, 1]
    assert isinstance(stages[0].module, torch.fx.GraphModule)
    assert stages[0].parameter_names == ("0.weight", "0.bias", "1.weight", "1.bias")
    assert stages[1].parameter_names == ("2.weight", "2.bias", "3.weight", "3.bias")
    assert stages[0].blocks == (0, 1) and stages[1].blocks == (2, 3)
    assert stages[0].device == torch.device("cpu")
    assert stages[1].cost is not None and stages[1].cost.params == 2 * (64 + 8)
    # the stage graphs compute the model: stage 1 of stage 0's output
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = stages[1].module(*stages[0].module(x))
        ref = pipe(x)
    assert torch.equal(out[0] if isinstance(out, tuple) else out, ref)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_warns_and_answers_as_its_new_home(pipe, name):
    where, read = MOVED[name]
    with pytest.warns(DeprecationWarning, match=where.replace("(", r"\(").replace(")", r"\)")):
        value = getattr(pipe, name)
        if callable(value) and name in ("peak_inflight", "weight_versions"):
            value = value()
    assert value == read(pipe)


def test_the_old_values(pipe):
    with pytest.warns(DeprecationWarning):
        assert pipe.microbatches == 2
        assert pipe.own_stages == (0, 1)
        assert pipe.last_schedule.name == pipe.last_step.schedule.name
        assert pipe.peak_inflight() == (2, 1)


def test_a_models_own_name_wins_over_a_pipeline_property():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stages = torch.nn.Linear(4, 4)
            self.microbatches = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.microbatches(self.stages(x))

    pipe = pc.compile(Model(), example_inputs=(torch.randn(4, 4),), devices=2,
                      loss_fn=lambda out, _: out.sum())
    assert pipe.stages.weight is dict(pipe.named_parameters())["stages.weight"]
    assert pipe.microbatches.weight is dict(pipe.named_parameters())["microbatches.weight"]
    assert len(pipe.program.stages) == 2


def test_stage_code_is_the_forward_training_runs(pipe):
    code = pipe.stage_code(1)
    assert "aten_linear_default(" in code and "read_2_weight()" in code  # direct calls
    assert "torch.ops.aten.linear.default" in pipe.stages[1].module.code  # the graph's own
    from pipecompile.runtime.direct_forward import direct_forward

    ran = direct_forward(pipe.runtime.workers[1].module, "stage 1")
    assert ran is not None and ran.source == code
