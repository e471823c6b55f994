"""Assembling the runtime of a compiled program: what a `Pipeline` runs its schedules on.

    assemble(program, schedule, options) -> LocalRuntime        one process, a thread per device
                                         -> DistributedRuntime  this rank's stages over
                                                                torch.distributed

Both build one `StageWorker` per stage this process runs (with its weight versions under the
asynchronous schedules), the `Executor`, one optimizer per stage (synchronous schedules) and a
transport per step. They differ in how values move (in-process `Mailbox` or `P2PTransport`),
how a step ends (tied copies' gradients summed locally, or reduced across ranks and replicas)
and how a forward-only call runs. `Pipeline` holds the result and never asks which it is.

What a user's training loop needs is here too (mechanisms in `training.py`): the caller's
autocast re-entered in the device threads, a loss scale, train/eval mode (the workers switch
between the stage graphs and their eval-mode forms), forward-only validation losses, clipping
by the global gradient norm, and tied copies that follow their owner.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..passes.eval_mode import eval_graph
from ..passes.split import StagedProgram
from ..rng import seed_random_ops
from ..tensors import to_device
from ..schedule.actions import Kind, Schedule
from .compiled import compile_stage
from .distributed import (GradientSync, Topology, _default_store, broadcast_outputs,
                          forward_only, reduce_mean_loss, value_specs)
from .executor import Executor, Wiring
from ..schedule.messages import gradient_values
from .mailbox import Mailbox
from .microbatch import MicroBatch, split_microbatches
from .p2p import P2PTransport, Waiter
from ..schedule.schedules import ASYNC_SCHEDULE_NAMES
from .data_parallel import MicrobatchSync, ReplicaSync, reduces_in_backward
from .stage_worker import LossSpec, StageWorker
from .training import AutocastState, TiedCopies, clip_grad_norm, counted_parameters
from .versions import VersionRule, WeightVersions

if TYPE_CHECKING:
    from ..options import CompileOptions

__all__ = ["Runtime", "LocalRuntime", "DistributedRuntime", "assemble"]


def assemble(program: StagedProgram, schedule: Schedule, options: "CompileOptions") -> "Runtime":
    """The runtime of `program` for this process: local, or this rank's part of it."""
    topology = options.ranks.topology
    if topology is None:
        return LocalRuntime(program, schedule, options)
    return DistributedRuntime(program, schedule, options, topology)



class Runtime:
    """Workers, executor and optimizers of the stages this process runs."""

    def __init__(self, program: StagedProgram, schedule: Schedule, options: "CompileOptions",
                 own_stages: Sequence[int], executor_rows: Sequence[int] | None = None,
                 label: Callable[[int], str] = lambda stage: f"stage {stage}"):
        self.program = program
        self.schedule = schedule
        self.microbatches = options.microbatches
        self.timeout = options.timeout
        self.asynchronous = schedule.name in ASYNC_SCHEDULE_NAMES
        self.own_stages = tuple(own_stages)
        self.grad_values = gradient_values(program)
        self.workers = _workers(program, schedule, options, self.own_stages, self.grad_values)
        self.wiring = Wiring(program.producer, program.consumers,
                             program.captured.input_names, tuple(s.device for s in program.stages),
                             self.grad_values)
        self.executor = Executor(self.workers, self.wiring, rows=executor_rows, label=label)
        self.optimizers = ([] if self.asynchronous
                           else _optimizers(program, options.optimizer, self.own_stages))
        self.parameters = self._parameters()  # every copy this process holds (tied: all)
        self.device_types = sorted({self.wiring.devices[s].type for s in self.own_stages})
        self.ties = TiedCopies(program, self.own_stages)
        self.training = True  # False: the workers run the stages' eval-mode graphs
        self._eval_modules: dict[int, torch.nn.Module] = {}
        self.compile_stages = options.compile_stages
        self.fsdp = options.fsdp
        self._train_modules = {i: w.module for i, w in self.workers.items()}
        self.last_schedule = schedule  # the schedule the last step ran
        self.summed = False  # the last step's losses are summed (num_items_in_batch), not meaned
        self.communication: Any = None  # the last step's message statistics (P2P transport)

    def own_copy(self, name: str) -> torch.Tensor | None:
        """This process's copy of a parameter or buffer (under torch.distributed: only those
        of this rank's stages; a tensor no stage reads stays with the first position)."""
        for stage, tensor in self.program.tensors[name]:
            if stage in self.own_stages or (stage == -1 and 0 in self.own_stages):
                return tensor
        return None

    def run(self, schedule: Schedule, mbs: Sequence[MicroBatch], *, batches: int,
            loss_scale: float | None = None, num_items: Any = None) -> list[torch.Tensor]:
        """Run `schedule` over micro-batches `mbs`; the mean loss of each batch. The caller's
        autocast applies in every device thread; `loss_scale` multiplies the loss before
        backward (a GradScaler's scale), not the returned loss. With `num_items` (the global
        number of items the loss is normalised by, transformers' `num_items_in_batch`), the
        loss function is given it, and micro-batch losses and replicas' gradients are summed."""
        self.summed = num_items is not None
        captured = self.program.captured
        flat = [captured.flatten_inputs(mb.args, mb.kwargs) for mb in mbs]
        self.ties.follow()
        if not self.asynchronous:
            for p in self.parameters:
                p.grad = None
        for worker in self.workers.values():
            worker.peak_inflight = 0
            if worker.versions is not None:
                worker.versions.begin_call()
        transport = self.transport(mbs)
        self.executor.autocast = AutocastState.current(self.device_types)
        for worker in self.workers.values():
            if worker.sync is not None:
                worker.sync.summed(self.summed)
        with self._scaled_loss(loss_scale, num_items):
            steps = self.executor.run(schedule, transport, mbs, flat)
        self.last_schedule = schedule
        self.communication = getattr(transport, "stats", None)  # P2P: messages, bytes, waits
        last = self.workers.get(self.program.num_stages - 1)
        losses = [last.losses.pop(mb.index) for mb in mbs] if last is not None else []
        m = self.microbatches
        result = self.finish([losses[b * m:(b + 1) * m] for b in range(batches)])
        if steps:
            for opt in self.optimizers:
                opt.step()
        return result

    def evaluate(self, mbs: Sequence[MicroBatch]) -> torch.Tensor:
        """The mean validation loss over `mbs`: forwards only, in eval mode, without
        autograd (nothing is kept for a backward pass)."""
        captured = self.program.captured
        flat = [captured.flatten_inputs(mb.args, mb.kwargs) for mb in mbs]
        self.ties.follow()
        self.executor.autocast = AutocastState.current(self.device_types)
        with self.mode(training=False), torch.no_grad():
            self.executor.run(forward_only(self.schedule, len(mbs)), self.transport(mbs),
                              mbs, flat, forward_only=True)
            last = self.workers.get(self.program.num_stages - 1)
            losses = ([last.loss_of(self.executor.outputs.pop(mb.index), mb.target)
                       for mb in mbs] if last is not None else [])
        return self.mean_loss(losses)

    def set_training(self, mode: bool) -> None:
        """Train mode runs the captured (training-mode) stage graphs; eval mode their
        inference forms (batch norm reads its running statistics, no dropout), built once on
        first use and sharing the same parameter and buffer objects."""
        if mode == self.training:
            return
        for index, worker in self.workers.items():
            stage = self.program.stages[index]
            if self.fsdp:  # the eval graph reads the gathered weights, gathered for it
                if mode:
                    stage.module.reshard()  # type: ignore[operator]
                else:
                    stage.module.unshard()  # type: ignore[operator]
                    self._eval_modules.pop(index, None)
            if mode:
                worker.module = self._train_modules[index]
            else:
                if index not in self._eval_modules:
                    graph = eval_graph(stage.module)
                    self._eval_modules[index] = (compile_stage(graph, index)
                                                 if self.compile_stages else graph)
                worker.module = self._eval_modules[index]
        self.training = mode

    @contextlib.contextmanager
    def mode(self, *, training: bool) -> Iterator[None]:
        """Run the body in train or eval mode, then return to the mode before."""
        before = self.training
        self.set_training(training)
        try:
            yield
        finally:
            self.set_training(before)

    def clip_grad_norm(self, max_norm: float, norm_type: float,
                       error_if_nonfinite: bool) -> torch.Tensor:
        """Clip by the global norm over every stage (and rank); returns the total norm."""
        return clip_grad_norm(counted_parameters(self.program, self.own_stages),
                              self.parameters, max_norm, norm_type,
                              device=self.wiring.devices[self.own_stages[0]],
                              group=self.norm_group, error_if_nonfinite=error_if_nonfinite)

    @property
    def norm_group(self) -> Any:
        """The process group a global gradient norm is reduced over (None: this process)."""
        return None

    @contextlib.contextmanager
    def _scaled_loss(self, loss_scale: float | None, num_items: Any = None) -> Iterator[None]:
        last = self.workers.get(self.program.num_stages - 1)
        if (loss_scale is None and num_items is None) or last is None or last.loss is None:
            yield
            return
        spec = last.loss
        scale = 1.0 if num_items is not None else spec.scale  # a sum, not a mean
        last.loss = replace(spec, scale=scale * (loss_scale or 1.0), num_items=num_items)
        try:
            yield
        finally:
            last.loss = spec

    # -- what the local and distributed runtimes do differently ----------------------------

    def transport(self, mbs: Sequence[MicroBatch]) -> Any:
        """A fresh transport for one step over `mbs`."""
        raise NotImplementedError

    def finish(self, losses: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """After the backward passes: complete the gradients; each batch's mean loss."""
        raise NotImplementedError

    def mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of one batch's micro-batch losses (of every replica's, on every rank)."""
        raise NotImplementedError

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Forward only, on the whole batch; the model's outputs."""
        raise NotImplementedError

    def _parameters(self) -> list[torch.Tensor]:
        seen = {}
        for copies in self.program.tensors.values():
            for stage, t in copies:
                if isinstance(t, torch.nn.Parameter) and (stage in self.own_stages or stage == -1):
                    seen[id(t)] = t
        return list(seen.values())


class LocalRuntime(Runtime):
    """Every stage in this process, a worker thread per device, values through a `Mailbox`."""

    def __init__(self, program: StagedProgram, schedule: Schedule, options: "CompileOptions"):
        super().__init__(program, schedule, options, range(program.num_stages))

    def transport(self, mbs: Sequence[MicroBatch]) -> Mailbox:
        return Mailbox(self.wiring.devices, self.timeout)

    def finish(self, losses: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        self._sum_tied_gradients()
        return [self.mean_loss(chunk) for chunk in losses]

    def mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack([l.to(losses[0].device) for l in losses])
        return stacked.sum() if self.summed else stacked.mean()

    def forward(self, args: tuple, kwargs: dict) -> Any:
        captured = self.program.captured
        env = dict(zip(captured.input_names, captured.flatten_inputs(args, kwargs)))
        self.ties.follow()
        outputs: tuple = ()
        for stage in self.program.stages:
            module = self.workers[stage.index].module  # the train- or eval-mode graph
            outputs = tuple(module(*[to_device(env[n], stage.device) for n in stage.inputs]))
            env.update(zip(stage.outputs, outputs))
        return captured.unflatten_outputs(list(outputs))

    def _sum_tied_gradients(self) -> None:
        """Copies of a tied parameter on different devices each get the sum of their grads."""
        for tie in self.program.ties:
            copies = list({id(t): t for _, t in self.program.tensors[tie.names[0]]}.values())
            grads = [t.grad for t in copies if t.grad is not None]
            if len(copies) < 2 or not grads:
                continue  # one object shared by the stages: autograd already summed
            total = grads[0].clone()
            for g in grads[1:]:
                total += g.to(total.device)
            for t in copies:
                t.grad = total.to(t.device)


class DistributedRuntime(Runtime):
    """This rank's stages; values as point-to-point messages; gradients reduced across ranks."""

    def __init__(self, program: StagedProgram, schedule: Schedule, options: "CompileOptions",
                 topology: Topology):
        own = options.ranks.own_stages(schedule)
        super().__init__(program, schedule, options, own, executor_rows=[topology.position],
                         label=lambda st: f"rank {topology.rank} (stage {st})")
        self.topology = topology
        in_backward = options.fsdp or (options.data_parallel > 1 and reduces_in_backward(
            schedule, any(map(options.stage_checkpoint, self.own_stages)),
            options.compile_stages))
        self.sync = GradientSync(topology, program, schedule, self.own_stages,
                                 sharded=options.fsdp, replicas_reduced=in_backward)
        if in_backward and not options.fsdp:  # replicated: DDP's reducer, armed per step
            for index, worker in self.workers.items():
                worker.sync = ReplicaSync(program.stages[index].module, options.microbatches,
                                          self.sync.dp_group, options.data_parallel)
        self.waiter = Waiter()
        # constant per plan: the receive buffers' specs, and their shapes per distinct sizes
        self.specs = value_specs(program)
        self.shapes: dict[tuple, tuple[int, ...]] = {}

    def transport(self, mbs: Sequence[MicroBatch]) -> P2PTransport:
        topology, position = self.topology, self.schedule.stage_to_device
        return P2PTransport(
            rank=topology.rank,
            rank_of_stage=lambda stage: topology.rank_of(position[stage]),
            specs=self.specs, shapes=self.shapes,
            devices=self.wiring.devices, sizes=[self._sizes(mb) for mb in mbs],
            timeout=self.timeout, waiter=self.waiter, store=_default_store(),
            label=lambda stage: f"rank {topology.rank} (stage {stage})")

    def _sizes(self, mb: MicroBatch) -> dict[Any, int]:
        """The size symbols' values in micro-batch `mb` (what the receive buffers are sized by)."""
        captured = self.program.captured
        return captured.sizes_of(captured.flatten_inputs(mb.args, mb.kwargs))

    def finish(self, losses: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        if not self.asynchronous:
            self.sync.reduce(self.parameters, summed=self.summed)
        return [self.mean_loss(chunk) for chunk in losses]

    def mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        return reduce_mean_loss(losses, self.wiring.devices[self.own_stages[0]],
                                summed=self.summed)

    @property
    def norm_group(self) -> Any:
        # sharded gradients differ between replicas: the norm sums every rank's shards
        return dist.group.WORLD if self.sync.sharded else self.sync.replica_group

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Forward only across the ranks of this replica; every rank gets the outputs."""
        captured = self.program.captured
        (mb,) = split_microbatches(args, kwargs, None, 1)
        flat = captured.flatten_inputs(mb.args, mb.kwargs)
        self.ties.follow()
        self.executor.autocast = None  # the caller's thread runs this rank's row
        with torch.no_grad():
            self.executor.run(forward_only(self.schedule), self.transport([mb]), [mb], [flat],
                              forward_only=True)
        autocast = AutocastState.current(self.device_types) is not None
        return captured.unflatten_outputs(
            broadcast_outputs(self.executor.outputs.get(0), self.program, self._sizes(mb),
                              self.topology, self.sync.replica_group, self.schedule,
                              self.wiring.devices, same_dtypes=not autocast))


def _workers(program: StagedProgram, schedule: Schedule, options: "CompileOptions",
             own: Sequence[int], grad_values: frozenset[str]) -> dict[int, StageWorker]:
    """One worker per stage in `own`; the last computes the loss. Asynchronous schedules give
    each worker its weight versions and their optimizer."""
    m, last = options.microbatches, program.num_stages - 1
    asynchronous = schedule.name in ASYNC_SCHEDULE_NAMES
    scale = (VersionRule(schedule.name, program.num_stages, 0, m).loss_scale
             if asynchronous else 1.0 / m)
    loss = LossSpec(program.captured.unflatten_outputs, options.loss_fn, scale)
    if asynchronous and options.compile_stages:
        raise ConfigError(
            f"compile_stages=True with schedule={schedule.name!r} is not supported (its stashed "
            f"weight versions run the uncompiled graph); use a synchronous schedule or "
            f"compile_stages=False")
    splits = any(a.kind is Kind.W for row in schedule.actions for a in row)
    holders = Counter(id(p) for s in program.stages if s.index in own
                      for p in s.module.parameters())
    exclusive = frozenset(i for i, n in holders.items() if n == 1)
    workers = {}
    for s in program.stages:
        if s.index not in own:
            continue
        versions = None
        if asynchronous:
            rule = VersionRule(schedule.name, program.num_stages, s.index, m,
                               options.vertical_sync)
            assert options.optimizer is not None, "resolve_options requires it for async"
            versions = WeightVersions(s.module, rule, options.optimizer)
        module, own_streams = s.module, False
        if options.rng == "global" and options.stage_checkpoint(s.index):
            seeded, names = seed_random_ops(s.module, 0)
            module, own_streams = (seeded, True) if names else (module, False)
        workers[s.index] = StageWorker(
            s.index, compile_stage(module, s.index) if options.compile_stages else module,
            s.inputs, s.outputs, frozenset(n for n in s.inputs if n in grad_values),
            loss if s.index == last else None, options.stage_checkpoint(s.index),
            versions=versions,
            fused_backward=options.compile_stages, own_streams=own_streams,
            split_weights=splits, exclusive_params=exclusive,
            sync=MicrobatchSync(s.module, m, options.data_parallel) if options.fsdp else None)
    return workers


def _optimizers(program: StagedProgram, optimizer: Callable | None,
                own_stages: Sequence[int]) -> list[torch.optim.Optimizer]:
    """One optimizer per stage over the parameters it owns (a shared object: its first stage)."""
    if optimizer is None:
        return []
    owned: set[int] = set()
    result = []
    for stage in program.stages:
        if stage.index not in own_stages:
            continue
        params = []
        for p in stage.module.parameters():
            if p.requires_grad and id(p) not in owned:
                owned.add(id(p))
                params.append(p)
        if params:
            result.append(optimizer(params))
    return result
