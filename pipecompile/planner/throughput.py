"""What a plan's predicted step means per device: samples and tokens per second, and MFU.

    throughput(plan) -> Throughput | None

    model FLOPs per step  3 x the forward FLOPs counted on the captured graph (torch's
                          FlopCounterMode: matmuls and attention, no recomputation), for the
                          global batch: the usual "model FLOPs" (a backward is twice a forward)
    MFU                   model FLOPs / (predicted step x devices x dense peak FLOP/s), the
                          peak of the preset in the model's dtype (PaLM's definition; none for
                          devices measured on this machine)
    tokens                samples x sequence length where the first input is a 2-D integer
                          tensor (token ids)
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import accelerator_of
from ..ir.records import evaluate
from .options import compute_dtype
from .plan import Plan

__all__ = ["Throughput", "throughput"]


@dataclass(frozen=True)
class Throughput:
    """One step of the whole job as predicted: its samples (tokens), devices and FLOPs."""

    step: float  # predicted seconds
    devices: int  # pipeline x data parallel
    samples: int  # global samples per step
    tokens: int | None  # global tokens per step (None: the input is not token ids)
    model_flops: float  # per step (module docstring)
    peak: float | None  # dense peak FLOP/s per device (None: not a preset)

    @property
    def mfu(self) -> float | None:
        if self.peak is None or self.step <= 0:
            return None
        return self.model_flops / (self.step * self.devices * self.peak)

    def per_device(self, count: float) -> float:
        """`count` per step as a rate per second per device."""
        return count / self.step / self.devices if self.step > 0 else 0.0

    def __str__(self) -> str:
        rate = (f"{self.per_device(self.tokens):,.0f} tokens/s per device "
                f"({self.per_device(self.samples):.3g} samples/s)" if self.tokens else
                f"{self.per_device(self.samples):.4g} samples/s per device")
        text = (f"throughput {rate} over {self.devices} devices; model FLOPs "
                f"{self.model_flops:.3e} per step (3 x the counted forward)")
        if self.mfu is not None and self.peak is not None:
            text += f", MFU {self.mfu:.1%} of {self.peak / 1e12:.1f} TFLOP/s dense peak"
        return text


def throughput(plan: Plan) -> Throughput | None:
    """The predicted throughput of a compiled plan (None: no prediction or block costs)."""
    if plan.predicted is None or plan.costs is None or plan.captured is None:
        return None
    o, whole = plan.resolved, plan.asked.global_batch  # whole: the example is the global batch
    captured = plan.captured
    replicas = o.data_parallel
    local = (captured.captured_batch_size // replicas if whole
             else captured.captured_batch_size)
    samples = local * replicas
    microbatch_flops = sum(b.forward_flops for b in plan.costs.blocks)
    size = captured.microbatch_size(o.microbatches * (replicas if whole else 1))
    model_flops = 3 * microbatch_flops * samples / max(1, size)
    spec = o.devices[0]
    accelerator = accelerator_of(spec) if spec.absolute else None
    peak = accelerator.peak(compute_dtype(captured.module)) if accelerator else None
    chosen = plan.choices.layout if plan.choices is not None else None
    tensor = chosen.tensor_parallel if chosen is not None else 1  # T ranks per position
    return Throughput(plan.predicted.makespan, len(o.devices) * replicas * tensor, samples,
                      _tokens(plan, samples), model_flops, peak)


def _tokens(plan: Plan, samples: int) -> int | None:
    captured = plan.captured
    assert captured is not None
    if not captured.input_names:
        return None
    info = captured.values.get(captured.input_names[0])
    if info is None or len(info.shape) != 2 or "int" not in str(info.dtype):
        return None
    return samples * int(evaluate(info.shape[1], captured.example_sizes))
