"""Stages timed as the runtime runs them: each with the runtime's own `StageWorker` on one real
micro-batch (single thread, no transport):

    F    forward, the loss included on the last stage (when a target is known)
    B    full backward
    I, W zero-bubble's input and weight parts (`runtime.split_backward`)
    loss the loss's forward and backward alone (part of the last stage's F and B)

A stage in a pipeline costs more than the sum of its blocks (`measure.profile` times those):
one graph module call and one autograd call per action instead of one per block, gradient
accumulation into `.grad`, the loss on the last stage, and, for zero-bubble's split backward,
one autograd call per weight-consuming op. Inputs come from one run of the captured graph;
output gradients are ones (their values do not change the time). Parameter gradients, buffers
and the RNG state are restored afterwards. `passes.calibrate` turns the times into corrected
block costs.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Mapping, Sequence

import torch

from ..ir.records import StageTimes
from ..runtime.stage_worker import LossSpec, StageWorker
from ..ir.tensors import to_device as _to
from .clock import elapsed

if TYPE_CHECKING:
    from ..ir.records import StagedProgram

__all__ = ["measure_stages", "thread_efficiency", "loss_runs"]


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
            result[index] = _time_stage(worker, inputs, _to(target, device), repeats, statistic,
                                        device)
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
                statistic: Callable[[list[float]], float], device: torch.device) -> StageTimes:
    """F, B, I, W and the loss, each run once per round in the order the runtime runs them
    (one's saved state feeds the next), so timed call by call (`clock.elapsed`: CUDA events on
    a GPU) rather than by torch.utils.benchmark, which repeats one statement."""

    def _clock(fn) -> float:
        return elapsed(fn, device)

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
        t_loss = _time_loss(worker, outputs, target, device) if worker.loss is not None else 0.0
        samples.append((t_f, t_b, t_i, t_w, t_loss))
    return StageTimes(*(statistic([s[k] for s in samples[1:]]) for k in range(5)))


def _time_loss(worker: StageWorker, outputs: Mapping[str, Any], target,
               device: torch.device) -> float:
    """Seconds of the loss's forward and backward alone, on the stage's outputs."""
    leaves = [v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor)
              else v for v in outputs.values()]

    def run():
        loss = worker._loss(tuple(leaves), target)
        if loss.requires_grad:
            loss.backward()

    return elapsed(run, device)


def _clock(fn) -> float:
    """Wall-clock seconds of `fn()`: device threads contending for this machine's CPU cores
    (`thread_efficiency`), several at once, not one device's events."""
    return elapsed(fn)
