"""Zero-bubble schedules with several stages per device: ZB-V and interleaved zero bubble.

Both split every backward into I (input gradient) and W (weight gradient) and are built by one
list scheduler (`_greedy`) on unit costs F = I = W = 1: at every time step each device runs, of
its ready actions, an I first (it is on the critical path), else an F while the device holds
fewer than ``cap`` micro-batch chunks (F run, W not yet), else a W (deferred W's fill what
would be bubbles). Ties go to the oldest micro-batch, then the later stage (nearer the loss).
A greedy stand-in for the hand-built orders of Qi et al. 2024 ("Pipeline Parallelism with
Controllable Memory"), not their exact lists; the order, not the unit timing, is what the
runtime keeps.

    ZB-V, D devices, 2D stages in a V: stage s on device s for s < D, on 2D-1-s after, so the
    first and last stage share device 0 (the loss's gradient starts where the input entered).
    cap = 2D chunks per device: the activations of 1F1B's stage 0 (D micro-batches of a stage
    twice the size). D=2, m=4 (kind, stage.micro-batch); simulated with F=I=W=1, each device
    runs its 24 actions in 25 time units (bubble 1/25; 1F1B on 2 devices: 1/5)::

      dev0  F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I0.0 I3.1 W0.0 F0.3 I0.1 W3.1 F3.2 I3.2 W0.1 ...
      dev1  F1.0 F2.0 F1.1 F2.1 I2.0 I1.0 W2.0 F1.2 I2.1 I1.1 W1.0 F2.2 W2.1 F1.3 I2.2 I1.2 ...

    interleaved-zb: interleaved 1F1B's placement (stage s on s % D, v stages per device) and
    its memory: device d holds at most 2(D-d-1) + (v-1)·D + 1 chunks, Megatron's warm-up + 1.

The bubble fractions `tests/schedule/test_zero_bubble_schedules.py` checks with F=I=W=1 are below
1F1B's and interleaved 1F1B's.
"""

from __future__ import annotations

import heapq

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule

__all__ = ["zb_v", "interleaved_zb", "zb_v_placement"]


def _check(name: str, **values: int) -> None:
    for label, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be an int >= 1, got {value!r}")


def zb_v_placement(num_devices: int) -> tuple[int, ...]:
    """ZB-V's stage -> device map: 0, 1, ..., D-1, D-1, ..., 1, 0."""
    return tuple(range(num_devices)) + tuple(reversed(range(num_devices)))


def zb_v(num_devices: int, num_microbatches: int, *, virtual_stages: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024): two chunks per device in a V, I/W split, 1F1B's peak memory."""
    _check("zb-v", num_devices=num_devices, num_microbatches=num_microbatches)
    if virtual_stages != 2:
        raise ScheduleError(f"zb-v places exactly 2 stages on every device (a V); got "
                            f"virtual_stages={virtual_stages}, leave it unset or use 2")
    d = num_devices
    return _greedy("zb-v", zb_v_placement(d), num_microbatches, caps=[2 * d] * d)


def interleaved_zb(num_devices: int, num_microbatches: int, *,
                   virtual_stages: int = 2) -> Schedule:
    """Interleaved zero bubble: interleaved 1F1B's placement and memory, B split into I and W
    with the W's deferred into the bubbles."""
    _check("interleaved-zb", num_devices=num_devices, num_microbatches=num_microbatches,
           virtual_stages=virtual_stages)
    d, v, m = num_devices, virtual_stages, num_microbatches
    caps = [min(v * m, 2 * (d - k - 1) + (v - 1) * d + 1) for k in range(d)]
    return _greedy("interleaved-zb", tuple(s % d for s in range(d * v)), m, caps=caps)


def _greedy(name: str, placement: tuple[int, ...], m: int, *, caps: list[int]) -> Schedule:
    """Per-device action lists from a unit-time list schedule (see the module docstring).

    Each device keeps its ready actions of each kind in a heap ordered as preferred (the
    oldest micro-batch, then the later stage); an action becomes ready when the last action it
    waits for finishes (F on the previous stage's F; I on its F and the next stage's I; W on
    its I), so each step looks only at what is ready."""
    p, devices = len(placement), max(placement) + 1
    stages_of = [[s for s in range(p) if placement[s] == dev] for dev in range(devices)]
    held = [0] * devices  # chunks with F run and W not yet
    rows: list[list[Action]] = [[] for _ in range(devices)]
    ready: list[dict[Kind, list[tuple[int, int]]]] = [
        {Kind.I: [], Kind.F: [], Kind.W: []} for _ in range(devices)]
    finished: set[tuple[Kind, int, int]] = set()

    def make_ready(kind: Kind, s: int, i: int) -> None:
        heapq.heappush(ready[placement[s]][kind], (i, -s))

    for i in range(m):
        make_ready(Kind.F, 0, i)
    left, t = 3 * p * m, 0
    while left:
        if t > 4 * p * m + 4 * p:  # every action could run one at a time by then
            raise ScheduleError(f"{name}: the list scheduler made no progress with caps {caps}")
        started = []
        for dev in range(devices):
            for kind in (Kind.I, Kind.F, Kind.W):  # an I, else an F under the cap, else a W
                if ready[dev][kind] and (kind is not Kind.F or held[dev] < caps[dev]):
                    i, s = heapq.heappop(ready[dev][kind])
                    started.append((kind, -s, i))
                    break
        finished.update(started)  # they finish at t + 1: what waits on them is ready then
        for kind, s, i in started:
            held[placement[s]] += {Kind.F: 1, Kind.W: -1}.get(kind, 0)
            rows[placement[s]].append(Action(s, kind, i))
            if kind is Kind.F:
                if s + 1 < p:
                    make_ready(Kind.F, s + 1, i)
                if s == p - 1 or (Kind.I, s + 1, i) in finished:
                    make_ready(Kind.I, s, i)
            elif kind is Kind.I:
                make_ready(Kind.W, s, i)
                if s > 0 and (Kind.F, s - 1, i) in finished:
                    make_ready(Kind.I, s - 1, i)
        left -= len(started)
        t += 1
    for dev in range(devices):
        rows[dev] += [Action(s, Kind.STEP) for s in stages_of[dev]]
    return Schedule(name, p, m, placement, tuple(map(tuple, rows)))
