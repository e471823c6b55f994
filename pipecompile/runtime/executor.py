"""Executor: interpret a lowered schedule's action lists over stage workers and a transport.

Each device row of the schedule is walked in order by its own thread (in one process: one
thread per device; under torch.distributed: this rank's row only). A dispatch table maps the
action kind to a small function. Values move exactly as the schedule says:

    F(s, i)          reads the values handed to stage s for micro-batch i; hands each output to
                     the stages reading it: directly when they share s's device, else into the
                     outbox of the message to that stage
    SEND(s, i, >p)   gives that message (all its values) to the transport      (transport.py)
    RECV(s, i, <p)   takes the message from the transport; its values feed s's next F or B
    B/I(s, i)        the same backward: output gradients summed over every reader of a value,
                     input gradients handed back directly or through SEND_B messages

The transport is a `Mailbox` (threads of one process) or a `P2PTransport` (ranks). A
synchronous STEP is returned to the caller, which applies it once the step's gradients are
complete (tied parameters and data-parallel replicas summed); an asynchronous STEP (with a
micro-batch: PipeDream, 2BW) updates its stage in place, in order.

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
from ..schedule.actions import Action, Kind, Schedule
from ..tensors import to_device
from .mailbox import Aborted
from ..schedule.messages import Dataflow, Message, message_of
from .microbatch import MicroBatch
from ..schedule.simulate import Event
from .stage_worker import StageWorker
from .transport import Transport

__all__ = ["Executor", "Wiring"]


@dataclass(frozen=True)
class Wiring:
    """Which stage produces each boundary value, which stages read it, which carry gradients."""

    producer: Mapping[str, int]
    consumers: Mapping[str, tuple[int, ...]]
    input_names: tuple[str, ...]  # flat model inputs, fed to every stage that reads them
    devices: tuple[torch.device, ...]  # device of each stage
    grad_values: frozenset[str]  # floating point boundary values (gradients flow back)

    def dataflow(self) -> Dataflow:
        """The links that lowering turns into messages."""
        return Dataflow.from_wiring(self.producer, self.consumers, self.grad_values,
                                    len(self.devices))


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
        self.autocast: Any = None  # the caller's AutocastState, re-entered around computation
        self.dataflow = wiring.dataflow()
        # Constant per plan, looked up on every action: each stage's links out and in, and
        # the message of each SEND/RECV action (the dataflow's links are scanned once).
        stages = range(len(wiring.devices))
        self._readers = {s: self.dataflow.readers(s) for s in stages}
        self._sources = {s: tuple(k for k in self.dataflow.sources(s) if k.grads) for s in stages}
        self._messages: dict[Action, Message] = {}
        # Per step: values handed to (stage, mb), output gradients summed for (stage, mb), and
        # each message's values from its producing action until its SEND. Each key is written
        # and read by one device's thread only.
        self._inputs: dict[tuple[int, int], dict[str, Any]] = {}
        self._grads: dict[tuple[int, int], dict[str, Any]] = {}
        self._outbox: dict[tuple[int, int, int, bool], dict[str, Any]] = {}
        self._home: tuple[int, ...] = ()

    def run(self, schedule: Schedule, transport: Transport, microbatches: Sequence[MicroBatch],
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
        self._inputs, self._grads, self._outbox = {}, {}, {}
        self._home = schedule.stage_to_device
        # Every receive of these rows, posted now: messages move while the devices compute.
        transport.post([self._message(a) for d in rows for a in schedule.actions[d]
                        if a.kind in (Kind.RECV_F, Kind.RECV_B)])

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

    def _ready(self, action: Action, transport: Transport) -> bool:
        """Only a receive waits for another row; everything else is ready in row order."""
        if action.kind in (Kind.RECV_F, Kind.RECV_B):
            return transport.poll(self._message(action))
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
        if self.autocast is not None and action.kind in _COMPUTE:  # thread-local: re-entered
            with self.autocast.entered():
                began = _ACTIONS[action.kind](self, action, *context)
        else:
            began = _ACTIONS[action.kind](self, action, *context)
        return began if began is not None else called

    def _forward(self, action, transport, feeds, microbatches) -> float:
        stage, mb = action.stage, action.microbatch
        worker = self.workers[stage]
        device = self.wiring.devices[stage]
        handed = self._inputs.pop((stage, mb), {})
        inputs = {}
        for name in worker.input_names:
            if name not in self.wiring.producer:
                inputs[name] = to_device(feeds[mb][name], device)
            elif name in handed:
                inputs[name] = handed[name]
            else:
                raise StageExecutionError(
                    f"{self.label(stage)} has no value {name!r} for micro-batch {mb} in action "
                    f"{action}: no receive from stage {self.wiring.producer[name]} ran before "
                    f"it; lower the schedule with the program's wiring (relower)")
        began = time.perf_counter()
        if self.forward_only:
            outputs = worker.infer(inputs)
            if worker.loss is not None:
                self.outputs[mb] = outputs
        else:
            target = to_device(microbatches[mb].target, device) if worker.loss is not None else None
            outputs = worker.forward(mb, inputs, target)
        _publish(device)
        for link in self._readers[stage]:
            values = {name: outputs[name] for name in link.values}
            if self._home[link.dst] == self._home[stage]:
                self._hand(self._inputs, (link.dst, mb), values, add=False)
            else:
                self._outbox[(stage, link.dst, mb, False)] = values
        return began

    def _backward(self, action, transport, feeds, microbatches) -> float:
        return self._backward_with(StageWorker.backward, action, transport)

    def _backward_input(self, action, transport, feeds, microbatches) -> float:
        return self._backward_with(StageWorker.backward_input, action, transport)

    def _backward_with(self, method: Callable, action, transport) -> float:
        """B or I: the summed output gradients in, the input gradients handed back."""
        stage, mb = action.stage, action.microbatch
        grads_in = self._grads.pop((stage, mb), {})
        began = time.perf_counter()
        grads = method(self.workers[stage], mb, grads_in)
        _publish(self.wiring.devices[stage])
        for link in self._sources[stage]:
            values = {name: grads.get(name) for name in link.grads}
            if self._home[link.src] == self._home[stage]:
                self._hand(self._grads, (link.src, mb), values, add=True)
            else:
                self._outbox[(stage, link.src, mb, True)] = values
        return began

    def _hand(self, store: dict, key: tuple[int, int], values: Mapping[str, Any], *,
              add: bool) -> None:
        """Values for stage key[0]: put (activations) or summed (gradients of a value read by
        several stages); a None gradient (the value did not reach the loss) adds nothing."""
        device = self.wiring.devices[key[0]]
        held = store.setdefault(key, {})
        for name, value in values.items():
            value = to_device(value, device)
            if not add:
                held[name] = value
            elif value is not None:
                held[name] = value if held.get(name) is None else held[name] + value

    def _message(self, action: Action) -> Message:
        message = self._messages.get(action)
        if message is None:  # several threads may store the same message: harmless
            message = self._messages[action] = message_of(action, self.dataflow)
        return message

    def _backward_weight(self, action, transport, feeds, microbatches) -> None:
        self.workers[action.stage].backward_weight(action.microbatch)

    def _update(self, action, transport, feeds, microbatches) -> None:
        """Asynchronous STEP: this stage's update, in the device's own order."""
        self.workers[action.stage].apply_update()

    def _send(self, action, transport, feeds, microbatches) -> None:
        """Give the transport the message this action names, with all its values."""
        message = self._message(action)
        key = (message.src, message.dst, message.microbatch, message.backward)
        values = self._outbox.pop(key, None)
        if values is None:
            raise StageExecutionError(
                f"{self.label(action.stage)}: {action} has nothing to send ({message}); the "
                f"action that computes it has not run on this device")
        transport.send(message, values)

    def _receive(self, action, transport, feeds, microbatches) -> None:
        """Take the message from the transport: inputs of the next F, or gradients to sum."""
        message = self._message(action)
        values = transport.recv(message)
        store = self._grads if message.backward else self._inputs
        self._hand(store, (message.dst, message.microbatch), values, add=message.backward)


_ACTIONS: dict[Kind, Callable] = {
    Kind.F: Executor._forward,
    Kind.B: Executor._backward,
    Kind.I: Executor._backward_input,
    Kind.W: Executor._backward_weight,
    Kind.STEP: Executor._update,
    Kind.SEND_F: Executor._send,
    Kind.RECV_F: Executor._receive,
    Kind.SEND_B: Executor._send,
    Kind.RECV_B: Executor._receive,
}

_COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})  # actions that run the stage or autograd


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

