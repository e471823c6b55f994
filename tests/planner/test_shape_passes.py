"""The passes before the model is cut: the planning probe (its own recorded pass), the search
(over the analytic costs and the probe's numbers, measuring nothing) and its `Choices`."""

from __future__ import annotations

import pytest
import torch

import pipecompile as pc
import pipecompile.planner.shape_passes as choose
import pipecompile.planner.decisions as planning
from pipecompile.planner.resolved import Choices
from pipecompile.ir.compile_cache import CompileCache
from pipecompile.planner.recipe import PASSES
from pipecompile.ir.records import Example
from pipecompile.planner.options import resolve_options
from pipecompile.planner.plan import Plan, run_passes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _loss(out, y):
    return (out - y).pow(2).mean()


def _options(example: Example, **given):
    asked = dict(devices=2, microbatches="auto", schedule="auto", virtual_stages="auto",
                 checkpoint="auto", memory_limit=None, bandwidth=None, data_parallel=1,
                 timeout=300.0, split_points=None, loss_fn=_loss, cache=CompileCache())
    return resolve_options(example, **{**asked, **given})


def test_the_probe_is_a_recorded_pass_and_the_search_after_it_measures_nothing(monkeypatch):
    example = Example(_model(), (torch.randn(8, 8),), {}, torch.randn(8, 8))
    names = [p.name for p in PASSES]
    probed = run_passes(Plan(_options(example)), PASSES[:names.index("probe") + 1], example)
    record = probed.passes[-1]
    assert record.name == "probe" and "measured: block times" in record.summary
    assert probed.probe is not None and probed.choices is None

    def measured(*args, **kwargs):
        raise AssertionError("the search measured this machine")

    for module, name in ((choose, "probe"), (planning, "matmul_rate"),
                         (planning, "action_overhead"), (planning, "profile_blocks")):
        monkeypatch.setattr(module, name, measured)
    search = PASSES[names.index("search")]
    searched = run_passes(probed, (search,), example)
    found = searched.search
    assert found is not None and searched.choices is not None
    best = found.best
    assert searched.choices == Choices(best.schedule, best.microbatches, best.virtual_stages,
                                       best.recompute, profile=False)
    # what the user asked is kept; plan.resolved is the asked options with the choices
    assert searched.asked == probed.asked and searched.asked.auto
    assert (searched.resolved.schedule, searched.resolved.microbatches) == (
        best.schedule, best.microbatches)


def test_a_plan_with_nothing_searched_records_why_it_was_not_probed():
    model = _model()
    pipe = pc.compile(model, (torch.randn(8, 8),), devices=2, schedule="gpipe", microbatches=2,
                      checkpoint=False, loss_fn=_loss, cache=CompileCache())
    record = next(r for r in pipe.plan.passes if r.name == "probe")
    assert "no planning probe: no searched option depends on time" in record.summary
    assert pipe.plan.probe is None
    assert pipe.plan.choices == Choices("gpipe", 2, 1, (False, False))


def test_a_meta_model_is_not_probed_and_not_profiled():
    with torch.device("meta"):
        model = _model()
    pipe = pc.compile(model, (torch.randn(8, 8),), devices=2, schedule="gpipe",
                      loss_fn=_loss, profile=True, cache=CompileCache())
    record = next(r for r in pipe.plan.passes if r.name == "probe")
    assert "no planning probe: model on the meta device" in record.summary
    assert pipe.plan.asked.profile and not pipe.plan.resolved.profile
    assert pipe.plan.choices is not None and pipe.plan.choices.profile is False


@pytest.mark.parametrize("checkpoint", [True, False])
def test_given_recomputation_is_resolved_per_stage(checkpoint):
    pipe = pc.compile(_model(), (torch.randn(8, 8),), devices=2, schedule="1f1b",
                      microbatches=4, checkpoint=checkpoint, loss_fn=_loss, cache=CompileCache())
    assert pipe.plan.choices.checkpoint == (checkpoint, checkpoint)
    assert pipe.plan.resolved.checkpoint == (checkpoint, checkpoint)
