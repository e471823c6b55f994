"""persist.py at the plan level (tests/integration/test_save_load.py saves and loads whole pipelines):
`load_plan(save_plan(plan))` gives back the plan's schedule, cuts, wiring, weights, options and
the numbers its prediction is made of, and no block costs."""

from __future__ import annotations

import json

import pytest
import torch

import pipecompile as pc
from pipecompile.outputs.persist import load_plan, save_plan


def _plan():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 3))
    pipe = pc.compile(model, (torch.randn(8, 6),), devices=2, microbatches=4, schedule="1f1b",
                      loss_fn=torch.nn.functional.mse_loss)
    return pipe.plan


def test_a_saved_plan_loads_back_equal(tmp_path):
    plan = _plan()
    path = save_plan(plan, tmp_path / "saved")
    data = json.loads((tmp_path / "saved" / "plan.json").read_text())
    assert path.endswith("plan.json") and data["format"] == "pipecompile-program"
    assert data["microbatches"] == 4
    names = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert {"stage0.py", "stage1.py", "stage0.safetensors", "stage1.safetensors",
            "schedule.json"} <= set(names)
    assert not [n for n in names if n.endswith((".pt", ".pkl", ".pickle"))]  # nothing pickled

    loaded = load_plan(tmp_path / "saved", loss_fn=torch.nn.functional.mse_loss)
    assert loaded.schedule == plan.schedule
    assert loaded.resolved.microbatches == 4 and loaded.resolved.schedule == "1f1b"
    old, new = plan.program, loaded.program
    assert new.bounds == old.bounds
    assert [(s.inputs, s.outputs, s.blocks) for s in new.stages] == [
        (s.inputs, s.outputs, s.blocks) for s in old.stages]
    assert dict(new.producer) == dict(old.producer)
    assert {k: tuple(v) for k, v in new.consumers.items()} == {
        k: tuple(v) for k, v in old.consumers.items()}
    for before, after in zip(old.stages, new.stages):
        want = dict(before.module.named_parameters())
        got = dict(after.module.named_parameters())
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor) and got[name] is not tensor, name
    # the numbers the prediction is made of, and so the prediction
    assert loaded.stage_costs == plan.stage_costs
    assert loaded.overhead == plan.overhead
    assert loaded.cores == plan.cores and loaded.efficiency == plan.efficiency
    assert loaded.predicted.makespan == plan.predicted.makespan
    assert loaded.costs is None  # no per-block costs: a loaded plan cannot be re-partitioned


def test_the_loaded_stages_compute_what_the_saved_ones_did(tmp_path):
    plan = _plan()
    save_plan(plan, tmp_path)
    loaded = load_plan(tmp_path)
    x = torch.randn(2, 6)  # one micro-batch
    name = plan.program.captured.input_names[0]
    outputs = []
    for program in (plan.program, loaded.program):
        values = {name: x}
        with torch.no_grad():
            for stage in program.stages:
                values.update(zip(stage.outputs, stage.module(*[values[n] for n in stage.inputs])))
        outputs.append(values[program.stages[-1].outputs[0]])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def test_a_saved_layout_loads_back_and_a_loaded_replica_refuses_to_run_alone(tmp_path):
    """The layout is part of the plan: P x D, FSDP and the dimension inside a node come back;
    one process cannot run D replicas, so a step says what to do instead of running one."""
    from pipecompile import zoo

    model = zoo.GPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    x = torch.randint(0, 64, (8, 16))
    pipe = pc.compile(model, (x,), devices=pc.cluster("h100", nodes=1, per_node=2),
                      data_parallel="auto", loss_fn=zoo.lm_loss)
    assert pipe.layout.data_parallel > 1  # a model this small: replicas, not stages
    pipe.save(tmp_path)
    back = pc.load(tmp_path, loss_fn=zoo.lm_loss)
    assert back.layout == pipe.layout
    assert f"layout {pipe.layout}" in str(back)
    with pytest.raises(pc.ConfigError, match=f"{pipe.layout.data_parallel} data-parallel replicas"):
        back.step(x, target=x)


class _Dropped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x)))).sum(-1)


def test_a_loaded_pipeline_draws_the_same_per_microbatch_masks(tmp_path):
    """rng="per-microbatch" survives save/load: the option is saved, and the reloaded stage
    graphs keep their seeded calls (the loader used to trace through them, so the loaded
    pipeline drew from the global generator and its losses differed)."""
    torch.manual_seed(0)
    model, x, y = _Dropped(), torch.randn(8, 8), torch.zeros(8)
    options = dict(loss_fn=torch.nn.functional.mse_loss, devices=2, microbatches=2,
                   schedule="gpipe", rng="per-microbatch", rng_seed=3)
    pipe = pc.compile(model, (x,), **options)
    pipe.save(tmp_path / "saved")
    loaded = pc.load(tmp_path / "saved", loss_fn=torch.nn.functional.mse_loss)
    assert (loaded.plan.asked.rng, loaded.plan.asked.rng_seed) == ("per-microbatch", 3)
    for step in range(2):
        torch.manual_seed(100 + step)  # the global generator must not matter
        want = pipe.step(x, target=y)
        torch.manual_seed(200 + step)
        got = loaded.step(x, target=y)
        assert float(got) == float(want)
    assert float(pipe.step(x, target=y)) != float(want)  # each step draws new masks
