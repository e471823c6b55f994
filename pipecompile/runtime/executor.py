"""Executor: interpret a schedule's action lists over stage workers and a transport.

Each device row of the schedule is walked in order by its own thread (in one process: one
thread per device; under torch.distributed: this rank's row only). A dispatch table maps the
action kind to a small function. Values move through a *transport*:

    Mailbox       in-process queues between device threads            (runtime/mailbox.py)
    P2PTransport  torch.distributed point-to-point between ranks      (runtime/p2p.py)

Both deliver a forward output straight from its producing stage to every consuming stage (skip
connections skip the stages in between) and sum the input gradients of a value read by several
stages. SEND/RECV actions are satisfied by the transport: a value is sent when it is produced and
received when an action needs it. A synchronous STEP is returned to the caller, which applies it
once the step's gradients are complete (tied parameters and data-parallel replicas summed); an
asynchronous STEP (with a micro-batch: PipeDream, 2BW) updates its stage in place, in order.

Every wait has a timeout; an exception in one thread stops the others and is raised as a
`StageExecutionError` naming the stage and the action.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import PipecompileError, StageExecutionError
from ..tensors import to_device as _to
from .actions import Action, Kind, Schedule
from .mailbox import Aborted
from .microbatch import MicroBatch
from .simulate import Event
from .stage_worker import StageWorker

__all__ = ["Executor", "Wiring"]


@dataclass(frozen=True)
class Wiring:
    """Which stage produces each boundary value and which stages read it."""

    producer: Mapping[str, int]
    consumers: Mapping[str, tuple[int, ...]]
    input_names: tuple[str, ...]  # flat model inputs, fed to every stage that reads them
    devices: tuple[torch.device, ...]  # device of each stage


class Executor:
    """Runs the device rows `rows` of a schedule over `workers` (stage index -> worker)."""

    def __init__(self, workers: Mapping[int, StageWorker], wiring: Wiring, *,
                 threads: bool = True, rows: Sequence[int] | None = None,
                 label: Callable[[int], str] = lambda stage: f"stage {stage}"):
        self.workers = dict(workers)
        self.wiring = wiring
        self.threads = threads
        self.rows = rows  # None: every device row of the schedule
        self.label = label  # how errors name a stage (the distributed executor adds the rank)
        self.records: list[Event] = []
        self.outputs: dict[int, dict[str, Any]] = {}  # forward-only runs: last stage's outputs
        self.forward_only = False

    def run(self, schedule: Schedule, transport, microbatches: Sequence[MicroBatch],
            flat_inputs: Sequence[Sequence[Any]], *, forward_only: bool = False) -> list[Action]:
        """Execute every non-STEP action of the rows; returns their STEP actions.

        `forward_only` runs F actions without keeping anything for a backward pass and collects
        the last stage's outputs in `self.outputs[microbatch]`.
        """
        self.forward_only = forward_only
        self.outputs = {}
        feeds = [dict(zip(self.wiring.input_names, flat)) for flat in flat_inputs]
        rows = list(self.rows) if self.rows is not None else list(range(schedule.num_devices))
        self.records = []
        self._start = time.perf_counter()
        errors: list[BaseException] = []
        steps = [a for d in rows for a in schedule.actions[d]
                 if a.kind is Kind.STEP and a.microbatch is None]
        context = (transport, feeds, microbatches)
        post = getattr(transport, "post_receives", None)
        if post is not None:  # point-to-point: let messages arrive while this rank computes
            post([a for d in rows for a in schedule.actions[d]], self.workers)

        if self.threads and len(rows) > 1:
            pool = [threading.Thread(target=self._row, args=(d, schedule, context, errors),
                                     daemon=True, name=f"pipecompile-device{d}") for d in rows]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        elif len(rows) == 1:
            self._row(rows[0], schedule, context, errors)
        else:
            self._interleave(rows, schedule, context, errors)
        if not errors:
            try:
                transport.finish()
            except BaseException as exc:  # noqa: BLE001
                transport.abort(exc)
                errors.append(exc)
        if errors:
            raise errors[0]
        return steps

    def _row(self, device: int, schedule: Schedule, context, errors: list) -> None:
        with _device_stream(self._row_device(device, schedule)):
            self._walk(device, schedule, context, errors)

    def _row_device(self, row: int, schedule: Schedule) -> torch.device:
        stages = [s for s in range(schedule.num_stages) if schedule.stage_to_device[s] == row]
        return self.wiring.devices[stages[0]] if stages else torch.device("cpu")

    def _walk(self, device: int, schedule: Schedule, context, errors: list) -> None:
        transport = context[0]
        for action in schedule.actions[device]:
            if action.kind is Kind.STEP and action.microbatch is None:
                continue  # a synchronous step waits for every stage: the caller applies it
            try:
                self._record(device, action, self._dispatch(action, context))
            except Aborted:
                return
            except BaseException as exc:  # noqa: BLE001 - reported with its action
                error = self._error(action, exc)
                errors.append(error)
                transport.abort(error)
                return

    def _interleave(self, rows, schedule, context, errors) -> None:
        """One thread, several rows: round-robin, running each row's next ready action."""
        cursors = {d: 0 for d in rows}
        pending = sum(len(schedule.actions[d]) for d in rows)
        while pending:
            progressed = False
            for device in rows:
                actions = schedule.actions[device]
                while cursors[device] < len(actions):
                    action = actions[cursors[device]]
                    if action.kind is not Kind.STEP or action.microbatch is not None:
                        if not self._ready(action, context[0]):
                            break
                        try:
                            self._record(device, action, self._dispatch(action, context))
                        except BaseException as exc:  # noqa: BLE001
                            errors.append(self._error(action, exc))
                            context[0].abort(errors[-1])
                            return
                    cursors[device] += 1
                    pending -= 1
                    progressed = True
            if not progressed:
                blocked = [str(schedule.actions[d][c]) for d, c in cursors.items()
                           if c < len(schedule.actions[d])]
                errors.append(StageExecutionError(
                    f"schedule {schedule.name!r} cannot progress: blocked on {blocked}"))
                return

    def _ready(self, action: Action, transport) -> bool:
        worker = self.workers[action.stage]
        if action.kind is Kind.F:
            names = [n for n in worker.input_names if n in self.wiring.producer]
            return transport.has_activations(action.stage, names, action.microbatch)
        if action.kind in (Kind.B, Kind.I) and worker.loss is None:
            return transport.has_gradients(worker.output_names, action.microbatch)
        return True

    def _record(self, device: int, action: Action, began: float) -> None:
        self.records.append(Event(device, action, began - self._start,
                                  time.perf_counter() - self._start))

    def _error(self, action: Action, exc: BaseException) -> BaseException:
        if isinstance(exc, PipecompileError):
            return exc  # already user-facing (a non-scalar loss, a failure of another rank)
        error = StageExecutionError(
            f"{self.label(action.stage)} failed in action {action}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    # -- actions ---------------------------------------------------------------------------

    def _dispatch(self, action: Action, context) -> float:
        """Run `action`; returns when its compute began (after its inputs arrived)."""
        called = time.perf_counter()
        began = _ACTIONS[action.kind](self, action, *context)
        return began if began is not None else called

    def _forward(self, action, transport, feeds, microbatches) -> float:
        stage, mb = action.stage, action.microbatch
        worker = self.workers[stage]
        device = self.wiring.devices[stage]
        inputs = {}
        for name in worker.input_names:
            if name in self.wiring.producer:
                inputs[name] = transport.recv_activation(stage, name, mb)
            else:
                inputs[name] = _to(feeds[mb][name], device)
        began = time.perf_counter()
        if self.forward_only:
            outputs = worker.infer(inputs)
            if worker.loss is not None:
                self.outputs[mb] = outputs
        else:
            target = _to(microbatches[mb].target, device) if worker.loss is not None else None
            outputs = worker.forward(mb, inputs, target)
        _publish(device)
        for name in worker.output_names:
            if name in self.wiring.consumers:
                transport.send_activation(stage, name, mb, outputs[name])
        return began

    def _output_grads(self, action, transport) -> dict[str, Any]:
        worker = self.workers[action.stage]
        if worker.loss is not None:
            return {}
        return {name: transport.recv_gradient(action.stage, name, action.microbatch)
                for name in worker.output_names}

    def _send_input_grads(self, action, transport, grads: Mapping[str, Any]) -> None:
        for name in self.workers[action.stage].input_names:
            if name in self.wiring.producer:
                transport.send_gradient(action.stage, name, action.microbatch, grads.get(name))

    def _backward(self, action, transport, feeds, microbatches) -> float:
        return self._backward_with(StageWorker.backward, action, transport)

    def _backward_input(self, action, transport, feeds, microbatches) -> float:
        return self._backward_with(StageWorker.backward_input, action, transport)

    def _backward_with(self, method: Callable, action, transport) -> float:
        """B or I: wait for the output gradients, run `method`, send the input gradients."""
        output_grads = self._output_grads(action, transport)
        began = time.perf_counter()
        grads = method(self.workers[action.stage], action.microbatch, output_grads)
        _publish(self.wiring.devices[action.stage])
        self._send_input_grads(action, transport, grads)
        return began

    def _backward_weight(self, action, transport, feeds, microbatches) -> None:
        self.workers[action.stage].backward_weight(action.microbatch)

    def _update(self, action, transport, feeds, microbatches) -> None:
        """Asynchronous STEP: this stage's update, in the device's own order."""
        self.workers[action.stage].apply_update()

    def _communication(self, action, transport, feeds, microbatches) -> None:
        """The transport sends values as they are produced and receives them when needed."""


_ACTIONS: dict[Kind, Callable] = {
    Kind.F: Executor._forward,
    Kind.B: Executor._backward,
    Kind.I: Executor._backward_input,
    Kind.W: Executor._backward_weight,
    Kind.STEP: Executor._update,
    Kind.SEND_F: Executor._communication,
    Kind.RECV_F: Executor._communication,
    Kind.SEND_B: Executor._communication,
    Kind.RECV_B: Executor._communication,
}


def _device_stream(device: torch.device):
    """On a CUDA device each worker thread issues its kernels on a stream of its own, so the
    devices of one process compute concurrently; elsewhere nothing changes."""
    if device.type == "cuda":
        return torch.cuda.stream(torch.cuda.Stream(device))
    return contextlib.nullcontext()


def _publish(device: torch.device) -> None:
    """Values leave this thread's stream: wait for the kernels that produce them (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
