"""makespan_floor never exceeds the simulated makespan (every generator, random per-stage
costs, overhead, setup and teardown, messages priced or not), is reached where nothing waits
(one device), and bounds 1F1B's closed form tightly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecompile.schedule.actions import Schedule
from pipecompile.schedule.bounds import fill_floor, makespan_floor
from pipecompile.schedule.lowering import add_communication
from pipecompile.schedule.messages import Dataflow
from pipecompile.schedule.schedules import SCHEDULES, TWO_STAGES_PER_DEVICE, make_schedule
from pipecompile.schedule.simulate import StageCosts, simulate

_SECONDS = st.floats(0.0, 5.0, allow_nan=False)


def _schedule(name: str, p: int, m: int) -> Schedule | None:
    v = 2 if name in TWO_STAGES_PER_DEVICE else 1
    try:
        return make_schedule(name, p, m, virtual_stages=v)
    except Exception:  # e.g. interleaving needs m to be a multiple of p
        return None


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), p=st.integers(1, 4), m=st.integers(1, 8),
       data=st.data(), overhead=st.floats(0.0, 0.5), priced=st.booleans())
def test_the_floor_never_exceeds_the_makespan(name, p, m, data, overhead, priced):
    schedule = _schedule(name, p, m)
    if schedule is None:
        return
    costs = []
    for _ in range(schedule.num_stages):
        f, i, w, setup, teardown, send = (data.draw(_SECONDS) for _ in range(6))
        costs.append(StageCosts(f, i + w, backward_input=i, backward_weight=w,
                                send_forward=send, send_backward=send, setup=setup,
                                teardown=teardown))
    transfers = ({(k.src, k.dst, d): 0.3 for k in Dataflow.chain(schedule.num_stages).links
                  for d in "FB"} if priced else None)
    timeline = simulate(schedule, costs, overhead=overhead, transfers=transfers)
    floor = makespan_floor(schedule, costs, overhead=overhead)
    assert floor <= timeline.makespan * (1 + 1e-12) + 1e-12


def test_one_device_is_its_own_work():
    schedule = make_schedule("1f1b", 1, 4)
    costs = [StageCosts(1.0, 2.0, setup=0.5, teardown=0.25)]
    assert makespan_floor(schedule, costs, overhead=0.1) == pytest.approx(
        simulate(schedule, costs, overhead=0.1).makespan) == pytest.approx(4 * 3.2 + 0.75)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 8), (8, 32)])
def test_1f1b_uniform_is_bounded_by_its_closed_form(p, m):
    """Uniform F = 1, B = 2: the makespan is (m + p - 1) x 3; the floor is the last device's
    work plus the forward before it and the backward after it: the same."""
    schedule = make_schedule("1f1b", p, m)
    costs = [StageCosts(1.0, 2.0)] * p
    assert makespan_floor(schedule, costs) == pytest.approx(3.0 * (m + p - 1))
    assert simulate(schedule, costs).makespan == pytest.approx(3.0 * (m + p - 1))


def test_a_given_dataflow_and_explicit_messages_give_the_same_floor():
    schedule = make_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)
    costs = [StageCosts(1.0 + s, 2.0) for s in range(schedule.num_stages)]
    flow = Dataflow.chain(schedule.num_stages)
    lowered = add_communication(schedule.__class__(
        schedule.name, schedule.num_stages, schedule.num_microbatches,
        schedule.stage_to_device, tuple(tuple(a for a in row if not a.is_comm)
                                        for row in schedule.actions)), flow)
    assert makespan_floor(lowered, costs, dataflow=flow) == pytest.approx(
        makespan_floor(schedule, costs))
    assert makespan_floor(schedule, costs) <= simulate(schedule, costs).makespan


def test_the_fill_floor_of_uniform_stages():
    """p equal stages of c each: under the uniform makespan (m + p - 1) c, m p c on one
    device, p c for one micro-batch; 0 for schedules that split backwards or interleave."""
    c = 1.0
    assert fill_floor("1f1b", 1, 8, 1, 4 * c) == pytest.approx(8 * 4 * c)
    assert fill_floor("gpipe", 4, 1, 1, 4 * c) == pytest.approx(4 * c)
    assert 8 * c * (1 + 3 / 16) * 0.99 < fill_floor("1f1b", 4, 8, 1, 4 * c) < (8 + 3) * c
    assert fill_floor("zb-h1", 4, 8, 1, 4 * c) == 0.0
    assert fill_floor("interleaved-1f1b", 4, 8, 2, 4 * c) == 0.0


def _reference_floor(schedule, costs, overhead=0.0, step_time=0.0):
    """makespan_floor as first written (every action's duration from simulate's `_duration`,
    the schedule's shape read again each call): the kept shapes must give the same bits."""
    from pipecompile.schedule.actions import Kind
    from pipecompile.schedule.bounds import _COMPUTE, _longest
    from pipecompile.schedule.simulate import _duration, _ends

    flow = Dataflow.infer(schedule)
    n = schedule.num_stages
    forward = [c.forward + overhead for c in costs]
    split = {a.stage for row in schedule.actions for a in row if a.kind is Kind.I}
    backward = [(c.input_time if s in split else c.backward) + overhead
                for s, c in enumerate(costs)]
    sources, graded = [[] for _ in range(n)], [[] for _ in range(n)]
    for link in flow.links:
        sources[link.dst].append(link.src)
        if link.grads:
            graded[link.dst].append(link.src)
    head, tail = _longest(sources, forward), _longest(graded, backward)
    ends = _ends(schedule)
    floor = 0.0
    for row in schedule.actions:
        work = [a for a in row if a.kind in _COMPUTE]
        if not work:
            continue
        durations = [_duration(a, costs[a.stage], step_time, overhead, ends) for a in work]
        busy = sum(durations)
        start = head[work[0].stage] if work[0].kind is Kind.F else 0.0
        k = max((k for k, a in enumerate(work) if a.kind is not Kind.STEP), default=0)
        after = sum(durations[k + 1:])
        wait = tail[work[k].stage] if work[k].kind in (Kind.B, Kind.I) else 0.0
        floor = max(floor, start + busy + max(0.0, wait - after))
    return floor


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), p=st.integers(1, 4), m=st.integers(1, 8),
       data=st.data(), overhead=st.floats(0.0, 0.5), step_time=st.floats(0.0, 2.0))
def test_the_kept_shapes_give_the_floor_bit_for_bit(name, p, m, data, overhead, step_time):
    schedule = _schedule(name, p, m)
    if schedule is None:
        return
    for _ in range(2):  # the second: the shape kept from the first
        costs = []
        for _ in range(schedule.num_stages):
            f, i, w, setup, teardown = (data.draw(_SECONDS) for _ in range(5))
            costs.append(StageCosts(f, i + w, backward_input=i, backward_weight=w,
                                    setup=setup if data.draw(st.booleans()) else 0.0,
                                    teardown=teardown))
        want = _reference_floor(schedule, costs, overhead, step_time)
        assert makespan_floor(schedule, costs, overhead=overhead, step_time=step_time) == want
