"""Codegen: each device's row of a lowered schedule, emitted as one straight-line Python function.

The executor does not interpret the action list. For every device row it emits a function that
performs that row's actions in order, one commented block per action, as torch.fx emits a
graph's ``forward``: values live in local dictionaries named for the stage and micro-batch they
belong to, messages are constants, and each local is deleted after its last use so nothing lives
longer than the interpreter kept it. Each stage's worker is bound once, with the behaviours
it was assembled with (`StageWorker.behaviours`), and each forward and backward names the one
it runs. For a 2-stage 1F1B whose last stage recomputes, device 1 reads::

    w1, d1 = workers[1], devices[1]  # stage 1 runs RecomputedForward, FusedBackward
    # 1RECV_F0<0: stage 1, receive the values of micro-batch 0
    with span('PP:1RECV_F0<0'):
        t = now()
        X1_0 = to_device(transport.recv(M[0]), d1)
        records.append((0, t, now()))
    # 1F0: stage 1, forward of micro-batch 0 (RecomputedForward)
    with span('PP:1F0'):
        t = now()
        o = w1.forward(0, {'h': X1_0['h']}, to_device(targets[0], d1))
        ...

Each action runs inside its profiler range (`profiling.span`: a `record_function` named
``PP:<action>`` while a profiler is active, a shared no-op otherwise).

The source is compiled under a file name registered with `linecache`, so a failing step's
traceback shows the generated line, and `failed_action` maps that line back to its action.
Lowering mistakes (a forward with no receive before it, a send of nothing) are found while
emitting, before any thread starts. ``stepwise=True`` emits a generator instead: before each
receive it yields while the message is not there, so one thread can interleave several rows.
"""

from __future__ import annotations

import bisect
import itertools
import linecache
import time
import weakref
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import StageExecutionError
from ..schedule.actions import Action, Kind, Schedule
from ..schedule.messages import Dataflow, Message, message_of
from ..ir.tensors import to_device
from .profiling import range_name, span

__all__ = ["StageCode", "DeviceCode", "emit", "load", "failed_action"]

_COUNTER = itertools.count()


@dataclass(frozen=True)
class StageCode:
    """What the emitter knows of a stage: its input names, which of them come from the model's
    inputs (not from another stage), whether it computes the loss, whether its device is an
    accelerator (values leaving it wait for its stream)."""

    index: int
    inputs: tuple[str, ...]
    fed: frozenset[str]
    loss: bool
    accelerator: bool = False
    # the worker's chosen behaviours (`StageWorker.behaviours`: forward, backward, gradient
    # hooks), named where the row binds the stage and on each action they run
    behaviours: tuple[str, ...] = ()

    @classmethod
    def of(cls, worker: Any, *, fed: frozenset[str], accelerator: bool = False) -> "StageCode":
        """What the emitter needs of a `StageWorker`, its chosen behaviours included."""
        return cls(worker.index, tuple(worker.input_names), fed, worker.loss is not None,
                   accelerator, tuple(getattr(worker, "behaviours", ())))


@dataclass
class DeviceCode:
    """One device row's generated function, its source and the first line of each action."""

    device: int
    source: str
    filename: str
    actions: tuple[Action, ...]  # the row's actions, in order (records name them by index)
    starts: tuple[int, ...]  # first source line of each action's block
    messages: tuple[Message, ...]
    fn: Callable[..., Any] = field(default=lambda *a: None, repr=False)

    def action_at(self, line: int) -> Action | None:
        """The action whose block holds source line `line`."""
        i = bisect.bisect_right(self.starts, line) - 1
        return self.actions[i] if i >= 0 else None


def emit(schedule: Schedule, device: int, stages: Mapping[int, StageCode], dataflow: Dataflow,
         *, forward_only: bool = False, stepwise: bool = False) -> DeviceCode:
    """The Python source of device row `device` of `schedule` (not yet compiled: `load`)."""
    return _Emitter(schedule, device, stages, dataflow, forward_only, stepwise).run()


def load(code: DeviceCode) -> DeviceCode:
    """Compile `code` under its own file name, registered with `linecache` for tracebacks
    (as long as `code` lives: the entry goes with it)."""
    linecache.cache[code.filename] = (len(code.source), None, code.source.splitlines(True),
                                      code.filename)
    weakref.finalize(code, linecache.cache.pop, code.filename, None)
    namespace: dict[str, Any] = {"M": code.messages, "to_device": to_device, "acc": _acc,
                                 "publish": _publish, "now": time.perf_counter, "span": span}
    exec(compile(code.source, code.filename, "exec"), namespace)  # noqa: S102 - our own source
    code.fn = namespace[f"device_{code.device}"]
    return code


def failed_action(code: DeviceCode, tb: TracebackType | None) -> Action | None:
    """The action whose generated line the traceback `tb` passed through last."""
    found = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == code.filename:
            found = code.action_at(tb.tb_lineno)
        tb = tb.tb_next
    return found


def _acc(store: dict, values: Mapping[str, Any], names: Sequence[str], device: Any) -> None:
    """Add gradients `values[names]` into `store` (a value read by several stages gets the sum
    of their gradients); a None gradient (the value did not reach the loss) adds nothing."""
    for name in names:
        value = values.get(name)
        if value is None:
            continue
        value = to_device(value, device)
        held = store.get(name)
        store[name] = value if held is None else held + value


def _publish(device: Any) -> None:
    """Values leave this thread's stream: wait for the kernels that produce them."""
    torch.cuda.current_stream(device).synchronize()


class _Emitter:
    """Writes one row's function; tracks which local dictionaries exist at each point."""

    def __init__(self, schedule: Schedule, device: int, stages: Mapping[int, StageCode],
                 dataflow: Dataflow, forward_only: bool, stepwise: bool):
        self.schedule, self.device, self.stages = schedule, device, stages
        self.dataflow, self.forward_only, self.stepwise = dataflow, forward_only, stepwise
        self.home = schedule.stage_to_device
        self.lines: list[str] = []
        self.messages: list[Message] = []
        self.inputs: dict[tuple[int, int], set[str]] = {}  # X{s}_{i}: values handed to s for mb i
        self.grads: set[tuple[int, int]] = set()  # G{s}_{i}: output gradients summed so far
        self.outbox: set[tuple[int, int, int, bool]] = set()  # S{src}_{dst}_{i}{F|B}
        self.depth = 1  # indentation of the statements being written

    def run(self) -> DeviceCode:
        actions = tuple(self.schedule.actions[self.device])
        own = [s for s, d in enumerate(self.home) if d == self.device]
        mode = "forward-only" if self.forward_only else "training step"
        self.line(f"def device_{self.device}(workers, devices, transport, finish, feeds, "
                  f"targets, outputs, records):", indent=-1)
        self.line(f'"""Device {self.device} of schedule {self.schedule.name!r} '
                  f'({mode}): stages {own}, {len(actions)} actions."""')
        for s in own:
            runs = self.stages[s].behaviours if s in self.stages and not self.forward_only \
                else ()
            self.line(f"w{s}, d{s} = workers[{s}], devices[{s}]"
                      + (f"  # stage {s} runs {', '.join(runs)}" if runs else ""))
        starts = []
        for k, action in enumerate(actions):
            starts.append(len(self.lines) + 1)
            self.action(k, action)
        if not actions or self.stepwise:
            self.line("return" if not self.stepwise else "yield from ()")
        source = "\n".join(self.lines) + "\n"
        filename = (f"<pipecompile-{next(_COUNTER)}: device {self.device}, "
                    f"{self.schedule.name} {mode}>")
        return DeviceCode(self.device, source, filename, actions, tuple(starts),
                          tuple(self.messages))

    def by(self, a: Action) -> str:
        """The behaviour that runs action `a` (its stage's forward or backward), as a comment
        suffix; nothing where the stage's behaviours are not known or nothing trains."""
        known = self.stages[a.stage].behaviours if a.stage in self.stages else ()
        if self.forward_only or len(known) < 2 or a.kind not in _BEHAVIOUR:
            return ""
        if a.kind is Kind.STEP and a.microbatch is None:  # `finish`, not the worker's
            return ""
        return f" ({known[_BEHAVIOUR[a.kind]]})"

    def line(self, text: str, indent: int = 0) -> None:
        self.lines.append("    " * (self.depth + indent) + text)

    def ranged(self, a: Action) -> None:
        """Open the action's profiler range (`profiling.span`): what follows, up to `closed`,
        runs inside it."""
        self.line(f"with span({range_name(a)!r}):")
        self.depth += 1

    def closed(self) -> None:
        self.depth -= 1

    def message(self, action: Action) -> tuple[int, Message]:
        self.messages.append(message_of(action, self.dataflow))
        return len(self.messages) - 1, self.messages[-1]

    def action(self, k: int, a: Action) -> None:
        s, i = a.stage, a.microbatch
        doing = _DOING[a.kind]
        self.line(f"# {a}: stage {s}, " + (f"{doing} {i}" if i is not None
                                            else doing.split(",")[0]) + self.by(a))
        if a.kind is Kind.STEP:
            if i is not None:  # PipeDream, 2BW: the stage updates in place, in row order
                self.ranged(a)
                self.line(f"t = now(); w{s}.apply_update(); records.append(({k}, t, now()))")
            elif self.stepwise:  # one thread runs every row: poll the stages it waits for
                self.line(f"finish.arrive({s})")
                self.line(f"while not finish.ready({s}):")
                self.line(f"yield {k}", indent=1)
                self.ranged(a)
                self.line(f"t = now(); finish.apply({s}); records.append(({k}, t, now()))")
            else:  # complete the stage's gradients (ties, replicas), then its optimizer
                self.ranged(a)
                self.line(f"t = now(); finish({s}); records.append(({k}, t, now()))")
            self.closed()
            return
        sent = self.message(a) if a.kind in _COMM else None
        if self.stepwise and sent is not None and a.kind in (Kind.RECV_F, Kind.RECV_B):
            self.line(f"while not transport.poll(M[{sent[0]}]):")
            self.line(f"yield {k}", indent=1)
        self.ranged(a)
        self.line("t = now()")
        getattr(self, "_" + a.kind.name.lower())(a, s, i, sent)
        self.line(f"records.append(({k}, t, now()))")
        self.closed()

    # -- one method per action kind --------------------------------------------------------

    def _f(self, a: Action, s: int, i: int, _: Any) -> None:
        stage = self.stages[s]
        handed = self.inputs.pop((s, i), set())
        args = []
        for name in stage.inputs:
            if name in stage.fed:
                args.append(f"{name!r}: to_device(feeds[{i}][{name!r}], d{s})")
            elif name in handed:
                args.append(f"{name!r}: X{s}_{i}[{name!r}]")
            else:
                producer = next((k.src for k in self.dataflow.sources(s) if name in k.values),
                                "another stage")
                raise StageExecutionError(
                    f"stage {s} has no value {name!r} for micro-batch {i} in action {a}: no "
                    f"receive from stage {producer} ran before it; lower the schedule with the "
                    f"program's wiring (relower)")
        inputs = "{" + ", ".join(args) + "}"
        if self.forward_only:
            self.line(f"o = w{s}.infer({inputs})")
            if stage.loss:
                self.line(f"outputs[{i}] = o")
        else:
            target = f"to_device(targets[{i}], d{s})" if stage.loss else "None"
            self.line(f"o = w{s}.forward({i}, {inputs}, {target})")
        if handed:
            self.line(f"del X{s}_{i}")
        if stage.accelerator:
            self.line(f"publish(d{s})")
        for link in self.dataflow.readers(s):
            picked = "{" + ", ".join(f"{n!r}: o[{n!r}]" for n in link.values) + "}"
            if self.home[link.dst] == self.device:
                key = (link.dst, i)
                if key in self.inputs:
                    self.line(f"X{link.dst}_{i}.update({picked})")
                else:
                    self.line(f"X{link.dst}_{i} = {picked}")
                self.inputs.setdefault(key, set()).update(link.values)
            else:
                self.line(f"S{s}_{link.dst}_{i}F = {picked}")
                self.outbox.add((s, link.dst, i, False))
        self.line("del o")

    def _b(self, a: Action, s: int, i: int, _: Any, method: str = "backward") -> None:
        grads = f"G{s}_{i}" if (s, i) in self.grads else "{}"
        self.line(f"g = w{s}.{method}({i}, {grads})")
        if (s, i) in self.grads:
            self.grads.discard((s, i))
            self.line(f"del G{s}_{i}")
        if self.stages[s].accelerator:
            self.line(f"publish(d{s})")
        for link in self.dataflow.sources(s):
            if not link.grads:
                continue
            if self.home[link.src] == self.device:
                key = (link.src, i)
                if key not in self.grads:
                    self.line(f"G{link.src}_{i} = {{}}")
                    self.grads.add(key)
                self.line(f"acc(G{link.src}_{i}, g, {link.grads!r}, d{link.src})")
            else:
                picked = "{" + ", ".join(f"{n!r}: g.get({n!r})" for n in link.grads) + "}"
                self.line(f"S{s}_{link.src}_{i}B = {picked}")
                self.outbox.add((s, link.src, i, True))
        self.line("del g")

    def _i(self, a: Action, s: int, i: int, _: Any) -> None:
        self._b(a, s, i, None, "backward_input")

    def _w(self, a: Action, s: int, i: int, _: Any) -> None:
        self.line(f"w{s}.backward_weight({i})")

    def _send_f(self, a: Action, s: int, i: int, sent: tuple[int, Message]) -> None:
        j, message = sent
        key = (message.src, message.dst, i, message.backward)
        if key not in self.outbox:
            raise StageExecutionError(
                f"stage {s}: {a} has nothing to send ({message}); the action that computes it "
                f"has not run on this device")
        self.outbox.discard(key)
        box = f"S{message.src}_{message.dst}_{i}{'B' if message.backward else 'F'}"
        self.line(f"transport.send(M[{j}], {box})")
        self.line(f"del {box}")

    _send_b = _send_f

    def _recv_f(self, a: Action, s: int, i: int, sent: tuple[int, Message]) -> None:
        j, message = sent
        key = (message.dst, i)
        received = f"to_device(transport.recv(M[{j}]), d{message.dst})"
        if key in self.inputs:
            self.line(f"X{message.dst}_{i}.update({received})")
        else:
            self.line(f"X{message.dst}_{i} = {received}")
        self.inputs.setdefault(key, set()).update(message.values)

    def _recv_b(self, a: Action, s: int, i: int, sent: tuple[int, Message]) -> None:
        j, message = sent  # gradients for the outputs of the receiving stage, message.dst
        key = (message.dst, i)
        if key not in self.grads:
            self.line(f"G{message.dst}_{i} = {{}}")
            self.grads.add(key)
        self.line(f"acc(G{message.dst}_{i}, transport.recv(M[{j}]), {message.values!r}, "
                  f"d{message.dst})")


_COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
# which of a stage's behaviours (StageCode.behaviours) runs each computing action
_BEHAVIOUR = {Kind.F: 0, Kind.B: 1, Kind.I: 1, Kind.W: 1, Kind.STEP: 1}
_DOING = {  # what an action does, completed by its micro-batch (a STEP may have none)
    Kind.F: "forward of micro-batch", Kind.B: "backward of micro-batch",
    Kind.I: "input gradients (zero-bubble I) of micro-batch",
    Kind.W: "weight gradients (zero-bubble W) of micro-batch",
    Kind.STEP: "optimizer step, after micro-batch", Kind.SEND_F: "send the values of micro-batch",
    Kind.RECV_F: "receive the values of micro-batch",
    Kind.SEND_B: "send the gradients of micro-batch",
    Kind.RECV_B: "receive the gradients of micro-batch",
}
