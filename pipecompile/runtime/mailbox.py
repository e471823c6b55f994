"""Mailbox: the in-process `Transport` between device threads (one process, several devices).

A SEND puts the message's values, already moved to the receiving stage's device, under the
message; the RECV of the same message takes them out, waiting at most ``timeout`` seconds.
`abort()` wakes every waiter when another thread has failed; `finish()` checks that every
message sent was received (a lowered schedule pairs each SEND with a RECV).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import StageExecutionError
from ..ir.tensors import to_device
from ..schedule.messages import Message

__all__ = ["Mailbox", "Aborted"]


class Aborted(Exception):
    """Raised in a waiting thread when another thread has failed."""


class Mailbox:
    """Messages in flight between the device threads of one process."""

    def __init__(self, devices: Sequence[torch.device], timeout: float, *,
                 label: Callable[[int], str] = lambda stage: f"stage {stage}"):
        self._devices = tuple(devices)  # device of each stage
        self._timeout = timeout
        self._label = label
        self._cond = threading.Condition()
        self._box: dict[Message, dict[str, Any]] = {}
        self.aborted = False
        # this step's messages and the bytes of their tensors, as `P2PTransport.stats` counts
        self.stats = {"messages": 0, "bytes": 0, "wait_seconds": 0.0}

    def post(self, messages: Sequence[Message]) -> None:
        """Nothing to prepare: a put is visible to the receiver at once."""

    def send(self, message: Message, values: Mapping[str, Any]) -> None:
        device = self._devices[message.dst]
        payload = {name: to_device(values.get(name), device) for name in message.values}
        sent = sum(v.numel() * v.element_size() for v in payload.values()
                   if isinstance(v, torch.Tensor))
        with self._cond:
            self.stats["messages"] += 1
            self.stats["bytes"] += sent
            self._box[message] = payload
            self._cond.notify_all()

    def recv(self, message: Message) -> dict[str, Any]:
        began = time.monotonic()
        deadline = began + self._timeout
        with self._cond:
            while message not in self._box:
                if self.aborted:
                    raise Aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self._label(message.dst)} waited {self._timeout:.0f}s for {message}; "
                        f"did stage {message.src} fail or skip its send?")
                self._cond.wait(min(left, 1.0))
            self.stats["wait_seconds"] += time.monotonic() - began
            return self._box.pop(message)

    def poll(self, message: Message) -> bool:
        with self._cond:
            return message in self._box

    def finish(self) -> None:
        if self._box:
            lost = "; ".join(map(str, list(self._box)[:3]))
            raise StageExecutionError(
                f"{len(self._box)} message(s) were sent but never received ({lost}); the "
                f"schedule's sends and receives do not match (run validate() on it)")

    def abort(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()
