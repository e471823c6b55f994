"""Where the predicted step goes: its makespan split into parts that sum to it exactly.

    step_breakdown(plan) -> StepBreakdown | None

The step is read on the busiest device (the most compute in the step without communication),
by simulating the plan's schedule three times (schedule/simulate.py):

    quiet       messages free and no fixed cost per action: the device's busy time, and its
                idle time (the pipeline's bubble)
    + messages  each message at its priced transfer: what the step grows by is the exposed
                pipeline communication
    + overhead  the plan's fixed cost per action and message: the rest of the step

The busy time splits into the layout's extras (the optimizer step, priced by its bytes as
`passes.kernel_prices.optimizer_seconds`, and the data-parallel collectives: the stages'
`setup` and `teardown`) and compute; compute splits by kernel kind (matmul, attention,
memory-bound, the loss over a vocabulary: softmax / cross-entropy over rows longer than
shared memory holds, launch floors) in the proportions the kernel model prices the device's
stages' blocks (`passes.kernels.Kernels.parts`: forward, backward, and forward again where a
stage recomputes), or stays one part where blocks were measured or not priced by kernel.

    matmul + attention + memory + loss + launch + compute + optimizer + collectives
        + communication + overhead + bubble = step
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..ir.records import evaluate
from ..passes.annotate import PricedBlockCost
from ..passes.kernel_prices import optimizer_seconds
from ..passes.kernels import KernelTimes
from ..schedule.simulate import simulate
from .shape_passes import collectives
from .plan import Plan
from .stage_costs import BlockTable

__all__ = ["StepBreakdown", "step_breakdown"]

_LABELS = {
    "matmul": "matmul kernels", "attention": "fused attention",
    "memory": "memory-bound kernels", "loss": "loss over the vocabulary",
    "launch": "launch floors (small kernels)",
    "compute": "compute (not split by kind)", "optimizer": "optimizer step + clipping",
    "collectives": "data-parallel collectives", "communication": "exposed pipeline messages",
    "overhead": "fixed cost per action", "bubble": "bubble (idle)",
}


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds of the predicted `step` on `device`, by part (module docstring)."""

    step: float
    device: int
    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    loss: float = 0.0  # softmax / cross-entropy over rows longer than shared memory holds
    launch: float = 0.0
    compute: float = 0.0  # compute not split by kind (measured or unpriced blocks)
    optimizer: float = 0.0
    collectives: float = 0.0
    communication: float = 0.0
    overhead: float = 0.0
    bubble: float = 0.0

    def parts(self) -> dict[str, float]:
        """The parts by name, in order; they sum to `step`."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("step", "device")}

    def __str__(self) -> str:
        lines = [f"predicted step {self.step * 1e3:.3f} ms, as device {self.device} (the "
                 f"busiest) spends it:"]
        for name, seconds in self.parts().items():
            if seconds != 0.0:
                share = seconds / self.step if self.step > 0 else 0.0
                lines.append(f"  {_LABELS[name]:<32}{seconds * 1e3:11.3f} ms  {share:6.1%}")
        return "\n".join(lines)


def step_breakdown(plan: Plan) -> StepBreakdown | None:
    """The predicted step of a compiled `plan` by part; None without a prediction or costs
    (a loaded plan)."""
    if (plan.predicted is None or not plan.stage_costs or plan.schedule is None
            or plan.costs is None or plan.placement is None):
        return None
    schedule, costs = plan.schedule, plan.stage_costs
    quiet = simulate(schedule, [replace(c, send_forward=0.0, send_backward=0.0) for c in costs],
                     transfers=lambda *_: 0.0, overhead=0.0, cores=plan.cores,
                     efficiency=plan.efficiency)
    sending = simulate(schedule, costs, transfers=plan.transfers, overhead=0.0,
                       cores=plan.cores, efficiency=plan.efficiency)
    step = plan.predicted.makespan
    device = max(range(quiet.num_devices), key=quiet.busy)
    busy = quiet.busy(device)
    stages = [s for s, d in enumerate(schedule.stage_to_device) if d == device]
    extras = sum(costs[s].setup + costs[s].teardown for s in stages)
    optimizer = min(extras, _optimizer(plan, stages))
    kinds = _kinds(plan, stages)
    compute = busy - extras
    total = kinds.total
    split = kinds.scaled(compute / total) if total > 0 else KernelTimes()
    return StepBreakdown(
        step=step, device=device, matmul=split.matmul, attention=split.attention,
        memory=split.memory, loss=split.loss, launch=split.launch,
        compute=0.0 if total > 0 else compute,
        optimizer=optimizer, collectives=extras - optimizer,
        communication=sending.makespan - quiet.makespan, overhead=step - sending.makespan,
        bubble=quiet.makespan - busy)


def _optimizer(plan: Plan, stages: list[int]) -> float:
    """Seconds of the optimizer step of `stages` as the layout prices it (0: not priced)."""
    priced = collectives(plan) if plan.choices is not None else None
    table = BlockTable.of(plan.costs) if plan.costs is not None else None
    if priced is None or priced.memory_bandwidth is None or table is None or not table.state_bytes:
        return 0.0
    shard = priced.layout.data_parallel if priced.layout.fsdp else 1
    bounds = plan.ready.placement.bounds
    seconds = 0.0
    for s in stages:
        for param, grad, state in table.state_bytes[bounds[s]:bounds[s + 1]]:
            seconds += optimizer_seconds(priced.memory_bandwidth, param / shard, grad / shard,
                                         state / shard, passes=priced.passes)
    return seconds


def _kinds(plan: Plan, stages: list[int]) -> KernelTimes:
    """The device's compute per step by kernel kind as the kernel model prices its blocks
    (zero where a block has no kernels: measured devices)."""
    rates = plan.device_model.kernels if plan.device_model is not None else None
    costs = plan.ready.costs
    if rates is None:
        return KernelTimes()
    o = plan.resolved
    bounds = plan.ready.placement.bounds
    specs = plan.stage_specs
    total = KernelTimes()
    for s in stages:
        for b in range(bounds[s], bounds[s + 1]):
            cost = costs.symbolic[b]
            if not isinstance(cost, PricedBlockCost):
                return KernelTimes()
            forward, backward = cost.kernels.parts(
                costs.blocks[b].backward_flops, rates, lambda e: evaluate(e, costs.sizes))
            again = forward if o.stage_checkpoint(s) else KernelTimes()
            total = total + (forward + backward + again).scaled(
                o.microbatches / specs[s].speed)
    return total
