"""P2PTransport: the `Transport` between ranks, over torch.distributed point-to-point operations.

A message of the lowered schedule (`messages.Message`: a link's values for one micro-batch,
forward or backward) goes as one tagged ``isend``/``irecv`` per value. Shapes and dtypes come
from the compiled plan: a value's symbolic shape evaluated at the sizes of the micro-batch's
inputs (its batch size, sequence length, ...), which every rank of a pipeline is given, so no
shape handshake precedes a message and any size the capture left symbolic works.
Every (message, value) has its own tag, so messages between two ranks cannot be confused
whatever the order in which the ranks post them (gloo honours tags).

Sends are asynchronous (`isend`) and completed by `finish()` at the end of the step. The
executor `post`s every receive of its row before the step starts (gloo moves a message only
once its receive is posted), and a RECV action blocks until its message has arrived. gloo
requests only complete inside `Work.wait()`, so a waiter thread calls it while the stage's
thread waits on an event, checking every 50 ms the process group's store for an error posted
by another rank (`abort`): a failure anywhere ends every rank promptly, and after `timeout`
seconds a wait gives up with an error naming the stage and the peer. The waiter is handed each
receive when it is posted, in the row's order, so it completes a message as soon as it arrives
and a RECV whose data is already there does not wait for a thread switch.

Per step, the transport allocates receive buffers and evaluates each value's symbolic shape
once per distinct set of sizes (`shapes`, a cache the runtime keeps across steps: the sympy
substitution costs far more than a message on a small model).
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import StageExecutionError
from ..schedule.messages import Message

__all__ = ["P2PTransport", "ValueSpec", "PeerFailure", "Waiter", "ERROR_KEY"]

ERROR_KEY = "pipecompile/error"


class PeerFailure(StageExecutionError):
    """Another rank failed; raised on every rank that was waiting for it."""


@dataclass(frozen=True)
class ValueSpec:
    """How to allocate a receive buffer for a value: its shape as a function of the size
    symbols' values (`CapturedModel.sizes_of` a micro-batch's inputs)."""

    shape: Callable[[Mapping[Any, int]], tuple[int, ...]]
    dtype: torch.dtype | None  # None: a Python int carried as a 0-dim int64 tensor


class Waiter:
    """A daemon thread that completes requests with `Work.wait()` on behalf of other threads."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="pipecompile-p2p-wait").start()

    def submit(self, work: dist.Work, timeout: float) -> tuple[threading.Event,
                                                                list[BaseException]]:
        """Wait for `work` on the thread; the event is set when it is done, the list then holds
        the exception it raised, if any."""
        done = threading.Event()
        outcome: list[BaseException] = []
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
                 specs: Mapping[str, ValueSpec], devices: tuple[torch.device, ...],
                 sizes: Sequence[Mapping[Any, int]], timeout: float, waiter: Waiter,
                 store: Any = None, label: Callable[[int], str] = str,
                 shapes: dict[tuple, tuple[int, ...]] | None = None):
        self.rank = rank
        self.rank_of = rank_of_stage
        self.specs = specs
        self.devices = devices  # device of each stage
        self.sizes = sizes  # per micro-batch: every size symbol's value
        self.timeout = timeout
        self.store = store
        self.waiter = waiter
        self.label = label
        self._index = {name: i for i, name in enumerate(sorted(specs))}
        self._num_stages = len(devices)
        self._sends: list[tuple[Any, str]] = []
        # per posted message: its buffers, and the waiter's (done, outcome) of each receive
        self._posted: dict[Message, list[tuple[Any, torch.Tensor]]] = {}
        self._shapes = {} if shapes is None else shapes  # (value, sizes) -> concrete shape
        self._size_keys = [tuple(s.items()) for s in sizes]
        self.stats = {"messages": 0, "bytes": 0, "wait_seconds": 0.0}  # this rank, this step

    # -- transport interface ---------------------------------------------------------------

    def post(self, messages: Sequence[Message]) -> None:
        """Post the receives of ``messages`` now, so their data moves while this rank computes."""
        for message in messages:
            if message not in self._posted:
                self._posted[message] = self._irecv(message)

    def send(self, message: Message, values: Mapping[str, Any]) -> None:
        dst = self.rank_of(message.dst)
        self.stats["messages"] += 1
        for name in message.values:
            tensor = self._payload(message, name, values.get(name))
            self.stats["bytes"] += tensor.numel() * tensor.element_size()
            work = dist.isend(tensor, dst=dst, tag=self._tag(message, name))
            self._sends.append((work, f"{message} (to rank {dst})"))

    def recv(self, message: Message) -> dict[str, Any]:
        requests = self._posted.pop(message, None) or self._irecv(message)
        src = self.rank_of(message.src)
        for handle, _ in requests:
            self._wait(handle, message.dst, message, src)
        return {name: buf if self.specs[name].dtype is not None else int(buf.item())
                for name, (_, buf) in zip(message.values, requests)}

    def poll(self, message: Message) -> bool:
        """A receive blocks until its data is there: one row per rank never needs to poll."""
        return True

    def _payload(self, message: Message, name: str, value: Any) -> torch.Tensor:
        device = self.devices[message.src]
        if value is None:  # a gradient of a value that did not reach the loss: zero
            spec = self.specs[name]
            return torch.zeros(self._shape(name, message.microbatch), dtype=spec.dtype,
                               device=device)
        if isinstance(value, torch.Tensor):
            # in the captured dtype, which the receive buffer has: under autocast a value may
            # be computed in bf16/fp16, and upcasting it is exact
            return value.detach().to(self.specs[name].dtype or value.dtype).contiguous()
        return torch.tensor(int(value), dtype=torch.int64, device=device)

    def _irecv(self, message: Message) -> list[tuple[Any, torch.Tensor]]:
        src, device = self.rank_of(message.src), self.devices[message.dst]
        requests = []
        for name in message.values:
            spec = self.specs[name]
            buf = torch.empty(self._shape(name, message.microbatch),
                              dtype=spec.dtype or torch.int64, device=device)
            work = dist.irecv(buf, src=src, tag=self._tag(message, name))
            assert work is not None, "this rank is in the default group"
            # waited for from now on: completed as soon as it arrives, in posting order
            requests.append((self.waiter.submit(work, self.timeout + 5.0), buf))
        return requests

    def _shape(self, name: str, microbatch: int) -> tuple[int, ...]:
        """Value `name`'s shape in `microbatch`, evaluated once per distinct sizes."""
        key = (name, self._size_keys[microbatch])
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = tuple(self.specs[name].shape(self.sizes[microbatch]))
        return shape

    def finish(self) -> None:
        """Complete every send of the step (they complete once their receiver has the data)."""
        for work, what in self._sends:
            self._wait(self.waiter.submit(work, self.timeout + 5.0), None, what, None)
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

    def _tag(self, message: Message, name: str) -> int:
        # Unique per (message, value) of a step: link, direction, micro-batch, value.
        link = (message.src * self._num_stages + message.dst) * 2 + message.backward
        return (link * len(self.sizes) + message.microbatch) * len(self._index) + self._index[name]

    def _wait(self, handle: tuple[threading.Event, list[BaseException]], stage: int | None,
              what: Any, peer: int | None) -> None:
        """Block until the waiter has completed a request (`Waiter.submit`'s handle)."""
        began = time.perf_counter()
        try:
            self._wait_for(handle, stage, what, peer)
        finally:
            self.stats["wait_seconds"] += time.perf_counter() - began

    def _wait_for(self, handle, stage: int | None, what: Any, peer: int | None) -> None:
        done, outcome = handle
        if done.is_set() and not outcome:
            return  # already arrived: the common case of a posted receive
        deadline = time.monotonic() + self.timeout
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
