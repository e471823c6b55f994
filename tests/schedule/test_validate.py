"""validate() catches each kind of mistake and says where and what."""

from __future__ import annotations

import re

import pytest

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Schedule
from pipecompile.schedule.schedules import SCHEDULES, make_schedule
from pipecompile.schedule.validate import dependencies, validate


def text(*rows: str, placement: str | None = None, m: int | None = None) -> Schedule:
    header = f"stage_to_device: {placement}\n" if placement else ""
    header += f"num_microbatches: {m}\n" if m else ""
    return Schedule.from_text(header + "\n".join(rows))


def edit(schedule: Schedule, device: int, old: str, new: str) -> Schedule:
    """The schedule with the actions ``old`` in device ``device``'s row replaced by ``new``."""
    rows = [" ".join(map(str, row)) for row in schedule.actions]
    assert f" {old} " in f" {rows[device]} ", (old, rows[device])
    rows[device] = " ".join(f" {rows[device]} ".replace(f" {old} ", f" {new} ").split())
    placement = " ".join(map(str, schedule.stage_to_device))
    return text(*rows, placement=placement, m=schedule.num_microbatches)


def fails(schedule: Schedule, *patterns: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    return message


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_generated_schedules_pass(name: str) -> None:
    v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
    validate(SCHEDULES[name](4, 8, virtual_stages=v))
    validate(make_schedule(name, 4, 8, virtual_stages=v))


def test_a_bad_schedule_can_be_caught_as_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"device 0, action 1 \(0F0\): duplicate"):
        validate(text("0F0 0F0 0B0", "1F0 1B0"))


# -- completeness ------------------------------------------------------------------------------


def test_missing_backward() -> None:
    schedule = edit(SCHEDULES["1f1b"](2, 2), 1, "1B1", "")
    fails(
        schedule, r"device 1: stage 1, micro-batch 1: no backward \(expected 1B1, or 1I1 and 1W1\)"
    )


def test_missing_forward() -> None:
    fails(text("0F0 0B0 0B1", "1F0 1B0 1F1 1B1"), r"stage 0, micro-batch 1: no forward 0F1")


def test_i_without_w_and_w_without_i() -> None:
    fails(text("0F0 0I0", "1F0 1B0"), r"0I0 without 0W0; the weight gradient")
    fails(text("0F0 0W0", "1F0 1B0"), r"0W0 without 0I0")


def test_b_and_split_backward_together() -> None:
    fails(text("0F0 0B0 0I0 0W0", "1F0 1B0"), r"has both 0B0 and a split backward")


def test_duplicate_action() -> None:
    fails(text("0F0 0F0 0B0", "1F0 1B0"), r"device 0, action 1 \(0F0\): duplicate")


# -- placement and ranges ----------------------------------------------------------------------


def test_action_on_the_wrong_device() -> None:
    schedule = text("0F0 0B0 1F0", "1B0", placement="0 1")
    fails(schedule, r"device 0, action 2 \(1F0\): stage 1 runs on device 1, not on device 0")


def test_stage_and_microbatch_ranges() -> None:
    base = SCHEDULES["gpipe"](2, 2)
    fails(edit(base, 0, "0F1", "0F7"), r"device 0, action 1 \(0F7\): micro-batch 7 does not exist")
    wrong = Schedule("x", 1, 1, (0,), ((base.actions[1][0],),))
    fails(wrong, r"device 0, action 0 \(1F0\): stage 1 does not exist")


# -- order on one device -----------------------------------------------------------------------


def test_backward_before_forward() -> None:
    fails(
        text("0B0 0F0", "1F0 1B0"),
        r"device 0, action 0 \(0B0\): comes before 0F0 \(action 1\) on the same device; "
        r"the backward of a micro-batch needs its forward first",
    )


def test_w_before_i() -> None:
    schedule = text("0F0 0W0 0I0", "1F0 1B0")
    fails(schedule, r"\(0W0\): comes before 0I0 .* W of a micro-batch needs its I")


def test_step_before_backward() -> None:
    fails(text("0F0 0STEP 0B0", "1F0 1B0"), r"\(0STEP\): comes before 0B0 .* optimizer step")


def test_stage_order_on_a_shared_device() -> None:
    forward_first = text("1F0 0F0 1B0 0B0", placement="0 0")
    fails(forward_first, r"\(1F0\): comes before 0F0 .* forward of each stage it reads from")
    backward_first = text("0F0 1F0 0B0 1B0", placement="0 0")
    fails(backward_first, r"\(0B0\): comes before 1B0 .* backward of each stage that reads its outputs")


# -- communication -----------------------------------------------------------------------------


def test_unmatched_recv() -> None:
    schedule = edit(make_schedule("1f1b", 2, 2), 0, "0SEND_F1>1", "")
    fails(schedule, r"device 1, action 4 \(1RECV_F1<0\): no matching 0SEND_F1>1 on device 0")


def test_unmatched_send() -> None:
    schedule = edit(make_schedule("1f1b", 2, 2), 0, "0RECV_B0<1", "")
    fails(schedule, r"device 1, action 3 \(1SEND_B0>0\): no matching 0RECV_B0<1 on device 0")


def test_missing_transfer_in_an_explicit_schedule() -> None:
    schedule = edit(edit(make_schedule("gpipe", 2, 2), 0, "0SEND_F1>1", ""), 1, "1RECV_F1<0", "")
    fails(schedule, r"device 1, action 2 \(1F1\): needs 1RECV_F1<0, which is not in the schedule")


def test_recv_after_its_consumer() -> None:
    schedule = edit(make_schedule("gpipe", 2, 1), 1, "1RECV_F0<0 1F0", "1F0 1RECV_F0<0")
    fails(schedule, r"\(1F0\): comes before 1RECV_F0<0 .* input received first")


def test_send_between_stages_on_one_device() -> None:
    schedule = text("0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0", placement="0 0")
    fails(schedule, r"\(0SEND_F0>1\): stages 0 and 1 both run on device 0; .* remove the SEND_F")


def test_send_past_the_last_stage() -> None:
    schedule = text("0F0 0B0", "1F0 1SEND_F0 1B0")
    fails(schedule, r"device 1, action 1 \(1SEND_F0>2\): stage 1 has no stage 2 to talk to")


# -- deadlock ----------------------------------------------------------------------------------


def test_deadlock_without_communication() -> None:
    # Device 0 waits for 1B0, which device 1 only reaches after 1F1, which needs 0F1 from device 0.
    schedule = text("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0")
    message = fails(
        schedule,
        r"deadlocks: no device can start its next action",
        r"device 0, action 1 \(0B0\): blocked, waits for 1B0 \(device 1, action 3\)",
        r"device 1, action 0 \(1F1\): blocked, waits for 0F1 \(device 0, action 2\)",
    )
    assert message.count("blocked") == 2


def test_deadlock_with_communication() -> None:
    # Device 0 waits for the first gradient before sending micro-batch 1 forward, but device 1
    # runs both forwards before its first backward.
    schedule = edit(
        make_schedule("gpipe", 2, 2), 0, "0F1 0SEND_F1>1 0RECV_B0<1 0B0",
        "0RECV_B0<1 0B0 0F1 0SEND_F1>1"
    )
    fails(
        schedule,
        r"device 0, action 2 \(0RECV_B0<1\): blocked, waits for 1SEND_B0>0",
        r"device 1, action 2 \(1RECV_F1<0\): blocked, waits for 0SEND_F1>1 \(device 0, action 5\)",
    )


def test_finished_devices_are_reported() -> None:
    schedule = Schedule.from_text("0: 0F0 0B0 0F1 0B1\n1: 1F1 1B1 1F0 1B0\n2:")
    assert schedule.num_devices == 3
    fails(schedule, r"deadlocks", r"device 2: finished")


def test_dependencies_name_transfers() -> None:
    deps = dependencies(make_schedule("1f1b", 2, 1))
    assert deps[Action.parse("1RECV_F0")] == (Action.parse("0SEND_F0"),)
    plain = dependencies(SCHEDULES["zb-h1"](2, 1))
    by_name = {str(a): [str(d) for d in ds] for a, ds in plain.items()}
    assert by_name["0I0"] == ["0F0", "1I0"]
    assert by_name["1F0"] == ["0F0"]
    assert by_name["0W0"] == ["0I0"]
    assert by_name["0STEP"] == ["0W0"]


# -- messages of a program's dataflow ----------------------------------------------------------


def _skip_flow():
    from pipecompile.schedule.messages import Dataflow

    links = {"a": (0, 1), "b": (1, 2), "s": (0, 2)}
    return Dataflow.from_wiring({k: v[0] for k, v in links.items()},
                                {k: (v[1],) for k, v in links.items()}, set(links), 3)


def test_dataflow_catches_a_missing_receive() -> None:
    from pipecompile.schedule.lowering import add_communication

    lowered = add_communication(SCHEDULES["1f1b"](3, 2), _skip_flow())
    validate(lowered, _skip_flow())
    schedule = edit(lowered, 2, "2RECV_F1<0", "")
    with pytest.raises(ScheduleError, match=r"\(0SEND_F1>2\): no matching 2RECV_F1<0 on device 2"):
        validate(schedule, _skip_flow())
    # A chain-lowered schedule lacks the skip's messages: the forward says what it needs.
    with pytest.raises(ScheduleError, match=r"\(0B0\): needs 0RECV_B0<2, which is not in"):
        validate(make_schedule("1f1b", 3, 2), _skip_flow())


def test_dataflow_catches_a_wrong_peer() -> None:
    from pipecompile.schedule.messages import Dataflow

    chain = make_schedule("gpipe", 3, 1)
    schedule = edit(edit(chain, 0, "0SEND_F0>1", "0SEND_F0>1 0SEND_F0>2"),
                    2, "2RECV_F0<1", "2RECV_F0<0 2RECV_F0<1")
    validate(schedule)  # on its own, a schedule's messages say which stages talk
    with pytest.raises(ScheduleError, match=r"\(0SEND_F0>2\): action 0SEND_F0>2: stage 2 reads no "
                                            r"value from stage 0 in the program's wiring"):
        validate(schedule, Dataflow.chain(3))
    backward = edit(chain, 1, "1SEND_B0>0", "1SEND_B0>0 1SEND_B0>2")
    with pytest.raises(ScheduleError, match=r"\(1SEND_B0>2\): .* stage 1 reads no value from stage 2"):
        validate(backward, Dataflow.chain(3))


def test_dataflow_catches_a_gradient_message_for_an_integer_value() -> None:
    from pipecompile.schedule.messages import Dataflow

    ints = Dataflow.from_wiring({"ids": 0}, {"ids": (1,)}, set(), 2)  # no gradient flows back
    lowered = make_schedule("1f1b", 2, 1, dataflow=ints)
    assert [str(a) for row in lowered.actions for a in row if a.is_comm] == ["0SEND_F0>1",
                                                                           "1RECV_F0<0"]
    with pytest.raises(ScheduleError, match=r"\(0RECV_B0<1\): action 0RECV_B0<1: no gradient "
                                            r"flows back from stage 1 to stage 0"):
        validate(make_schedule("1f1b", 2, 1), ints)
