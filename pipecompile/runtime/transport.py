"""Transport: how the executor moves the messages of a lowered schedule between devices.

The executor carries out exactly the schedule's SEND and RECV actions: ``SEND`` hands the
transport one `Message` and the values it carries, ``RECV`` takes them out on the receiving
side (on the receiving stage's device). Stages on one device never use the transport: the
executor hands their values over directly. Two implementations:

    Mailbox       threads of one process, one per device        (runtime/mailbox.py)
    P2PTransport  one rank per device over torch.distributed    (runtime/p2p.py)

Sends never block (they may complete later, in `finish`); receives block until the message
is there or ``timeout`` seconds pass, and then raise an error naming the waiting stage and the
message. `abort` wakes every waiter (in this process, or on every rank) after a failure.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from ..schedule.messages import Message

__all__ = ["Transport"]


@runtime_checkable
class Transport(Protocol):
    """Moves one step's messages; a fresh transport per step."""

    def post(self, messages: Sequence[Message]) -> None:
        """Receives this side will run, announced at step start so data can move early
        (gloo moves a message only once its receive is posted)."""

    def send(self, message: Message, values: Mapping[str, Any]) -> None:
        """Send every value of ``message`` (a gradient may be None: it did not reach the loss)."""

    def recv(self, message: Message) -> dict[str, Any]:
        """Block until ``message`` has arrived; its values on the receiving stage's device."""

    def poll(self, message: Message) -> bool:
        """Whether `recv` would return without waiting (single-thread interleaving)."""

    def finish(self) -> None:
        """Complete the step's sends; raise if a message was lost."""

    def abort(self, error: BaseException) -> None:
        """Another thread or rank failed: wake every waiter (they raise)."""
