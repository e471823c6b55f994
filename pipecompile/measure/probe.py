"""The model measured as it runs, for the planner: the planning probe (what the analytic costs
miss on this machine, before the search), and the split stages timed for `profile=True` and
for how much CPU device threads slow each other down. Under torch.distributed rank 0 measures
(or each rank its own stages) and `Ranks` shares the numbers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from ..ir.compile_cache import CompileCache, digest, function_key, layout
from ..ir.records import CostTable, LinearGraph, StageTimes
from ..ir.records import Example
from ..passes.calibrate import Calibration
from ..passes.split import split
from ..ir.records import StagedProgram
from .ranks import Ranks
from ..runtime.microbatch import split_microbatches
from ..runtime.stage_worker import LossSpec
from ..schedule.actions import Schedule
from ..schedule.messages import gradient_values
from .profile import record_values
from .stages import loss_runs, measure_stages, thread_efficiency

__all__ = ["measure", "efficiency", "Probe", "probe"]


def measure(program: StagedProgram, schedule: Schedule, example: Example, *, microbatches: int,
            loss_fn: Any, ranks: Ranks) -> dict[int, StageTimes]:
    """Every stage's measured F/B/I/W on the first micro-batch (`passes.calibrate`). Under
    torch.distributed each rank times its own stages and all ranks share the results."""
    values, target = _first_microbatch(program.linear, example, microbatches)
    own = ranks.own_stages(schedule) if ranks.distributed else None
    measured = measure_stages(program, values, grad_values=gradient_values(program),
                              loss=LossSpec(program.captured.unflatten_outputs, loss_fn,
                                            1.0 / microbatches),
                              target=target, stages=own)
    return ranks.stage_times(measured)


def efficiency(program: StagedProgram, schedule: Schedule, example: Example, *,
               microbatches: int, cores: int) -> float:
    """The speed of device threads running at once on `cores` cores, relative to their share."""
    values, _ = _first_microbatch(program.linear, replace(example, target=None), microbatches)
    firsts = [min(s for s in range(schedule.num_stages) if schedule.stage_to_device[s] == d)
              for d in range(schedule.num_devices)]
    return thread_efficiency(program, values, grad_values=gradient_values(program),
                             device_stages=firsts, cores=cores)


@dataclass(frozen=True)
class Probe:
    """The model measured as it runs, before the planning search: what the analytic costs
    miss on this machine."""

    calibration: Calibration  # analytic block times -> measured, the loss's own time
    split_ratio: float  # zero-bubble's (I + W) / B, measured
    efficiency: float  # device threads computing at once, relative to their share of the cores

    def __str__(self) -> str:
        return (f"{self.calibration}, (I+W)/B {self.split_ratio:.2f}, device threads at "
                f"{self.efficiency:.2f} of their share")


def probe(linear: LinearGraph, costs: CostTable, example: Example, device: torch.device, *,
          microbatches: int, loss_fn: Any, threads: int, cores: int | None,
          cache: CompileCache | None = None) -> Probe:
    """Measure the model cut after its first block (`linear`, at least 2 blocks, `costs` its
    analytic costs at the size of one of `microbatches` micro-batches) on `device`, as the
    runtime runs stages: the factor from analytic to measured block time, the loss's time, the
    split backward's (I + W) / B on the second stage (the first has no input gradient to
    compute), and, when `threads` device threads share `cores` CPU cores, their efficiency
    running the second stage at once. Costs about 15 forward + backward passes of the model on
    one micro-batch; parameter gradients, buffers and the random state are left as they were.
    Kept in `cache` (None: measured afresh) for a graph, its parameters' shapes, the analytic
    prediction, input layout, loss function and setting: compiling the same model again, with
    other options or weights, reuses the numbers."""
    def run() -> Probe:
        return _probe(linear, costs, example, device, microbatches=microbatches,
                      loss_fn=loss_fn, threads=threads, cores=cores)

    if cache is None:
        return run()
    # the calibration is measured time over `costs`' prediction: the key holds both what runs
    # (code, parameter shapes) and the prediction, so no other compile's costs leak in
    gm = linear.captured.module
    state = tuple((name, tuple(t.shape), str(t.dtype), t.requires_grad)
                  for name, t in (*gm.named_parameters(), *gm.named_buffers()))
    key = ("probe", digest(gm.code, state, tuple(b.time for b in costs.blocks)),
           linear.granularity, layout(example.args), layout(dict(example.kwargs)),
           layout(example.target), microbatches, function_key(loss_fn), str(device), threads,
           cores)
    return cache.get(key, run)


def _probe(linear: LinearGraph, costs: CostTable, example: Example, device: torch.device, *,
           microbatches: int, loss_fn: Any, threads: int, cores: int | None) -> Probe:
    bounds = (0, 1, linear.num_blocks)
    program = split(linear, bounds, [device, device], placed=example.placed)
    values, target = _first_microbatch(linear, example, microbatches)
    grads = gradient_values(program)
    # a model that returns its own loss has it in its blocks; any other output gets ones as
    # its gradient
    last = LossSpec(linear.captured.unflatten_outputs, loss_fn, 1.0) if loss_fn else None
    # the fastest of a few runs: what the work costs, not what other processes added to it
    measured = measure_stages(program, values, grad_values=grads, loss=last, target=target,
                              repeats=4, statistic=min)
    predicted = sum(b.time for b in costs.blocks)
    actual = sum(t.forward + t.backward - t.loss for t in measured.values())
    size = linear.captured.microbatch_size(microbatches)
    calibration = Calibration(actual / predicted if predicted > 0 else 1.0, measured[1].loss,
                              microbatch_size=size,
                              loss_timed=loss_runs(loss_fn, target))
    rest = measured[1]
    ratio = ((rest.backward_input + rest.backward_weight) / rest.backward
             if rest.backward > 0 else 1.0)
    shared = 1.0
    if cores is not None and threads >= 2:
        shared = thread_efficiency(program, values, grad_values=grads,
                                   device_stages=[1] * threads, cores=cores, repeats=3)
    return Probe(calibration, ratio, shared)


def _first_microbatch(linear: LinearGraph, example: Example,
                      microbatches: int) -> tuple[Mapping[str, Any], Any]:
    """Every graph value on the first micro-batch, and that micro-batch's target."""
    mb = split_microbatches(example.args, dict(example.kwargs), example.target, microbatches)[0]
    captured = linear.captured
    return record_values(captured.module, captured.flatten_inputs(mb.args, mb.kwargs)), mb.target
