"""P2PTransport: stage-to-stage values over torch.distributed point-to-point operations.

One message per (value, consuming stage, micro-batch, direction). Shapes and dtypes come from
the compiled plan (a value's symbolic shape evaluated at the micro-batch size), so no shape
handshake precedes a message, and a batch of another size than the example still works. Every
message has its own tag, so messages between two ranks cannot be confused whatever the order
in which the ranks post them (gloo honours tags).

Sends are asynchronous (`isend`) and completed by `finish()` at the end of the step. Every
receive of the step is posted before it starts (`post_receives`: gloo moves a message only once
its receive is posted), and an action blocks until its values have arrived. gloo requests only complete inside `Work.wait()`, so a waiter
thread calls it while the stage's thread waits on an event, checking every 50 ms the process
group's store for an error posted by another rank (`abort`): a failure anywhere ends every rank
promptly, and after `timeout` seconds a wait gives up with an error naming the peer.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..errors import StageExecutionError
from .mailbox import _to

__all__ = ["P2PTransport", "ValueSpec", "PeerFailure", "Waiter", "ERROR_KEY"]

ERROR_KEY = "pipecompile/error"


class PeerFailure(StageExecutionError):
    """Another rank failed; raised on every rank that was waiting for it."""


@dataclass(frozen=True)
class ValueSpec:
    """How to allocate a receive buffer for a value: shape as a function of micro-batch size."""

    shape: Callable[[int], tuple[int, ...]]
    dtype: torch.dtype | None  # None: a Python int carried as a 0-dim int64 tensor


class Waiter:
    """A daemon thread that completes requests with `Work.wait()` on behalf of other threads."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="pipecompile-p2p-wait").start()

    def submit(self, work, timeout: float) -> tuple[threading.Event, list]:
        done, outcome = threading.Event(), []
        self._queue.put((work, timeout, done, outcome))
        return done, outcome

    def _loop(self) -> None:
        while True:
            work, timeout, done, outcome = self._queue.get()
            try:
                work.wait(datetime.timedelta(seconds=timeout))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                outcome.append(exc)
            done.set()


class P2PTransport:
    """The transport of one rank: its stages talk to stages on other ranks by tagged messages."""

    def __init__(self, *, rank: int, rank_of_stage: Callable[[int], int],
                 producer: Mapping[str, int], consumers: Mapping[str, tuple[int, ...]],
                 specs: Mapping[str, ValueSpec], grad_values: frozenset[str],
                 devices: tuple[torch.device, ...], microbatch_sizes: list[int],
                 timeout: float, waiter: Waiter, store: Any = None,
                 label: Callable[[int], str] = str):
        self.rank = rank
        self.rank_of = rank_of_stage
        self.producer = producer
        self.consumers = consumers
        self.specs = specs
        self.grad_values = grad_values
        self.devices = devices
        self.sizes = microbatch_sizes
        self.timeout = timeout
        self.store = store
        self.waiter = waiter
        self.label = label
        self._index = {name: i for i, name in enumerate(sorted(producer))}
        self._num_stages = len(devices)
        self._local_acts: dict[tuple[int, str, int], Any] = {}
        self._local_grads: dict[tuple[str, int], Any] = {}
        self._sends: list[tuple[Any, str]] = []
        self._posted: dict[tuple, tuple[Any, torch.Tensor]] = {}  # receives posted up front
        self.stats = {"messages": 0, "bytes": 0, "wait_seconds": 0.0}  # this rank, this step

    # -- transport interface ---------------------------------------------------------------

    def send_activation(self, stage: int, name: str, mb: int, value: Any) -> None:
        for consumer in self.consumers[name]:
            dst = self.rank_of(consumer)
            if dst == self.rank:
                self._local_acts[(consumer, name, mb)] = _to(value, self.devices[consumer])
            else:
                tensor = _as_tensor(value, self.devices[stage])
                self._count(tensor)
                work = dist.isend(tensor, dst=dst, tag=self._tag(name, consumer, mb, 0))
                self._sends.append((work, f"activation {name!r} of micro-batch {mb} to rank {dst}"))

    def recv_activation(self, stage: int, name: str, mb: int) -> Any:
        local = self._local_acts.pop((stage, name, mb), _MISSING)
        if local is not _MISSING:
            return local
        src = self.rank_of(self.producer[name])
        key = ("act", name, stage, mb)
        work, buf = self._posted.pop(key, None) or self._post(key)
        self._wait(work, stage, f"activation {name!r} of micro-batch {mb}", src)
        return buf if self.specs[name].dtype is not None else int(buf.item())

    def send_gradient(self, stage: int, name: str, mb: int, grad: Any) -> None:
        if name not in self.grad_values:
            return
        producer = self.producer[name]
        dst = self.rank_of(producer)
        if dst == self.rank:
            grad = _to(grad, self.devices[producer])
            key = (name, mb)
            if grad is not None:
                held = self._local_grads.get(key)
                self._local_grads[key] = grad if held is None else held + grad
            return
        if grad is None:  # the value did not reach the loss: its gradient is zero
            spec = self.specs[name]
            grad = torch.zeros(spec.shape(self.sizes[mb]), dtype=spec.dtype,
                               device=self.devices[stage])
        grad = grad.contiguous()
        self._count(grad)
        work = dist.isend(grad, dst=dst, tag=self._tag(name, stage, mb, 1))
        self._sends.append((work, f"gradient of {name!r} for micro-batch {mb} to rank {dst}"))

    def recv_gradient(self, stage: int, name: str, mb: int) -> Any:
        if name not in self.grad_values:
            return None
        total = self._local_grads.pop((name, mb), None)
        for consumer in self.consumers[name]:
            src = self.rank_of(consumer)
            if src == self.rank:
                continue  # delivered locally above
            key = ("grad", name, consumer, mb)
            work, buf = self._posted.pop(key, None) or self._post(key)
            self._wait(work, stage, f"gradient of {name!r} for micro-batch {mb}", src)
            total = buf if total is None else total + buf
        return total

    def post_receives(self, actions, workers) -> None:
        """Post, before the step starts, every receive these actions will need.

        gloo moves a message only once its receive is posted; posting them all up front lets
        a value travel while its receiver is still computing something else.
        """
        for action in actions:
            worker = workers.get(action.stage)
            if worker is None or action.microbatch is None:
                continue
            if action.kind.value == "F":
                for name in worker.input_names:
                    if name in self.producer and self.rank_of(self.producer[name]) != self.rank:
                        key = ("act", name, action.stage, action.microbatch)
                        self._posted[key] = self._post(key)
            elif action.kind.value in ("B", "I") and worker.loss is None:
                for name in worker.output_names:
                    if name not in self.grad_values:
                        continue
                    for consumer in self.consumers[name]:
                        if self.rank_of(consumer) != self.rank:
                            key = ("grad", name, consumer, action.microbatch)
                            self._posted[key] = self._post(key)

    def _post(self, key: tuple):
        """irecv for ("act", value, consumer stage, mb) or ("grad", value, consumer, mb)."""
        kind, name, consumer, mb = key
        spec = self.specs[name]
        if kind == "act":
            src, direction = self.rank_of(self.producer[name]), 0
            device, dtype = self.devices[consumer], spec.dtype or torch.int64
        else:
            src, direction = self.rank_of(consumer), 1
            device, dtype = self.devices[self.producer[name]], spec.dtype
        buf = torch.empty(spec.shape(self.sizes[mb]), dtype=dtype, device=device)
        return dist.irecv(buf, src=src, tag=self._tag(name, consumer, mb, direction)), buf

    def finish(self) -> None:
        """Complete every send of the step (they complete once their receiver has the data)."""
        for work, what in self._sends:
            self._wait(work, None, what, None)
        self._sends = []

    def abort(self, error: BaseException) -> None:
        """Tell every rank that this one failed (they stop waiting and raise)."""
        if self.store is None or isinstance(error, PeerFailure):
            return  # a peer's failure is already posted; keep its message
        try:
            if not self.store.check([ERROR_KEY]):
                self.store.set(ERROR_KEY, f"rank {self.rank}: {error}")
        except Exception:  # noqa: BLE001 - the store may be gone already; nothing to add
            pass

    # -- internals -------------------------------------------------------------------------

    def _tag(self, name: str, consumer: int, mb: int, direction: int) -> int:
        # Unique per message of a step: value, consuming stage, micro-batch, forward/backward.
        index = self._index[name] * self._num_stages + consumer
        return (index * len(self.sizes) + mb) * 2 + direction

    def _count(self, tensor: torch.Tensor) -> None:
        self.stats["messages"] += 1
        self.stats["bytes"] += tensor.numel() * tensor.element_size()

    def _wait(self, work, stage: int | None, what: str, peer: int | None) -> None:
        began = time.perf_counter()
        try:
            self._wait_for(work, stage, what, peer)
        finally:
            self.stats["wait_seconds"] += time.perf_counter() - began

    def _wait_for(self, work, stage: int | None, what: str, peer: int | None) -> None:
        deadline = time.monotonic() + self.timeout
        done, outcome = self.waiter.submit(work, self.timeout + 5.0)
        while not done.wait(0.05):
            self._check_peers()
            if time.monotonic() >= deadline:
                who = self.label(stage) if stage is not None else f"rank {self.rank}"
                source = f" from rank {peer}" if peer is not None else ""
                raise StageExecutionError(
                    f"{who} waited {self.timeout:.0f}s for {what}{source}; that rank may have "
                    f"failed or died (timeout={self.timeout:.0f}s, see compile(timeout=...))")
        if outcome:
            self._check_peers()
            source = f"rank {peer}" if peer is not None else "a peer"
            raise StageExecutionError(
                f"rank {self.rank}: communication with {source} failed while waiting for "
                f"{what}: {outcome[0]}") from outcome[0]

    def _check_peers(self) -> None:
        if self.store is None:
            return
        try:
            failed = self.store.check([ERROR_KEY])
        except Exception:  # noqa: BLE001 - store unreachable: the timeout will report it
            return
        if failed:
            message = self.store.get(ERROR_KEY).decode(errors="replace")
            raise PeerFailure(f"stopped because {message}")


_MISSING = object()


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().contiguous()
    return torch.tensor(int(value), dtype=torch.int64, device=device)
