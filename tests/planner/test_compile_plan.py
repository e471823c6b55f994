"""Compiler-level planning: partition quality on a heterogeneous model, refinement, reports."""

from __future__ import annotations

import re

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.passes.partition import uniform_bounds
from pipecompile.schedule.simulate import simulate


def _heavy_head_gpt():
    # A large vocabulary makes the embedding + LM head much heavier than one layer.
    # The head must outweigh several layers whatever the measured matmul rate makes of FLOPs.
    model = zoo.GPT(vocab=32768, dim=64, layers=12, heads=2, seq=16, tied=False)
    return model, torch.randint(0, 32768, (8, 16))


def test_heavy_lm_head_gets_fewer_layers_and_balanced_stages():
    model, x = _heavy_head_gpt()
    pipe = pc.compile(model, (x,), devices=4, microbatches=4, loss_fn=zoo.lm_loss)
    counts = [len(s.blocks) for s in pipe.program.stages]
    assert counts[-1] < max(counts), counts  # the stage with the LM head holds fewer blocks
    program = pipe.program
    blocks = program.linear.num_blocks
    problem_times = [b.time for b in _costs(pipe)]
    ours = max(sum(problem_times[a:b]) for a, b in zip(program.bounds, program.bounds[1:]))
    times = [s.cost.forward_time + s.cost.backward_time for s in pipe.program.stages]
    assert abs(max(times) - ours) <= 1e-9 * ours  # the same numbers compile planned with
    equal = max(sum(problem_times[a:b]) for a, b in zip(uniform_bounds(blocks, 4),
                                                        uniform_bounds(blocks, 4)[1:]))
    assert ours < equal, (ours, equal)
    lower = max(sum(problem_times) / 4, max(problem_times))
    assert ours <= 1.35 * lower, (ours, lower)


def _costs(pipe):
    """The block costs compile planned with (analytic, calibrated by the planning probe)."""
    assert pipe.plan.costs.blocks and len(pipe.plan.costs.blocks) == pipe.program.linear.num_blocks
    return pipe.plan.costs.blocks


def test_blocks_are_refined_when_stages_outnumber_layers():
    model = zoo.GPT(vocab=32, dim=16, layers=1, heads=2, seq=8)
    x = torch.randint(0, 32, (8, 8))
    pipe = pc.compile(model, (x,), devices=6, microbatches=2, loss_fn=zoo.lm_loss)
    assert len(pipe.program.stages) == 6
    assert pipe.program.linear.granularity != "layer"


def test_profile_measures_block_times():
    model = zoo.GPT(vocab=32, dim=16, layers=2, heads=2, seq=8)
    x = torch.randint(0, 32, (8, 8))
    before = [b.detach().clone() for b in model.buffers()]
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=zoo.lm_loss, profile=True)
    assert "measured" in pipe.explain()
    assert all(s.cost.forward_time > 0 for s in pipe.program.stages)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


def test_passes_advance_a_frozen_plan_and_record_only_what_ran():
    from dataclasses import FrozenInstanceError, replace

    import pytest

    from pipecompile.planner.options import CompileOptions
    from pipecompile.ir.devices import DeviceSpec
    from pipecompile.planner.plan import Pass, Plan, run_passes

    start = Plan(CompileOptions(devices=(DeviceSpec(),), microbatches=2, schedule="gpipe"))
    passes = (Pass("first", lambda plan, example: (replace(plan, cores=3), "three cores"),
                   produces=("cores",)),
              Pass("skipped", lambda plan, example: None),
              Pass("second", lambda plan, example: (replace(plan, efficiency=0.5), "half speed"),
                   requires=("cores",), produces=("efficiency",)))
    plan = run_passes(start, passes, example=None)
    assert (plan.cores, plan.efficiency) == (3, 0.5)
    assert [(r.name, r.summary) for r in plan.passes] == [("first", "three cores"),
                                                          ("second", "half speed")]
    assert all(r.seconds >= 0 for r in plan.passes)
    assert start.passes == () and start.cores is None  # the input plan is unchanged
    with pytest.raises(FrozenInstanceError):
        plan.cores = 1


def test_compile_records_its_passes_in_order():
    model = zoo.GPT(vocab=32, dim=16, layers=2, heads=2, seq=8)
    pipe = pc.compile(model, (torch.randint(0, 32, (8, 8)),), devices=2, microbatches=2,
                      loss_fn=zoo.lm_loss, granularity="layer")
    assert [r.name for r in pipe.plan.passes] == ["capture", "probe", "search", "schedule",
                                             "linearize", "annotate", "partition", "split",
                                             "simulate"]
    assert pipe.plan.placement.bounds == pipe.program.bounds
    # the prediction is the compiled schedule simulated with the compiled costs (not a stale
    # one from before a later pass changed them): every action once, the same times
    predicted = pipe.predicted
    again = simulate(pipe.schedule, pipe.plan.stage_costs, cores=pipe.plan.cores,
                     efficiency=pipe.plan.efficiency, transfers=pipe.plan.transfers,
                     overhead=pipe.plan.overhead)
    assert predicted.events == again.events and predicted.makespan == again.makespan
    assert sorted(map(str, (e.action for e in predicted.events))) == sorted(
        str(a) for row in pipe.schedule.actions for a in row)
    # and no shorter than the work it must do (transfers and sharing at efficiency < 1 only
    # add): every F, B, I and W costs its stage's time for it plus the fixed overhead; each
    # device runs its own actions one at a time, the devices together run at most `cores` at
    # full speed, and micro-batch 0 passes forward through every stage, then backward
    costs, overhead = pipe.plan.stage_costs, pipe.plan.overhead

    def seconds(action):
        cost = costs[action.stage]
        work = {"F": cost.forward, "B": cost.backward, "I": cost.input_time,
                "W": cost.weight_time}.get(action.kind.value)
        return 0.0 if work is None else work + overhead

    busy = [sum(map(seconds, row)) for row in pipe.schedule.actions]
    # micro-batch 0's chain: F on every stage, then B (or I) on every stage
    first = [a for row in pipe.schedule.actions for a in row
             if a.microbatch == 0 and a.kind.value in ("F", "B", "I")]
    lower = max(max(busy), sum(busy) / (pipe.plan.cores or len(busy)), sum(map(seconds, first)))
    assert 0 < lower <= predicted.makespan * (1 + 1e-9), (lower, predicted.makespan)


def test_schedule_names_are_the_generators():
    from pipecompile.schedule.async_schedules import ASYNC_SCHEDULES
    from pipecompile.schedule.schedules import ASYNC_SCHEDULE_NAMES, SCHEDULE_NAMES, SCHEDULES

    assert set(ASYNC_SCHEDULE_NAMES) == set(ASYNC_SCHEDULES)
    assert set(SCHEDULE_NAMES) == set(SCHEDULES) | set(ASYNC_SCHEDULES)
