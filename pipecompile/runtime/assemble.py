"""Assembling the runtime of a compiled program: what a `Pipeline` runs its schedules on.

    assemble(program, schedule, spec) -> LocalRuntime        one process, a thread per device
                                      -> DistributedRuntime  this rank's stages over
                                                             torch.distributed
    runtime.run(schedule, micro-batches) -> StepResult      losses, measured events, messages

`spec` is a `RuntimeSpec` (spec.py): what the runtime needs of compile's options, nothing else.
The parts, one concept each:

    workers.py              one `StageWorker` per stage (behaviours chosen once), optimizers
    step_driver.py          `Runtime`: runs a step, a stream, an evaluation, clips gradients
    stage_modes.py          train/eval mode: the stage graphs or their eval-mode forms
    local_runtime.py        `LocalRuntime`: every stage here, values through a `Mailbox`
    distributed_runtime.py  `DistributedRuntime`: this rank's stages, P2P messages, replicas

`Pipeline` holds the result and never asks which it is; what a step produced comes back as a
`StepResult`.
"""

from __future__ import annotations

from ..ir.records import StagedProgram
from ..schedule.actions import Schedule
from .distributed_runtime import DistributedRuntime
from .local_runtime import LocalRuntime
from .spec import RuntimeSpec
from .step_driver import Runtime
from .workers import stage_optimizers as _optimizers  # noqa: F401 - its old name (tests)

__all__ = ["Runtime", "LocalRuntime", "DistributedRuntime", "assemble"]


def assemble(program: StagedProgram, schedule: Schedule, spec: RuntimeSpec) -> Runtime:
    """The runtime of `program` for this process: local, or this rank's part of it."""
    if spec.topology is None:
        return LocalRuntime(program, schedule, spec)
    return DistributedRuntime(program, schedule, spec)
