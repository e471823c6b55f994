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

from typing import Sequence

from pipecompile.schedule.actions import Kind, Schedule
from pipecompile.schedule.messages import Dataflow
from pipecompile.schedule.simulate import StageCosts, _duration, _ends

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
    forward = [c.forward + overhead for c in costs]
    split = {a.stage for row in schedule.actions for a in row if a.kind is Kind.I}
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
    ends = _ends(schedule)
    floor = 0.0
    for row in schedule.actions:
        work = [a for a in row if a.kind in _COMPUTE]
        if not work:
            continue
        durations = [_duration(a, costs[a.stage], step_time, overhead, ends) for a in work]
        busy = sum(durations)
        start = head[work[0].stage] if work[0].kind is Kind.F else 0.0
        # the last backward, and what the device still runs after it (its STEP)
        k = max((k for k, a in enumerate(work) if a.kind is not Kind.STEP), default=0)
        after = sum(durations[k + 1:])
        wait = tail[work[k].stage] if work[k].kind in (Kind.B, Kind.I) else 0.0
        floor = max(floor, start + busy + max(0.0, wait - after))
    return floor


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
