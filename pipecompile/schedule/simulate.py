"""Predict a schedule's timeline from per-stage costs.

Terms
-----
- **event**: one action that ran on one device from ``start`` to ``end`` (seconds).
- **timeline**: the events of one training step. `simulate` predicts it; the executors record
  the same type with measured times, so a plot or a test can put both side by side.
- **bubble**: the idle share of the devices' time,
  ``1 - Σ compute time / (num_devices · makespan)``; compute is F, B, I, W and STEP.
- **in flight**: a micro-batch whose forward has started on a stage and whose backward (the W
  of a split backward) has not finished; activation memory grows with it.

Semantics (`simulate`)
----------------------
Every device runs its actions in order, one at a time. A compute action starts when its device
is free and its data dependencies (`pipecompile.schedule.validate.dependencies`) are met; a
message from another device arrives ``transfers[(sender, receiver, direction)]`` seconds after
the sending stage finished what it sends (direction ``"F"``: activations, producer to consumer;
``"B"``: gradients, back; `messages.message_bytes` and `messages.transfer_seconds` compute them
from a program). Without ``transfers``, a message costs its sender's ``StageCosts.send_forward``
or ``send_backward``. A transfer is pure latency on a link: it uses no device time, links never
contend, and the timeline records each one (`Timeline.transfers`).
A stage's ``setup`` is added to its first forward of the step and its ``teardown`` to its STEP
(else to its last backward, B or W), so that it delays its device but not the gradients its
last backward sends: the layout's collectives that the step waits for (an
FSDP all-gather before the first forward, a gradient reduction and optimizer step after the
last backward). A ``SEND`` takes no time; a ``RECV`` lasts from when its device reaches it until the value
arrives (waiting, not counted as compute). Schedules with or without explicit communication give
the same times. With ``blocking=True`` (a runtime whose sends block, as Megatron-LM's
p2p_communication waits on its batched isend/irecv and synchronizes the device after each
exchange), a ``SEND`` occupies its device until its message has arrived: the message's time
is spent on the sender's device, and the receiver has the value when the send ends.

Devices that share cores (``cores``): worker threads of one process on a CPU compete for its
cores. With ``cores=c``, when k > c compute actions run at once each progresses at c/k of its
speed (processor sharing, as the OS time-slices the threads); with k <= c, at full speed. With
``efficiency=e`` < 1, k >= 2 actions running at once are each e times slower again (the GIL,
shared caches: `measure.stages.thread_efficiency` measures it). The default (``cores=None``)
gives every device its own hardware.

p=2, m=2, F=1, B=2, 1F1B::

    t     0    1    2    3    4    5    6    7    8    9
    dev0  [0F0][0F1]..........[0B0     ].....[0B1     ]
    dev1  .....[1F0][1B0     ][1F1][1B1     ]..........
    makespan 9, busy 6 per device, bubble 1 - 12/18 = 1/3 = (p-1)/(m+p-1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.messages import Dataflow
from pipecompile.schedule.validate import dependencies, validate

__all__ = ["StageCosts", "Event", "Transfer", "Timeline", "simulate", "inflight", "Transfers"]

#: Seconds per message, by (sender stage, receiver stage, "F" or "B"): a mapping (a missing key
#: costs nothing) or a function.
Transfers = Union[Mapping[tuple[int, int, str], float], Callable[[int, int, str], float]]

_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP)
_SENDS = (Kind.SEND_F, Kind.SEND_B)


@dataclass(frozen=True)
class StageCosts:
    """Seconds one stage spends per micro-batch on each action.

    ``backward_input``/``backward_weight`` are the I and W parts of ``backward``; when one is None
    it is ``backward`` minus the other, and when both are None each is half of ``backward``.
    ``send_forward``/``send_backward``: the cost of each message this stage sends when
    `simulate` is given no per-message ``transfers``.
    """

    forward: float
    backward: float
    backward_input: float | None = None
    backward_weight: float | None = None
    send_forward: float = 0.0
    send_backward: float = 0.0
    # the layout's collectives on the critical path (data parallelism): seconds added to the
    # stage's first forward of the step (FSDP's all-gather) and to its last backward (the
    # replicas' gradient reduction and the optimizer step, where not hidden behind backward)
    setup: float = 0.0
    teardown: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "send_forward", "send_backward", "setup",
                     "teardown"):
            if getattr(self, name) < 0:
                raise ScheduleError(f"StageCosts.{name} must be >= 0, got {getattr(self, name)}")
        if self.input_time < 0 or self.weight_time < 0:
            raise ScheduleError(
                f"StageCosts: backward_input ({self.input_time}) and backward_weight "
                f"({self.weight_time}) must be >= 0; give both or keep them within backward"
            )

    @property
    def input_time(self) -> float:
        if self.backward_input is not None:
            return self.backward_input
        if self.backward_weight is not None:
            return self.backward - self.backward_weight
        return self.backward / 2

    @property
    def weight_time(self) -> float:
        if self.backward_weight is not None:
            return self.backward_weight
        return self.backward - self.input_time


@dataclass(frozen=True)
class Event:
    device: int
    action: Action
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ScheduleError(
                f"event {self.action} on device {self.device} ends before it starts"
            )

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Transfer:
    """One message on its link: sent by stage ``src`` at ``start``, there at ``end``."""

    src: int
    dst: int
    microbatch: int
    direction: str  # "F" (activations) or "B" (gradients)
    start: float
    end: float

    def __str__(self) -> str:
        return f"{self.src}->{self.dst} {self.direction}{self.microbatch}"


@dataclass(frozen=True)
class Timeline:
    """The events of one step, predicted or measured, and the predicted transfers."""

    events: tuple[Event, ...]
    num_devices: int
    transfers: tuple[Transfer, ...] = ()

    @property
    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, device: int) -> float:
        """Compute seconds (F, B, I, W, STEP) spent on ``device``."""
        return sum(
            e.duration for e in self.events if e.device == device and e.action.kind in _COMPUTE
        )

    @property
    def bubble_fraction(self) -> float:
        total = self.num_devices * self.makespan
        if total == 0:
            return 0.0
        return 1.0 - sum(self.busy(d) for d in range(self.num_devices)) / total

    def peak_inflight(self, stage: int) -> int:
        """Most micro-batches on ``stage`` between the start of F and the end of B (or W)."""
        return _peak([e for e in self.events if e.action.stage == stage])

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (chrome://tracing, Perfetto): one thread per device, µs."""
        trace: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": f"device {d}"}}
            for d in range(self.num_devices)
        ]
        for e in self.events:
            trace.append(
                {
                    "name": str(e.action),
                    "cat": e.action.kind.value,
                    "ph": "X",
                    "pid": 0,
                    "tid": e.device,
                    "ts": e.start * 1e6,
                    "dur": e.duration * 1e6,
                    "args": {"stage": e.action.stage, "microbatch": e.action.microbatch},
                }
            )
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_devices": self.num_devices,
            "events": [
                {"device": e.device, "action": str(e.action), "start": e.start, "end": e.end}
                for e in self.events
            ],
            "transfers": [
                {"src": t.src, "dst": t.dst, "microbatch": t.microbatch,
                 "direction": t.direction, "start": t.start, "end": t.end}
                for t in self.transfers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        try:
            events = tuple(
                Event(
                    int(e["device"]), Action.parse(e["action"]), float(e["start"]), float(e["end"])
                )
                for e in data["events"]
            )
            transfers = tuple(
                Transfer(int(t["src"]), int(t["dst"]), int(t["microbatch"]), str(t["direction"]),
                         float(t["start"]), float(t["end"]))
                for t in data.get("transfers", ())
            )
            return cls(events, int(data["num_devices"]), transfers)
        except (KeyError, TypeError) as error:
            raise ScheduleError(
                f"not a timeline dict ({error!r}); expected {{'num_devices': int, 'events': "
                f"[{{'device', 'action', 'start', 'end'}}, ...]}} as written by Timeline.to_dict"
            ) from None


def _ends(schedule: Schedule) -> tuple[set[Action], set[Action]]:
    """Each stage's first forward, and its STEP (else its last backward, B or W) in its
    device's row: where `StageCosts.setup` and `teardown` are charged."""
    first: dict[int, Action] = {}
    last: dict[int, Action] = {}
    for row in schedule.actions:
        for a in row:
            if a.kind is Kind.F and a.stage not in first:
                first[a.stage] = a
            if a.kind is Kind.STEP or (a.kind in (Kind.B, Kind.W)
                                       and getattr(last.get(a.stage), "kind", None)
                                       is not Kind.STEP):
                last[a.stage] = a
    return set(first.values()), set(last.values())


def _duration(action: Action, cost: StageCosts, step_time: float, overhead: float = 0.0,
              ends: tuple[set[Action], set[Action]] | None = None) -> float:
    extra = 0.0
    if ends is not None and (cost.setup or cost.teardown):
        extra = (cost.setup if action in ends[0] else 0.0) + (
            cost.teardown if action in ends[1] else 0.0)
    return extra + _work(action, cost, step_time, overhead)


def _work(action: Action, cost: StageCosts, step_time: float, overhead: float) -> float:
    if action.kind is Kind.STEP:
        return step_time
    work = {
        Kind.F: cost.forward,
        Kind.B: cost.backward,
        Kind.I: cost.input_time,
        Kind.W: cost.weight_time,
    }.get(action.kind)
    return 0.0 if work is None else work + overhead


def _peak(mine: Sequence[Event]) -> int:
    """Most micro-batches in flight among one stage's events ``mine``."""
    split = {e.action.microbatch for e in mine if e.action.kind is Kind.W}
    changes: list[tuple[float, int]] = []
    for e in mine:
        a = e.action
        if a.kind is Kind.F:
            changes.append((e.start, +1))
        elif a.kind is Kind.W or (a.kind is Kind.B and a.microbatch not in split):
            changes.append((e.end, -1))
    # At equal times a release comes first: memory freed at t can be reused at t.
    count = peak = 0
    for _, delta in sorted(changes):
        count += delta
        peak = max(peak, count)
    return peak


def simulate(
    schedule: Schedule,
    costs: Sequence[StageCosts],
    *,
    step_time: float = 0.0,
    cores: int | None = None,
    efficiency: float = 1.0,
    dataflow: Dataflow | None = None,
    transfers: Transfers | None = None,
    overhead: float = 0.0,
    validated: bool = False,
    blocking: bool = False,
    deps: Mapping[Action, tuple[Action, ...]] | None = None,
    messages: bool = True,
) -> Timeline:
    """Predict when every action of a valid ``schedule`` runs; ``costs[s]`` is stage s's
    compute time.

    ``cores``: how many compute actions the devices can run at full speed at once (None: no
    limit); ``efficiency``: their speed when several run at once; ``dataflow``: the program's
    links (see `validate`); ``transfers``: seconds per message; ``overhead``: the fixed seconds
    every F, B, I and W action and every message between devices costs on top (dispatch, Python,
    launch, message latency); ``validated``: the schedule was validated already (by
    `make_schedule`), skip that (the planning search simulates many); ``blocking``: each
    explicit ``SEND`` lasts its message's time on the sender's device; see the module docstring.
    ``deps``: ``dependencies(schedule, dataflow)`` where the caller has it already (a search
    that simulates one schedule with many costs); ``messages=False``: leave
    `Timeline.transfers` empty (a search that reads the makespan only).
    """
    if not 0 <= overhead < float("inf"):
        raise ScheduleError(f"simulate: overhead must be finite and >= 0, got {overhead}")
    if len(costs) != schedule.num_stages:
        raise ScheduleError(
            f"simulate: got {len(costs)} StageCosts for {schedule.num_stages} stages; give one "
            f"per stage (e.g. [costs] * {schedule.num_stages})"
        )
    if not validated:
        validate(schedule, dataflow)
    if deps is None:
        deps = dependencies(schedule, dataflow)
    home = schedule.stage_to_device

    def message(src: int, dst: int, forward: bool) -> float:
        if transfers is None:
            cost = costs[src]
            return overhead + (cost.send_forward if forward else cost.send_backward)
        key = (src, dst, "F" if forward else "B")
        return overhead + (transfers(*key) if callable(transfers) else transfers.get(key, 0.0))

    def latency(dep: Action, action: Action) -> float:
        if home[dep.stage] == home[action.stage]:
            return 0.0
        if blocking and dep.kind in _SENDS:
            return 0.0  # the blocking send ended when its message had arrived
        return message(dep.stage, action.stage, dep.kind in (Kind.F, Kind.SEND_F))

    sends = {a: message(a.stage, a.peer, a.kind is Kind.SEND_F)
             for row in (schedule.actions if blocking else ()) for a in row
             if a.kind in _SENDS and a.peer is not None
             and home[a.stage] != home[a.peer]}

    if cores is not None and cores < 1:
        raise ScheduleError(f"simulate: cores must be >= 1 or None, got {cores}")
    if not 0 < efficiency <= 1:
        raise ScheduleError(f"simulate: efficiency must be in (0, 1], got {efficiency}")
    if cores is not None and (cores < schedule.num_devices or efficiency < 1):
        timeline = _simulate_shared(schedule, costs, deps, latency, step_time, cores, efficiency,
                                    overhead, sends)
    else:
        timeline = _simulate_free(schedule, costs, deps, latency, step_time, overhead, sends)
    if not messages:
        return timeline
    return Timeline(timeline.events, timeline.num_devices,
                    _transfers(timeline, deps, latency, sends))


def inflight(schedule: Schedule) -> tuple[int, ...]:
    """Peak in-flight micro-batches per stage (at least 1) of a valid schedule: what a stage's
    activation memory is sized for. A stage's actions run on its device one after another in
    the device's list, so the peak is read from the list order (an F holds a micro-batch; its
    W, or its B where the backward is not split, releases it), as any simulation gives it."""
    n = schedule.num_stages
    split = {(a.stage, a.microbatch) for row in schedule.actions for a in row if a.kind is Kind.W}
    count, peak = [0] * n, [1] * n
    for a in (a for row in schedule.actions for a in row if a.stage < n):
        if a.kind is Kind.F:
            count[a.stage] += 1
            peak[a.stage] = max(peak[a.stage], count[a.stage])
        elif a.kind is Kind.W or (a.kind is Kind.B and (a.stage, a.microbatch) not in split):
            count[a.stage] -= 1
    return tuple(peak)


def _transfers(timeline: Timeline, deps, latency, sends: dict) -> tuple[Transfer, ...]:
    """Every dependency across devices is a message: from its sender's end, for its latency
    (a blocking send: for the send's own duration)."""
    end = {e.action: e.end for e in timeline.events}
    begin = {e.action: e.start for e in timeline.events}
    home = {e.action: e.device for e in timeline.events}
    found = []
    for e in timeline.events:
        for dep in deps[e.action]:
            if home[dep] != e.device:
                microbatch = e.action.microbatch
                assert microbatch is not None, "only a STEP has none, and it waits on its stage"
                forward = dep.kind in (Kind.F, Kind.SEND_F)
                start = begin[dep] if dep in sends else end[dep]
                found.append(Transfer(dep.stage, e.action.stage, microbatch,
                                      "F" if forward else "B", start,
                                      end[dep] + latency(dep, e.action)))
    return tuple(sorted(found, key=lambda t: (t.start, t.src, t.dst)))


def _simulate_free(schedule, costs, deps, latency, step_time: float,
                   overhead: float, sends: dict) -> Timeline:
    """`simulate` when every device has its own hardware."""
    end: dict[Action, float] = {}
    ends = _ends(schedule)
    free = [0.0] * schedule.num_devices
    pcs = [0] * schedule.num_devices
    events: list[list[Event]] = [[] for _ in range(schedule.num_devices)]
    progress = True
    while progress:  # validate() guarantees that this loop finishes every device
        progress = False
        for device, row in enumerate(schedule.actions):
            while pcs[device] < len(row) and all(d in end for d in deps[row[pcs[device]]]):
                action = row[pcs[device]]
                ready = max((end[d] + latency(d, action) for d in deps[action]), default=0.0)
                if action.kind is Kind.RECV_F or action.kind is Kind.RECV_B:
                    start, finish = free[device], max(free[device], ready)
                else:
                    start = max(free[device], ready)
                    finish = start + (sends[action] if action in sends else _duration(
                        action, costs[action.stage], step_time, overhead, ends))
                events[device].append(Event(device, action, start, finish))
                end[action] = free[device] = finish
                pcs[device] += 1
                progress = True
    return Timeline(tuple(e for row in events for e in row), schedule.num_devices)


def _simulate_shared(schedule, costs, deps, latency, step_time: float, cores: int,
                     efficiency: float, overhead: float, sends: dict) -> Timeline:
    """`simulate` when the devices share ``cores``: an event-driven fluid simulation.

    Between two events (an action finishing, a transfer arriving) the k running compute actions
    each progress at rate min(1, cores / k), times ``efficiency`` when k >= 2; every device still
    runs its row in order.
    """
    n = schedule.num_devices
    end: dict[Action, float] = {}
    ends = _ends(schedule)
    pcs = [0] * n
    free = [0.0] * n  # when each device finished its previous action
    running: dict[int, list] = {}  # device -> [action, start, remaining seconds of work]
    waiting: dict[int, float] = {}  # device -> when its next action's inputs arrive
    events: list[list[Event]] = [[] for _ in range(n)]
    now = 0.0

    def finish(device: int, action: Action, start: float, t: float) -> None:
        events[device].append(Event(device, action, start, t))
        end[action] = free[device] = t
        pcs[device] += 1

    def start_ready() -> None:
        """Start (or finish, if instantaneous) every idle device's next action that can go now."""
        progress = True
        while progress:
            progress = False
            for device, row in enumerate(schedule.actions):
                if device in running or pcs[device] >= len(row):
                    continue
                action = row[pcs[device]]
                if not all(d in end for d in deps[action]):
                    continue
                ready = max((end[d] + latency(d, action) for d in deps[action]), default=0.0)
                if ready > now:
                    waiting[device] = ready
                    continue
                waiting.pop(device, None)
                if action.kind is Kind.RECV_F or action.kind is Kind.RECV_B:
                    finish(device, action, free[device], max(free[device], ready))
                    progress = True
                    continue
                work = sends[action] if action in sends else _duration(
                    action, costs[action.stage], step_time, overhead, ends)
                if work <= 0:
                    finish(device, action, now, now)
                    progress = True
                else:
                    running[device] = [action, now, work]

    start_ready()
    while running or waiting:
        k = len(running)
        rate = min(1.0, cores / k) * (efficiency if k >= 2 else 1.0) if k else 1.0
        t_next = min([now + r[2] / rate for r in running.values()] + list(waiting.values()))
        for r in running.values():
            r[2] -= (t_next - now) * rate
        now = t_next
        for device in [d for d, r in running.items() if r[2] <= 1e-12]:
            action, start, _ = running.pop(device)
            finish(device, action, start, now)
        start_ready()
    return Timeline(tuple(e for row in events for e in row), n)
