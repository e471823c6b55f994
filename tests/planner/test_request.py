"""request.py: compile's options as one frozen, grouped `Request`, each option's own rule checked
once; recipe.py: the passes as one flat list that resolves into `plan.resolved` and never
rewrites what was asked."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import pipecompile as pc
from pipecompile.ir.compile_cache import CompileCache
from pipecompile.ir.records import Example
from pipecompile.planner.layout_options import job_options
from pipecompile.planner.options import CompileOptions
from pipecompile.planner.resolved import Resolved
from pipecompile.planner.recipe import PASSES, plan_for
from pipecompile.planner.request import AUTO, LayoutRequest, Request, ScheduleRequest


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def test_the_options_are_grouped_and_auto_stays_auto():
    loss = torch.nn.functional.mse_loss
    request = Request.of(devices=2, loss_fn=loss, capture_budget=5.0, profile=True,
                         split_points=["2"], checkpoint=False)
    assert request.layout == LayoutRequest(devices=2, split_points=("2",))
    assert request.schedule == ScheduleRequest(schedule=AUTO, microbatches=AUTO,
                                               virtual_stages=AUTO, checkpoint=False)
    assert (request.capture.method, request.capture.budget) == ("export", 5.0)
    assert request.training.loss_fn is loss and request.costs.profile is True
    assert Request.of(**request.keywords()) == request
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.layout.devices = 4  # type: ignore[misc]


def test_an_unknown_option_is_a_type_error_naming_the_closest():
    with pytest.raises(TypeError, match="unexpected keyword argument 'microbatch'; did you "
                                        "mean 'microbatches'"):
        Request.of(microbatch=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'devise'"):
        pc.compile(_model(), devise=2)


@pytest.mark.parametrize("options, message", [
    (dict(microbatches=0), "microbatches must be a positive int or 'auto', got 0"),
    (dict(microbatches=True), "microbatches must be a positive int or 'auto', got True"),
    (dict(virtual_stages="2"), "virtual_stages must be a positive int or 'auto', got '2'"),
    (dict(checkpoint="yes"), "checkpoint must be True, False or 'auto', got 'yes'"),
    (dict(data_parallel=0), "data_parallel must be a positive int or 'auto', got 0"),
    (dict(fsdp="sometimes"), "fsdp must be True, False or 'auto', got 'sometimes'"),
    (dict(vocab_parallel="rows"), "vocab_parallel must be True, False or 'auto', got 'rows'"),
    (dict(timeout=-1), "timeout must be a positive number of seconds"),
    (dict(capture_budget=0), "capture_budget must be a positive number of seconds"),
    (dict(symbolic_sizes="some"), "symbolic_sizes='some' is not supported"),
    (dict(rng="local"), "rng='local' is not a random-stream mode"),
])
def test_each_bad_value_is_refused_once_with_what_to_pass(options, message):
    with pytest.raises(pc.ConfigError, match=message):
        Request.of(**options)


def test_the_auto_micro_batch_start_is_one_rule_for_given_and_searched_layouts():
    """The largest divisor of the batch up to 4, whether the layout is given or searched."""
    for batch, start in ((6, 3), (2, 2), (7, 1), (8, 4)):
        example = Example(_model(), (torch.randn(batch, 4),), {})
        given = job_options(example, Request.of(devices=["cpu"]))
        searched = job_options(example, Request.of(devices=pc.cluster("h100", per_node=2),
                                                   data_parallel="auto"))
        assert (given.microbatches, searched.microbatches) == (start, start)
    assert job_options(None, Request.of(devices=["cpu"])).microbatches == 4


def test_the_recipe_resolves_into_plan_resolved_and_keeps_what_was_asked():
    assert [p.name for p in PASSES] == [
        "join", "capture", "probe", "search", "ranks", "schedule", "linearize", "annotate",
        "partition", "calibrate", "refine", "split", "threads", "simulate", "plan check",
        "shard", "tensor"]
    assert not any("asked" in (*p.produces, *p.updates) for p in PASSES)
    assert [p.name for p in PASSES if "resolved" in p.updates] == ["join", "search", "ranks"]
    request = Request.of(devices=["cpu", "cpu"], microbatches=2, cache=CompileCache())
    unplanned = plan_for(None, request)
    assert unplanned.passes == () and unplanned.resolved == Resolved.start(unplanned.asked)
    example = Example(_model(), (torch.randn(4, 4),), {})
    plan = plan_for(example, request)
    assert plan.request is request and plan.asked == unplanned.asked
    assert plan.asked.schedule == "gpipe" and "schedule" in plan.asked.auto  # a start value
    assert (plan.resolved.microbatches, plan.resolved.schedule) == (
        2, plan.ready.choices.schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = plan.options
    assert [w.category for w in caught] == [DeprecationWarning]
    # the old single record: what was asked with every resolved value in place
    assert isinstance(merged, CompileOptions) and merged.loss_fn is plan.asked.loss_fn
    assert (merged.schedule, merged.microbatches, merged.checkpoint, merged.devices) == (
        plan.resolved.schedule, plan.resolved.microbatches, plan.resolved.checkpoint,
        plan.resolved.devices)


def test_the_old_pass_list_path_still_answers_with_a_warning():
    import pipecompile.compiler as compiler

    with pytest.warns(DeprecationWarning, match="planner.recipe.PASSES"):
        assert compiler.PASSES is PASSES
