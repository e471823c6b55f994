"""Lowering derives SEND/RECV from the program's wiring: one message per link, micro-batch and
direction between stages on different devices; the running schedule moves exactly those."""

from __future__ import annotations

import copy

import pytest
import torch

import pipecompile as pc
from pipecompile.errors import ScheduleError, StageExecutionError
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.lowering import add_communication, relower, strip_communication
from pipecompile.runtime.microbatch import split_microbatches
from pipecompile.runtime.values import message_bytes
from pipecompile.schedule.messages import Dataflow, Message, message_of, transfer_seconds
from pipecompile.schedule.schedules import SCHEDULES, interleaved_1f1b, make_schedule
from pipecompile.schedule.simulate import StageCosts, Transfer, simulate
from pipecompile.schedule.validate import validate
from tests.support.models import CASES
from tests.support.reference import assert_grads_equal, reference_step


def flow(*links: str, stages: int, no_grad: tuple[str, ...] = ()) -> Dataflow:
    """A dataflow from "src>dst" links, one value per link named after it."""
    producer, consumers = {}, {}
    for link in links:
        src, dst = map(int, link.split(">"))
        producer[link], consumers[link] = src, (dst,)
    return Dataflow.from_wiring(producer, consumers, set(links) - set(no_grad), stages)


def rows(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, row)) for row in schedule.actions]


def test_neighbour_chain_is_the_default() -> None:
    plain = SCHEDULES["gpipe"](3, 1)
    assert add_communication(plain) == add_communication(plain, Dataflow.chain(3))
    assert rows(add_communication(plain)) == [
        "0F0 0SEND_F0>1 0RECV_B0<1 0B0 0STEP",
        "1RECV_F0<0 1F0 1SEND_F0>2 1RECV_B0<2 1B0 1SEND_B0>0 1STEP",
        "2RECV_F0<1 2F0 2B0 2SEND_B0>1 2STEP",
    ]


def test_skip_connection_to_a_non_neighbour_is_one_message_each_way() -> None:
    skip = flow("0>1", "1>2", "0>2", stages=3)
    lowered = add_communication(SCHEDULES["gpipe"](3, 1), skip)
    assert rows(lowered) == [
        "0F0 0SEND_F0>1 0SEND_F0>2 0RECV_B0<1 0RECV_B0<2 0B0 0STEP",
        "1RECV_F0<0 1F0 1SEND_F0>2 1RECV_B0<2 1B0 1SEND_B0>0 1STEP",
        "2RECV_F0<0 2RECV_F0<1 2F0 2B0 2SEND_B0>0 2SEND_B0>1 2STEP",
    ]
    validate(lowered, skip)
    assert message_of(Action.parse("2RECV_F0<0"), skip) == Message(0, 2, 0, False, ("0>2",))
    assert message_of(Action.parse("2SEND_B0>0"), skip) == Message(2, 0, 0, True, ("0>2",))


def test_values_without_gradient_send_nothing_back() -> None:
    ints = flow("0>1", "0>2", "1>2", stages=3, no_grad=("0>2",))
    lowered = add_communication(SCHEDULES["1f1b"](3, 2), ints)
    comm = {str(a) for row in lowered.actions for a in row if a.is_comm}
    assert {"0SEND_F1>2", "2RECV_F1<0"} <= comm
    assert not any(a.endswith(">0") and a.startswith("2SEND_B") for a in comm)
    validate(lowered, ints)


def test_two_stages_on_one_device_exchange_no_message() -> None:
    plain = Schedule.from_text("stage_to_device: 0 0 1\n0F0 1F0 1B0 0B0\n2F0 2B0")
    lowered = add_communication(plain, flow("0>1", "0>2", "1>2", stages=3))
    assert rows(lowered) == [
        "0F0 0SEND_F0>2 1F0 1SEND_F0>2 1RECV_B0<2 1B0 0RECV_B0<2 0B0",
        "2RECV_F0<0 2RECV_F0<1 2F0 2B0 2SEND_B0>0 2SEND_B0>1",
    ]
    one_device = interleaved_1f1b(1, 2, virtual_stages=3)
    assert add_communication(one_device, flow("0>1", "1>2", "0>2", stages=3)) == one_device


def test_interleaved_virtual_stages() -> None:
    # D=2, v=2: stages 0, 2 on device 0 and 1, 3 on device 1; 0>2 stays on device 0.
    skips = flow("0>1", "1>2", "2>3", "0>2", "0>3", stages=4)
    lowered = add_communication(interleaved_1f1b(2, 2, virtual_stages=2), skips)
    validate(lowered, skips)
    sends = sorted({str(Action(a.stage, a.kind, 0, a.peer)) for row in lowered.actions
                    for a in row if a.kind is Kind.SEND_F})
    assert sends == ["0SEND_F0>1", "0SEND_F0>3", "1SEND_F0>2", "2SEND_F0>3"]
    messages = sum(a.is_comm for row in lowered.actions for a in row)
    assert messages == 2 * 2 * 4 * 2  # (send + recv) x (F + B) x 4 remote links x 2 mbs


def test_lowering_checks_its_input_and_relower_replaces_messages() -> None:
    chain = make_schedule("1f1b", 3, 2)
    with pytest.raises(ScheduleError, match="already has communication"):
        add_communication(chain)
    with pytest.raises(ScheduleError, match="has 3 stages but the dataflow has 2"):
        relower(chain, Dataflow.chain(2))
    skip = flow("0>1", "1>2", "0>2", stages=3)
    assert relower(chain, skip) == add_communication(strip_communication(chain), skip)
    assert chain == make_schedule("1f1b", 3, 2)  # unchanged


def test_transfer_seconds_use_the_senders_bandwidth() -> None:
    got = transfer_seconds({(0, 3, "F"): 800, (3, 0, "B"): 800}, lambda s: 100.0 * (s + 1))
    assert got == {(0, 3, "F"): 8.0, (3, 0, "B"): 2.0}
    assert transfer_seconds({(0, 1, "F"): 5}, float("inf")) == {(0, 1, "F"): 0.0}


# -- a U-Net whose long skip goes from stage 0 to stage 3 -------------------------------------


@pytest.fixture(scope="module")
def unet():
    torch.manual_seed(0)
    case = CASES["unet"]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=4, microbatches=2, schedule="1f1b",
                      loss_fn=case.loss_fn, split_points=["enc2", "mid", "dec2"])
    return case, reference, pipe


def test_unet_long_skip_is_one_message_from_stage_0_to_3(unet) -> None:
    case, _, pipe = unet
    printed = str(pipe.schedule)
    for text in ("0SEND_F0>3", "3RECV_F0<0", "3SEND_B1>0", "0RECV_B1<3"):
        assert text in printed, text
    e1 = pipe.program.stages[0].outputs
    assert Dataflow.of(pipe.program).link(0, 3).values == e1
    validate(pipe.schedule, Dataflow.of(pipe.program))
    size = case.args[0].shape[0] // 2
    nbytes = message_bytes(pipe.program, size)
    e1_bytes = case.model.enc1(case.args[0][:size]).numel() * 8  # float64
    assert nbytes[(0, 3, "F")] == nbytes[(3, 0, "B")] == e1_bytes
    timeline = simulate(pipe.schedule, [StageCosts(1.0, 2.0)] * 4,
                        dataflow=Dataflow.of(pipe.program),
                        transfers=transfer_seconds(nbytes, bandwidth=e1_bytes / 0.5))
    skip = [t for t in timeline.transfers if (t.src, t.dst, t.direction) == (0, 3, "F")]
    assert skip == [Transfer(0, 3, 0, "F", 1.0, 1.5), Transfer(0, 3, 1, "F", 2.0, 2.5)]


def test_unet_on_four_devices_equals_the_unsplit_model(unet) -> None:
    case, reference, pipe = unet
    loss = pipe.step(*case.args, target=case.target)
    ref_loss, ref_grads = reference_step(reference, case.args, {}, case.target, case.loss_fn, 2)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
    assert len(assert_grads_equal(pipe, ref_grads)) == len(ref_grads)


def test_executor_moves_only_the_messages_of_the_schedule(unet) -> None:
    case, _, pipe = unet
    neighbours_only = relower(pipe.schedule, Dataflow.chain(4))
    mbs = split_microbatches(case.args, {}, case.target, 2)
    with pytest.raises(StageExecutionError, match="stage 3 has no value 'relu' for micro-batch 0"
                                                  ".* no receive from stage 0"):
        pipe.runtime.run(neighbours_only, mbs, batches=1)
