"""Executor: run a lowered schedule's generated device functions over stage workers.

Each device row of the schedule is emitted once as a straight-line Python function
(`codegen.py`: one block of statements per action, no interpretation per action) and run by
its own thread (in one process: one thread per device; under torch.distributed: this rank's row
only). Values move exactly as the schedule says:

    F(s, i)          reads the values handed to stage s for micro-batch i; hands each output to
                     the stages reading it: directly when they share s's device, else into the
                     outbox of the message to that stage
    SEND(s, i, >p)   gives that message (all its values) to the transport      (transport.py)
    RECV(s, i, <p)   takes the message from the transport; its values feed s's next F or B
    B/I(s, i)        the same backward: output gradients summed over every reader of a value,
                     input gradients handed back directly or through SEND_B messages

The transport is a `Mailbox` (threads of one process) or a `P2PTransport` (ranks). A
synchronous STEP(s) completes stage s's gradients (tied copies and data-parallel replicas
summed) and steps its optimizer where the row reaches it (`stage_steps.py`); an asynchronous
STEP (with a micro-batch: PipeDream, 2BW) updates its stage in place, in order.

Each action runs inside a `torch.profiler.record_function` range named ``PP:<action>``
(`profiling.py`); a step profiled in one process runs every row in the calling thread, which
the profiler records.

Every wait has a timeout; an exception in one thread stops the others and is raised as a
`StageExecutionError` naming the device, stage, action and micro-batch, found from the
generated code's frame in the traceback.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import ConfigError, PipecompileError, StageExecutionError
from ..schedule.actions import Action, Kind, Schedule
from .mailbox import Aborted
from .thread_state import kept_thread_state
from ..schedule.messages import Dataflow, Message
from ..schedule.simulate import Event
from .codegen import DeviceCode, StageCode, emit, failed_action, load
from .microbatch import MicroBatch
from .profiling import thread_local_session
from .stage_steps import StepRound
from .stage_worker import StageWorker
from .transport import Transport

__all__ = ["Executor", "Executed", "Wiring"]


@dataclass(frozen=True)
class Wiring:
    """The program's links (`Dataflow`: which stage produces each boundary value, which stages
    read it, which carry gradients), its flat model inputs and each stage's device."""

    dataflow: Dataflow
    input_names: tuple[str, ...]  # flat model inputs, fed to every stage that reads them
    devices: tuple[torch.device, ...]  # device of each stage


@dataclass(frozen=True)
class Executed:
    """What running a schedule's rows gave: the timed actions, and (forward-only runs) the
    last stage's outputs per micro-batch."""

    events: tuple[Event, ...]
    outputs: Mapping[int, Mapping[str, Any]]
    started: float = 0.0  # time.perf_counter() when the run began: the events' zero


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
        self.dataflow = wiring.dataflow
        produced = self.dataflow.producers()
        self._stages = {
            s: StageCode.of(w, fed=frozenset(n for n in w.input_names if n not in produced),
                            accelerator=wiring.devices[s].type == "cuda")
            for s, w in self.workers.items()}
        # generated code per schedule and mode, by the schedule's identity and by its value
        self._programs: dict[tuple, _Program] = {}
        # each device row's CUDA stream, made once: the caching allocator pools blocks per
        # stream, so a new stream every step would cudaMalloc every step
        self._streams: dict[tuple[int, torch.device], Any] = {}

    def code(self, schedule: Schedule, device: int, *, forward_only: bool = False) -> str:
        """The generated source of device row `device` running `schedule`."""
        rows = self.rows if self.rows is not None else range(schedule.num_devices)
        if device not in rows:
            raise ConfigError(f"device {device} is not run by this process (it runs rows "
                              f"{list(rows)}); under torch.distributed each rank generates "
                              f"only its own row")
        return self._program(schedule, [device], forward_only, stepwise=False).rows[0].source

    def run(self, schedule: Schedule, transport: Transport, microbatches: Sequence[MicroBatch],
            flat_inputs: Sequence[Sequence[Any]], *, forward_only: bool = False,
            autocast: Any = None, finish: StepRound | None = None) -> Executed:
        """Execute every action of the rows; a synchronous STEP(s) calls `finish(s)`
        (`stage_steps.StepRound`: the stage's gradients completed, its optimizer stepped).

        `forward_only` runs F actions without keeping anything for a backward pass and collects
        the last stage's outputs. `autocast` (the caller's `AutocastState`, or None) is entered
        in each device thread, around its whole row.
        """
        rows = list(self.rows) if self.rows is not None else list(range(schedule.num_devices))
        # a profiler recording only this thread would miss the device threads: run every row
        # here instead (`profiling.py`)
        stepwise = len(rows) > 1 and (not self.threads or thread_local_session())
        program = self._program(schedule, rows, forward_only, stepwise)
        names = self.wiring.input_names
        feeds = [dict(zip(names, flat)) for flat in flat_inputs]
        targets = [mb.target for mb in microbatches]
        outputs: dict[int, Any] = {}
        records: list[list[tuple]] = [[] for _ in program.rows]
        args = [(self.workers, self.wiring.devices, transport, finish, feeds, targets,
                 outputs, records[r]) for r in range(len(program.rows))]
        entered = (lambda: autocast.entered()) if autocast is not None \
            else contextlib.nullcontext
        errors: list[BaseException] = []
        start = time.perf_counter()
        # Every receive of these rows, posted now: messages move while the devices compute.
        transport.post(program.receives)
        if stepwise:
            self._interleave(program, args, transport, errors, entered)
        elif len(program.rows) > 1:
            streams = [self._stream(code.device, program.devices[r])
                       for r, code in enumerate(program.rows)]
            pool = [threading.Thread(target=self._row, args=(code, program.devices[r], args[r],
                                                             transport, finish, errors, entered,
                                                             streams[r]),
                                     daemon=True, name=f"pipecompile-device{code.device}")
                    for r, code in enumerate(program.rows)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        else:
            # one row, in the caller's thread: its current stream (nothing runs beside it)
            self._row(program.rows[0], program.devices[0], args[0], transport, finish, errors,
                      entered, None)
        if not errors:
            try:
                transport.finish()
            except BaseException as exc:  # noqa: BLE001
                transport.abort(exc)
                errors.append(exc)
        if errors:
            raise errors[0]
        events = tuple(Event(code.device, code.actions[k], began - start, end - start)
                       for code, row in zip(program.rows, records) for k, began, end in row)
        return Executed(events, outputs, start)

    def _program(self, schedule: Schedule, rows: Sequence[int], forward_only: bool,
                 stepwise: bool) -> "_Program":
        """The generated code of `rows`, emitted once per schedule and mode (a few kept)."""
        key = (id(schedule), tuple(rows), forward_only, stepwise)
        known = self._programs.get(key)
        if known is not None and known.schedule is schedule:
            return known
        # an equal schedule made again (a forward-only call builds its own each time)
        same = (schedule, tuple(rows), forward_only, stepwise)
        known = self._programs.get(same)
        if known is not None:
            return known
        codes = tuple(load(emit(schedule, d, self._stages, self.dataflow,
                                forward_only=forward_only, stepwise=stepwise)) for d in rows)
        receives = tuple(m for code in codes for a, m in zip(_comm(code.actions), code.messages)
                         if a.kind in (Kind.RECV_F, Kind.RECV_B))
        program = _Program(schedule, codes, receives,
                           tuple(self._row_device(code) for code in codes))
        while len(self._programs) >= 2 * _KEEP:  # the oldest go (dicts keep insertion order)
            del self._programs[next(iter(self._programs))]
        self._programs[key] = self._programs[same] = program
        return program

    def _row(self, code: DeviceCode, device: torch.device, args: tuple, transport: Transport,
             finish: StepRound | None, errors: list[BaseException],
             entered: Callable[[], Any], stream: Any) -> None:
        """Run one row's generated function in this thread (on `stream`, None: the thread's
        current one); a failure aborts the others (their receives, and a STEP waiting for
        this row's stages)."""
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        try:  # a failure inside a no-grad region must not leave this thread without grad
            with kept_thread_state((device.type,)), on_stream, entered():
                code.fn(*args)
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - reported with its action
            error = self._error(code, exc)
            errors.append(error)
            transport.abort(error)
            if finish is not None:
                finish.abort(error)

    def _interleave(self, program: "_Program", args: list[tuple], transport: Transport,
                    errors: list[BaseException], entered: Callable[[], Any]) -> None:
        """One thread, several rows: round-robin over their generators, each running until a
        receive whose message has not arrived; no row moving in a whole round is a deadlock."""
        running = {r: code.fn(*args[r]) for r, code in enumerate(program.rows)}
        waiting: dict[int, int] = {}  # row -> the action index it waits at
        with kept_thread_state(d.type for d in program.devices), entered():
            while running:
                moved = False
                for r, generator in list(running.items()):
                    try:
                        at = next(generator)
                    except StopIteration:
                        del running[r]
                        moved = True
                        continue
                    except BaseException as exc:  # noqa: BLE001
                        errors.append(self._error(program.rows[r], exc))
                        transport.abort(errors[-1])
                        return
                    moved = moved or waiting.get(r) != at
                    waiting[r] = at
                if running and not moved:
                    blocked = [str(program.rows[r].actions[waiting[r]]) for r in running]
                    errors.append(StageExecutionError(
                        f"schedule {program.schedule.name!r} cannot progress: blocked on "
                        f"{blocked}"))
                    return

    def _stream(self, row: int, device: torch.device) -> Any:
        """On a CUDA device, the stream device row `row` issues its kernels on (its own, so the
        devices of one process compute concurrently; the same one every step); else None."""
        if device.type != "cuda":
            return None
        key = (row, device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    def _row_device(self, code: DeviceCode) -> torch.device:
        stages = sorted({a.stage for a in code.actions})
        return self.wiring.devices[stages[0]] if stages else torch.device("cpu")

    def _error(self, code: DeviceCode, exc: BaseException) -> BaseException:
        if isinstance(exc, PipecompileError):
            return exc  # already user-facing (a non-scalar loss, a failure of another rank)
        action = failed_action(code, exc.__traceback__)
        if action is None:
            where = f"device {code.device}"
        else:
            mb = "" if action.microbatch is None else f", micro-batch {action.microbatch}"
            where = (f"{self.label(action.stage)} failed in action {action} (device "
                     f"{code.device}{mb})")
        error = StageExecutionError(f"{where}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error


@dataclass(frozen=True)
class _Program:
    """The generated code of a schedule's rows, with what a run needs besides."""

    schedule: Schedule
    rows: tuple[DeviceCode, ...]
    receives: tuple[Message, ...]  # every receive of the rows: posted at step start
    devices: tuple[torch.device, ...]  # each row's device (its first stage's)


_KEEP = 8  # generated programs kept per executor (schedules it ran recently)


def _comm(actions: Sequence[Action]) -> list[Action]:
    """The send and receive actions, in order: the i-th has the generated code's i-th message."""
    return [a for a in actions if a.kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)]

