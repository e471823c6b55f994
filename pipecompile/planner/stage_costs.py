"""From block costs to what the simulator needs: the one path the search, the compiler's split
pass and `Pipeline.simulate` share, so a candidate's predicted step is the compiled plan's.

    simulator_costs(table, bounds, specs, recompute=..., split_ratio=...) -> StageCosts per stage
    dataflow(table, bounds), message_costs(table, bounds, specs)       -> links, seconds each
    partition_problem(table, specs, inflight, ratio=placement_ratio(...)) -> PartitionProblem
    inflight_for(schedule, stages, microbatches=..., virtual_stages=...) -> in-flight per stage
    with_stage_costs(program, costs, placement, inflight, times)         -> stages with StageCost
    predict(schedule, plan)                                              -> predicted Timeline

A stage costs the sum of its blocks at its device's speed (measured per stage with
`profile=True`); a split backward (zero-bubble I + W) costs `backward_ratio` times the fused B.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from typing import Mapping, Protocol, Sequence

import torch

from ..errors import PipecompileError
from ..ir.records import CostTable, LinearGraph, StageCost, StageTimes
from ..ir.devices import DeviceSpec
from ..passes.partition import Partition, PartitionProblem
from ..passes.split import BlockWiring, block_wiring
from ..ir.records import StagedProgram
from .layout import Collectives, Layout, layout_static
from ..measure.ranks import Ranks
from ..schedule.actions import Schedule
from ..schedule.messages import Dataflow, MessageKey, gradient_values, link_bytes, transfer_seconds
from ..schedule.schedules import SCHEDULES, make_schedule
from ..schedule.simulate import StageCosts, Timeline, inflight, simulate

__all__ = ["SPLIT_BACKWARD_RATIO", "BlockTable", "backward_ratio", "placement_ratio",
           "with_collectives",
           "simulator_costs", "dataflow", "message_costs", "partition_problem", "inflight_for",
           "Priced", "predict", "with_stage_costs", "shared_cores"]

#: (I + W) / B: what splitting a backward into input and weight gradients costs, for the analytic
#: costs when no planning probe measured it. Measured on this project's 2-core CPU (torch 2.13,
#: fp32) through StageWorker: fused backward vs backward_input + backward_weight of a
#: LayerNorm-Linear-GELU-Linear block (d = 256, 512, 768, hidden 4d, 256/128/64 rows), fastest
#: and 10th-percentile of 150 interleaved runs, twice: 1.07 to 1.23 in 11 of 12 readings (one
#: 0.84 under load). The split walks the autograd graph twice.
SPLIT_BACKWARD_RATIO = 1.15


@dataclass(frozen=True)
class BlockTable:
    """What pricing needs of a block cost table (seconds and bytes per micro-batch)."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    static_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    cut_bytes: tuple[float, ...]  # len n + 1
    # where each value is made and read, its bytes and whether a gradient flows back through
    # it: the messages of any cut (None: messages priced by the cut bytes, a chain's)
    wiring: BlockWiring | None = None
    value_bytes: Mapping[str, float] = field(default_factory=dict)
    grad_values: frozenset[str] = frozenset()
    # per block: parameter, gradient and optimizer-state bytes (what the layout's collectives
    # and optimizer step move); empty: not known (a loaded plan)
    state_bytes: tuple[tuple[float, float, float], ...] = ()

    @classmethod
    def of(cls, costs: CostTable, linear: LinearGraph | None = None,
           layout: Layout | None = None) -> "BlockTable":
        """The table of `costs`, with `linear`'s wiring when given; with `layout`, the bytes
        a device holds per block under it (`planner.layout.layout_static`)."""
        b = costs.blocks
        state = tuple((float(c.param_bytes), float(c.grad_bytes), float(c.optimizer_bytes))
                      for c in costs.symbolic)
        static = tuple(x.static_bytes for x in b)
        if layout is not None and len(state) == len(b):
            static = tuple(layout_static(*s, layout) for s in state)
        table = cls(tuple(x.forward_time for x in b), tuple(x.backward_input_time for x in b),
                    tuple(x.backward_weight_time for x in b), static,
                    tuple(x.activation_bytes for x in b), tuple(costs.cut_bytes),
                    state_bytes=state)
        if linear is None:
            return table
        wiring = block_wiring(linear)
        values = linear.captured.values
        return replace(table, wiring=wiring,
                       value_bytes={n: values[n].bytes_at(costs.sizes) for n in wiring.readers},
                       grad_values=gradient_values(linear, wiring.readers))

    @property
    def num_blocks(self) -> int:
        return len(self.forward)


def backward_ratio(split_ratio: float | None) -> float:
    """(I + W) / B that prices a split backward: the measured ratio (None: SPLIT_BACKWARD_RATIO),
    at least 1. I and W run the fused backward's kernels plus bookkeeping, so a ratio below 1 is
    timing noise (a loaded machine preempts the one long B more often than the short I and W;
    measured 0.13-0.8 on a shared 2-core CPU) and would make zero-bubble schedules look cheaper
    than they can run."""
    return max(1.0, SPLIT_BACKWARD_RATIO if split_ratio is None else split_ratio)


def placement_ratio(schedule: Schedule, split_ratio: float | None) -> float:
    """What a block's backward costs when placing it, relative to its fused backward:
    `backward_ratio(split_ratio)` where `schedule` splits backwards into I and W, else 1."""
    return backward_ratio(split_ratio) if schedule.splits_backward else 1.0


def simulator_costs(table: BlockTable, bounds: Sequence[int], specs: Sequence[DeviceSpec], *,
                    recompute: Sequence[bool], split_ratio: float | None,
                    measured: Mapping[int, StageTimes] | None = None) -> tuple[StageCosts, ...]:
    """The simulator's costs of stage s = blocks [bounds[s], bounds[s+1]) on `specs[s]`.

    Analytic: the blocks' sums at the device's speed; measured (`profile=True`): the stage's own
    times. A stage that receives no gradient-carrying input (cut bytes 0: the first) has nothing
    to do in I, its whole backward is W; a stage that `recompute`s runs its forward again in B
    (or I); I + W cost `backward_ratio(split_ratio)` times B. Messages cost their sender's
    `DeviceSpec.send_time` of the cut's bytes (when `simulate` is given no per-link transfers)."""
    ratio = backward_ratio(split_ratio)
    out = []
    for s, spec in enumerate(specs):
        a, b = bounds[s], bounds[s + 1]
        times = measured.get(s) if measured is not None else None
        if times is None:
            f = sum(table.forward[a:b]) / spec.speed
            i = sum(table.backward_input[a:b]) / spec.speed
            w = sum(table.backward_weight[a:b]) / spec.speed
            whole = i + w
            if table.cut_bytes[a] == 0:
                i, w = 0.0, whole
            i, w = ratio * i, ratio * w
        else:
            f, whole = times.forward, times.backward
            i, w = times.backward_input, times.backward_weight
            if 0 < i + w < whole:  # noise (see backward_ratio): I + W are at least B
                i, w = i * whole / (i + w), w * whole / (i + w)
        again = f if recompute[s] else 0.0
        out.append(StageCosts(forward=f, backward=whole + again, backward_input=i + again,
                              backward_weight=w, send_forward=spec.send_time(table.cut_bytes[b]),
                              send_backward=spec.send_time(table.cut_bytes[a])))
    return tuple(out)


def with_collectives(costs: Sequence[StageCosts], table: BlockTable, bounds: Sequence[int],
                     collectives: Collectives | None, *, recompute: Sequence[bool],
                     split: bool) -> tuple[StageCosts, ...]:
    """`costs` with each stage's share of the layout's collectives and optimizer step as its
    `setup` and `teardown` (`planner.layout.Collectives.extras`); unchanged without
    `collectives` or per-block state bytes. The replicas' all-reduce overlaps the last
    backward only where torch's hooks run in it (no `split` backward, no recomputation)."""
    if collectives is None or not table.state_bytes:
        return tuple(costs)
    out = []
    for s, c in enumerate(costs):
        held = table.state_bytes[bounds[s]:bounds[s + 1]]
        param, grad, optimizer = (sum(x[i] for x in held) for i in range(3))
        setup, teardown = collectives.extras(param, grad, optimizer, c.backward,
                                             overlap=not split and not recompute[s])
        out.append(replace(c, setup=setup, teardown=teardown))
    return tuple(out)


def dataflow(table: BlockTable, bounds: Sequence[int]) -> Dataflow | None:
    """The links between the stages of a cut (None: `table` has no wiring)."""
    if table.wiring is None:
        return None
    producer, consumers = table.wiring.at(bounds)
    return Dataflow.from_wiring(producer, consumers, table.grad_values, len(bounds) - 1)


def message_costs(table: BlockTable, bounds: Sequence[int], specs: Sequence[DeviceSpec]
                  ) -> dict[MessageKey, float] | None:
    """Seconds per message of a cut, over the sending stage's link (None: no wiring; messages
    then cost `StageCosts.send_forward`/`send_backward`)."""
    links = dataflow(table, bounds)
    if links is None:
        return None
    return transfer_seconds(link_bytes(links, lambda name: table.value_bytes[name]),
                            lambda s: specs[s].bandwidth, lambda s: specs[s].latency)


def partition_problem(table: BlockTable, specs: Sequence[DeviceSpec], inflight: Sequence[int], *,
                      recompute: Sequence[bool | None] | None, ratio: float = 1.0
                      ) -> PartitionProblem:
    """The placement problem of `table` on one device per stage. `recompute` per stage: must
    (True), must not (False) or may where memory needs it (None); None: no stage may. `ratio`:
    what a backward costs relative to its blocks' (`backward_ratio` for split schedules)."""
    times = tuple(f + ratio * (i + w) for f, i, w in
                  zip(table.forward, table.backward_input, table.backward_weight))
    modes = None if recompute is None else tuple(recompute)
    return PartitionProblem(
        block_times=times, cut_bytes=table.cut_bytes, static_bytes=table.static_bytes,
        activation_bytes=table.activation_bytes, devices=tuple(specs), inflight=tuple(inflight),
        forward_times=None if modes is None else table.forward, recompute=modes)


@functools.lru_cache(maxsize=4096)
def inflight_for(schedule: str, stages: int, *, microbatches: int,
                 virtual_stages: int) -> tuple[int, ...]:
    """In-flight micro-batches per stage if the pipeline had `stages` stages (the partitioner's
    advice on how many devices would fit); where `schedule` cannot run on that many (e.g.
    interleaving constraints), the worst case: every micro-batch on every stage.

    A built-in generator's schedule is read unvalidated and without its messages (its tests
    validate every generator; in-flight counts read only F, B and W): the advice tries every
    stage count up to the block count, and validating 80-stage schedules took minutes."""
    devices = stages // virtual_stages
    if virtual_stages == 1 and schedule == "gpipe":  # every forward before any backward
        return (microbatches,) * stages
    if virtual_stages == 1 and schedule == "1f1b":  # stage s warms up with p - s forwards
        return tuple(max(1, min(microbatches, stages - s)) for s in range(stages))
    try:
        if schedule in SCHEDULES:
            if devices * virtual_stages != stages:
                raise PipecompileError(f"{stages} stages are not {virtual_stages} per device")
            return inflight(SCHEDULES[schedule](devices, microbatches,
                                                virtual_stages=virtual_stages))
        return inflight(make_schedule(schedule, devices, microbatches,
                                      virtual_stages=virtual_stages))
    except PipecompileError:
        return (microbatches,) * stages


class Priced(Protocol):
    """What a prediction reads of a plan (`Plan` is one): per-stage costs and messages from
    this module, the fixed cost per action, and how the devices share cores."""

    @property
    def stage_costs(self) -> tuple[StageCosts, ...]: ...
    @property
    def transfers(self) -> Mapping[MessageKey, float] | None: ...
    @property
    def overhead(self) -> float: ...
    @property
    def cores(self) -> int | None: ...
    @property
    def efficiency(self) -> float: ...


def predict(schedule: Schedule, plan: Priced) -> Timeline:
    """The predicted timeline of `schedule` with `plan`'s costs: `pipe.predicted` (the compiler's
    simulate pass) and `pipe.simulate()` both, so they cannot drift apart."""
    return simulate(schedule, plan.stage_costs, cores=plan.cores, efficiency=plan.efficiency,
                    transfers=plan.transfers, overhead=plan.overhead)


def with_stage_costs(program: StagedProgram, costs: CostTable, placement: Partition,
                     inflight: Sequence[int], times: Sequence[StageCosts]) -> StagedProgram:
    """`program` whose stages carry their `StageCost`: what the stage table reports beside the
    simulator's `times` (from `simulator_costs`)."""
    stages = []
    for s in program.stages:
        blocks = [costs.blocks[b] for b in s.blocks]
        stage_cost = StageCost(
            num_blocks=len(blocks),
            params=sum(p.numel() for p in {id(p): p for p in s.module.parameters()}.values()),
            forward_flops=sum(b.forward_flops for b in blocks),
            memory=placement.stage_memory[s.index],
            inflight=inflight[s.index],
            send_bytes=costs.cut_bytes[s.blocks[-1] + 1],
            times=times[s.index],
        )
        stages.append(replace(s, cost=stage_cost))
    return replace(program, stages=tuple(stages))


def shared_cores(specs: Sequence[DeviceSpec], ranks: Ranks) -> int | None:
    """How many CPU device threads of this process can compute at full speed at once.

    In one process every CPU "device" is a worker thread on the same cores, each op using
    torch's intra-op threads; more devices than that oversubscribes the cores, and the simulator
    must share them. None (no sharing) for accelerators and for one rank per process."""
    if ranks.distributed or any(torch.device(s.name).type != "cpu" for s in specs):
        return None
    available = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count())
    return max(1, (available or 1) // max(1, torch.get_num_threads()))
