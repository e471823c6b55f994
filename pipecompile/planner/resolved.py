"""What compile resolved of its options: the record the search pass produces.

`CompileOptions` keeps what the user asked (an option given as "auto" is named in its `auto`
and holds only a starting value there, e.g. the micro-batch count a static capture is made
at). The search pass decides those options and records the result here; the plan's
`options` view (`Plan.options`) is the asked options with these choices applied, which is what
the runtime, persist and the reports read.

    Choices(schedule="1f1b", microbatches=4, virtual_stages=1, checkpoint=(True, False))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..ir.devices import DeviceSpec
    from .layout import Layout

__all__ = ["Choices"]


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
