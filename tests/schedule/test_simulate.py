"""simulate() against closed-form bubbles and hand-computed timelines; Timeline serialisation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.lowering import strip_communication
from pipecompile.schedule.schedules import make_schedule
from pipecompile.schedule.simulate import Event, StageCosts, Timeline, inflight, simulate

UNIFORM = StageCosts(forward=1.0, backward=2.0)  # I = W = 1
SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16, 32)]


def run(name: str, p: int, m: int, v: int = 1, costs: StageCosts = UNIFORM) -> Timeline:
    schedule = make_schedule(name, p, m, virtual_stages=v)
    return simulate(schedule, [costs] * schedule.num_stages)


# -- bubble formulas (uniform costs F=1, B=2) --------------------------------------------------


@pytest.mark.parametrize(("p", "m"), SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble(name: str, p: int, m: int) -> None:
    # Huang et al. 2019 / Narayanan et al. 2021: (p-1)/(m+p-1)
    assert run(name, p, m).bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert run(name, p, m).makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize(("d", "m"), [(d, m) for d, m in SIZES if m % d == 0])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble(d: int, m: int, v: int) -> None:
    # Megatron-LM (Narayanan et al. 2021): (p-1)/(v·m+p-1) with p = D devices
    assert run("interleaved-1f1b", d, m, v).bubble_fraction == pytest.approx(
        (d - 1) / (v * m + d - 1), abs=1e-12
    )


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if p > 1])
def test_zb_h1_bubble_below_1f1b(p: int, m: int) -> None:
    zb, ref = run("zb-h1", p, m).bubble_fraction, run("1f1b", p, m).bubble_fraction
    assert zb < ref
    if m >= p:
        # Qi et al. 2024: idle (p-1)(F+I-W) = p-1 per device instead of (p-1)(F+B) = 3(p-1)
        assert zb == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 32), (8, 16)])
def test_zb_h1_idle_time_is_a_third_of_1f1b(p: int, m: int) -> None:
    # The paper's "1/3" is the bubble size, idle seconds per device; as a fraction of the
    # makespan it approaches 1/3 as m grows.
    zb, ref = run("zb-h1", p, m), run("1f1b", p, m)
    idle = [t.makespan - t.busy(0) for t in (zb, ref)]
    assert idle[0] == pytest.approx(idle[1] / 3)
    if m >= 8 * p:
        assert zb.bubble_fraction / ref.bubble_fraction == pytest.approx(1 / 3, abs=0.03)


# -- in-flight micro-batches -------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_peak_inflight(p: int, m: int) -> None:
    assert run("gpipe", p, m).peak_inflight(0) == m
    one_f_one_b = run("1f1b", p, m)
    assert [one_f_one_b.peak_inflight(s) for s in range(p)] == [min(p - s, m) for s in range(p)]
    zb = run("zb-h1", p, m)
    assert zb.peak_inflight(0) == min(p, m)
    assert max(zb.peak_inflight(s) for s in range(p)) == min(p, m)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v",
                             "interleaved-zb"]),
       p=st.integers(1, 5), m=st.integers(1, 9), v=st.integers(2, 3),
       costs=st.lists(st.tuples(st.floats(0.1, 5.0), st.floats(0.1, 5.0), st.floats(0.1, 5.0)),
                      min_size=15, max_size=15))
def test_inflight_read_from_the_lists_equals_a_simulation_at_any_costs(
        name: str, p: int, m: int, v: int, costs: list) -> None:
    """`inflight` reads the peaks from each device's list order (no simulation): the same
    peaks a simulation at random costs per stage gives."""
    if name == "interleaved-1f1b" and m % p:
        m = p * max(1, m // p)
    kwargs = {"virtual_stages": v} if name.startswith("interleaved") else {}
    schedule = make_schedule(name, p, m, **kwargs)
    stage_costs = [StageCosts(forward=f, backward=i + w, backward_input=i, backward_weight=w)
                   for f, i, w in costs[:schedule.num_stages]]
    timeline = simulate(schedule, stage_costs)
    assert inflight(schedule) == tuple(max(1, timeline.peak_inflight(s))
                                       for s in range(schedule.num_stages))


# -- exact timelines ---------------------------------------------------------------------------


def spans(timeline: Timeline) -> dict[str, tuple[float, float]]:
    return {str(e.action): (e.start, e.end) for e in timeline.events}


def test_1f1b_p2_m2_by_hand() -> None:
    timeline = run("1f1b", 2, 2)
    got = spans(timeline)
    expected = {
        "0F0": (0, 1), "0F1": (1, 2), "0B0": (4, 6), "0B1": (7, 9),
        "1F0": (1, 2), "1B0": (2, 4), "1F1": (4, 5), "1B1": (5, 7),
    }  # fmt: skip
    assert {k: got[k] for k in expected} == expected
    assert got["1RECV_F1<0"] == (4, 4)  # the value arrived at 2, the device got there at 4
    assert got["0RECV_B1<1"] == (6, 7)  # waiting for 1B1 shows as a receive from 6 to 7
    assert timeline.makespan == 9
    assert timeline.busy(0) == timeline.busy(1) == 6
    assert timeline.bubble_fraction == pytest.approx(1 / 3)


def test_transfer_latency_belongs_to_the_sender() -> None:
    costs = [StageCosts(1, 2, send_forward=0.5), StageCosts(1, 2, send_backward=0.25)]
    for schedule in (make_schedule("1f1b", 2, 1), strip_communication(make_schedule("1f1b", 2, 1))):
        got = spans(simulate(schedule, costs))
        assert got["1F0"] == (1.5, 2.5)
        assert got["1B0"] == (2.5, 4.5)
        assert got["0B0"] == (4.75, 6.75)


def test_a_blocking_send_spends_its_message_on_the_senders_device() -> None:
    # 1F1B, p = 2, m = 2, F = 1, B = 2, 0.5 s per message each way (latency + bytes / link)
    schedule, costs = make_schedule("1f1b", 2, 2), [StageCosts(1, 2)] * 2
    transfers = {(0, 1, "F"): 0.5, (1, 0, "B"): 0.5}
    assert simulate(schedule, costs, transfers=transfers).makespan == 10
    timeline = simulate(schedule, costs, transfers=transfers, blocking=True)
    got = spans(timeline)
    assert got["0SEND_F0>1"] == (1, 1.5) and got["0F1"] == (1.5, 2.5)  # sender waits it out
    assert got["1F0"] == (1.5, 2.5)  # the value is there when the send ends
    assert got["1SEND_B0>0"] == (4.5, 5) and got["1F1"] == (5, 6)
    assert got["0B0"] == (5, 7) and got["0B1"] == (8.5, 10.5)
    assert timeline.makespan == 10.5
    assert [(t.start, t.end) for t in timeline.transfers] == [(1, 1.5), (2.5, 3), (4.5, 5),
                                                              (8, 8.5)]
    assert timeline.busy(0) == timeline.busy(1) == 6  # sends are not compute


def test_step_time_and_split_costs() -> None:
    costs = [StageCosts(1, 3, backward_input=1)]
    got = spans(simulate(make_schedule("zb-h1", 1, 1), costs, step_time=0.5))
    assert got == {"0F0": (0, 1), "0I0": (1, 2), "0W0": (2, 4), "0STEP": (4, 4.5)}


def test_stage_costs_defaults_and_checks() -> None:
    assert (UNIFORM.input_time, UNIFORM.weight_time) == (1.0, 1.0)
    assert StageCosts(1, 2, backward_weight=0.5).input_time == 1.5
    with pytest.raises(ScheduleError, match="forward must be >= 0"):
        StageCosts(-1, 2)
    with pytest.raises(ScheduleError, match="backward_weight"):
        StageCosts(1, 2, backward_input=3)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
    st.integers(1, 4),
    st.integers(1, 6),
    st.lists(
        st.builds(
            StageCosts,
            st.floats(0.1, 5),
            st.floats(0.1, 5),
            send_forward=st.floats(0, 2),
            send_backward=st.floats(0, 2),
        ),
        min_size=4,
        max_size=4,
    ),
)
def test_explicit_and_implicit_transfers_agree(
    name: str, p: int, m: int, costs: list[StageCosts]
) -> None:
    lowered = make_schedule(name, p, m)
    a, b = simulate(lowered, costs[:p]), simulate(strip_communication(lowered), costs[:p])
    assert a.makespan == pytest.approx(b.makespan)
    assert 0 <= a.bubble_fraction < 1
    assert a.makespan >= max(a.busy(d) for d in range(p)) - 1e-9
    for device in range(p):  # a device runs one action at a time, in its order
        events = [e for e in a.events if e.device == device]
        assert [e.action for e in events] == list(lowered.actions[device])
        assert all(x.end <= y.start + 1e-12 for x, y in zip(events, events[1:]))


def test_simulate_rejects_bad_input() -> None:
    with pytest.raises(ScheduleError, match="got 1 StageCosts for 2 stages"):
        simulate(make_schedule("1f1b", 2, 2), [UNIFORM])
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(Schedule.from_text("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0"), [UNIFORM] * 2)


# -- serialisation -----------------------------------------------------------------------------


def test_chrome_trace_structure() -> None:
    timeline = run("interleaved-1f1b", 2, 4, 2)
    trace = json.loads(json.dumps(timeline.to_chrome_trace()))
    events = trace["traceEvents"]
    spans_ = [e for e in events if e["ph"] == "X"]
    names = [e for e in events if e["ph"] == "M"]
    assert len(spans_) == len(timeline.events)
    assert [e["args"]["name"] for e in names] == ["device 0", "device 1"]
    for raw, event in zip(spans_, timeline.events):
        assert raw["name"] == str(event.action) and raw["cat"] == event.action.kind.value
        assert raw["pid"] == 0 and raw["tid"] == event.device
        assert raw["ts"] == pytest.approx(event.start * 1e6)
        assert raw["dur"] == pytest.approx((event.end - event.start) * 1e6)


def test_to_dict_round_trip() -> None:
    timeline = run("zb-h1", 3, 4, costs=StageCosts(1.25, 2.5, send_forward=0.1))
    data = json.loads(json.dumps(timeline.to_dict()))
    assert Timeline.from_dict(data) == timeline
    assert data["events"][0] == {"device": 0, "action": "0F0", "start": 0.0, "end": 1.25}
    with pytest.raises(ScheduleError, match="not a timeline dict"):
        Timeline.from_dict({"events": []})


def test_measured_timelines_need_not_start_at_zero() -> None:
    events = (
        Event(0, Action(0, Kind.F, 0), 100.0, 101.0),
        Event(0, Action(0, Kind.B, 0), 102.0, 104.0),
    )
    timeline = Timeline(events, num_devices=1)
    assert timeline.makespan == 4.0
    assert timeline.bubble_fraction == pytest.approx(0.25)
    assert timeline.peak_inflight(0) == 1
    with pytest.raises(ScheduleError, match="ends before it starts"):
        Event(0, Action(0, Kind.F, 0), 2.0, 1.0)


# -- devices sharing cores (threads of one process) ---------------------------------------------


def test_shared_core_timeline_by_hand() -> None:
    """1F1B, p=2, m=2, F=1, B=2 on one core: actions that overlap share it (rate 1/2 each)."""
    timeline = simulate(make_schedule("1f1b", 2, 2), [UNIFORM] * 2, cores=1)
    spans = {str(e.action): (e.start, e.end) for e in timeline.events
             if e.action.kind in (Kind.F, Kind.B)}
    assert spans == {
        "0F0": (0, 1),
        "0F1": (1, 3), "1F0": (1, 3),   # both ready at 1, each at half speed
        "1B0": (3, 5),                  # alone
        "0B0": (5, 9), "1F1": (5, 7),   # shared until 1F1 ends at 7
        "1B1": (7, 10),                 # shared with 0B0 until 9, then alone
        "0B1": (10, 12),
    }
    assert timeline.makespan == 12  # = all the work: one core is never idle here


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
def test_shared_cores_bounds(name) -> None:
    costs = StageCosts(forward=1.0, backward=2.5, backward_input=1.0)
    schedule = make_schedule(name, 4, 8)
    per_stage = [costs] * schedule.num_stages
    free = simulate(schedule, per_stage)
    work = sum(free.busy(d) for d in range(4))
    assert simulate(schedule, per_stage, cores=4).events == free.events
    spans = [simulate(schedule, per_stage, cores=c).makespan for c in (1, 2, 3)]
    assert spans[0] == pytest.approx(work)  # one core: the work, serialised
    assert spans[0] >= spans[1] >= spans[2] >= free.makespan
    assert spans[1] >= work / 2 - 1e-9
    slower = simulate(schedule, per_stage, cores=4, efficiency=0.5)
    assert slower.makespan > free.makespan


def test_shared_cores_rejects_bad_values() -> None:
    schedule = make_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="cores"):
        simulate(schedule, [UNIFORM] * 2, cores=0)
    with pytest.raises(ScheduleError, match="efficiency"):
        simulate(schedule, [UNIFORM] * 2, cores=2, efficiency=1.5)


def test_a_long_skip_message_is_charged_on_its_own_link() -> None:
    from pipecompile.schedule.lowering import add_communication
    from pipecompile.schedule.messages import Dataflow
    from pipecompile.schedule.simulate import Transfer

    links = {"a": (0, 1), "b": (1, 2), "c": (2, 3), "skip": (0, 3)}
    flow = Dataflow.from_wiring({k: v[0] for k, v in links.items()},
                                {k: (v[1],) for k, v in links.items()}, set(links), 4)
    schedule = add_communication(Schedule.from_text("0F0 0B0\n1F0 1B0\n2F0 2B0\n3F0 3B0"), flow)
    costs = [UNIFORM] * 4
    seconds = {(0, 3, "F"): 5.0, (3, 0, "B"): 0.5}
    for transfers in (seconds, lambda src, dst, d: seconds.get((src, dst, d), 0.0)):
        timeline = simulate(schedule, costs, dataflow=flow, transfers=transfers)
        got = spans(timeline)
        assert got["3RECV_F0<0"] == (0, 6)  # sent at 1, five seconds on the link
        assert got["3RECV_F0<2"] == (6, 6)  # the neighbours' chain was there at 3
        assert got["3F0"] == (6, 7) and got["3B0"] == (7, 9)
        assert got["0RECV_B0<3"] == (13, 13) and got["0B0"] == (13, 15)
        assert Transfer(0, 3, 0, "F", 1, 6) in timeline.transfers
        assert Transfer(3, 0, 0, "B", 9, 9.5) in timeline.transfers
        assert Transfer(1, 2, 0, "F", 2, 2) in timeline.transfers
    # Without per-message costs, every message costs its sender's send_forward/send_backward.
    flat = simulate(schedule, [StageCosts(1, 2, send_forward=1.0)] * 4, dataflow=flow)
    assert spans(flat)["3F0"] == (6, 7)
    again = Timeline.from_dict(timeline.to_dict())
    assert again == timeline


# -- the layout's collectives: setup on a stage's first forward, teardown at its STEP ---------


def test_setup_delays_the_first_forward_and_teardown_ends_the_stages_step() -> None:
    schedule = make_schedule("1f1b", 2, 2)
    plain = simulate(schedule, [StageCosts(1.0, 2.0)] * 2)
    timed = simulate(schedule, [StageCosts(1.0, 2.0, setup=0.5, teardown=1.0)] * 2)
    # 9 = 3 (m + p - 1); the two setups lie on the warm-up chain (0F0 -> 1F0); stage 1's
    # teardown follows its STEP and overlaps stage 0's last backward; stage 0's ends the step
    assert plain.makespan == pytest.approx(9.0)
    assert timed.makespan == pytest.approx(9.0 + 0.5 + 0.5 + 1.0)
    first = {e.action: e for e in timed.events}
    assert first[Action.parse("0F0")].duration == pytest.approx(1.5)
    assert first[Action.parse("0F1")].duration == pytest.approx(1.0)


def test_costs_refuse_negative_collectives() -> None:
    with pytest.raises(ScheduleError, match="teardown must be >= 0"):
        StageCosts(1.0, 2.0, teardown=-1.0)
