"""What compile resolved of its options: the search's `Choices`, the `Resolved` record and
`resolve`, the one place choices become what compile runs.

The `Request` (request.py) keeps what the user asked, "auto" as "auto"; `plan.asked` holds the
validated options with the starting values the passes begin from (the micro-batch count a
static capture is made at). `plan.resolved` is a `Resolved`: only what the passes resolve (the
layout, the devices and their links, this process's ranks, the schedule, the micro-batch and
virtual stage counts, recomputation per stage, whether blocks are measured). Settings nothing
resolves (loss_fn, split_points, capture, rng, timeout, ...) are read from `plan.asked`; no
view merges the two. Three passes resolve it, and nothing else rewrites it:

    join    the process group joined, the link between ranks measured    (ranks_passes.py)
    search  the "auto" options chosen: `Choices`, then `resolve`           (shape_passes.py)
    ranks   this process's place in the chosen P x D                      (ranks_passes.py)

    Choices(schedule="1f1b", microbatches=4, virtual_stages=1, checkpoint=(True, False))
    Resolved.start(asked) --resolve(., choices)--> Resolved(devices=..., microbatches=4, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..ir.records import Example, microbatch_size
from ..measure.ranks import Ranks
from ..schedule.schedules import schedule_properties

if TYPE_CHECKING:
    from ..ir.devices import DeviceSpec
    from ..runtime.distributed import Topology
    from ..schedule.actions import Schedule
    from .layout import Layout
    from .options import CompileOptions

__all__ = ["Choices", "Resolved", "resolve", "merged_options", "example_microbatch_size"]


@dataclass(frozen=True)
class Choices:
    """The schedule, micro-batch count, virtual stages per device, per-stage recomputation and
    whether block times are measured, as compile runs them (given or searched)."""

    schedule: str  # a built-in schedule's name, or a written schedule's
    microbatches: int
    virtual_stages: int
    checkpoint: tuple[bool, ...]  # per stage: recompute its forward in backward
    profile: bool = False  # profile=True, unless the model is on the meta device (nothing runs)
    # the searched layout (data_parallel="auto" or a cluster) and its P pipeline devices,
    # each sending over the link it uses; None: the layout asked
    layout: "Layout | None" = None
    devices: "tuple[DeviceSpec, ...] | None" = None

    @property
    def num_stages(self) -> int:
        return len(self.checkpoint)

    def __str__(self) -> str:
        recomputed = [s for s, r in enumerate(self.checkpoint) if r]
        return (f"{self.schedule}, {self.microbatches} micro-batches, {self.virtual_stages} "
                f"virtual stage(s), recompute stages {recomputed}"
                + (f", layout {self.layout}" if self.layout is not None else ""))


@dataclass(frozen=True)
class Resolved:
    """What the join, search and ranks passes resolved: the layout (P devices x D replicas x
    T tensor-parallel ranks, FSDP), the pipeline devices with the links they send over, this
    process's ranks, the schedule, the counts and recomputation. Before the search it holds
    the asked starting values (`start`)."""

    devices: "tuple[DeviceSpec, ...]"  # one per pipeline device, each with its link
    ranks: Ranks  # this process's place in the job (topology) and how ranks share results
    data_parallel: int  # D replicas of the pipeline
    tensor_parallel: int  # T ranks share each layer of a stage (a searched T: choices.layout)
    sequence_parallel: bool  # and split the tokens between its layers (T > 1)
    fsdp: bool  # each stage fully_shard-ed over the replicas
    schedule: str  # a built-in schedule's name, or the written schedule's
    given_schedule: "Schedule | None"  # the written schedule itself (None: a built-in one)
    microbatches: int
    virtual_stages: int
    checkpoint: bool | tuple[bool, ...]  # all stages (not yet searched), or per stage
    profile: bool  # block times measured rather than modelled

    @classmethod
    def start(cls, asked: "CompileOptions") -> "Resolved":
        """The asked options' starting values, before any pass resolved them."""
        return cls(devices=asked.devices, ranks=asked.ranks, data_parallel=asked.data_parallel,
                   tensor_parallel=asked.tensor_parallel,
                   sequence_parallel=asked.sequence_parallel, fsdp=asked.fsdp,
                   schedule=asked.schedule, given_schedule=asked.given_schedule,
                   microbatches=asked.microbatches, virtual_stages=asked.virtual_stages,
                   checkpoint=asked.checkpoint, profile=asked.profile)

    @property
    def topology(self) -> "Topology | None":
        """This process's place (None: every stage in this process)."""
        return self.ranks.topology

    @property
    def num_stages(self) -> int:
        return len(self.devices) * self.virtual_stages

    def stage_checkpoint(self, stage: int) -> bool:
        """Whether `stage` recomputes its forward in backward (activation checkpointing)."""
        if isinstance(self.checkpoint, tuple):
            return self.checkpoint[stage]
        return bool(self.checkpoint)

    @property
    def asynchronous(self) -> bool:
        """PipeDream and 2BW update the weights during a step."""
        return schedule_properties(self.schedule, self.given_schedule).asynchronous

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits backwards into input (I) and weight (W) gradients."""
        return schedule_properties(self.schedule, self.given_schedule).splits_backward


def resolve(resolved: Resolved, choices: Choices) -> Resolved:
    """`resolved` with what the search chose: the schedule, counts, recomputation per stage
    and, for a searched layout, its P pipeline devices, D and FSDP."""
    chosen = replace(resolved, schedule=choices.schedule, microbatches=choices.microbatches,
                     virtual_stages=choices.virtual_stages, checkpoint=choices.checkpoint,
                     profile=choices.profile)
    if choices.layout is None or choices.devices is None:
        return chosen
    return replace(chosen, devices=choices.devices, data_parallel=choices.layout.data_parallel,
                   fsdp=choices.layout.fsdp)


def merged_options(asked: "CompileOptions", resolved: Resolved) -> "CompileOptions":
    """The old single view (deprecated `Plan.options`): `asked` with every resolved value in
    place. Compile itself never reads it."""
    return replace(asked, devices=resolved.devices, ranks=resolved.ranks,
                   data_parallel=resolved.data_parallel, tensor_parallel=resolved.tensor_parallel,
                   sequence_parallel=resolved.sequence_parallel, fsdp=resolved.fsdp,
                   schedule=resolved.schedule,
                   given_schedule=resolved.given_schedule, microbatches=resolved.microbatches,
                   virtual_stages=resolved.virtual_stages, checkpoint=resolved.checkpoint,
                   profile=resolved.profile)


def example_microbatch_size(example: Example, asked: "CompileOptions", resolved: Resolved
                            ) -> int:
    """Samples per micro-batch of the example batch (the size a static capture is made at):
    of a replica's slice when the example is the global batch."""
    replicas = resolved.data_parallel if asked.global_batch else 1
    return microbatch_size(example.batch, resolved.microbatches * replicas)
