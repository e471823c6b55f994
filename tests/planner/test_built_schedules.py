"""BuiltSchedules (pipecompile/planner/built_schedules.py): each schedule built once with its
in-flight peaks; a relowered schedule's dependencies computed only when asked for."""

from __future__ import annotations

from pipecompile.planner.built_schedules import BuiltSchedules
from pipecompile.schedule.lowering import add_communication, relower
from pipecompile.schedule.messages import Dataflow
from pipecompile.schedule.schedules import SCHEDULES
from pipecompile.schedule.simulate import inflight
from pipecompile.schedule.validate import dependencies


def test_a_schedule_is_built_once_with_its_peaks_and_shared_through_the_memo():
    memo: dict = {}
    built = BuiltSchedules(memo)
    schedule, peaks = built.get("1f1b", 3, 6, 1)
    assert schedule == add_communication(SCHEDULES["1f1b"](3, 6))
    assert peaks == inflight(schedule) == (3, 2, 1)
    again = BuiltSchedules(memo)  # another layout's search, the same memo
    assert again.get("1f1b", 3, 6, 1)[0] is schedule


def test_dependencies_of_a_relowered_schedule_are_computed_on_first_need_and_kept():
    built = BuiltSchedules()
    links = Dataflow.chain(4)
    lowered, deps = built.lowered("interleaved-1f1b", 2, 4, 2, links)
    assert lowered == relower(built.get("interleaved-1f1b", 2, 4, 2)[0], links)
    first = deps()
    assert first == dependencies(lowered, links)
    assert built.lowered("interleaved-1f1b", 2, 4, 2, links)[1]() is first  # kept
