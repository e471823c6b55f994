"""Profiling: a profiled step records one `PP:<action>` range per action, each holding the
operators its action ran (forward addmm under F, the backward's mm under B/I/W), with the
same values as an unprofiled step; with no profiler, `span` is one shared no-op."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import pipecompile as pc
from pipecompile.runtime import profiling
from tests.support.reference import assert_grads_equal, reference_step
from tests.support.ranges import pp_range


def _pipe(schedule, model):
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule=schedule,
                      loss_fn=torch.nn.functional.mse_loss)
    return pipe, x


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_profiled_step_has_one_range_per_action_holding_its_operators(schedule):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).double()
    reference = copy.deepcopy(model)
    pipe, x = _pipe(schedule, model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = pipe.step(x, target=x)
    events = prof.events()
    ranges = Counter(e.name for e in events if e.name.startswith("PP:"))
    actions = [f"PP:{a}" for row in pipe.schedule.actions for a in row]
    assert ranges == Counter(actions) and set(ranges.values()) == {1}
    # each forward ran two Linear layers (addmm); the backward's matrix products sit under B or
    # I/W, the loss's backward under the last stage's
    owners = Counter((e.name, pp_range(e)) for e in events
                     if e.name in ("aten::addmm", "aten::mm", "aten::mse_loss_backward"))
    for stage in (0, 1):
        for mb in (0, 1):
            assert owners[("aten::addmm", f"PP:{stage}F{mb}")] == 2
            backward = [f"PP:{stage}{k}{mb}" for k in ("B", "I", "W")]
            assert sum(owners[("aten::mm", b)] for b in backward) >= 2
    assert any(owners[("aten::mse_loss_backward", f"PP:1{k}0")] for k in ("B", "I"))
    assert not any(name is None for (op, name) in owners if op == "aten::addmm")
    # the profiled step computed what the unsplit model computes
    ref_loss, ref_grads = reference_step(reference, (x,), {}, x, torch.nn.functional.mse_loss, 2)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
    assert_grads_equal(pipe, ref_grads)


def test_without_a_profiler_span_is_one_shared_no_op():
    assert not profiling.profiling()
    assert profiling.span("PP:0F0") is profiling.span("PP:1B3")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert profiling.profiling() and profiling.thread_local_session()
        assert profiling.span("PP:0F0") is not profiling.span("PP:0F0")


def test_range_names_follow_torch_pipelining():
    from pipecompile.schedule.actions import Action

    assert profiling.range_name(Action.parse("0F3")) == "PP:0F3"
    assert profiling.range_name(Action.parse("2SEND_F1>3")) == "PP:2SEND_F1>3"
