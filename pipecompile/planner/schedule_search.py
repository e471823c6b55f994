"""The planning search: which schedule, micro-batch count, virtual stages and recomputation.

    search(space, devices, costs_for, ...) -> SearchResult   (every candidate, the fastest first)

For every candidate (schedule x micro-batches m x virtual stages v) the blocks, costed at
micro-batch size batch/m (`costs_for`), are placed optimally under memory (`partition`, where
each stage may recompute only where memory needs it), the step is predicted by the simulator
exactly as the compiled plan will predict it (`stage_costs`: the placement's per-stage costs,
the schedule lowered with the cut's real messages, each priced by its bytes, and a fixed cost
per action and message), and the peak memory per device is summed from the stages. The
fastest candidate that fits wins; near ties (within `TIE`) go to the one with the least peak
memory summed over the devices, then to the earlier one in the fixed enumeration order
(schedules as listed, then m, then v), so every rank given the same costs picks the same plan.
Nothing here measures or reads globals.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ..errors import PartitionError, PipecompileError
from ..ir.devices import DeviceSpec
from ..ir.progress import Progress
from ..passes.partition import PartitionMemoryError, PartitionProblem, partition
from ..ir.formats import format_bytes
from ..schedule.actions import Schedule
from ..schedule.schedules import TWO_STAGES_PER_DEVICE, schedule_properties
from ..schedule.simulate import simulate
from ..schedule.bounds import fill_floor, makespan_floor
from .built_schedules import BuiltSchedules
from .device_share import device_memory, fit_devices
from .layout import Collectives
from ..schedule.actions import Kind
from .stage_costs import (
    backward_ratio,
    SPLIT_BACKWARD_RATIO,
    BlockTable,
    dataflow,
    inflight_for,
    message_costs,
    partition_problem,
    placement_ratio,
    simulator_costs,
    with_collectives,
)

# BlockTable and SPLIT_BACKWARD_RATIO live in stage_costs (the pricing); named here for callers
__all__ = ["FSDP_SCHEDULES", "BlockTable", "Space", "Candidate", "SearchResult", "search",
           "microbatch_choices", "SYNC_SCHEDULES", "SPLIT_BACKWARD_RATIO", "ANY_V_SCHEDULES",
           "Outpaced", "NOT_SIMULATED"]

log = logging.getLogger(__name__)

#: The synchronous schedules an automatic schedule choice considers, in tie-breaking order
#: (the zero-bubble ones priced with the measured (I + W) / B of the planning probe).
SYNC_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v",
                                   "interleaved-zb")
#: Those whose backward runs FSDP's hooks (one autograd backward per micro-batch): fsdp=True.
FSDP_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")

#: The schedules that place any number v of stages on a device (the others: 1, zb-v 2).
ANY_V_SCHEDULES: tuple[str, ...] = ("interleaved-1f1b", "interleaved-zb")

#: Predicted steps within this fraction of the fastest are ties, decided by peak memory.
TIE = 1e-3

#: How a candidate skipped by its lower bound (`search`'s `above`) begins its reason.
NOT_SIMULATED = "not simulated"


class Outpaced(PipecompileError):
    """`search` with `above`: no candidate that was simulated fits and every other one's lower
    bound is over the step to beat, so the space holds no plan as fast (`floor`: the lowest of
    those bounds)."""

    def __init__(self, message: str, floor: float) -> None:
        super().__init__(message)
        self.floor = floor


@dataclass(frozen=True)
class Space:
    """The choices to search: each a tuple of values (one value: given by the user)."""

    schedules: tuple[str, ...]
    microbatches: tuple[int, ...]
    virtual_stages: tuple[int, ...] | None = None  # None: 2 for TWO_STAGES_PER_DEVICE, else 1
    checkpoint: bool | None = False  # True every stage, None where memory needs it
    # with virtual_stages None: the v tried by the schedules that take any v (ANY_V_SCHEDULES:
    # interleaving), where 2 alone is too coarse (Megatron-LM interleaves up to one layer per
    # stage); None: 2
    interleave: tuple[int, ...] | None = None

    def virtual_for(self, name: str) -> tuple[int, ...]:
        """The virtual stage counts tried for schedule `name`."""
        if self.virtual_stages:
            return self.virtual_stages
        if name in ANY_V_SCHEDULES and self.interleave:
            return self.interleave
        return (2,) if name in TWO_STAGES_PER_DEVICE else (1,)


@dataclass(frozen=True)
class Candidate:
    """One plan the search costed; `step` is inf and `reason` says why when it does not fit."""

    schedule: str
    microbatches: int
    virtual_stages: int
    recompute: tuple[bool, ...] = ()  # per stage
    bounds: tuple[int, ...] = ()
    step: float = math.inf  # predicted seconds per training step
    memory: tuple[float, ...] = ()  # predicted peak bytes per device
    reason: str = ""  # why it was not chosen ("" for the winner)
    needed: float = 0.0  # infeasible: bytes its fullest device would need

    @property
    def fits(self) -> bool:
        return math.isfinite(self.step)

    @property
    def recomputed(self) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.recompute) if r)


@dataclass(frozen=True)
class SearchResult:
    """The winner, every candidate (winner first, then by predicted step) and a lower bound."""

    best: Candidate
    candidates: tuple[Candidate, ...]
    lower_bound: float  # seconds: the winner's total compute over what can run at once (the
    #                     devices, or the cores their threads share), no bubble or overhead
    searched: tuple[str, ...]  # the options that were "auto"
    bound_note: str = "compute / devices, no bubble, no overhead"  # what the bound assumes
    # the layouts compared (data_parallel="auto" or a cluster; planner/layout_search.py),
    # the winner first; this result's candidates are the winning layout's
    layouts: tuple[Any, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Strict JSON (an infinite step or need as "inf"): what a saved plan and
        `pipecompile plan --json` write; `from_dict` reads it back."""
        def plain(x: float) -> float | str:
            return x if math.isfinite(x) else str(x)

        return {"candidates": [{"schedule": c.schedule, "microbatches": c.microbatches,
                                "virtual_stages": c.virtual_stages, "recompute": list(c.recompute),
                                "bounds": list(c.bounds), "step": plain(c.step),
                                "memory": [plain(x) for x in c.memory], "reason": c.reason,
                                "needed": plain(c.needed)} for c in self.candidates],
                "lower_bound": self.lower_bound, "searched": list(self.searched),
                "bound_note": self.bound_note,
                "layouts": [c.to_dict() for c in self.layouts]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SearchResult":
        """The result `to_dict` wrote, the winner first."""
        candidates = tuple(
            Candidate(c["schedule"], c["microbatches"], c["virtual_stages"],
                      tuple(c["recompute"]), tuple(c["bounds"]), float(c["step"]),
                      tuple(map(float, c["memory"])), c["reason"], float(c["needed"]))
            for c in data["candidates"])
        from .layout import LayoutCandidate

        return cls(candidates[0], candidates, data["lower_bound"], tuple(data["searched"]),
                   data.get("bound_note", cls.bound_note),
                   tuple(LayoutCandidate.from_dict(c) for c in data.get("layouts", ())))


def microbatch_choices(batch: int, cap: int = 32) -> tuple[int, ...]:
    """Micro-batch counts that divide `batch`, at most `cap`; over 8 of them: the powers of two
    and the largest (fewer candidates, same range)."""
    divisors = [m for m in range(1, min(batch, cap) + 1) if batch % m == 0]
    if len(divisors) > 8:
        divisors = sorted({m for m in divisors if m & (m - 1) == 0} | {divisors[-1]})
    return tuple(divisors)


def search(space: Space, devices: Sequence[DeviceSpec],
           costs_for: Callable[[int, int], BlockTable | None], *, overhead: float = 0.0,
           split_ratio: float | None = None, cores: int | None = None,
           efficiency: float = 1.0, searched: tuple[str, ...] = (),
           collectives: Collectives | None = None, memo: dict | None = None,
           written: Schedule | None = None, advise: bool = True,
           above: float | None = None) -> SearchResult:
    """Cost every candidate of `space` on `devices` and pick the fastest that fits.

    `costs_for(m, num_stages)` is the block table at micro-batch size batch/m, linearized finely
    enough for `num_stages` stages (None: the model has too few blocks). `overhead` is the fixed
    seconds per action and message; `split_ratio` the measured (I + W) / B of split-backward
    schedules (None: SPLIT_BACKWARD_RATIO; see `stage_costs.backward_ratio`); `collectives`
    the data-parallel layout's (`stage_costs.with_collectives`), None for one replica; `memo`
    keeps the schedules built, for the searches of several layouts; `written`: the user's
    schedule that `space.schedules` names.
    Raises `PartitionMemoryError` when no candidate fits in memory; with `advise`, its message
    names the fewest devices that would fit (a search over more stages: the layout search,
    which compares device counts itself, passes False).
    With `above` (the layout search's best step so far, inf for none), a candidate is not
    simulated where a lower bound of its step is over (1 + TIE) x the lower of `above` and the
    best step found in this search: before building its schedule, its compute over the
    devices; after placing it, `schedule.bounds.makespan_floor`. Such a candidate cannot win or
    tie (its step is at least its bound), so the winner and its step are those of the full
    search; it is listed last, its reason saying so (`NOT_SIMULATED`). Where nothing simulated
    fits and some candidate was skipped, `Outpaced` is raised.
    """
    devices = tuple(devices)
    p = len(devices)
    schedules = BuiltSchedules(memo, written)
    found: list[Candidate] = []
    skipped: list[tuple[float, Candidate]] = []  # (its lower bound, it)
    total = sum(len(space.microbatches) * len(space.virtual_for(n)) for n in space.schedules)
    progress = Progress(log, f"schedule search on {p} devices", total, unit="candidates")
    speed = sum(d.speed for d in devices)
    enumerated = [(name, m, v) for name in space.schedules for m in space.microbatches
                  for v in space.virtual_for(name)]
    tables = {(m, v): costs_for(m, p * v) for _, m, v in enumerated}
    works = {key: _work(table, key[0]) / speed for key, table in tables.items()
             if table is not None}
    # with `above`, the likeliest fastest first, to bound the others sooner: the order changes
    # what is simulated, never the winner (ties go by the enumeration order below)
    order_of = {key: k for k, key in enumerate(enumerated)}
    todo = enumerated if above is None else sorted(
        enumerated, key=lambda c: (_estimate(c, p, works.get(c[1:], math.inf)), order_of[c]))
    for name, m, v in todo:
        table = tables[(m, v)]
        progress.advance()
        if table is None:
            continue
        limit = _limit(above, found)
        # a split backward's I + W cost backward_ratio x B (simulator_costs); the fill
        ratio = backward_ratio(split_ratio) if _splits(name, written) else 1.0
        work = max(_work(table, m, ratio) / speed,
                   fill_floor(name, p, m, v, _work(table, 1) / max(d.speed for d in devices)))
        if work > limit:  # every device's compute together, spread evenly, and the fill
            skipped.append((work, _skip(name, m, v, work, limit,
                                        "its compute and the pipeline fill")))
            continue
        c = _candidate(name, m, v, table, devices, space.checkpoint, schedules,
                       overhead=overhead, split_ratio=split_ratio, cores=cores,
                       efficiency=efficiency, collectives=collectives, limit=limit)
        if isinstance(c, Candidate):
            found.append(c)
        else:  # its timeline's floor is over the limit
            skipped.append((c, _skip(name, m, v, c, limit, "its timeline")))
    progress.done()
    found.sort(key=lambda c: order_of[(c.schedule, c.microbatches, c.virtual_stages)])
    skipped.sort(key=lambda fc: order_of[(fc[1].schedule, fc[1].microbatches,
                                          fc[1].virtual_stages)])
    if skipped and not any(c.fits for c in found):
        floor = min(f for f, _ in skipped)
        raise Outpaced(f"no plan on {p} devices is as fast as {(above or 0.0) * 1e3:.1f} ms: "
                       f"{len(skipped)} of them take at least {floor * 1e3:.1f} ms and the "
                       f"others do not fit", floor)
    if not found:
        raise PartitionError(
            f"no schedule of {list(space.schedules)} with micro-batches {list(space.microbatches)}"
            f" can run on {p} devices (too few blocks or micro-batches); use fewer devices")
    order = {id(c): k for k, c in enumerate(found)}
    ranked = sorted(found, key=lambda c: (not c.fits, c.step if c.fits else c.needed, order[id(c)]))
    # Predicted ties (gpipe and 1f1b with m = 2 on 2 devices run the same timeline) go to the
    # plan that holds less memory: fewer live activations also run faster on a real allocator.
    tied = [c for c in ranked if c.fits and c.step <= ranked[0].step * (1 + TIE)]
    if tied:
        winner = min(tied, key=lambda c: (sum(c.memory), order[id(c)]))
        ranked.remove(winner)
        ranked.insert(0, winner)
    best = ranked[0]
    table = costs_for(best.microbatches, p * best.virtual_stages)
    assert table is not None, "the candidate was costed"
    if not best.fits and not advise:
        raise PartitionMemoryError(
            f"no plan fits in memory on {p} devices: the smallest ({best.schedule}, "
            f"{best.microbatches} micro-batches) {best.reason}", memory_needed=best.needed,
            devices_needed=None)
    if not best.fits:
        raise _no_fit(best, table, devices, space.checkpoint, split_ratio, schedules)
    # the compute spread over what can run at once: every device, or with device threads of
    # one process sharing `cores` cores, that share of them at their measured efficiency
    share = 1.0 if cores is None else min(1.0, cores / p) * efficiency
    speed = sum(d.speed for d in devices) * share
    bound = best.microbatches * (sum(table.forward) + sum(table.backward_input)
                                 + sum(table.backward_weight)) / speed
    labelled = [_label(c, best) for c in ranked] + [c for _, c in skipped]
    note = ("compute / devices, no bubble, no overhead" if cores is None or cores >= p else
            f"compute over {p} device threads, of which this machine's cores run {cores} at a "
            f"time at {efficiency:.2f} of their speed; no bubble, no overhead")
    return SearchResult(labelled[0], tuple(labelled), bound, searched, note)


def _work(table: BlockTable, m: int, ratio: float = 1.0) -> float:
    """Seconds of compute of a step of `m` micro-batches on one device of speed 1, each
    backward costing `ratio` x the table's."""
    return m * (sum(table.forward)
                + ratio * (sum(table.backward_input) + sum(table.backward_weight)))


def _splits(name: str, written: Schedule | None) -> bool:
    """Whether schedule `name` (the written one where it has that name) splits backwards."""
    return schedule_properties(name, written if written and written.name == name else None
                               ).splits_backward


def _estimate(candidate: tuple[str, int, int], p: int, work: float) -> float:
    """A rough step (not a bound) to order the search by: the compute spread over the `p`
    devices (`work`) with the bubble of uniform stages (Narayanan et al. 2021: (p-1)/m, interleaved (p-1)/(v m);
    zero-bubble schedules a third of that, ZB-V and interleaved-zb none)."""
    name, m, v = candidate
    bubble = (p - 1) / m
    if name in ANY_V_SCHEDULES or name in TWO_STAGES_PER_DEVICE:
        bubble /= v
    if name.startswith("zb") or name == "interleaved-zb":
        bubble /= 3
    return work * (1 + bubble)


def _limit(above: float | None, found: Sequence[Candidate]) -> float:
    """The bound over which a candidate is not simulated (inf: every one is)."""
    if above is None:
        return math.inf
    return min([above] + [c.step for c in found if c.fits]) * (1 + TIE)


def _skip(name: str, m: int, v: int, floor: float, limit: float, what: str) -> Candidate:
    return Candidate(name, m, v, reason=(
        f"{NOT_SIMULATED}: {what} takes at least {floor * 1e3:.1f} ms > "
        f"{limit * 1e3:.1f} ms (a plan found, + {TIE:.1%})"))


# -- one candidate ------------------------------------------------------------------------------


def _problem(schedule: Schedule, peaks: tuple[int, ...], table: BlockTable,
             specs: tuple[DeviceSpec, ...], checkpoint: bool | None,
             split_ratio: float | None) -> PartitionProblem:
    """One candidate's placement problem: every stage may recompute (checkpoint None: where
    memory needs it) unless `checkpoint` is False; split backwards at their measured cost."""
    return partition_problem(
        table, specs, peaks, ratio=placement_ratio(schedule, split_ratio),
        recompute=None if checkpoint is False else (checkpoint,) * schedule.num_stages)


def _candidate(name: str, m: int, v: int, table: BlockTable, devices: tuple[DeviceSpec, ...],
               checkpoint: bool | None, schedules: BuiltSchedules, *, overhead: float,
               split_ratio: float | None, cores: int | None, efficiency: float,
               collectives: Collectives | None = None, limit: float = math.inf
               ) -> Candidate | float:
    """The candidate costed, or where its timeline's floor is over `limit`, that floor."""
    try:
        schedule, peaks = schedules.get(name, len(devices), m, v)
    except PipecompileError as error:  # e.g. interleaving needs m to be a multiple of p
        return Candidate(name, m, v, needed=math.inf,  # ranked after every other candidate
                         reason=f"not valid: {str(error).split(';')[0]}")
    stages = schedule.num_stages
    specs = tuple(devices[d] for d in schedule.stage_to_device)
    try:
        problem = _problem(schedule, peaks, table, specs, checkpoint, split_ratio)
        placement = fit_devices(problem, schedule.stage_to_device, partition)
    except PartitionMemoryError as error:
        limit = min(d.memory for d in devices)
        needed = error.memory_needed * v  # a device holds v stages (at most this together)
        return Candidate(name, m, v, needed=needed, reason=(
            f"needs {'up to ' if v > 1 else ''}{format_bytes(needed)} on a device > limit "
            f"{format_bytes(limit)}"))
    recompute = placement.recompute or (False,) * stages
    memory = device_memory(problem, placement, schedule.stage_to_device)
    over = [d for d, used in enumerate(memory) if used > devices[d].memory]
    if over:  # virtual stages share their device's memory
        d = over[0]
        return Candidate(name, m, v, recompute, placement.bounds, math.inf, tuple(memory),
                         needed=max(memory), reason=(
                             f"needs {format_bytes(memory[d])} on device {d} > limit "
                             f"{format_bytes(devices[d].memory)}"))
    # as the compiled plan predicts it (stage_costs): its stages' costs, the schedule lowered
    # with the cut's real messages, each priced by its bytes
    costs = simulator_costs(table, placement.bounds, specs, recompute=recompute,
                            split_ratio=split_ratio)
    costs = with_collectives(costs, table, placement.bounds, collectives, recompute=recompute,
                             split=any(a.kind is Kind.W for row in schedule.actions for a in row))
    links = dataflow(table, placement.bounds)
    lowered, deps = schedules.lowered(name, len(devices), m, v, links)
    if math.isfinite(limit) and cores is None:
        floor = makespan_floor(lowered, costs, dataflow=links, overhead=overhead)
        if floor > limit:
            return floor
    timeline = simulate(lowered, costs, cores=cores, efficiency=efficiency, overhead=overhead,
                        transfers=message_costs(table, placement.bounds, specs), validated=True,
                        deps=deps(), messages=False)
    return Candidate(name, m, v, recompute, placement.bounds, timeline.makespan, tuple(memory))


def _label(c: Candidate, best: Candidate) -> Candidate:
    if c is best:
        return c
    if not c.fits:
        return c
    if c.step > best.step * (1 + TIE):
        return replace(c, reason=f"slower (+{(c.step / best.step - 1) * 100:.1f}%)")
    if sum(c.memory) > sum(best.memory):
        return replace(c, reason="tie (more memory)")
    return replace(c, reason="tie (later in order)")


def _no_fit(smallest: Candidate, table: BlockTable, devices: tuple[DeviceSpec, ...],
            checkpoint: bool | None, split_ratio: float | None,
            schedules: BuiltSchedules) -> PartitionMemoryError:
    """The error when nothing fits: the smallest plan's need per device, in the partitioner's
    words when its placement failed (with the fewest devices that would fit), and the fixes."""
    p, m, v = len(devices), smallest.microbatches, smallest.virtual_stages
    what = (f"{smallest.schedule}, {m} micro-batches"
            + (f", {v} virtual stages" if v > 1 else ""))
    fixes = ("allow recomputation (checkpoint='auto' or True)" if checkpoint is False
             else "recomputation on every stage does not suffice")
    head = f"no plan fits in memory on {p} device{'s' * (p != 1)}: the smallest ({what})"
    tail = (f" Also: {fixes}; or use smaller micro-batches (more micro-batches or a smaller "
            f"batch).")
    if smallest.memory:  # placed, but virtual stages overfill their device
        return PartitionMemoryError(
            f"{head} {smallest.reason}. To fix: use more devices or devices with at least "
            f"{format_bytes(smallest.needed)}." + tail,
            memory_needed=smallest.needed, devices_needed=None)
    schedule, peaks = schedules.get(smallest.schedule, p, m, v)
    specs = tuple(devices[d] for d in schedule.stage_to_device)
    try:
        partition(_problem(schedule, peaks, table, specs, checkpoint, split_ratio),
                  inflight_for=lambda q: inflight_for(
            smallest.schedule, q, microbatches=m, virtual_stages=v))
    except PartitionMemoryError as error:
        return PartitionMemoryError(f"{head}: {error}" + tail,
                                    memory_needed=error.memory_needed,
                                    devices_needed=error.devices_needed)
    raise AssertionError("the smallest candidate did not fit when searched")
