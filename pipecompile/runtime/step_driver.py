"""The runtime's step driver: `Runtime`, what a `Pipeline` runs its schedules on.

    runtime.run(schedule, micro-batches)   -> StepResult   one training step (or a stream's)
    runtime.evaluate(micro-batches)        -> StepResult   forwards only, in eval mode
    runtime.call(args, kwargs)             -> outputs      forward only, the whole batch
    runtime.clip_grad_norm(max_norm, ...)  -> total norm   over every stage, rank and replica

`Runtime` is built from its parts (workers.py: the workers and optimizers; stage_modes.py:
train/eval graphs; stage_steps.py: how a step's STEPs complete the gradients; executor.py: the
generated code per device row) and drives them; the mechanisms of a user's training loop are in
training.py (autocast in the device threads, tied copies, the global norm). What differs with
where the stages run (how values move, how a batch's loss is averaged, the forward-only path)
is left to the two subclasses: local_runtime.py and distributed_runtime.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError
from ..ir.records import StagedProgram, batch_size_of
from ..schedule.actions import Schedule
from ..schedule.messages import Dataflow, gradient_values
from ..schedule.schedules import make_schedule
from .distributed import forward_only
from .executor import Executor, Wiring
from .microbatch import MicroBatch, forward_in_chunks, split_microbatches
from .spec import RuntimeSpec, StepResult
from .stage_modes import StageModes
from .stage_steps import StageSteps
from .training import AutocastState, TiedCopies, clip_grad_norm, counted_parameters, stepping
from .workers import stage_optimizers, stage_workers

__all__ = ["Runtime"]


class Runtime:
    """Workers, executor and optimizers of the stages this process runs, and the driver of
    their steps."""

    def __init__(self, program: StagedProgram, schedule: Schedule, spec: RuntimeSpec,
                 own_stages: Sequence[int], executor_rows: Sequence[int] | None = None,
                 label: Callable[[int], str] = lambda stage: f"stage {stage}",
                 hooks: Callable[[int], Any] | None = None):
        self.program = program
        self.schedule = schedule
        self.spec = spec
        self.asynchronous = schedule.asynchronous
        self.own_stages = tuple(own_stages)
        self.grad_values = gradient_values(program)
        self.workers = stage_workers(program, schedule, spec, self.own_stages,
                                     self.grad_values, hooks)
        self.wiring = Wiring(Dataflow.of(program), program.captured.input_names,
                             tuple(s.device for s in program.stages))
        self.executor = Executor(self.workers, self.wiring, rows=executor_rows, label=label)
        by_stage = ({} if self.asynchronous
                    else stage_optimizers(program, spec.optimizer, self.own_stages))
        self.optimizers = list(by_stage.values())
        self.stage_steps = StageSteps(program, self.own_stages, by_stage, timeout=spec.timeout,
                                      reduce=self._reduce_across_ranks())
        self.parameters = self._parameters()  # every copy this process holds (tied: all)
        self.device_types = sorted({self.wiring.devices[s].type for s in self.own_stages})
        self.ties = TiedCopies(program, self.own_stages)
        self.modes = StageModes(program, self.workers, spec)

    def _reduce_across_ranks(self) -> Callable[[bool], None] | None:
        """What completes gradients across processes before an optimizer step (None: this
        process holds every stage)."""
        return None

    def own_copy(self, name: str) -> torch.Tensor | None:
        """This process's copy of a parameter or buffer (under torch.distributed: only those
        of this rank's stages; a tensor no stage reads stays with the first position)."""
        copies = self.program.held_copies(name, self.own_stages)
        return copies[0] if copies else None

    def run(self, schedule: Schedule, mbs: Sequence[MicroBatch], *, batches: int,
            loss_scale: float | None = None, num_items: Any = None) -> StepResult:
        """Run `schedule` over micro-batches `mbs`; its result holds the mean loss of each
        batch. The caller's autocast applies in every device thread; `loss_scale` multiplies
        the loss before backward (a GradScaler's scale), not the returned loss. With
        `num_items` (the global number of items the loss is normalised by, transformers'
        `num_items_in_batch`), the loss function is given it, and micro-batch losses and
        replicas' gradients are summed."""
        summed = num_items is not None
        captured = self.program.captured
        flat = [captured.flatten_inputs(mb.args, mb.kwargs) for mb in mbs]
        self.ties.follow()
        if not self.asynchronous:
            for p in self.parameters:
                p.grad = None
        for worker in self.workers.values():
            worker.begin_call(summed=summed)
        transport = self.transport(mbs)
        autocast = AutocastState.current(self.device_types)
        steps = self.stage_steps.round(schedule, summed=summed)
        last = self.workers.get(self.program.num_stages - 1)
        scaled: contextlib.AbstractContextManager[None] = (
            last.scaled_loss(loss_scale, num_items) if last is not None
            else contextlib.nullcontext())
        with stepping():  # tie copies keep their gradients for the step's sum
            with scaled:
                ran = self.executor.run(schedule, transport, mbs, flat, autocast=autocast,
                                        finish=steps)
            steps.complete()
        losses = last.take_losses([mb.index for mb in mbs]) if last is not None else []
        m = self.spec.microbatches
        means = [self.mean_loss(losses[b * m:(b + 1) * m], summed=summed)
                 for b in range(batches)]
        return StepResult(tuple(means), schedule, ran.events, summed=summed,
                          communication=getattr(transport, "stats", None),
                          peak_inflight=tuple(w.peak_inflight for _, w in
                                              sorted(self.workers.items())),
                          started=ran.started)

    def run_stream(self, batches: Sequence[tuple[tuple, dict, Any]]) -> StepResult:
        """An asynchronous schedule over a stream of (args, kwargs, target) batches as one
        schedule, without draining between batches; the result holds each batch's mean loss."""
        m = self.spec.microbatches
        split = [mb for a, k, t in batches for mb in split_microbatches(a, k, t, m)]
        mbs = [replace(mb, index=i) for i, mb in enumerate(split)]
        schedule = make_schedule(self.schedule.name, self.schedule.num_devices, m,
                                 batches=len(batches), dataflow=self.wiring.dataflow)
        return self.run(schedule, mbs, batches=len(batches))

    def evaluate(self, mbs: Sequence[MicroBatch]) -> StepResult:
        """The mean validation loss over `mbs` (the result's one loss): forwards only, in eval
        mode, without autograd (nothing is kept for a backward pass)."""
        captured = self.program.captured
        flat = [captured.flatten_inputs(mb.args, mb.kwargs) for mb in mbs]
        self.ties.follow()
        autocast = AutocastState.current(self.device_types)
        schedule, transport = forward_only(self.schedule, len(mbs)), self.transport(mbs)
        with self.mode(training=False), torch.no_grad():
            ran = self.executor.run(schedule, transport, mbs, flat, forward_only=True,
                                    autocast=autocast)
            events, outputs = ran.events, dict(ran.outputs)
            last = self.workers.get(self.program.num_stages - 1)
            losses = ([last.loss_of(outputs.pop(mb.index), mb.target) for mb in mbs]
                      if last is not None else [])
        return StepResult((self.mean_loss(losses),), schedule, events,
                          communication=getattr(transport, "stats", None))

    @property
    def training(self) -> bool:
        """Whether the workers run the training graphs (False: their eval-mode forms)."""
        return self.modes.training

    def set_training(self, mode: bool) -> None:
        """Train mode runs the captured stage graphs, eval mode their inference forms
        (stage_modes.py)."""
        self.modes.set(mode)

    def mode(self, *, training: bool) -> contextlib.AbstractContextManager[None]:
        """Run the body in train or eval mode, then return to the mode before."""
        return self.modes.mode(training=training)

    def clip_grad_norm(self, max_norm: float, norm_type: float,
                       error_if_nonfinite: bool) -> torch.Tensor:
        """Clip by the global norm over every stage (and rank); returns the total norm."""
        if self.asynchronous:
            raise ConfigError(
                f"schedule={self.schedule.name!r} updates the weights during the step, so there "
                f"are no step gradients to clip afterwards; use a synchronous schedule")
        return clip_grad_norm(self.counted_parameters(),
                              self.parameters, max_norm, norm_type,
                              device=self.wiring.devices[self.own_stages[0]],
                              group=self.norm_group, error_if_nonfinite=error_if_nonfinite)

    def weight_versions(self) -> dict[int, int]:
        """Asynchronous schedules: per stage, the most weight versions held at once so far."""
        return {i: w.versions.peak_versions for i, w in self.workers.items()
                if w.versions is not None}

    @property
    def norm_group(self) -> Any:
        """The process group a global gradient norm is reduced over (None: this process)."""
        return None

    def counted_parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this process counts in a global norm."""
        return counted_parameters(self.program, self.own_stages)

    # -- what the local and distributed runtimes do differently ----------------------------

    def transport(self, mbs: Sequence[MicroBatch]) -> Any:
        """A fresh transport for one step over `mbs`."""
        raise NotImplementedError

    def mean_loss(self, losses: list[torch.Tensor], *, summed: bool = False) -> torch.Tensor:
        """The mean (`summed`: the sum) of one batch's micro-batch losses, of every
        replica's, on every rank."""
        raise NotImplementedError

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Forward only, on the whole batch; the model's outputs."""
        raise NotImplementedError

    def call(self, args: tuple, kwargs: dict) -> Any:
        """`forward`, a model captured with static shapes in chunks of its captured batch."""
        captured, batch = self.program.captured, batch_size_of(args, kwargs)
        if not captured.dynamic_batch and batch != captured.captured_batch_size:
            return forward_in_chunks(self.forward, captured, args, kwargs, batch)
        return self.forward(args, kwargs)

    def _parameters(self) -> list[torch.Tensor]:
        seen = {}
        for copies in self.program.tensors.values():
            for stage, t in copies:
                if isinstance(t, torch.nn.Parameter) and (stage in self.own_stages or stage == -1):
                    seen[id(t)] = t
        return list(seen.values())
