"""Mailbox: the in-process transport moves whole messages, times out naming the stage, and wakes
its waiters on abort."""

from __future__ import annotations

import threading

import pytest
import torch

from pipecompile.errors import StageExecutionError
from pipecompile.runtime.mailbox import Aborted, Mailbox
from pipecompile.schedule.messages import Message
from pipecompile.runtime.transport import Transport

CPU = (torch.device("cpu"),) * 4


def test_send_then_recv_gives_every_value_of_the_message() -> None:
    box = Mailbox(CPU, timeout=5.0)
    assert isinstance(box, Transport)
    message = Message(0, 3, 1, False, ("e1", "n"))
    e1 = torch.arange(4.0)
    assert not box.poll(message)
    box.send(message, {"e1": e1, "n": 7})
    assert box.poll(message)
    got = box.recv(message)
    assert got.keys() == {"e1", "n"} and got["n"] == 7
    assert torch.equal(got["e1"], e1)
    assert not box.poll(message)
    box.finish()


def test_messages_of_other_micro_batches_or_links_stay_apart() -> None:
    box = Mailbox(CPU, timeout=5.0)
    first, later = Message(0, 1, 0, False, ("x",)), Message(0, 1, 1, False, ("x",))
    back = Message(1, 0, 0, True, ("x",))
    box.send(later, {"x": torch.ones(1)})
    box.send(back, {"x": torch.zeros(1)})
    box.send(first, {"x": torch.full((1,), 2.0)})
    assert box.recv(first)["x"].item() == 2.0
    assert box.recv(back)["x"].item() == 0.0
    assert box.recv(later)["x"].item() == 1.0


def test_finish_reports_a_message_nobody_received() -> None:
    box = Mailbox(CPU, timeout=5.0)
    box.send(Message(0, 2, 0, False, ("x",)), {"x": torch.ones(1)})
    with pytest.raises(StageExecutionError, match="1 message.* from stage 0 to stage 2"):
        box.finish()


def test_timeout_names_the_waiting_stage_and_the_message() -> None:
    box = Mailbox(CPU, timeout=0.05)
    with pytest.raises(TimeoutError, match=r"stage 2 waited 0s for values 'h' of micro-batch 1 "
                                           r"from stage 0 to stage 2"):
        box.recv(Message(0, 2, 1, False, ("h",)))


def test_abort_wakes_a_waiter() -> None:
    box = Mailbox(CPU, timeout=60.0)
    raised: list[BaseException] = []
    started = threading.Event()

    def wait() -> None:
        started.set()
        try:
            box.recv(Message(0, 1, 0, False, ("x",)))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    started.wait(5.0)
    box.abort(RuntimeError("stage 0 failed"))
    waiter.join(10.0)
    assert not waiter.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], Aborted)
