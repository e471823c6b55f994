"""A lower bound of a schedule's simulated makespan, found without simulating it.

    makespan_floor(schedule, costs, dataflow=..., overhead=...) <= simulate(...).makespan
    fill_floor(name, p, m, v, compute)   <= the makespan of gpipe or 1f1b, however placed

`simulate` runs each device's actions one at a time in order, each for at least its own
duration (its work, the fixed overhead and the stage's setup or teardown where they are
charged); waits and messages only add. So for every device the step lasts at least:

- the earliest its first action can be a forward: the forwards of that micro-batch on the
  stages its stage reads from, and theirs before them (the longest such path of the dataflow),
- plus the duration of every compute action on the device,
- plus, where its last compute action before its STEP is a backward (B or I) of stage s, the
  backwards of that micro-batch that wait for it (on the stages whose values s reads with a
  gradient, and theirs after them: the longest such path), less what the device still runs
  after that backward.

The planning search skips simulating a candidate whose floor is already over a plan found
(planner/schedule_search.py): the floor never exceeds the makespan, so no faster plan is lost.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from pipecompile.schedule.actions import Kind, Schedule
from pipecompile.schedule.messages import Dataflow
from pipecompile.schedule.simulate import StageCosts, _ends

__all__ = ["makespan_floor", "fill_floor"]

_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP)


def makespan_floor(schedule: Schedule, costs: Sequence[StageCosts], *,
                   dataflow: Dataflow | None = None, overhead: float = 0.0,
                   step_time: float = 0.0) -> float:
    """Seconds that `simulate(schedule, costs, dataflow=..., overhead=..., step_time=...)`'s
    makespan is at least, with or without ``transfers`` and with free devices (``cores``
    None); see the module docstring."""
    flow = dataflow or Dataflow.infer(schedule)
    n = schedule.num_stages
    split, rows = _shape(schedule)
    forward = [c.forward + overhead for c in costs]
    backward = [(c.input_time if s in split else c.backward) + overhead  # I or B: what it runs
                for s, c in enumerate(costs)]
    sources: list[list[int]] = [[] for _ in range(n)]
    graded: list[list[int]] = [[] for _ in range(n)]  # graded[s]: stages s sends gradients to
    for link in flow.links:
        sources[link.dst].append(link.src)
        if link.grads:
            graded[link.dst].append(link.src)
    head = _longest(sources, forward)
    tail = _longest(graded, backward)
    seconds: dict[tuple[int, Kind, bool, bool], float] = {}  # simulate's `_duration`, once each
    floor = 0.0
    for work, last in rows:
        for key in work:
            if key not in seconds:
                seconds[key] = _seconds(key, costs[key[0]], step_time, overhead)
        durations = [seconds[key] for key in work]
        busy = sum(durations)
        start = head[work[0][0]] if work[0][1] is Kind.F else 0.0
        # the last backward, and what the device still runs after it (its STEP)
        after = sum(durations[last + 1:])
        stage, kind = work[last][0], work[last][1]
        wait = tail[stage] if kind in (Kind.B, Kind.I) else 0.0
        floor = max(floor, start + busy + max(0.0, wait - after))
    return floor


_Key = tuple[int, Kind, bool, bool]  # (stage, kind, its stage's first forward, its last action)

#: The last schedules' shapes (what `makespan_floor` reads of a schedule whatever its costs),
#: by identity: a search bounds many placements of each schedule it builds.
_SHAPES: OrderedDict[int, tuple[Schedule, tuple[set[int], list[tuple[list[_Key], int]]]]] = (
    OrderedDict())
_SHAPES_KEPT = 64


def _shape(schedule: Schedule) -> tuple[set[int], list[tuple[list[_Key], int]]]:
    """The stages that split their backward, and per device with compute, its compute actions
    as keys and the index of its last one before its STEP."""
    found = _SHAPES.get(id(schedule))
    if found is not None and found[0] is schedule:
        _SHAPES.move_to_end(id(schedule))
        return found[1]
    split = {a.stage for row in schedule.actions for a in row if a.kind is Kind.I}
    first, last = _ends(schedule)
    rows = []
    for row in schedule.actions:
        work = [a for a in row if a.kind in _COMPUTE]
        if not work:
            continue
        k = max((k for k, a in enumerate(work) if a.kind is not Kind.STEP), default=0)
        rows.append(([(a.stage, a.kind, a in first, a in last) for a in work], k))
    _SHAPES[id(schedule)] = (schedule, (split, rows))
    while len(_SHAPES) > _SHAPES_KEPT:
        _SHAPES.popitem(last=False)
    return split, rows


def _seconds(key: _Key, cost: StageCosts, step_time: float, overhead: float) -> float:
    """simulate's `_duration` of an action with this key (the same expression)."""
    _, kind, first, last = key
    extra = 0.0
    if cost.setup or cost.teardown:
        extra = (cost.setup if first else 0.0) + (cost.teardown if last else 0.0)
    if kind is Kind.STEP:
        return extra + step_time
    work = {Kind.F: cost.forward, Kind.B: cost.backward, Kind.I: cost.input_time,
            Kind.W: cost.weight_time}[kind]
    return extra + (work + overhead)


def _longest(before: list[list[int]], seconds: Sequence[float]) -> list[float]:
    """Per stage s: the longest sum of `seconds` over a chain of stages that must run before
    (or after) s, following `before[s]` (the stages s waits for) transitively. A program's
    stages are numbered in dataflow order (t < s); a link against it counts as 0, which keeps
    the result a lower bound."""
    out = [0.0] * len(before)
    for s, waits in enumerate(before):
        out[s] = max((out[t] + seconds[t] for t in waits if t < s), default=0.0)
    return out


def fill_floor(name: str, p: int, m: int, v: int, compute: float) -> float:
    """A lower bound of the makespan of a schedule whose backwards are whole and which places
    one stage per device (gpipe, 1f1b; 0 for the others), over every placement of `compute`
    seconds per micro-batch (forward and backward of the whole model) on `p` devices.

    Device d cannot start before micro-batch 0's forward passed the stages before it, and
    after its last backward that micro-batch's backward still runs through them, so with c_s
    a stage's F + B per micro-batch, makespan >= m c_d + sum_{s<d} c_s for every d. Over every
    split of the compute C into c_0..c_{p-1}, the least max is where all p terms are equal:
    C / (1 - (1 - 1/m)^p) (m C for p = 1, C for m = 1; the uniform stages' makespan is
    (m + p - 1) C / p). Messages, overheads and recomputation only add to it."""
    if v != 1 or name not in ("gpipe", "1f1b"):
        return 0.0
    return compute / (1 - (1 - 1 / m) ** p)
