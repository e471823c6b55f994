"""Step metrics: a flat dict of floats describing the last training step, for any logger.

    pipe.step(x, target=y)
    writer.add_scalars("train", pipe.metrics(), step)   # or wandb.log, logging, ...

Keys (each a float; a key is absent where nothing says its value):

    loss                       the step's mean loss (after `fit`: its last batch's)
    step_time_s                the step's measured span: first action's start to last action's
                               end (under torchrun the slowest rank's)
    bubble_fraction            1 - compute seconds of every device / (devices x step time): the
                               measured share of the step the devices sat idle; under torchrun
                               summed over every rank, so it is the job's, not one device's
    samples_per_s              the step's rows (every replica's) / step time
    tokens_per_s               rows x sequence length / step time, where the first input is a
                               batch of token ids (an integer tensor of two or more dimensions)
    bytes_sent                 bytes of the tensors sent between devices (every rank's)
    peak_memory_bytes/device{d} pipeline device d's peak: on CUDA the allocator's peak, on a CPU
                               parameters + gradients + optimizer state + saved activations
                               (`pipe.memory_stats()`); the largest over data-parallel replicas

Under torchrun every rank calls `pipe.metrics()` (it reduces across ranks: two all_reduce calls
over the default group) and gets the same dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..runtime.microbatch import MicroBatch
from ..runtime.spec import StepResult
from ..schedule.actions import COMPUTE_KINDS

__all__ = ["InputSizes", "Reduce", "all_reduce", "pipeline_metrics", "step_metrics"]

# reduce(values, op) -> the values reduced over every rank ("sum" or "max"); None: one process
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


@dataclass(frozen=True)
class InputSizes:
    """What a step's inputs say of its size: rows, and tokens where the first input is a batch
    of token ids."""

    rows: int
    tokens: int | None

    @classmethod
    def of(cls, mbs: Sequence[MicroBatch]) -> "InputSizes":
        rows = 0
        tokens: int | None = 0
        for mb in mbs:
            first = next((v for v in (*mb.args, *mb.kwargs.values())
                          if isinstance(v, torch.Tensor) and v.dim() > 0), None)
            if first is None:
                return cls(sum(mb.size for mb in mbs), None)
            rows += first.shape[0]
            ids = not first.is_floating_point() and not first.is_complex() and first.dim() >= 2
            tokens = tokens + first.shape[0] * first.shape[1] if ids and tokens is not None \
                else None
        return cls(rows, tokens)


def step_metrics(result: StepResult, *, devices: int, memory: Sequence[Any],
                 sizes: InputSizes | None, reduce: Reduce | None = None,
                 replicas: int = 1) -> dict[str, float]:
    """The metrics of `result` (see the module docstring). `devices`: the pipeline's devices;
    `memory`: this process's `DeviceMemory` records; `reduce`: across ranks (None: one
    process); `replicas`: data-parallel replicas (ranks = devices x replicas)."""
    events = result.events
    start = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=0.0) - start
    busy = sum(e.duration for e in events if e.action.kind in COMPUTE_KINDS)
    loss = result.losses[-1] if result.losses else None  # (fit: its last batch's)
    sent = float((result.communication or {}).get("bytes", 0))
    rows = float(sizes.rows) if sizes is not None else 0.0
    tokens = float(sizes.tokens) if sizes is not None and sizes.tokens is not None else -1.0
    peaks = [0.0] * devices
    for m in memory:
        peaks[m.device] = max(peaks[m.device], float(m.total))
    summed = torch.tensor([busy, float(loss.detach()) if loss is not None else 0.0,
                           1.0 if loss is not None else 0.0, rows, tokens, sent],
                          dtype=torch.float64)
    largest = torch.tensor([span, *peaks], dtype=torch.float64)
    ranks = 1
    if reduce is not None:
        summed, largest = reduce(summed, "sum"), reduce(largest, "max")
        ranks = devices * replicas
    busy, loss_sum, losses, rows, tokens, sent = summed.tolist()
    span, peaks = largest[0].item(), largest[1:].tolist()
    pipelines = ranks // replicas if reduce is not None else 1  # ranks that saw one batch
    out: dict[str, float] = {}
    if losses:
        out["loss"] = loss_sum / losses
    out["step_time_s"] = span
    out["bubble_fraction"] = 1.0 - busy / (devices * replicas * span) if span > 0 else 0.0
    if rows and span > 0:
        out["samples_per_s"] = rows / pipelines / span
        if tokens >= 0:
            out["tokens_per_s"] = tokens / pipelines / span
    out["bytes_sent"] = sent
    for d, peak in enumerate(peaks):
        out[f"peak_memory_bytes/device{d}"] = peak
    return out


def all_reduce(values: torch.Tensor, op: str, *, device: torch.device) -> torch.Tensor:
    """`values` reduced over the default process group (sum or max), on `device` for the
    collective (NCCL needs a CUDA tensor), handed back on the CPU."""
    import torch.distributed as dist

    moved = values.to(device)
    dist.all_reduce(moved, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return moved.cpu()


def pipeline_metrics(pipe: Any, sizes: InputSizes | None) -> dict[str, float]:
    """`step_metrics` of a Pipeline's last step; under torchrun reduced over its ranks."""
    import torch.distributed as dist

    topology = pipe.topology
    reduce: Reduce | None = None
    if topology is not None and dist.is_available() and dist.is_initialized():
        runtime = pipe.runtime
        device = runtime.wiring.devices[runtime.own_stages[0]]
        reduce = lambda values, op: all_reduce(values, op, device=device)  # noqa: E731
    return step_metrics(pipe.last_step, devices=pipe.schedule.num_devices,
                        memory=pipe.memory_stats(), sizes=sizes, reduce=reduce,
                        replicas=topology.data_parallel if topology is not None else 1)
