"""`LocalRuntime`: every stage in this process, a worker thread per device.

Values move through an in-process `Mailbox`; a batch's loss is the mean of its micro-batch
losses; the forward-only path (`pipe(x)`) calls the stages in order on the whole batch. The
step driver it inherits is step_driver.py's `Runtime`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..ir.records import StagedProgram
from ..ir.tensors import to_device
from ..schedule.actions import Schedule
from .mailbox import Mailbox
from .microbatch import MicroBatch
from .spec import RuntimeSpec
from .step_driver import Runtime

__all__ = ["LocalRuntime"]


class LocalRuntime(Runtime):
    """Every stage in this process, a worker thread per device, values through a `Mailbox`."""

    def __init__(self, program: StagedProgram, schedule: Schedule, spec: RuntimeSpec):
        super().__init__(program, schedule, spec, range(program.num_stages))

    def transport(self, mbs: Sequence[MicroBatch]) -> Mailbox:
        return Mailbox(self.wiring.devices, self.spec.timeout)

    def mean_loss(self, losses: list[torch.Tensor], *, summed: bool = False) -> torch.Tensor:
        stacked = torch.stack([l.to(losses[0].device) for l in losses])
        return stacked.sum() if summed else stacked.mean()

    def forward(self, args: tuple, kwargs: dict) -> Any:
        captured = self.program.captured
        env = dict(zip(captured.input_names, captured.flatten_inputs(args, kwargs)))
        self.ties.follow()
        if torch.is_grad_enabled():  # the caller may run backward: copies' grads to owners
            self.ties.route_to_owners()
        outputs: tuple = ()
        for stage in self.program.stages:
            module = self.workers[stage.index].module  # the train- or eval-mode graph
            outputs = tuple(module(*[to_device(env[n], stage.device) for n in stage.inputs]))
            env.update(zip(stage.outputs, outputs))
        return captured.unflatten_outputs(list(outputs))
