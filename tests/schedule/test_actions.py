"""The action IR: text forms of actions and schedules round-trip, mistakes are named."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.lowering import add_communication
from pipecompile.schedule.messages import Dataflow
from pipecompile.schedule.schedules import SCHEDULES, make_schedule

actions = st.builds(
    lambda stage, kind, mb, peer: Action(
        stage, kind, None if kind is Kind.STEP else mb,
        stage + 1 + peer if kind.value.startswith(("SEND", "RECV")) else None),
    st.integers(0, 10**6),
    st.sampled_from(list(Kind)),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
)


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("1F3", Action(1, Kind.F, 3)),
        ("0B2", Action(0, Kind.B, 2)),
        ("2I0", Action(2, Kind.I, 0)),
        ("2W0", Action(2, Kind.W, 0)),
        ("1SEND_F3>2", Action(1, Kind.SEND_F, 3, 2)),
        ("2RECV_F3<1", Action(2, Kind.RECV_F, 3, 1)),
        ("2SEND_B3>1", Action(2, Kind.SEND_B, 3, 1)),
        ("1RECV_B3<2", Action(1, Kind.RECV_B, 3, 2)),
        ("0SEND_F3>3", Action(0, Kind.SEND_F, 3, 3)),
        ("3RECV_F3<0", Action(3, Kind.RECV_F, 3, 0)),
        ("3SEND_B3>0", Action(3, Kind.SEND_B, 3, 0)),
        ("0RECV_B3<3", Action(0, Kind.RECV_B, 3, 3)),
        ("2STEP", Action(2, Kind.STEP)),
        ("12F345", Action(12, Kind.F, 345)),
    ],
)
def test_every_kind_round_trips(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text


def test_a_send_or_receive_without_a_peer_talks_to_its_neighbour() -> None:
    assert Action.parse("1SEND_F3") == Action.parse("1SEND_F3>2")
    assert Action.parse("1RECV_F3") == Action.parse("1RECV_F3<0")
    assert Action.parse("1SEND_B3") == Action.parse("1SEND_B3>0")
    assert Action.parse("1RECV_B3") == Action.parse("1RECV_B3<2")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("0RECV_F0", "no previous stage to talk to; name the peer, e.g. 0RECV_F0<1"),
        ("0SEND_F1<2", "SEND_F takes '>'"),
        ("2RECV_B1>3", "RECV_B takes '<'"),
        ("1F3>2", "F takes no peer"),
        ("1SEND_F3>1", "cannot send to or receive from itself"),
    ],
)
def test_bad_peers_are_named(text: str, error: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(error)):
        Action.parse(text)
    with pytest.raises(ScheduleError, match="only sends and receives have a peer"):
        Action(1, Kind.F, 3, peer=2)


_PEERS = {Kind.SEND_F: ">4", Kind.RECV_F: "<2", Kind.SEND_B: ">2", Kind.RECV_B: "<4"}


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips_through_text(kind: Kind) -> None:
    peer = _PEERS.get(kind)
    action = Action(3, kind, None if kind is Kind.STEP else 7,
                    peer=None if peer is None else int(peer[1:]))
    text = str(action)
    assert text == f"3{kind.value}" + ("" if kind is Kind.STEP else "7") + (peer or "")
    assert Action.parse(text) == action


@given(actions)
def test_parse_inverts_str(action: Action) -> None:
    assert Action.parse(str(action)) == action


@given(st.text(max_size=12))
def test_parse_raises_only_schedule_error(text: str) -> None:
    try:
        action = Action.parse(text)
    except ScheduleError:
        return
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    "text", ["", "F3", "1X3", "1F", "-1F0", "1f3", "1F3 1B3", "1 F3", "1STEPX"]
)
def test_bad_text_is_named(text: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(text)


def test_constructor_checks_fields() -> None:
    assert Action(0, "F", 1).kind is Kind.F  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="needs a micro-batch"):
        Action(0, Kind.F)
    assert str(Action(0, Kind.STEP, 1)) == "0STEP1"  # an asynchronous per-micro-batch update
    assert Action.parse("0STEP1") == Action(0, Kind.STEP, 1)
    with pytest.raises(ScheduleError, match="needs a micro-batch int >= 0"):
        Action(0, Kind.STEP, -1)
    with pytest.raises(ScheduleError, match="stage must be an int >= 0"):
        Action(-1, Kind.F, 0)
    with pytest.raises(ScheduleError, match="unknown action kind 'X'"):
        Action(0, "X", 0)  # type: ignore[arg-type]


def test_repr_is_readable_and_evaluates() -> None:
    action = Action.parse("1SEND_F3>4")
    assert repr(action) == "Action.parse('1SEND_F3>4')"
    assert eval(repr(action)) == action
    assert sorted([Action.parse("1F0"), Action.parse("0B1"), Action.parse("0F1")]) == [
        Action.parse("0B1"),
        Action.parse("0F1"),
        Action.parse("1F0"),
    ]


# -- schedules as text and CSV ----------------------------------------------------------------


def _examples() -> list[Schedule]:
    out = []
    for name in SCHEDULES:
        v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
        plain = SCHEDULES[name](2, 4, virtual_stages=v)
        out += [plain, add_communication(plain)]
    out.append(make_schedule("1f1b", 3, 5))
    skip = Dataflow.from_wiring({"h": 0, "skip": 0, "g": 1}, {"h": (1,), "skip": (2,), "g": (2,)},
                                {"h", "skip", "g"}, 3)
    out.append(make_schedule("zb-h1", 3, 4, dataflow=skip))  # 0SEND_F0>2 ... 0RECV_B0<2
    return out


@pytest.mark.parametrize("schedule", _examples(), ids=lambda s: f"{s.name}-{s.has_communication}")
def test_text_and_csv_round_trip(schedule: Schedule) -> None:
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_csv(schedule.to_csv()) == schedule


def test_messages_to_a_non_neighbour_are_written_with_their_peer() -> None:
    skip = _examples()[-1]
    text = skip.to_text()
    assert "0SEND_F0>2" in text and "2RECV_F0<0" in text and "2SEND_B0>0" in text
    assert ",0RECV_B3<2," in skip.to_csv()


def test_text_format_is_documented_shape() -> None:
    text = SCHEDULES["1f1b"](2, 3).to_text()
    assert text == (
        "name: 1f1b\n"
        "num_stages: 2\n"
        "num_microbatches: 3\n"
        "stage_to_device: 0 1\n"
        "0: 0F0 0F1 0B0 0F2 0B1 0B2 0STEP\n"
        "1: 1F0 1B0 1F1 1B1 1F2 1B2 1STEP\n"
    )


def test_hand_written_text_infers_the_header() -> None:
    schedule = Schedule.from_text("# two stages\n0F0 0F1 0B0 0B1\n\n1F0 1B0 1F1 1B1  # done\n")
    rows = ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]
    expected = Schedule(
        "custom", 2, 2, (0, 1), tuple(tuple(map(Action.parse, r.split())) for r in rows)
    )
    assert schedule == expected


def test_hand_written_csv_with_padding() -> None:
    schedule = Schedule.from_csv("name,my sched\n0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1,,\n")
    assert schedule.name == "my sched"
    assert schedule.stage_to_device == (0, 1)
    assert schedule.actions[1][-1] == Action.parse("1B1")


def test_interleaved_placement_is_inferred() -> None:
    schedule = Schedule.from_text("0F0 2F0 2B0 0B0\n1F0 3F0 3B0 1B0")
    assert schedule.stage_to_device == (0, 1, 0, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0 0B0\n1F0 1Q0", "text line 2: cannot parse action '1Q0'"),
        ("0: 0F0\n1F0", "number all of them or none"),
        ("0F0 1F0\n1B0", "stage 1 appears on devices \\[0, 1\\]"),
        ("stages: 2\n0F0", "unknown key 'stages'"),
        ("0: 0F0\n0: 0B0", "device 0 has two lines"),
        ("num_stages: two\n0F0", "num_stages must be integers"),
        ("num_stages: 3\nstage_to_device: 0 1\n0F0\n1F0", "stage_to_device has 2 entries"),
    ],
)
def test_text_errors_say_where(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_text(text)


def test_schedule_checks_placement() -> None:
    with pytest.raises(ScheduleError, match="placed on device 2"):
        Schedule("x", 2, 1, (0, 2), ((), ()))
    with pytest.raises(ScheduleError, match="expected Action"):
        Schedule("x", 1, 1, (0,), (("0F0",),))  # type: ignore[arg-type]


def test_str_is_a_grid() -> None:
    text = str(SCHEDULES["1f1b"](2, 2))
    assert text.splitlines() == [
        "1f1b: 2 stages on 2 devices, 2 micro-batches",
        "slot      0     1     2     3     4",
        "dev 0   0F0   0F1   0B0   0B1 0STEP",
        "dev 1   1F0   1B0   1F1   1B1 1STEP",
    ]
