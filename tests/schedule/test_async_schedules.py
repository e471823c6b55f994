"""schedule/async_schedules.py: PipeDream and PipeDream-2BW as action lists, against hand-derived
lists and the weight-version rule the runtime relies on."""

from __future__ import annotations

import pytest

from pipecompile.errors import ScheduleError
from pipecompile.schedule import async_schedules
from pipecompile.schedule.actions import Kind, Schedule
from pipecompile.schedule.validate import validate


def rows(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, row)) for row in schedule.actions]


def test_pipedream_p2_m2_two_batches_is_the_docstring_timeline():
    schedule = async_schedules.pipedream(2, 2, batches=2)
    assert rows(schedule) == [
        "0F0 0F1 0B0 0STEP0 0F2 0B1 0STEP1 0F3 0B2 0STEP2 0B3 0STEP3",
        "1F0 1B0 1STEP0 1F1 1B1 1STEP1 1F2 1B2 1STEP2 1F3 1B3 1STEP3",
    ]
    assert schedule.name == "pipedream" and schedule.num_microbatches == 4
    assert schedule.stage_to_device == (0, 1)


def test_two_bw_updates_once_per_batch_after_its_last_backward():
    # p = 3: stage s keeps p - s - 1 forwards ahead; STEP after B1 and B3 (m = 2)
    assert rows(async_schedules.two_bw(3, 2, batches=2)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0STEP1 0B2 0B3 0STEP3",
        "1F0 1F1 1B0 1F2 1B1 1STEP1 1F3 1B2 1B3 1STEP3",
        "2F0 2B0 2F1 2B1 2STEP1 2F2 2B2 2F3 2B3 2STEP3",
    ]


@pytest.mark.parametrize("p,m,batches", [(2, 2, 2), (3, 4, 2), (4, 1, 5), (4, 3, 3)])
def test_forward_i_follows_exactly_max_0_i_minus_p_plus_s_plus_1_updates(p, m, batches):
    """PipeDream's weight-stashing formula holds because of this order (module docstring)."""
    schedule = async_schedules.pipedream(p, m, batches=batches)
    for s, row in enumerate(schedule.actions):
        updates = 0
        for action in row:
            if action.kind == Kind.STEP:
                updates += 1
            elif action.kind == Kind.F:
                assert updates == max(0, action.microbatch - p + s + 1), (s, action)
        # every micro-batch of the stream: one F, one B, one update each
        assert [a.microbatch for a in row if a.kind == Kind.STEP] == list(range(m * batches))
    validate(schedule)  # no deadlock, every dependency ordered


@pytest.mark.parametrize("p,m,batches", [(2, 3, 2), (4, 2, 3)])
def test_two_bw_steps_are_the_batches_last_microbatches(p, m, batches):
    schedule = async_schedules.two_bw(p, m, batches=batches)
    for row in schedule.actions:
        steps = [a.microbatch for a in row if a.kind == Kind.STEP]
        assert steps == [b * m + m - 1 for b in range(batches)]
        for k, action in enumerate(row):  # each STEP right after that micro-batch's B
            if action.kind == Kind.STEP:
                assert row[k - 1].kind == Kind.B and row[k - 1].microbatch == action.microbatch
    validate(schedule)


def test_async_schedules_refuse_virtual_stages_and_are_registered_by_name():
    with pytest.raises(ScheduleError, match="2bw runs one stage per device; got virtual_stages=2"):
        async_schedules.two_bw(2, 2, virtual_stages=2)
    with pytest.raises(ScheduleError, match="pipedream runs one stage per device"):
        async_schedules.pipedream(2, 2, virtual_stages=3)
    assert async_schedules.ASYNC_SCHEDULES == {"pipedream": async_schedules.pipedream,
                                               "2bw": async_schedules.two_bw}
