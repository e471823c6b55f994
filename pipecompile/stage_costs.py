"""Costs of the split stages: the stage table's `StageCost` and the simulator's `StageCosts`.

Without profiling a stage costs the sum of its blocks; with `profile=True` it costs what
`measure/probe.py` timed it at.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Sequence

import torch

from .ir import CostTable, StageCost, StageTimes
from .passes.partition import DeviceSpec, Partition
from .passes.split import Stage, StagedProgram
from .ranks import Ranks
from .schedule.simulate import StageCosts
from .search import SPLIT_BACKWARD_RATIO

__all__ = ["with_stage_costs", "simulator_costs", "shared_cores"]


def with_stage_costs(program: StagedProgram, costs: CostTable, placement: Partition,
                     inflight: Sequence[int]) -> StagedProgram:
    """`program` whose stages carry their predicted `StageCost` (summed from their blocks)."""
    stages = []
    for s in program.stages:
        blocks = [costs.blocks[b] for b in s.blocks]
        stage_cost = StageCost(
            num_blocks=len(blocks),
            params=sum(p.numel() for p in {id(p): p for p in s.module.parameters()}.values()),
            forward_flops=sum(b.forward_flops for b in blocks),
            forward_time=sum(b.forward_time for b in blocks),
            backward_time=sum(b.backward_time for b in blocks),
            memory=placement.stage_memory[s.index],
            inflight=inflight[s.index],
            send_bytes=costs.cut_bytes[s.blocks[-1] + 1],
        )
        stages.append(replace(s, cost=stage_cost))
    return replace(program, stages=tuple(stages))


def simulator_costs(stage: Stage, costs: CostTable, spec: DeviceSpec,
                    measured: StageTimes | None = None, *, recompute: bool = False,
                    split_ratio: float = SPLIT_BACKWARD_RATIO) -> StageCosts:
    """Simulator costs of a stage: measured (`profile=True`) or the sum of its blocks'. A stage
    that receives no gradient-carrying input (the first) has nothing to do in I: its whole
    backward is weight gradients. A stage that `recompute`s runs its forward again in B (or I);
    analytic I and W together cost `split_ratio` times B (see search.SPLIT_BACKWARD_RATIO)."""
    assert stage.cost is not None, "with_stage_costs runs first"
    first = stage.blocks[0]
    transfers = dict(send_forward=_transfer(stage.cost.send_bytes, spec),
                     send_backward=_transfer(costs.cut_bytes[first], spec))
    if measured is not None:
        again = measured.forward if recompute else 0.0
        return StageCosts(forward=measured.forward, backward=measured.backward + again,
                          backward_input=measured.backward_input + again,
                          backward_weight=measured.backward_weight, **transfers)
    blocks = [costs.blocks[b] for b in stage.blocks]
    if costs.cut_bytes[first] == 0:
        i_time, w_time = 0.0, stage.cost.backward_time
    else:
        i_time = sum(b.backward_input_time for b in blocks)
        w_time = sum(b.backward_weight_time for b in blocks)
    again = stage.cost.forward_time if recompute else 0.0
    return StageCosts(forward=stage.cost.forward_time, backward=stage.cost.backward_time + again,
                      backward_input=split_ratio * i_time + again,
                      backward_weight=split_ratio * w_time, **transfers)


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


def _transfer(nbytes: float, spec: DeviceSpec) -> float:
    return spec.send_time(nbytes)
