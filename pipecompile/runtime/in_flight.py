"""What a stage holds between a micro-batch's forward and its backward, and per step.

    Saved        one micro-batch: its leaves and outputs (kept forward), or the inputs and
                 random state to recompute from (recomputed forward); what W needs (split
                 backward); the weight version it used (asynchronous schedules)
    InFlight     a stage's saved micro-batches, last-stage losses, the bytes they keep
                 (`memory.SavedActivations`, read by `pipe.memory_stats()`), the most held at
                 once, and the steps begun (micro-batch 0's forward starts one)
    NoSync       the gradient hooks of a stage without data parallelism: none
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .memory import SavedActivations, step_started
from .rng_state import RngState
from .weight_store import WeightGradStore

__all__ = ["Saved", "InFlight", "NoSync"]


@dataclass
class Saved:
    """What micro-batch i's backward needs, kept by its forward."""

    leaves: dict[str, torch.Tensor]  # received inputs that need a gradient, as leaves
    outputs: dict[str, Any]
    loss: torch.Tensor | None = None
    inputs: dict[str, Any] | None = None  # recomputed forward: what to recompute from
    rng: RngState | None = None  # recomputed forward: the random state the forward started from
    target: Any = None  # recomputed forward, last stage: the target the loss is recomputed with
    stream: tuple[int, int] = (0, 0)  # recomputed forward: `rng.microbatch`'s (index, step)
    weight_work: Any = None  # split backward: what W needs, recorded by I
    store: WeightGradStore | None = None  # split backward, deferred linears: W's queued work
    weights: dict | None = None  # asynchronous schedules: the weight version this mb uses


class NoSync:
    """Gradient hooks of a stage that is not data parallel (`data_parallel.py` has the FSDP and
    DDP ones): nothing to arm before a backward or at a step's start."""

    def begin_step(self) -> None:
        """A step begins: nothing to reset."""

    def summed(self, summed: bool) -> None:
        """Gradients are summed or averaged over replicas: there are none."""

    def before_backward(self) -> None:
        """A backward begins: no reduction to arm."""


@dataclass
class InFlight:
    """A stage's micro-batches in flight and its per-step counts."""

    saved: dict[int, Saved] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # last stage: detached losses
    activations: SavedActivations = field(default_factory=SavedActivations)
    peak_inflight: int = 0  # most micro-batches held at once (activations saved) so far
    steps: int = 0  # training steps begun (forwards of micro-batch 0): per-step random streams

    def begin_step(self, inputs: Mapping[str, Any], module: torch.nn.Module, sync: Any) -> None:
        """The first forward of a step (micro-batch 0): new random streams and memory counts,
        and the gradient hooks told a step begins."""
        self.steps += 1
        self.activations.reset()
        sync.begin_step()
        tensors = [*inputs.values(), *module.parameters()]
        step_started({t.device for t in tensors if isinstance(t, torch.Tensor)}, self.steps)
