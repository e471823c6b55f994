"""Schedule generators: pure functions from (devices, micro-batches) to per-device action lists.

Terms: p stages, D devices, v virtual stages per device (p = D·v), m micro-batches. ``F``
forward, ``B`` backward, ``I``/``W`` backward for inputs/weights, ``STEP`` optimizer step; see
`pipecompile.schedule.actions`. Generators emit compute actions only; `make_schedule` lowers the
result with `add_communication` (the messages of a program's dataflow) and validates it. A
user-written `Schedule` (``Schedule.from_text``/``from_csv``) takes the same path in place of a
generator's output (`user_schedule`: its counts checked, its own messages dropped).

Every generator has the signature
``(num_devices, num_microbatches, *, virtual_stages=1) -> Schedule``; only the interleaved
schedule accepts ``virtual_stages > 1``. Simulated timelines with F=1, B=2 (I=W=1), p=3, m=4,
one character per time unit: a digit is the forward of that micro-batch, a letter its backward
(``a`` = micro-batch 0, ``b`` = 1, ...; a B is two cells ``aa``, an I upper case ``A``, a W lower
case ``a``), ``.`` is idle::

    GPipe (Huang et al. 2019): bubble (p-1)/(m+p-1) = 1/3; stage 0 holds m = 4 micro-batches
      dev0  0123......aabbccdd
      dev1  .0123...aabbccdd..
      dev2  ..0123aabbccdd....

    1F1B / PipeDream-Flush (Narayanan et al. 2021): same bubble; stage s holds min(p-s, m)
      dev0  012....aa3bb.cc.dd
      dev1  .01..aa2bb3cc.dd..
      dev2  ..0aa1bb2cc3dd....

    ZB-H1 (Qi et al. 2024): bubble (p-1)(F+I-W) per device instead of (p-1)(F+B), here
    (p-1)/(3m+p-1) = 1/7, about 1/3 of 1F1B's; stage 0 holds min(p, m) like 1F1B
      dev0  012..Aa3BbCcDd
      dev1  .01.A2Ba3CbDcd
      dev2  ..0A1B2Ca3Dbcd

    Interleaved 1F1B (Megatron-LM), D=2, v=2 (stages 0, 2 on dev0; 1, 3 on dev1), m=4:
    bubble (D-1)/(v·m+D-1) = 1/9
      dev0  01012.aa3bb2aa3bb.cc.ddccdd
      dev1  .010aa1bb2aa3bb2cc3ddccdd..

`tests/schedule/test_schedules.py` pins the exact action lists and
`tests/schedule/test_simulate.py` the bubble formulas.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Protocol

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.lowering import add_communication
from pipecompile.schedule.messages import Dataflow
from pipecompile.schedule.validate import validate
from pipecompile.schedule.zero_bubble import interleaved_zb, zb_v

__all__ = [
    "TWO_STAGES_PER_DEVICE",
    "ScheduleFn",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "SCHEDULES",
    "ASYNC_SCHEDULE_NAMES",
    "SCHEDULE_NAMES",
    "ScheduleProperties",
    "properties_of",
    "schedule_properties",
    "make_schedule",
    "user_schedule",
]


class ScheduleFn(Protocol):
    def __call__(
        self, num_devices: int, num_microbatches: int, *, virtual_stages: int = 1
    ) -> Schedule: ...


def _check(name: str, num_devices: int, num_microbatches: int, virtual_stages: int) -> None:
    for label, value in (
        ("num_devices", num_devices),
        ("num_microbatches", num_microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be an int >= 1, got {value!r}")


def _one_stage_per_device(name: str, num_devices: int, m: int, virtual_stages: int) -> None:
    _check(name, num_devices, m, virtual_stages)
    if virtual_stages != 1:
        raise ScheduleError(
            f"{name} runs one stage per device, so virtual_stages must be 1 "
            f"(got {virtual_stages}); use 'interleaved-1f1b' for several stages per device"
        )


def _schedule(name: str, p: int, m: int, rows: list[list[Action]]) -> Schedule:
    d = len(rows)
    return Schedule(name, p, m, tuple(s % d for s in range(p)), tuple(map(tuple, rows)))


def gpipe(num_devices: int, num_microbatches: int, *, virtual_stages: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards, then the optimizer step.

    Backwards run in micro-batch order 0..m-1 (the reverse order gives the same makespan with
    uniform costs; in order keeps the printed schedule easy to read).
    """
    _one_stage_per_device("gpipe", num_devices, num_microbatches, virtual_stages)
    p, m = num_devices, num_microbatches
    rows = [
        [Action(s, Kind.F, i) for i in range(m)]
        + [Action(s, Kind.B, i) for i in range(m)]
        + [Action(s, Kind.STEP)]
        for s in range(p)
    ]
    return _schedule("gpipe", p, m, rows)


def _one_f_one_b_row(s: int, p: int, m: int) -> list[Action]:
    # PipeDream-Flush (Narayanan et al. 2021, "Memory-efficient pipeline-parallel DNN
    # training"): min(p-s-1, m) warm-up forwards, then alternate one forward and one backward,
    # then drain; at most min(p-s, m) micro-batches are ever in flight on stage s.
    warmup = min(p - s - 1, m)
    row = [Action(s, Kind.F, i) for i in range(warmup)]
    for k in range(m - warmup):
        row += [Action(s, Kind.F, warmup + k), Action(s, Kind.B, k)]
    row += [Action(s, Kind.B, i) for i in range(m - warmup, m)]
    return row + [Action(s, Kind.STEP)]


def one_f_one_b(num_devices: int, num_microbatches: int, *, virtual_stages: int = 1) -> Schedule:
    """1F1B / PipeDream-Flush: same bubble as GPipe, stage s holds at most p - s micro-batches."""
    _one_stage_per_device("1f1b", num_devices, num_microbatches, virtual_stages)
    p, m = num_devices, num_microbatches
    return _schedule("1f1b", p, m, [_one_f_one_b_row(s, p, m) for s in range(p)])


def interleaved_1f1b(
    num_devices: int, num_microbatches: int, *, virtual_stages: int = 1
) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v stages per device, s on s % D.

    Each device works through its m·v (stage, micro-batch) units in Megatron's order: micro-
    batches go in groups of D, and a group visits the device's stages in turn (forwards from the
    first stage to the last, backwards from the last to the first). Device d runs
    ``2(D-d-1) + (v-1)·D`` warm-up forwards, then one forward and one backward per step, then
    drains. The bubble shrinks to (D-1)/(v·m + D-1). With v = 1 this is plain 1F1B.
    """
    name = "interleaved-1f1b"
    _check(name, num_devices, num_microbatches, virtual_stages)
    d_count, m, v = num_devices, num_microbatches, virtual_stages
    if v == 1:
        rows = [_one_f_one_b_row(s, d_count, m) for s in range(d_count)]
        return _schedule(name, d_count, m, rows)
    if m % d_count:
        raise ScheduleError(
            f"{name}: micro-batches go through the devices in groups of num_devices, so "
            f"num_microbatches ({m}) must be a multiple of num_devices ({d_count}); use "
            f"{(m // d_count + 1) * d_count} micro-batches, or '1f1b'"
        )
    total = m * v

    def unit(k: int, device: int, *, forward: bool) -> Action:
        # Megatron's get_model_chunk_id / microbatch id for the k-th unit of a device.
        chunk = (k // d_count) % v
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // (d_count * v)) * d_count + k % d_count
        return Action(chunk * d_count + device, Kind.F if forward else Kind.B, mb)

    rows = []
    for device in range(d_count):
        warmup = min((d_count - device - 1) * 2 + (v - 1) * d_count, total)
        row = [unit(k, device, forward=True) for k in range(warmup)]
        for k in range(total - warmup):
            row += [unit(warmup + k, device, forward=True), unit(k, device, forward=False)]
        row += [unit(k, device, forward=False) for k in range(total - warmup, total)]
        row += [Action(c * d_count + device, Kind.STEP) for c in range(v)]
        rows.append(row)
    return _schedule(name, d_count * v, m, rows)


def zb_h1(num_devices: int, num_microbatches: int, *, virtual_stages: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2.1).

    1F1B with the backward split into I (input gradient, on the critical path) and W (weight
    gradient, free to move). Stage s keeps 1F1B's p-s-1 warm-up forwards, then runs F, I pairs
    and starts issuing one W per step only after s steps, so every stage has at most p
    micro-batches between F and W (stage 0, which holds the most, keeps 1F1B's peak). The
    deferred W's fill the drain: the bubble is (p-1)(F+I-W) instead of 1F1B's (p-1)(F+I+W),
    i.e. a bubble fraction of (p-1)/(3m+p-1) when F=I=W and m >= p (fewer micro-batches leave
    too few W's to fill it, but it stays below 1F1B's).
    """
    _one_stage_per_device("zb-h1", num_devices, num_microbatches, virtual_stages)
    p, m = num_devices, num_microbatches
    rows = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        row = [Action(s, Kind.F, i) for i in range(warmup)]
        weights = 0
        for k in range(m):  # step k runs I(k): with F(warmup+k) first while forwards remain
            if warmup + k < m:
                row.append(Action(s, Kind.F, warmup + k))
            row.append(Action(s, Kind.I, k))
            if k >= s:  # delay W by s steps (torch.distributed.pipelining does the same)
                row.append(Action(s, Kind.W, weights))
                weights += 1
        row += [Action(s, Kind.W, i) for i in range(weights, m)]
        rows.append(row + [Action(s, Kind.STEP)])
    return _schedule("zb-h1", p, m, rows)


SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,  # two stages per device in a V (schedule/zero_bubble.py)
    "interleaved-zb": interleaved_zb,  # interleaved 1F1B's placement, I/W split
}

# The one list of schedule names (compile validates against it, the CLI offers it, load reads
# it back): the synchronous ones above, then those that update weights during a step
# (schedule/async_schedules.py, imported lazily because it builds on this module).
ASYNC_SCHEDULE_NAMES: tuple[str, ...] = ("pipedream", "2bw")
SCHEDULE_NAMES: tuple[str, ...] = (*SCHEDULES, *ASYNC_SCHEDULE_NAMES)
#: The schedules that place two stages on every device unless told otherwise.
TWO_STAGES_PER_DEVICE: tuple[str, ...] = ("interleaved-1f1b", "zb-v", "interleaved-zb")


@dataclass(frozen=True)
class ScheduleProperties:
    """What a built-in schedule is, read from a small instance's actions (`Schedule`'s
    properties), for code that knows only the name."""

    splits_backward: bool
    asynchronous: bool


@functools.lru_cache(maxsize=None)
def properties_of(name: str) -> ScheduleProperties:
    """The properties of the built-in schedule `name` (2 devices, 4 micro-batches)."""
    instance = make_schedule(name, 2, 4)
    return ScheduleProperties(instance.splits_backward, instance.asynchronous)


def schedule_properties(name: str, written: Schedule | None = None) -> ScheduleProperties:
    """The properties of the `written` schedule, else of the built-in schedule `name` (neither
    split nor asynchronous for a name that is not one)."""
    if written is not None:
        return ScheduleProperties(written.splits_backward, written.asynchronous)
    return properties_of(name) if name in SCHEDULE_NAMES else ScheduleProperties(False, False)


def make_schedule(
    name: str | Schedule, num_devices: int, num_microbatches: int, *,
    virtual_stages: int | None = None, batches: int = 1, dataflow: Dataflow | None = None,
) -> Schedule:
    """Generate the schedule ``name`` (or take a user-written `Schedule`: `user_schedule`), add its
    sends and receives, and validate it.

    `virtual_stages` None: the schedule's own default (2 for zb-v and interleaved-zb, else 1).

    `batches` > 1 (asynchronous schedules only) makes one stream of batches × m micro-batches.
    `dataflow`: the program's links, whose messages the schedule moves (default: each stage
    reads from the one before it, `Dataflow.chain`).
    """
    from pipecompile.schedule.async_schedules import ASYNC_SCHEDULES

    known = {**SCHEDULES, **ASYNC_SCHEDULES}
    if isinstance(name, Schedule):
        plain = user_schedule(name, num_devices, num_microbatches,
                              virtual_stages=virtual_stages, batches=batches)
        validate(plain, dataflow)  # errors name the actions written, not the messages added
    elif name not in known:
        raise ScheduleError(
            f"unknown schedule {name!r}; known schedules: {', '.join(sorted(known))}"
        )
    elif name in ASYNC_SCHEDULES:
        plain = ASYNC_SCHEDULES[name](num_devices, num_microbatches,
                                      virtual_stages=virtual_stages or 1, batches=batches)
    elif batches != 1:
        raise ScheduleError(f"{name} flushes after every batch; streams need pipedream or 2bw")
    else:
        plain = (SCHEDULES[name](num_devices, num_microbatches) if virtual_stages is None else
                 SCHEDULES[name](num_devices, num_microbatches, virtual_stages=virtual_stages))
    schedule = add_communication(plain, dataflow)
    validate(schedule, dataflow)
    return schedule


def user_schedule(schedule: Schedule, num_devices: int, num_microbatches: int, *,
                  virtual_stages: int | None = None, batches: int = 1) -> Schedule:
    """A user-written synchronous schedule as a generator would return it: compute only.

    Its counts must be the ones asked for (`virtual_stages` None: any number of stages). Its
    sends and receives, if it has any, are dropped: lowering adds the messages of the program
    that runs it. A stage without a ``STEP`` gets one at the end of its device's list, as the
    generators write it. A ``STEP`` with a micro-batch (an asynchronous update) is refused.
    """
    stages = None if virtual_stages is None else num_devices * virtual_stages
    for what, has, asked in (("devices", schedule.num_devices, num_devices),
                             ("micro-batches", schedule.num_microbatches, num_microbatches),
                             ("stages", schedule.num_stages, stages)):
        if asked is not None and has != asked:
            raise ScheduleError(f"schedule {schedule.name!r} has {has} {what}, but {asked} "
                                f"were asked for; write it for {asked} or ask for {has}")
    if batches != 1:
        raise ScheduleError(f"schedule {schedule.name!r} flushes after every batch; streams "
                            f"need pipedream or 2bw")
    rows = [[a for a in row if not a.is_comm] for row in schedule.actions]
    for device, row in enumerate(rows):
        for action in row:
            if action.kind is Kind.STEP and action.microbatch is not None:
                raise ScheduleError(
                    f"schedule {schedule.name!r}, device {device}: {action} updates the weights "
                    f"after micro-batch {action.microbatch} (asynchronous); a written schedule "
                    f"must be synchronous: write {action.stage}STEP after the stage's last "
                    f"backward, or leave it out")
    stepped = {a.stage for row in rows for a in row if a.kind is Kind.STEP}
    for stage, device in enumerate(schedule.stage_to_device):
        if stage not in stepped:
            rows[device].append(Action(stage, Kind.STEP))
    return replace(schedule, actions=tuple(map(tuple, rows)))
