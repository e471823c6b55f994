"""Schedule generators against hand-derived action lists, and properties over many sizes.

Also covers `pipecompile.schedule.lowering` (sends/receives, I+W merging), which acts on these
schedules.
"""

from __future__ import annotations

from collections import Counter

import pytest

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Kind, Schedule
from pipecompile.schedule.lowering import (
    add_communication,
    merge_iw,
    split_backward,
    strip_communication,
)
from pipecompile.schedule.schedules import (
    SCHEDULES,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zb_h1,
)
from pipecompile.schedule.validate import validate
from pipecompile.schedule.zero_bubble import zb_v_placement


def rows(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, row)) for row in schedule.actions]


# -- golden action lists, derived by hand from each paper's rule ---------------------------------


def test_gpipe_p2_m2() -> None:
    assert rows(gpipe(2, 2)) == [
        "0F0 0F1 0B0 0B1 0STEP",
        "1F0 1F1 1B0 1B1 1STEP",
    ]


def test_1f1b_p2_m3() -> None:
    # stage s: min(p-s-1, m) warm-up forwards, then F/B pairs, then the remaining B's
    assert rows(one_f_one_b(2, 3)) == [
        "0F0 0F1 0B0 0F2 0B1 0B2 0STEP",
        "1F0 1B0 1F1 1B1 1F2 1B2 1STEP",
    ]


def test_1f1b_p3_m4() -> None:
    assert rows(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3 0STEP",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3 1STEP",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2STEP",
    ]


def test_interleaved_d2_v2_m4() -> None:
    # Device 0 holds stages 0 and 2, device 1 stages 1 and 3. Warm-up 2(D-d-1) + (v-1)D: 4 and 2.
    # Forward unit k: stage (k//2 % 2)*2 + d, micro-batch (k//4)*2 + k%2; backwards visit the
    # stages in reverse.
    schedule = interleaved_1f1b(2, 4, virtual_stages=2)
    assert schedule.stage_to_device == (0, 1, 0, 1)
    assert rows(schedule) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 0STEP 2STEP",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 1STEP 3STEP",
    ]


def test_zb_h1_p2_m3() -> None:
    # 1F1B's warm-up; step k runs (F) I(k), and from step s on one W, oldest first.
    assert rows(zb_h1(2, 3)) == [
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2 0STEP",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2 1STEP",
    ]


def test_zb_h1_p3_m4() -> None:
    assert rows(zb_h1(3, 4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3 0STEP",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3 1STEP",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3 2STEP",
    ]


def test_make_schedule_lowers_1f1b_p2_m2() -> None:
    assert rows(make_schedule("1f1b", 2, 2)) == [
        "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0STEP",
        "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1STEP",
    ]


# -- properties over stages 1..8 x micro-batches 1..32 -----------------------------------------


def _sizes(name: str) -> list[tuple[int, int, int]]:
    if name in ("zb-v", "interleaved-zb"):  # list-scheduled: fewer, smaller sizes
        vs = (2,) if name == "zb-v" else (1, 2, 3)
        return [(d, m, v) for d in range(1, 5) for m in range(1, 10) for v in vs]
    out = []
    for d in range(1, 9):
        for m in range(1, 33):
            if name != "interleaved-1f1b":
                out.append((d, m, 1))
            elif m % d == 0:
                out += [(d, m, v) for v in (1, 2, 3)]
    return out


def _max_inflight(row: tuple, stage: int) -> int:
    """Most micro-batches of ``stage`` between F and its B (or W), counted along the list."""
    count = peak = 0
    for a in row:
        if a.stage != stage:
            continue
        if a.kind is Kind.F:
            count += 1
        elif a.kind in (Kind.B, Kind.W):
            count -= 1
        peak = max(peak, count)
    return peak


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_size_validates_with_right_counts(name: str) -> None:
    split = name in ("zb-h1", "zb-v", "interleaved-zb")
    for d, m, v in _sizes(name):
        plain = SCHEDULES[name](d, m, virtual_stages=v)
        assert plain.num_stages == d * v and plain.num_devices == d
        assert plain.stage_to_device == (zb_v_placement(d) if name == "zb-v"
                                         else tuple(s % d for s in range(d * v)))
        assert not plain.has_communication
        validate(plain)
        counts = Counter((a.stage, a.kind) for row in plain.actions for a in row)
        for s in range(d * v):
            assert counts[s, Kind.F] == m and counts[s, Kind.STEP] == 1
            assert counts[s, Kind.I] == counts[s, Kind.W] == (m if split else 0)
            assert counts[s, Kind.B] == (0 if split else m)
        if name in ("1f1b", "zb-h1"):
            # 1F1B: stage s holds at most p - s; ZB-H1: at most p on every stage (Qi et al.)
            for s in range(d):
                bound = min(d if split else d - s, m)
                assert _max_inflight(plain.actions[s], s) == bound
        lowered = add_communication(plain)
        validate(lowered)
        if d > 1:
            assert lowered.has_communication
        assert strip_communication(lowered) == plain


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_make_schedule_validates(name: str) -> None:
    v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
    schedule = make_schedule(name, 4, 8, virtual_stages=v)
    validate(schedule)
    assert schedule.name == name


def test_no_sends_between_stages_on_one_device() -> None:
    schedule = add_communication(interleaved_1f1b(1, 4, virtual_stages=3))
    assert not schedule.has_communication
    validate(schedule)


def test_lowered_sends_sit_next_to_their_compute() -> None:
    for row in make_schedule("interleaved-1f1b", 2, 4, virtual_stages=2).actions:
        for before, after in zip(row, row[1:]):
            if after.kind in (Kind.SEND_F, Kind.SEND_B):
                assert before.stage == after.stage and before.microbatch == after.microbatch
            if before.kind in (Kind.RECV_F, Kind.RECV_B):
                assert before.stage == after.stage and before.microbatch == after.microbatch


# -- errors ------------------------------------------------------------------------------------


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'zb-h9'.*1f1b, 2bw, gpipe"):
        make_schedule("zb-h9", 2, 2)


def test_interleaved_needs_multiple_of_devices() -> None:
    message = r"num_microbatches \(5\) must be a multiple of num_devices \(2\); use 6"
    with pytest.raises(ScheduleError, match=message):
        make_schedule("interleaved-1f1b", 2, 5, virtual_stages=2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_one_stage_per_device_schedules_reject_virtual_stages(name: str) -> None:
    with pytest.raises(ScheduleError, match="virtual_stages must be 1 .*interleaved-1f1b"):
        make_schedule(name, 2, 4, virtual_stages=2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_sizes_must_be_positive_ints(bad: object) -> None:
    with pytest.raises(ScheduleError, match="num_microbatches must be an int >= 1"):
        make_schedule("1f1b", 2, bad)  # type: ignore[arg-type]


# -- lowering ----------------------------------------------------------------------------------


def test_add_communication_twice_is_an_error() -> None:
    with pytest.raises(ScheduleError, match="already has communication.*strip_communication"):
        add_communication(make_schedule("gpipe", 2, 2))


def test_split_then_merge_is_identity() -> None:
    plain = one_f_one_b(3, 5)
    split = split_backward(plain)
    validate(split)
    assert merge_iw(split) == plain
    assert merge_iw(add_communication(split)) == add_communication(plain)


def test_merge_iw_leaves_deferred_w() -> None:
    merged = merge_iw(zb_h1(2, 3))
    assert rows(merged) == [
        "0F0 0F1 0B0 0F2 0B1 0B2 0STEP",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2 1STEP",
    ]
    validate(merged)
    validate(merge_iw(make_schedule("zb-h1", 4, 8)))


def test_lowering_does_not_change_its_input() -> None:
    plain = zb_h1(3, 3)
    text = plain.to_text()
    add_communication(plain)
    merge_iw(plain)
    split_backward(plain)
    assert plain.to_text() == text


def test_a_schedules_properties_are_read_from_its_actions():
    from pipecompile.schedule.schedules import SCHEDULE_NAMES, properties_of

    split = {n for n in SCHEDULE_NAMES if properties_of(n).splits_backward}
    asynchronous = {n for n in SCHEDULE_NAMES if properties_of(n).asynchronous}
    assert split == {"zb-h1", "zb-v", "interleaved-zb"}
    assert asynchronous == {"pipedream", "2bw"}
    written = Schedule.from_text("0: 0F0 0I0 0W0\n")
    assert written.splits_backward and not written.asynchronous
    assert not make_schedule("1f1b", 2, 4).splits_backward


def test_schedule_properties_prefer_the_written_schedule_over_the_name():
    from pipecompile.schedule.schedules import ScheduleProperties, schedule_properties

    written = Schedule.from_text("0: 0F0 0I0 0W0\n")
    assert schedule_properties("1f1b", written) == ScheduleProperties(True, False)
    assert schedule_properties("2bw") == ScheduleProperties(False, True)
    assert schedule_properties("my-schedule") == ScheduleProperties(False, False)
