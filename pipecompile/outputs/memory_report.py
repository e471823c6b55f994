"""Measured memory of the last training step, per device, next to the plan's prediction.

Parameters, gradients and optimizer state are read from the tensors when `pipe.memory_stats()`
is called; saved activations are what `runtime/memory.py` counted during the step; on CUDA the
allocator's peak since the step began (`torch.cuda.max_memory_allocated`) is the device total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from ..ir.formats import format_bytes
from .table import format_table
from ..runtime.memory import SavedActivations

if TYPE_CHECKING:
    from ..planner.plan import Plan
    from ..runtime.assemble import Runtime

__all__ = ["DeviceMemory", "device_memory", "format_memory"]


@dataclass(frozen=True)
class DeviceMemory:
    """Measured (last training step) and predicted (the plan's cost model) bytes of one
    pipeline device. `total` is parameters + gradients + optimizer state + activations on a
    CPU, the allocator's peak on CUDA; the predictions are None for a loaded plan."""

    device: int  # the schedule's device index
    place: str  # the torch device, e.g. "cpu" or "cuda:1"
    stages: tuple[int, ...]
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # peak of the saved-for-backward bytes held at once
    total: int
    microbatch_activations: int  # the most one micro-batch held on this device
    predicted_total: float | None = None
    predicted_static: float | None = None  # parameters + gradients + optimizer state
    predicted_activations: float | None = None

    @property
    def ratio(self) -> float | None:
        """predicted_total / total (1.0: exact)."""
        if self.predicted_total is None or not self.total:
            return None
        return self.predicted_total / self.total

    def __str__(self) -> str:
        return format_memory((self,))


def format_memory(devices: Sequence[DeviceMemory]) -> str:
    """A table of measured and predicted bytes, one row per device."""
    def fmt(x: float | None) -> str:
        return "-" if x is None else format_bytes(x)

    head = ("device", "stages", "params", "grads", "optim", "activ", "total",
            "pred activ", "pred total", "pred/meas")
    rows = [head]
    for d in devices:
        ratio = "-" if d.ratio is None else f"{d.ratio:.2f}"
        rows.append((f"{d.device} {d.place}", ",".join(map(str, d.stages)), fmt(d.parameters),
                     fmt(d.gradients), fmt(d.optimizer_state), fmt(d.activations),
                     fmt(d.total), fmt(d.predicted_activations), fmt(d.predicted_total), ratio))
    return "\n".join(format_table(rows, right=range(1, len(head))))


def _nbytes(tensors: Iterable[Any]) -> int:
    unique = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _device_peak(trackers: Sequence[SavedActivations]) -> int:
    """The most bytes the stages of one device held at once (their events in order)."""
    if len(trackers) == 1:
        return trackers[0].peak
    held = peak = 0
    for _, change in sorted(e for t in trackers for e in t.events):
        held += change
        peak = max(peak, held)
    return peak


def device_memory(runtime: "Runtime", plan: "Plan",
                  optimizers: Sequence[torch.optim.Optimizer]) -> tuple[DeviceMemory, ...]:
    """Per device of this process, the last step's measured memory and the plan's prediction."""
    program, schedule = runtime.program, runtime.schedule
    by_device: dict[int, list[int]] = {}
    for s in runtime.own_stages:
        by_device.setdefault(schedule.stage_to_device[s], []).append(s)
    result = []
    for d, stages in sorted(by_device.items()):
        place = runtime.wiring.devices[stages[0]]
        params = list({id(p): p for s in stages
                       for p in program.stages[s].module.parameters()}.values())
        ids = {id(p) for p in params}
        state = [t for opt in optimizers for p, st in opt.state.items() if id(p) in ids
                 for t in st.values() if isinstance(t, torch.Tensor)]
        trackers = [runtime.workers[s].activations for s in stages]
        parameters, optimizer_state = _nbytes(params), _nbytes(state)
        gradients = _nbytes(p.grad for p in params)
        activations = _device_peak(trackers)
        total = parameters + gradients + optimizer_state + activations
        if place.type == "cuda":
            total = torch.cuda.max_memory_allocated(place)
        result.append(DeviceMemory(
            d, str(place), tuple(stages), parameters, gradients, optimizer_state, activations,
            total, max((v for t in trackers for v in t.microbatch.values()), default=0),
            *_predicted(plan, stages)))
    return tuple(result)


def _predicted(plan: "Plan", stages: Sequence[int]) -> tuple[float | None, ...]:
    """(total, static, activations) the plan predicts for `stages`, or Nones."""
    assert plan.program is not None, "a compiled plan"
    costs = [plan.program.stages[s].cost for s in stages]
    if any(c is None for c in costs):
        return None, None, None
    total = sum(c.memory for c in costs if c is not None)
    if plan.costs is None:
        return total, None, None
    static = sum(plan.costs.blocks[b].static_bytes for s in stages
                 for b in plan.program.stages[s].blocks)
    return total, static, total - static
