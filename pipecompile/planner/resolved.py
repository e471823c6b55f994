"""What compile resolved of its options: the search pass's `Choices`, and `resolve`, the one
place they become the options compile runs with.

The `Request` (request.py) keeps what the user asked, "auto" as "auto"; `plan.asked` holds the
starting values the passes begin from (the micro-batch count a static capture is made at).
Three passes resolve the rest, each writing `plan.resolved` (the options as compile runs
them: the layout, the devices and their links, this process's topology, the schedule, the
micro-batch and virtual stage counts, recomputation per stage) and nothing else rewrites it:

    join    the process group joined, the link between ranks measured    (ranks_passes.py)
    search  the "auto" options chosen: `Choices`, then `resolve`           (shape_passes.py)
    ranks   this process's place in the chosen P x D                      (ranks_passes.py)

    Choices(schedule="1f1b", microbatches=4, virtual_stages=1, checkpoint=(True, False))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dataclasses import replace

if TYPE_CHECKING:
    from ..ir.devices import DeviceSpec
    from .layout import Layout
    from .options import CompileOptions

__all__ = ["Choices", "resolve"]


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


def resolve(options: "CompileOptions", choices: Choices) -> "CompileOptions":
    """`options` with what the search chose: the schedule, counts, recomputation per stage and,
    for a searched layout, its P pipeline devices, D and FSDP."""
    resolved = replace(options, schedule=choices.schedule, microbatches=choices.microbatches,
                       virtual_stages=choices.virtual_stages, checkpoint=choices.checkpoint,
                       profile=choices.profile)
    if choices.layout is None or choices.devices is None:
        return resolved
    return replace(resolved, devices=choices.devices,
                   data_parallel=choices.layout.data_parallel, fsdp=choices.layout.fsdp)
