"""calibrate: measure the split stages as the runtime runs them, and correct the block costs.

`profile` times every block alone. A stage in a pipeline costs more than the sum of its blocks:
one graph module call and one autograd call per action instead of one per block, gradient
accumulation into `.grad`, the loss on the last stage, and, for zero-bubble's split backward,
one autograd call per weight-consuming op. This pass measures each stage with the runtime's own
`StageWorker` on one real micro-batch (single thread, no transport):

    F    forward, the loss included on the last stage (when a target is known)
    B    full backward
    I, W zero-bubble's input and weight parts (`runtime.split_backward`)
    loss the loss's forward and backward alone (part of the last stage's F and B)

Inputs come from one run of the captured graph; output gradients are ones (their values do not
change the time). Parameter gradients, buffers and the RNG state are restored afterwards.

`fit_calibration` finds one factor for every block's time (the median of the stages'
measured / predicted ratios) and takes the loss's time, measured alone on the last stage;
`calibrate_blocks` applies them to a cost table (of any granularity). The compiler re-plans on
the calibrated costs.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Mapping, Sequence

import torch

from ..ir import CostTable
from ..runtime.stage_worker import LossSpec, StageWorker
from ..tensors import to_device as _to
from .profile import sync_device

if TYPE_CHECKING:
    from .split import StagedProgram

__all__ = ["StageTimes", "Calibration", "measure_stages", "thread_efficiency", "fit_calibration",
           "calibrate_blocks", "loss_runs"]


@dataclass(frozen=True)
class StageTimes:
    """Measured seconds of one stage's actions for one micro-batch."""

    forward: float
    backward: float
    backward_input: float
    backward_weight: float
    loss: float = 0.0  # of forward + backward: the loss's own forward and backward (last stage)


def measure_stages(
    program: StagedProgram,
    values: Mapping[str, Any],
    *,
    grad_values: AbstractSet[str],
    loss: LossSpec | None,
    target: Any = None,
    stages: Sequence[int] | None = None,
    repeats: int = 5,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[int, StageTimes]:
    """Times of `stages` (default: all) of a `StagedProgram` on one micro-batch: the median of
    `repeats` runs (`statistic=min`: the fastest, what the work costs without interference).

    `values` maps every boundary value and graph input to its value on that micro-batch;
    `loss` (for the last stage) is used only when `target` is given or `loss.loss_fn` is None.
    """
    last = program.num_stages - 1
    chosen = range(program.num_stages) if stages is None else stages
    result = {}
    with _restoring(program):
        for index in chosen:
            with_loss = index == last and loss is not None and loss_runs(loss.loss_fn, target)
            worker, inputs = _worker(program, index, values, grad_values,
                                     loss if with_loss else None)
            device = program.stages[index].device
            result[index] = _time_stage(worker, inputs, _to(target, device), repeats, statistic)
    return result


def loss_runs(loss_fn: Any, target: Any) -> bool:
    """Does timing run the loss? A `loss_fn` needs a target; without one (a model that returns
    its own loss) the loss is part of the graph."""
    return target is not None or loss_fn is None


def thread_efficiency(
    program: StagedProgram,
    values: Mapping[str, Any],
    *,
    grad_values: AbstractSet[str],
    device_stages: Sequence[int],
    cores: int,
    repeats: int = 5,
) -> float:
    """Speed of device threads computing at once, relative to an ideal share of the cores.

    One process runs a thread per device; together they contend for the GIL (Python dispatch),
    memory bandwidth and caches, so each runs slower than alone even with a core to itself.
    Each stage of `device_stages` (one per device) runs forward + backward `repeats` times alone,
    then all at once in threads; efficiency = (alone / together) / min(1, cores / threads).
    """
    runs = [_worker(program, index, values, grad_values, None) for index in device_stages]
    with _restoring(program):
        alone = []
        for worker, inputs in runs:
            times = [_clock(lambda: _forward_backward(worker, inputs)) for _ in range(repeats + 1)]
            alone.append(statistics.median(times[1:]))
        # All threads run until the slowest has done `repeats` iterations; only iterations that
        # finished while every thread was still running count (no one finishes early and
        # leaves the others more cores).
        together: list[list[float]] = [[] for _ in runs]
        start, stop = threading.Barrier(len(runs)), threading.Event()

        def loop(worker, inputs, times):
            start.wait()
            while not stop.is_set() and len(times) < 100 * (repeats + 1):
                elapsed = _clock(lambda: _forward_backward(worker, inputs))
                if not stop.is_set():
                    times.append(elapsed)
                if all(len(t) > repeats for t in together):
                    stop.set()

        threads = [threading.Thread(target=loop, args=(*run, times), daemon=True)
                   for run, times in zip(runs, together)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ratio = statistics.mean(a / statistics.median(t[1:] or t) for a, t in zip(alone, together))
    return min(1.0, max(0.1, ratio / min(1.0, cores / len(runs))))


def _forward_backward(worker: StageWorker, inputs) -> None:
    outputs = worker.forward(0, inputs)
    grads = {n: torch.ones_like(v) for n, v in outputs.items()
             if isinstance(v, torch.Tensor) and v.requires_grad}
    worker.backward(0, grads)


def _worker(program, index: int, values, grad_values, loss) -> tuple[StageWorker, dict]:
    stage = program.stages[index]
    # one thread: W may add into .grad in place, as for a parameter no other stage holds
    worker = StageWorker(index, stage.module, stage.inputs, stage.outputs,
                         frozenset(n for n in stage.inputs if n in grad_values), loss,
                         exclusive_params=frozenset(id(p) for p in stage.module.parameters()))
    return worker, {n: _to(values[n], stage.device) for n in stage.inputs}


@contextlib.contextmanager
def _restoring(program):
    """Leave parameter gradients, buffers and the RNG state as they were."""
    params = {id(p): p for s in program.stages for p in s.module.parameters()}
    grads = {k: p.grad for k, p in params.items()}
    buffers = {id(b): (b, b.detach().clone()) for s in program.stages for b in s.module.buffers()}
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers.values():
                b.copy_(saved)
        for k, p in params.items():
            p.grad = grads[k]


def _time_stage(worker: StageWorker, inputs, target, repeats: int,
                statistic: Callable[[list[float]], float]) -> StageTimes:
    samples = []
    for _ in range(repeats + 1):  # the first round warms up
        t_f = _clock(lambda: worker.forward(0, inputs, target))
        outputs = worker.saved[0].outputs
        grads = {n: torch.ones_like(v) for n, v in outputs.items()
                 if isinstance(v, torch.Tensor) and v.requires_grad}
        t_b = _clock(lambda: worker.backward(0, grads))
        # I and W as zero-bubble stages run them, from a forward with deferred linears; F and
        # B above as the other schedules run them, from the plain graph. That forward's extra
        # time (the deferred linears' Python) is charged to I: (I + W) / B then prices all
        # that splitting costs
        worker.split_weights = True
        try:
            extra = max(0.0, _clock(lambda: worker.forward(0, inputs, target)) - t_f)
            t_i = _clock(lambda: worker.backward_input(0, grads)) + extra
            t_w = _clock(lambda: worker.backward_weight(0))
        finally:
            worker.split_weights = False
        t_loss = _time_loss(worker, outputs, target) if worker.loss is not None else 0.0
        samples.append((t_f, t_b, t_i, t_w, t_loss))
    return StageTimes(*(statistic([s[k] for s in samples[1:]]) for k in range(5)))


def _time_loss(worker: StageWorker, outputs: Mapping[str, Any], target) -> float:
    """Seconds of the loss's forward and backward alone, on the stage's outputs."""
    leaves = [v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor)
              else v for v in outputs.values()]

    def run():
        loss = worker._loss(tuple(leaves), target)
        if loss.requires_grad:
            loss.backward()

    return _clock(run)


def _clock(fn) -> float:
    sync_device()
    start = time.perf_counter()
    fn()
    sync_device()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Calibration:
    """How measured stages differ from the sum of their blocks: a time factor for every block,
    and the loss's seconds per micro-batch, charged to the last block."""

    factor: float = 1.0
    loss_time: float = 0.0
    microbatch_size: int = 0  # the size the loss was timed at (0: the size it is applied to)
    loss_timed: bool = True  # False: no target at compile, so the loss was not run (time 0)

    def __str__(self) -> str:
        if not self.loss_timed:
            return (f"block times x{self.factor:.2f}, loss not timed (no target at compile: "
                    f"compile lazily or pass example_target=)")
        return f"block times x{self.factor:.2f}, loss {self.loss_time * 1e3:.3f} ms/mb"

    def at(self, microbatch_size: int) -> "Calibration":
        """This calibration for micro-batches of `microbatch_size`: the loss's time scales with
        the rows it reduces."""
        if not self.microbatch_size or microbatch_size == self.microbatch_size:
            return self
        return replace(self, loss_time=self.loss_time * microbatch_size / self.microbatch_size,
                       microbatch_size=microbatch_size)


def fit_calibration(
    costs: CostTable, bounds: Sequence[int], measured: Mapping[int, StageTimes], *,
    loss_timed: bool = True,
) -> Calibration:
    """The factor is the median over the stages of measured / predicted F+B (the loss's own
    measured time left out); the loss is measured directly on the last stage (`loss_timed`
    False: it was not run, for want of a target)."""
    predicted = [sum(costs.blocks[b].time for b in range(lo, hi))
                 for lo, hi in zip(bounds, bounds[1:])]
    loss = measured[len(predicted) - 1].loss
    actual = [measured[s].forward + measured[s].backward - measured[s].loss
              for s in range(len(predicted))]
    ratios = [a / p for a, p in zip(actual, predicted) if p > 0]
    return Calibration(statistics.median(ratios) if ratios else 1.0, loss, loss_timed=loss_timed)


def calibrate_blocks(costs: CostTable, calibration: Calibration) -> CostTable:
    """`costs` with every block time scaled and the loss added to the last block."""
    blocks = []
    last = len(costs.blocks) - 1
    for i, b in enumerate(costs.blocks):
        extra = calibration.loss_time if i == last else 0.0
        # the loss runs in forward and starts the backward: charge it to F and I evenly
        blocks.append(replace(
            b,
            forward_time=b.forward_time * calibration.factor + extra / 2,
            backward_input_time=b.backward_input_time * calibration.factor + extra / 2,
            backward_weight_time=b.backward_weight_time * calibration.factor,
        ))
    return replace(costs, blocks=tuple(blocks),
                   notes=(*costs.notes, f"calibrated by the measured stages: {calibration}"))
