"""LocalExecutor: run a schedule in one process, one worker thread per device.

Each device thread walks its action list in order; a dispatch table maps the action kind to a
small function. Values move between stages through a `Mailbox`: a forward output is put, already
on the consumer's device, under (consumer stage, value, micro-batch); an input gradient is added
under (value, micro-batch) and is complete once every consumer stage has delivered its part (a
skip connection read by two later stages gets the sum). SEND/RECV actions are satisfied by the
mailbox itself: a receive is a wait, a send is done when the producer puts the value.

Every wait has a timeout and fails with an error naming the stage, the action and the value it
waited for; an exception in one thread stops the others (they see the abort flag) and is raised
from `run` as a `StageExecutionError` naming the stage and the action.

Optimizer STEP actions run after every thread has finished the step's actions, once tied
parameters' gradients are summed across their copies (synchronous schedules only; the
asynchronous ones bring their own update rule).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import StageExecutionError
from .actions import Action, Kind, Schedule
from .microbatch import MicroBatch
from .simulate import Event
from .stage_worker import StageWorker

__all__ = ["LocalExecutor", "Mailbox", "Wiring"]


@dataclass(frozen=True)
class Wiring:
    """Which stage produces each boundary value and which stages read it."""

    producer: Mapping[str, int]
    consumers: Mapping[str, tuple[int, ...]]
    input_names: tuple[str, ...]  # flat model inputs, fed to every stage that reads them
    devices: tuple[torch.device, ...]  # device of each stage


class _Aborted(Exception):
    """Raised in a waiting thread when another thread has failed."""


class Mailbox:
    """Values in flight between stages; waits are bounded by `timeout` seconds."""

    def __init__(self, consumers: Mapping[str, tuple[int, ...]], timeout: float):
        self._consumers = consumers
        self._timeout = timeout
        self._cond = threading.Condition()
        self._acts: dict[tuple[int, str, int], Any] = {}
        self._grads: dict[tuple[str, int], list] = {}  # (value, mb) -> [sum, deliveries]
        self.aborted = False

    def put_activation(self, stage: int, name: str, mb: int, value: Any) -> None:
        with self._cond:
            self._acts[(stage, name, mb)] = value
            self._cond.notify_all()

    def get_activation(self, stage: int, name: str, mb: int, what: str) -> Any:
        return self._wait(lambda: self._acts.pop((stage, name, mb), _MISSING), what)

    def add_gradient(self, name: str, mb: int, grad: Any) -> None:
        with self._cond:
            entry = self._grads.setdefault((name, mb), [None, 0])
            if grad is not None:
                entry[0] = grad if entry[0] is None else entry[0] + grad
            entry[1] += 1
            self._cond.notify_all()

    def get_gradient(self, name: str, mb: int, what: str) -> Any:
        expected = len(self._consumers[name])

        def take():
            entry = self._grads.get((name, mb))
            if entry is None or entry[1] < expected:
                return _MISSING
            del self._grads[(name, mb)]
            return entry[0]

        return self._wait(take, what)

    def abort(self) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()

    def _wait(self, take: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while True:
                if self.aborted:
                    raise _Aborted()
                value = take()
                if value is not _MISSING:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"waited {self._timeout:.0f}s for {what}")
                self._cond.wait(min(left, 1.0))


_MISSING = object()


class LocalExecutor:
    """Interprets a synchronous schedule over `workers` (one per stage) in one process."""

    def __init__(
        self,
        workers: Sequence[StageWorker],
        wiring: Wiring,
        *,
        timeout: float = 300.0,
        threads: bool = True,
    ):
        self.workers = list(workers)
        self.wiring = wiring
        self.timeout = timeout
        self.threads = threads
        self.records: list[Event] = []

    def run(self, schedule: Schedule, microbatches: Sequence[MicroBatch],
            flat_inputs: Sequence[Sequence[Any]]) -> list[Action]:
        """Execute every non-STEP action of `schedule`; returns the STEP actions to apply."""
        mailbox = Mailbox(self.wiring.consumers, self.timeout)
        feeds = [dict(zip(self.wiring.input_names, flat)) for flat in flat_inputs]
        self.records = []
        start = time.perf_counter()
        errors: list[BaseException] = []
        steps = [a for actions in schedule.actions for a in actions if a.kind is Kind.STEP]

        def device_loop(device: int) -> None:
            for action in schedule.actions[device]:
                if action.kind is Kind.STEP:
                    continue
                try:
                    began = self._dispatch(action, mailbox, feeds, microbatches)
                except _Aborted:
                    return
                except BaseException as exc:  # noqa: BLE001 - reported with its action
                    errors.append(_stage_error(action, exc))
                    mailbox.abort()
                    return
                self.records.append(Event(device, action, began - start,
                                          time.perf_counter() - start))

        if self.threads and schedule.num_devices > 1:
            pool = [threading.Thread(target=device_loop, args=(d,), daemon=True,
                                     name=f"pipecompile-device{d}")
                    for d in range(schedule.num_devices)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        else:
            self._run_interleaved(schedule, mailbox, feeds, microbatches, errors, start)
        if errors:
            raise errors[0]
        return steps

    def _run_interleaved(self, schedule, mailbox, feeds, microbatches, errors, start) -> None:
        """One thread: round-robin over devices, running each device's next ready action."""
        cursors = [0] * schedule.num_devices
        pending = sum(len(a) for a in schedule.actions)
        while pending:
            progressed = False
            for device, actions in enumerate(schedule.actions):
                while cursors[device] < len(actions):
                    action = actions[cursors[device]]
                    if action.kind is not Kind.STEP and not self._ready(action, mailbox):
                        break
                    if action.kind is not Kind.STEP:
                        try:
                            began = self._dispatch(action, mailbox, feeds, microbatches)
                        except BaseException as exc:  # noqa: BLE001
                            errors.append(_stage_error(action, exc))
                            return
                        self.records.append(Event(device, action, began - start,
                                                  time.perf_counter() - start))
                    cursors[device] += 1
                    pending -= 1
                    progressed = True
            if not progressed:
                blocked = [str(a[c]) for a, c in zip(schedule.actions, cursors) if c < len(a)]
                errors.append(StageExecutionError(
                    f"schedule {schedule.name!r} cannot progress: blocked on {blocked}"))
                return

    # -- actions ---------------------------------------------------------------------------

    def _dispatch(self, action: Action, mailbox: Mailbox, feeds, microbatches) -> float:
        """Run `action`; returns when its compute began (after its inputs arrived)."""
        called = time.perf_counter()
        began = _ACTIONS[action.kind](self, action, mailbox, feeds, microbatches)
        return began if began is not None else called

    def _ready(self, action: Action, mailbox: Mailbox) -> bool:
        """Single-thread mode: whether `action`'s inputs are already in the mailbox."""
        w = self.workers[action.stage]
        mb = action.microbatch
        if action.kind is Kind.F:
            names = [n for n in w.input_names if n in self.wiring.producer]
            with mailbox._cond:
                return all((action.stage, n, mb) in mailbox._acts for n in names)
        if action.kind in (Kind.B, Kind.I):
            if w.loss is not None:
                return True
            with mailbox._cond:
                return all(
                    (n, mb) in mailbox._grads
                    and mailbox._grads[(n, mb)][1] >= len(self.wiring.consumers[n])
                    for n in w.output_names
                )
        return True

    def _forward(self, action, mailbox, feeds, microbatches) -> None:
        stage, mb = action.stage, action.microbatch
        worker = self.workers[stage]
        device = self.wiring.devices[stage]
        inputs = {}
        for name in worker.input_names:
            if name in self.wiring.producer:
                what = f"activation {name!r} of micro-batch {mb} from stage {self.wiring.producer[name]}"
                inputs[name] = mailbox.get_activation(stage, name, mb, what)
            else:
                inputs[name] = _to(feeds[mb][name], device)
        target = _to(microbatches[mb].target, device) if worker.loss is not None else None
        began = time.perf_counter()
        outputs = worker.forward(mb, inputs, target)
        for name in worker.output_names:
            for consumer in self.wiring.consumers.get(name, ()):
                value = _to(outputs[name], self.wiring.devices[consumer])
                mailbox.put_activation(consumer, name, mb, value)
        return began

    def _output_grads(self, action, mailbox) -> dict[str, Any]:
        worker = self.workers[action.stage]
        if worker.loss is not None:
            return {}
        grads = {}
        for name in worker.output_names:
            what = f"gradient of {name!r} for micro-batch {action.microbatch}"
            grads[name] = mailbox.get_gradient(name, action.microbatch, what)
        return grads

    def _send_input_grads(self, action, mailbox, grads: Mapping[str, Any]) -> None:
        for name in self.workers[action.stage].input_names:
            if name in self.wiring.producer:
                grad = grads.get(name)
                producer_device = self.wiring.devices[self.wiring.producer[name]]
                mailbox.add_gradient(name, action.microbatch, _to(grad, producer_device))

    def _backward(self, action, mailbox, feeds, microbatches) -> float:
        output_grads = self._output_grads(action, mailbox)
        began = time.perf_counter()
        grads = self.workers[action.stage].backward(action.microbatch, output_grads)
        self._send_input_grads(action, mailbox, grads)
        return began

    def _backward_input(self, action, mailbox, feeds, microbatches) -> float:
        output_grads = self._output_grads(action, mailbox)
        began = time.perf_counter()
        grads = self.workers[action.stage].backward_input(action.microbatch, output_grads)
        self._send_input_grads(action, mailbox, grads)
        return began

    def _backward_weight(self, action, mailbox, feeds, microbatches) -> None:
        self.workers[action.stage].backward_weight(action.microbatch)

    def _communication(self, action, mailbox, feeds, microbatches) -> None:
        """The mailbox moves values as they are produced; nothing to do here."""


_ACTIONS: dict[Kind, Callable] = {
    Kind.F: LocalExecutor._forward,
    Kind.B: LocalExecutor._backward,
    Kind.I: LocalExecutor._backward_input,
    Kind.W: LocalExecutor._backward_weight,
    Kind.SEND_F: LocalExecutor._communication,
    Kind.RECV_F: LocalExecutor._communication,
    Kind.SEND_B: LocalExecutor._communication,
    Kind.RECV_B: LocalExecutor._communication,
}


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def _stage_error(action: Action, exc: BaseException) -> BaseException:
    from ..errors import PipecompileError

    if isinstance(exc, PipecompileError) and not isinstance(exc, StageExecutionError):
        return exc  # a user-facing error (e.g. a non-scalar loss): raise it as it is
    error = StageExecutionError(
        f"stage {action.stage} failed in action {action}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
