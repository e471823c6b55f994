"""Virtual stages share their device's memory: what a device holds, and placing its stages so
that together they fit.

    device_memory(problem, placement, stage_to_device) -> peak bytes per device
    fit_devices(problem, stage_to_device, solve)        -> Partition

The partitioner checks each stage against its device's memory alone and recomputes a stage only
where that stage alone needs it. With several stages on a device (interleaved schedules, zb-v)
each may fit while together they overflow it. `fit_devices` places once; where a device's
stages overflow it together, it makes that device's stages recompute, those that save the most
first, until the device's sum fits by the placement's own figures, and places again with those
stages recomputing (a few rounds, since the new cut may move blocks). The search (schedule_search.py)
and the compiler's placement (planning.place) both place through it, so the compiled plan is
the one searched.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..passes.partition import Partition, PartitionMemoryError, PartitionProblem

__all__ = ["fit_devices", "device_memory"]

_ROUNDS = 3


def device_memory(problem: PartitionProblem, placement: Partition,
                  stage_to_device: Sequence[int]) -> list[float]:
    """Peak bytes per device holding the stages `stage_to_device` maps to it: their
    `placement.stage_memory` summed, but one micro-batch's activations of a recomputing stage
    counted once per device (the largest): a device runs one backward at a time, and a
    recomputing stage holds its activations only during its own backward."""
    used = [0.0] * (max(stage_to_device, default=-1) + 1)
    again = [0.0] * len(used)
    recomputes = placement.recompute or (False,) * len(stage_to_device)
    for s, d in enumerate(stage_to_device):
        used[d] += placement.stage_memory[s]
        if recomputes[s]:
            acts = _activations(problem, placement, s)
            used[d] -= acts
            again[d] = max(again[d], acts)
    return [u + a for u, a in zip(used, again)]


def fit_devices(problem: PartitionProblem, stage_to_device: Sequence[int] | None,
                solve: Callable[[PartitionProblem], Partition]) -> Partition:
    """`solve(problem)`'s placement, or where the stages of a device overflow it together, the
    placement with enough of them recomputing (module docstring). When that fits nothing, the
    last placement found is returned (the caller sees it overflow)."""
    placement = solve(problem)
    if (stage_to_device is None or problem.recompute is None
            or len(set(stage_to_device)) == len(stage_to_device)):
        return placement
    modes = list(problem.recompute)
    for _ in range(_ROUNDS):
        forced = _forced(problem, placement, stage_to_device, modes)
        if forced is None:
            break
        modes = forced
        try:
            placement = solve(replace(problem, recompute=tuple(modes)))
        except PartitionMemoryError:
            break
    return placement


def _forced(problem: PartitionProblem, placement: Partition, stage_to_device: Sequence[int],
            modes: list[bool | None]) -> list[bool | None] | None:
    """`modes` with the stages that must recompute so that every device fits (by this
    placement's stage bytes), the largest saving first; None when every device fits or no
    stage that may recompute is left to force."""
    used = device_memory(problem, placement, stage_to_device)
    limit = {d: problem.devices[s].memory for s, d in enumerate(stage_to_device)}
    over = {d for d in limit if used[d] > limit[d]}
    if not over:
        return None
    recomputes = placement.recompute or (False,) * len(stage_to_device)
    out = list(modes)
    changed = False
    for d in over:
        savings = sorted(((placement.stage_memory[s] - _recomputed_bytes(problem, placement, s),
                           s) for s, dev in enumerate(stage_to_device)
                          if dev == d and not recomputes[s] and modes[s] is None), reverse=True)
        excess = used[d] - limit[d]
        for saving, s in savings:
            if excess <= 0 or saving <= 0:
                break
            out[s], excess, changed = True, excess - saving, True
    return out if changed else None


def _recomputed_bytes(problem: PartitionProblem, placement: Partition, s: int) -> float:
    """Stage s's bytes if it recomputed: its state, its input per in-flight micro-batch and one
    micro-batch's activations (passes/partition.py's formula)."""
    a = placement.bounds[s]
    return (sum(problem.static_bytes[a:placement.bounds[s + 1]])
            + problem.inflight[s] * problem.cut_bytes[a] + _activations(problem, placement, s))


def _activations(problem: PartitionProblem, placement: Partition, s: int) -> float:
    """One micro-batch's activations of stage s's blocks."""
    return sum(problem.activation_bytes[placement.bounds[s]:placement.bounds[s + 1]])
