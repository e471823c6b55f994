"""What the runtime is given and what it gives back, as two frozen records.

    RuntimeSpec ──▶ assemble(program, schedule, spec) ──▶ Runtime
                                                            │ run(schedule, micro-batches)
                                                            ▼
                                                        StepResult

`RuntimeSpec` holds exactly what the runtime reads of compile's options, resolved (per-stage
recomputation as a set of stages, the data-parallel degree from the topology); it is built from
a finished plan outside runtime/ (`pipecompile.planner.assembly.runtime_spec`), so the runtime sits
below the planner and never sees `CompileOptions`. `StepResult` is everything one run of a
schedule produced (losses, measured events, message statistics, the schedule itself), returned
rather than left behind as attributes for the caller to read afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..schedule.actions import Schedule
from ..schedule.simulate import Event, Timeline
from .distributed import Topology

__all__ = ["RuntimeSpec", "StepResult"]


@dataclass(frozen=True)
class RuntimeSpec:
    """How to run a plan's stages in this process."""

    microbatches: int  # per batch: a synchronous schedule's step, an asynchronous one's batch
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None  # None: the model returns its loss
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None  # one per stage (or version)
    checkpoint: frozenset[int] = frozenset()  # stages that recompute their forward in backward
    rng: str = "global"  # "global": a recomputing stage gets streams that redraw the same masks
    vertical_sync: bool = False  # PipeDream: every stage uses the first stage's weight version
    compile_stages: bool = False  # each stage graph through torch.compile (runtime/compiled.py)
    fsdp: bool = False  # stages fully_shard-ed over the data-parallel replicas
    timeout: float = 300.0  # seconds any blocking wait gives up after
    topology: Topology | None = None  # this rank's place; None: every stage in this process
    # a stage graph's inference form (batch norm on running statistics, no dropout): the
    # compiler hands its pass in (passes/eval_mode.eval_graph); None: eval mode is refused
    eval_graph: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = None

    @property
    def data_parallel(self) -> int:
        """Replicas of the whole pipeline (1 in a single process)."""
        return self.topology.data_parallel if self.topology is not None else 1


@dataclass(frozen=True)
class StepResult:
    """What one run of a schedule produced in this process."""

    losses: tuple[torch.Tensor, ...]  # per batch: the mean micro-batch loss (`summed`: the sum)
    schedule: Schedule  # the schedule that ran (fit: one over every batch)
    events: tuple[Event, ...] = ()  # measured start and end of every action this process ran
    summed: bool = False  # num_items_in_batch: losses and gradients are sums, not means
    communication: Mapping[str, Any] | None = None  # P2P: messages, bytes, wait_seconds
    peak_inflight: tuple[int, ...] = ()  # per stage of this process, in order: most
    #                                      micro-batches whose activations were held at once
    started: float = 0.0  # time.perf_counter() at the events' zero (joining ranks' traces)

    @property
    def timeline(self) -> Timeline:
        """The measured events in the simulator's format."""
        return Timeline(self.events, self.schedule.num_devices)
