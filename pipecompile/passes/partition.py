"""Partition a chain of blocks into pipeline stages: the placement policy.

Terms:
  block      one of the n >= 1 units the model is cut between (a layer, a transformer block).
  cut a      the boundary before block a; cut 0 is the model input, cut n its output.
  stage j    the contiguous, non-empty run of blocks [bounds[j], bounds[j+1]) placed on device j.
  bounds     the p+1 cut positions 0 = bounds[0] < bounds[1] < ... < bounds[p] = n.
  in-flight  the micro-batches whose activations a stage holds at its peak (p - j under 1F1B).

Cost model, per micro-batch, for stage j holding blocks [a, b):

  stage_time   = sum(block_times[a:b]) / speed_j + send_j(cut_bytes[a]) + send_j(cut_bytes[b])
                 (compute, plus sending activations over cut b and input gradients over cut a;
                 send_j(x) = x / bandwidth_j + latency_j for a message of x > 0 bytes, else 0)
  stage_memory = sum(static_bytes[a:b]) + inflight_j * (sum(activation_bytes[a:b]) + cut_bytes[a])
                 (parameters, gradients and optimizer state, plus saved activations and the
                 received input of every in-flight micro-batch)

A stage that recomputes (activation checkpointing) keeps only its input per in-flight
micro-batch plus one micro-batch's activations, and runs its forward once more in backward:

  stage_memory = sum(static_bytes[a:b]) + inflight_j * cut_bytes[a] + sum(activation_bytes[a:b])
  stage_time  += sum(forward_times[a:b]) / speed_j

`PartitionProblem.recompute` says per stage whether it must (True), must not (False) or may where
memory needs it (None) recompute; the chosen flags come back in `Partition.recompute`.

In a steady pipeline every stage advances at the pace of the slowest, so `partition` minimises
the bottleneck max_j stage_time subject to stage_memory <= memory_j, by exact dynamic programming
over cut positions (O(p n^2) with prefix sums). Among placements whose bottleneck is within a
relative 1e-12 of the optimum it then picks the one with the smallest sum of squared stage times
(a second, additive DP restricted to stage times <= that bottleneck), so the bottleneck stays
optimal and the other stages are as even as possible. Remaining exact ties go to the latest cut,
starting from the last stage.

    >>> problem = PartitionProblem(block_times=(1, 2, 3, 4, 5, 6), cut_bytes=(0,) * 7,
    ...     static_bytes=(0,) * 6, activation_bytes=(0,) * 6,
    ...     devices=(DeviceSpec(),) * 3, inflight=(3, 2, 1))
    >>> partition(problem).bounds
    (0, 3, 5, 6)

This module is pure: it returns cut positions and imports neither torch nor a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from pipecompile.errors import ConfigError, PartitionError, PartitionMemoryError
from pipecompile.ir.devices import DeviceSpec
from pipecompile.ir.formats import format_bytes
from pipecompile.passes.chain_arrays import min_max_then_even

__all__ = [
    "DeviceSpec",
    "PartitionProblem",
    "Partition",
    "PartitionMemoryError",
    "stage_time",
    "stage_memory",
    "partition",
    "evaluate",
    "uniform_bounds",
    "lower_bound",
    "balanced_by",
]

_REL_TOL = 1e-12  # bottlenecks within this relative distance count as equal


@dataclass(frozen=True)
class PartitionProblem:
    """Per-block costs of a chain of n blocks and the p devices to place it on."""

    block_times: tuple[float, ...]  # seconds per micro-batch, fwd+bwd, on a speed-1 device; len n
    cut_bytes: tuple[float, ...]  # len n+1: bytes crossing the boundary before block i
    static_bytes: tuple[float, ...]  # per block: params + grads + optimizer state; len n
    activation_bytes: tuple[float, ...]  # per block: saved activations per micro-batch; len n
    devices: tuple[DeviceSpec, ...]  # len p
    inflight: tuple[int, ...]  # len p: micro-batches whose activations stage j holds at peak
    forward_times: tuple[float, ...] | None = None  # per block: what recomputation runs again
    recompute: tuple[bool | None, ...] | None = None  # per stage (see the module doc); None: never

    def __post_init__(self) -> None:
        n, p = len(self.block_times), len(self.devices)
        if self.recompute is not None:
            if len(self.recompute) != p:
                raise ConfigError(f"recompute has length {len(self.recompute)}; expected {p}")
            if self.forward_times is None or len(self.forward_times) != n:
                raise ConfigError(f"recompute needs forward_times with one entry per block ({n})")
        if n < 1 or p < 1:
            raise ConfigError(f"need at least one block and one device; got {n} blocks and "
                              f"{p} devices")
        for field, want in (("cut_bytes", n + 1), ("static_bytes", n), ("activation_bytes", n),
                            ("inflight", p)):
            got = len(getattr(self, field))
            if got != want:
                raise ConfigError(f"{field} has length {got}; expected {want} "
                                  f"(n={n} blocks, p={p} devices)")
        for field in ("block_times", "cut_bytes", "static_bytes", "activation_bytes", "inflight"):
            bad = [x for x in getattr(self, field) if not 0 <= x < math.inf]
            if bad:
                raise ConfigError(f"{field} must be finite and >= 0; got {bad[0]}")

    @property
    def num_blocks(self) -> int:
        return len(self.block_times)

    @property
    def num_stages(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class Partition:
    """A placement and its cost: what `partition` and `evaluate` return."""

    bounds: tuple[int, ...]  # len p+1; stage j holds blocks [bounds[j], bounds[j+1])
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    recompute: tuple[bool, ...] = ()  # per stage: whether it recomputes (empty: none does)

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_blocks(self, j: int) -> range:
        return range(self.bounds[j], self.bounds[j + 1])


def _prefix(xs: Sequence[float]) -> list[float]:
    return list(accumulate(xs, initial=0.0))  # P[b] - P[a] = sum(xs[a:b])


# The DP and the public cost functions below evaluate the same expressions on the same prefix
# sums, so a placement the DP found feasible is feasible when re-evaluated, bit for bit.
def stage_time(problem: PartitionProblem, j: int, a: int, b: int) -> float:
    """Seconds per micro-batch of stage j holding blocks [a, b) (see the module docstring)."""
    return _stage(problem, j, a, b)[0]


def stage_memory(problem: PartitionProblem, j: int, a: int, b: int) -> float:
    """Peak bytes of stage j holding blocks [a, b) (see the module docstring)."""
    return _stage(problem, j, a, b)[1]


def _sums(problem: PartitionProblem) -> tuple[list[float], ...]:
    """The prefix sums `_stage` reads: block times, static and activation bytes, forwards."""
    return tuple(_prefix(x) for x in (problem.block_times, problem.static_bytes,
                                      problem.activation_bytes,
                                      problem.forward_times or (0.0,) * problem.num_blocks))


def _stage(problem: PartitionProblem, j: int, a: int, b: int,
           sums: tuple[list[float], ...] | None = None) -> tuple[float, float, bool]:
    """(time, memory, recomputes) of stage j holding [a, b): without recomputation where that is
    allowed and fits, else with it where allowed (memory over the limit if neither fits).
    `sums`: `_sums(problem)`, computed once for every stage of a placement."""
    t, s, act, f = sums or _sums(problem)
    d, cut, k = problem.devices[j], problem.cut_bytes, problem.inflight[j]
    send = d.send_time(cut[a]) + d.send_time(cut[b])
    time = (t[b] - t[a]) / d.speed + send
    memory = (s[b] - s[a]) + k * ((act[b] - act[a]) + cut[a])
    mode = None if problem.recompute is None else problem.recompute[j]
    if problem.recompute is None or mode is False or (mode is None and memory <= d.memory):
        return time, memory, False
    assert problem.forward_times is not None, "checked in PartitionProblem"
    return (((t[b] - t[a]) + (f[b] - f[a])) / d.speed + send,
            (s[b] - s[a]) + k * cut[a] + (act[b] - act[a]), True)


# (stage j, first block a, end b) -> cost of that stage; inf marks an infeasible stage.
_Cost = Callable[[int, int, int], float]


def _chain_dp(n: int, p: int, cost: _Cost, floor: _Cost, *, additive: bool,
              squared_under: float | None = None) -> tuple[float, tuple[int, ...] | None]:
    """Minimise max (or, if additive, the sum) of cost over p contiguous non-empty stages.

    best_j[b] = min over a of combine(best_{j-1}[a], cost(j, a, b)). `floor(j, a, b)` must be a
    lower bound of cost that never decreases as a decreases (e.g. the compute part of a time),
    so the scan over a can stop once floor reaches the best value found: no earlier cut can win.
    With `squared_under`, each cost and floor c counts as c^2 where c <= squared_under, else
    inf (`_min_max_then_even`'s second pass). Returns (optimum, bounds), or (inf, None) when
    every placement costs inf.
    """
    square = squared_under is not None
    under = squared_under if squared_under is not None else math.inf

    def first(b: int) -> float:
        c = cost(0, 0, b)
        return (c * c if c <= under else math.inf) if square else c

    prev = [math.inf] * (n + 1)
    for b in range(1, n - p + 2):
        prev[b] = first(b)
    parents: list[list[int]] = []
    for j in range(1, p):
        cur, arg = [math.inf] * (n + 1), [0] * (n + 1)
        for b in range(n if j == p - 1 else j + 1, n - p + j + 2):
            best, best_a = math.inf, -1
            for a in range(b - 1, j - 1, -1):  # later cuts first: floor grows as a decreases
                low = floor(j, a, b)
                if low > under:  # squared: inf, which is >= any best
                    break
                if square:
                    low *= low
                if low >= best:
                    break
                if prev[a] == math.inf:
                    continue
                c = cost(j, a, b)
                if square:
                    c = c * c if c <= under else math.inf
                value = prev[a] + c if additive else max(prev[a], c)
                if value < best:
                    best, best_a = value, a
            cur[b], arg[b] = best, best_a
        parents.append(arg)
        prev = cur
    if prev[n] == math.inf:
        return math.inf, None
    bounds = [n]
    for arg in reversed(parents):
        bounds.append(arg[bounds[-1]])
    return prev[n], (0, *reversed(bounds))


def _min_max_then_even(n: int, p: int, cost: _Cost, floor: _Cost) -> tuple[int, ...] | None:
    """Bounds minimising max cost; among those (within _REL_TOL) the smallest sum of cost^2."""
    best, _ = _chain_dp(n, p, cost, floor, additive=False)
    if best == math.inf:
        return None
    return _chain_dp(n, p, cost, floor, additive=True, squared_under=best * (1 + _REL_TOL))[1]


def _time_costs(problem: PartitionProblem) -> tuple[_Cost, _Cost]:
    """Stage time where the stage fits in memory (inf otherwise), and its monotone floor.
    Each stage recomputes only where allowed and needed (see `_stage`)."""
    t, s, act = (_prefix(x) for x in (problem.block_times, problem.static_bytes,
                                      problem.activation_bytes))
    f = _prefix(problem.forward_times or (0.0,) * problem.num_blocks)
    cut, inflight = problem.cut_bytes, problem.inflight
    speed, mem = zip(*((d.speed, d.memory) for d in problem.devices))
    rows: dict[DeviceSpec, list[float]] = {}  # stages mostly run on equal devices
    for d in problem.devices:
        if d not in rows:
            rows[d] = [d.send_time(x) for x in cut]
    send = [rows[d] for d in problem.devices]  # [j][a]: one message
    modes = problem.recompute or (False,) * problem.num_stages
    plain = tuple(m is not True for m in modes)  # may run without recomputation
    again = tuple(m is not False for m in modes)  # may recompute

    def cost(j: int, a: int, b: int) -> float:
        static, acts = s[b] - s[a], act[b] - act[a]  # the expressions of _stage, bit for bit
        if plain[j] and static + inflight[j] * (acts + cut[a]) <= mem[j]:
            return (t[b] - t[a]) / speed[j] + (send[j][a] + send[j][b])
        if again[j] and static + inflight[j] * cut[a] + acts <= mem[j]:
            return ((t[b] - t[a]) + (f[b] - f[a])) / speed[j] + (send[j][a] + send[j][b])
        return math.inf

    def floor(j: int, a: int, b: int) -> float:  # drops the cut terms, which are not monotone
        static, acts = s[b] - s[a], act[b] - act[a]
        if ((plain[j] and static + inflight[j] * acts <= mem[j])
                or (again[j] and static + acts <= mem[j])):
            return (t[b] - t[a]) / speed[j]
        return math.inf

    return cost, floor


def _memory_needed(problem: PartitionProblem) -> float:
    """Smallest max_j stage_memory over all placements (times and device memory ignored)."""
    s, act = _prefix(problem.static_bytes), _prefix(problem.activation_bytes)
    cut, inflight = problem.cut_bytes, problem.inflight
    again = tuple(m is not False for m in problem.recompute or (False,) * problem.num_stages)

    def cost(j: int, a: int, b: int) -> float:
        if again[j]:  # recomputation never needs more memory
            return (s[b] - s[a]) + inflight[j] * cut[a] + (act[b] - act[a])
        return (s[b] - s[a]) + inflight[j] * ((act[b] - act[a]) + cut[a])

    def floor(j: int, a: int, b: int) -> float:
        return (s[b] - s[a]) + (1 if again[j] else inflight[j]) * (act[b] - act[a])

    return _chain_dp(problem.num_blocks, problem.num_stages, cost, floor, additive=False)[0]


def _fits(problem: PartitionProblem) -> bool:
    """Whether some placement fits in memory (the time DP with every finite time set to 0)."""

    def zero_if_finite(f: _Cost) -> _Cost:
        return lambda j, a, b: 0.0 if f(j, a, b) < math.inf else math.inf

    cost, floor = _time_costs(problem)
    return _chain_dp(problem.num_blocks, problem.num_stages, zero_if_finite(cost),
                     zero_if_finite(floor), additive=False)[1] is not None


def _devices_needed(problem: PartitionProblem, inflight_for: Callable[[int], tuple[int, ...]]
                    ) -> int | None:
    """Smallest p' in (p, n] that fits when devices are padded with copies of the last one."""
    last = problem.devices[-1]
    for q in range(problem.num_stages + 1, problem.num_blocks + 1):
        devices = problem.devices + (last,) * (q - problem.num_stages)
        modes = problem.recompute and problem.recompute + (problem.recompute[-1],) * (
            q - problem.num_stages)
        if _fits(replace(problem, devices=devices, inflight=tuple(inflight_for(q)),
                         recompute=modes or None)):
            return q
    return None


def _check_fill(n: int, p: int) -> None:
    if p < 1:
        raise ConfigError(f"need at least one stage; got p={p}")
    if p > n:
        raise PartitionError(f"{n} blocks cannot fill {p} stages; use at most {n} devices "
                             f"or finer blocks")


def partition(problem: PartitionProblem, *,
              inflight_for: Callable[[int], tuple[int, ...]] | None = None) -> Partition:
    """The placement with the smallest bottleneck that fits in memory.

    `inflight_for(p')` gives the per-stage in-flight counts for p' stages; it is only used to
    tell, when nothing fits, how many devices would.
    """
    n, p = problem.num_blocks, problem.num_stages
    _check_fill(n, p)
    bounds = min_max_then_even(problem, _REL_TOL)  # the DP below on arrays, the same bits
    if bounds is NotImplemented:
        bounds = _min_max_then_even(n, p, *_time_costs(problem))
    if bounds is not None:
        return evaluate(problem, bounds)
    needed = _memory_needed(problem)
    limits = sorted({d.memory for d in problem.devices})
    have = (f"each device has {format_bytes(limits[0])}" if len(limits) == 1 else
            "devices have " + ", ".join(format_bytes(d.memory) for d in problem.devices))
    fixes = [f"use devices with at least {format_bytes(needed)}"]
    devices_needed = None
    if inflight_for is None:
        fixes.append("pass inflight_for= to partition() to learn how many devices would fit")
    else:
        devices_needed = _devices_needed(problem, inflight_for)
        if devices_needed is None:
            fixes[0] += f" (more devices do not help: no number of devices up to {n} fits)"
        else:
            fixes.append(f"use {devices_needed} devices (the fewest that fit)")
    fixes.append("save memory (fewer micro-batches in flight, activation checkpointing)")
    message = (f"no placement of {n} blocks on {p} device{'s' * (p != 1)} fits in memory "
               f"({have}); the best placement needs {format_bytes(needed)} on its fullest "
               f"device. To fix: " + "; ".join(fixes) + ".")
    raise PartitionMemoryError(message, memory_needed=needed, devices_needed=devices_needed)


def evaluate(problem: PartitionProblem, bounds: Sequence[int]) -> Partition:
    """Stage times and memory of the given bounds (which need not fit in memory)."""
    n, p, bounds = problem.num_blocks, problem.num_stages, tuple(bounds)
    if (len(bounds) != p + 1 or bounds[0] != 0 or bounds[-1] != n
            or any(a >= b for a, b in zip(bounds, bounds[1:]))):
        raise ConfigError(f"bounds {bounds} must be {p + 1} strictly increasing cut positions "
                          f"from 0 to {n}; see uniform_bounds({n}, {p}) for an example")
    sums = _sums(problem)
    stages = [_stage(problem, j, a, b, sums) for j, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return Partition(bounds=bounds, stage_times=tuple(t for t, _, _ in stages),
                     stage_memory=tuple(m for _, m, _ in stages),
                     recompute=tuple(r for _, _, r in stages) if problem.recompute else ())


def uniform_bounds(n: int, p: int) -> tuple[int, ...]:
    """Bounds giving every stage n // p blocks, one more to each of the first n % p stages."""
    _check_fill(n, p)
    q, r = divmod(n, p)
    return tuple(j * q + min(j, r) for j in range(p + 1))


def lower_bound(problem: PartitionProblem) -> float:
    """A bound no placement's bottleneck can beat, ignoring transfers and memory.

    Work is conserved (total / total speed) and no block can be split (largest / fastest).
    """
    times, speeds = problem.block_times, [d.speed for d in problem.devices]
    return max(sum(times) / sum(speeds), max(times) / max(speeds))


def balanced_by(values: Sequence[float], p: int) -> tuple[int, ...]:
    """Bounds minimising the largest per-stage sum of `values` (e.g. parameter counts).

    Ties are broken like `partition`'s, by the smallest sum of squared stage sums.
    """
    if any(not 0 <= v < math.inf for v in values):
        raise ConfigError(f"values must be finite and >= 0; got {list(values)}")
    _check_fill(len(values), p)
    pre = _prefix(values)

    def cost(j: int, a: int, b: int) -> float:
        return pre[b] - pre[a]

    bounds = _min_max_then_even(len(values), p, cost, cost)
    assert bounds is not None  # every cost is finite
    return bounds
