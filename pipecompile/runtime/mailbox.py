"""Mailbox: the in-process transport between stages (LocalExecutor's worker threads).

An activation is put, already on the consumer's device, under (consumer stage, value, mb). An
input gradient is added under (value, mb) by each consumer stage and is complete once every
consumer has delivered its part (a skip connection read by two later stages gets the sum).
Waits are bounded by `timeout`; `abort()` wakes every waiter when another thread has failed.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

import torch

from ..tensors import to_device as _to

__all__ = ["Mailbox", "Aborted"]


class Aborted(Exception):
    """Raised in a waiting thread when another thread has failed."""


_MISSING = object()


class Mailbox:
    """Values in flight between stages of one process."""

    def __init__(self, consumers: Mapping[str, tuple[int, ...]],
                 devices: tuple[torch.device, ...], producer: Mapping[str, int], timeout: float):
        self._consumers = consumers
        self._devices = devices
        self._producer = producer
        self._timeout = timeout
        self._cond = threading.Condition()
        self._acts: dict[tuple[int, str, int], Any] = {}
        self._grads: dict[tuple[str, int], list] = {}  # (value, mb) -> [sum, deliveries]
        self.aborted = False

    # -- transport interface ---------------------------------------------------------------

    def send_activation(self, stage: int, name: str, mb: int, value: Any) -> None:
        """Stage `stage` produced `name` for micro-batch `mb`: deliver it to every consumer."""
        with self._cond:
            for consumer in self._consumers[name]:
                self._acts[(consumer, name, mb)] = _to(value, self._devices[consumer])
            self._cond.notify_all()

    def recv_activation(self, stage: int, name: str, mb: int) -> Any:
        what = f"activation {name!r} of micro-batch {mb} from stage {self._producer[name]}"
        return self._wait(lambda: self._acts.pop((stage, name, mb), _MISSING), stage, what)

    def send_gradient(self, stage: int, name: str, mb: int, grad: Any) -> None:
        """Consumer `stage` contributes the gradient of `name` for micro-batch `mb`."""
        grad = _to(grad, self._devices[self._producer[name]])
        with self._cond:
            entry = self._grads.setdefault((name, mb), [None, 0])
            if grad is not None:
                entry[0] = grad if entry[0] is None else entry[0] + grad
            entry[1] += 1
            self._cond.notify_all()

    def recv_gradient(self, stage: int, name: str, mb: int) -> Any:
        expected = len(self._consumers[name])

        def take():
            entry = self._grads.get((name, mb))
            if entry is None or entry[1] < expected:
                return _MISSING
            del self._grads[(name, mb)]
            return entry[0]

        return self._wait(take, stage, f"gradient of {name!r} for micro-batch {mb}")

    def finish(self) -> None:
        """Nothing is left in flight in-process once every thread has returned."""

    def abort(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()

    # -- single-thread scheduling ----------------------------------------------------------

    def has_activations(self, stage: int, names, mb: int) -> bool:
        with self._cond:
            return all((stage, n, mb) in self._acts for n in names)

    def has_gradients(self, names, mb: int) -> bool:
        with self._cond:
            return all((n, mb) in self._grads
                       and self._grads[(n, mb)][1] >= len(self._consumers[n]) for n in names)

    def _wait(self, take: Callable[[], Any], stage: int, what: str) -> Any:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while True:
                if self.aborted:
                    raise Aborted()
                value = take()
                if value is not _MISSING:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"stage {stage} waited {self._timeout:.0f}s for {what}")
                self._cond.wait(min(left, 1.0))
