"""Assembling the runtime of a compiled program: what a `Pipeline` runs its schedules on.

    assemble(program, schedule, spec) -> LocalRuntime        one process, a thread per device
                                      -> DistributedRuntime  this rank's stages over
                                                             torch.distributed
    runtime.run(schedule, micro-batches) -> StepResult      losses, measured events, messages

`spec` is a `RuntimeSpec` (spec.py): what the runtime needs of compile's options, nothing else.

Both build one `StageWorker` per stage this process runs (with its weight versions under the
asynchronous schedules), the `Executor`, one optimizer per stage (synchronous schedules) and a
transport per step. They differ in how values move (in-process `Mailbox` or `P2PTransport`),
how a step's STEPs complete the gradients (`stage_steps.py`: tied copies summed locally, or
reduced across ranks and replicas) and how a forward-only call runs. `Pipeline` holds the result and never asks which it is; what a
step produced comes back as a `StepResult`.

What a user's training loop needs is here too (mechanisms in `training.py`): the caller's
autocast re-entered in the device threads, a loss scale, train/eval mode (the workers switch
between the stage graphs and their eval-mode forms), forward-only validation losses, clipping
by the global gradient norm, and tied copies that follow their owner.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..ir.records import StagedProgram, batch_size_of
from ..ir.rng import seed_random_ops
from ..ir.tensors import to_device
from ..schedule.actions import Schedule
from .compiled import compile_stage
from .distributed import (GradientSync, _default_store, broadcast_outputs,
                          forward_only, reduce_mean_loss, value_specs)
from .executor import Executor, Wiring
from ..schedule.messages import Dataflow, gradient_values
from .mailbox import Mailbox
from .microbatch import MicroBatch, forward_in_chunks, split_microbatches
from .p2p import P2PTransport, Waiter
from ..schedule.schedules import make_schedule
from .data_parallel import MicrobatchSync, ReplicaSync, reduces_in_backward
from .spec import RuntimeSpec, StepResult
from .stage_steps import StageSteps
from .stage_worker import LossSpec, StageWorker
from .training import AutocastState, TiedCopies, clip_grad_norm, counted_parameters
from .versions import VersionRule, WeightVersions

__all__ = ["Runtime", "LocalRuntime", "DistributedRuntime", "assemble"]


def assemble(program: StagedProgram, schedule: Schedule, spec: RuntimeSpec) -> "Runtime":
    """The runtime of `program` for this process: local, or this rank's part of it."""
    if spec.topology is None:
        return LocalRuntime(program, schedule, spec)
    return DistributedRuntime(program, schedule, spec)


class Runtime:
    """Workers, executor and optimizers of the stages this process runs."""

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
        self.workers = _workers(program, schedule, spec, self.own_stages, self.grad_values,
                               hooks)
        self.wiring = Wiring(Dataflow.of(program), program.captured.input_names,
                             tuple(s.device for s in program.stages))
        self.executor = Executor(self.workers, self.wiring, rows=executor_rows, label=label)
        by_stage = ({} if self.asynchronous
                    else _optimizers(program, spec.optimizer, self.own_stages))
        self.optimizers = list(by_stage.values())
        self.stage_steps = StageSteps(program, self.own_stages, by_stage, timeout=spec.timeout,
                                reduce=self._reduce_across_ranks())
        self.parameters = self._parameters()  # every copy this process holds (tied: all)
        self.device_types = sorted({self.wiring.devices[s].type for s in self.own_stages})
        self.ties = TiedCopies(program, self.own_stages)
        self.training = True  # False: the workers run the stages' eval-mode graphs
        self._eval_modules: dict[int, torch.nn.Module] = {}
        self._train_modules = {i: w.module for i, w in self.workers.items()}

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
            worker.peak_inflight = 0
            if worker.versions is not None:
                worker.versions.begin_call()
        transport = self.transport(mbs)
        autocast = AutocastState.current(self.device_types)
        for worker in self.workers.values():
            if worker.sync is not None:
                worker.sync.summed(summed)
        steps = self.stage_steps.round(schedule, summed=summed)
        with self._scaled_loss(loss_scale, num_items):
            ran = self.executor.run(schedule, transport, mbs, flat, autocast=autocast,
                                    finish=steps)
        steps.complete()
        last = self.workers.get(self.program.num_stages - 1)
        losses = [last.losses.pop(mb.index) for mb in mbs] if last is not None else []
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

    def _eval_graph(self, module: Any) -> torch.fx.GraphModule:
        """The inference form of a stage graph, by the pass the spec hands in."""
        if self.spec.eval_graph is None:
            raise ConfigError("this runtime was assembled without eval-mode stage graphs "
                              "(RuntimeSpec.eval_graph): assemble it with one to run eval()")
        return self.spec.eval_graph(module)

    def set_training(self, mode: bool) -> None:
        """Train mode runs the captured (training-mode) stage graphs; eval mode their
        inference forms (batch norm reads its running statistics, no dropout), built once on
        first use and sharing the same parameter and buffer objects."""
        if mode == self.training:
            return
        for index, worker in self.workers.items():
            stage = self.program.stages[index]
            if self.spec.fsdp:  # the eval graph reads the gathered weights, gathered for it
                if mode:
                    stage.module.reshard()  # type: ignore[operator]
                else:
                    stage.module.unshard()  # type: ignore[operator]
                    self._eval_modules.pop(index, None)
            if mode:
                worker.module = self._train_modules[index]
            else:
                if index not in self._eval_modules:
                    graph = self._eval_graph(stage.module)
                    self._eval_modules[index] = (compile_stage(graph, index)
                                                 if self.spec.compile_stages else graph)
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
        outputs: tuple = ()
        for stage in self.program.stages:
            module = self.workers[stage.index].module  # the train- or eval-mode graph
            outputs = tuple(module(*[to_device(env[n], stage.device) for n in stage.inputs]))
            env.update(zip(stage.outputs, outputs))
        return captured.unflatten_outputs(list(outputs))


class DistributedRuntime(Runtime):
    """This rank's stages; values as point-to-point messages; gradients reduced across ranks."""

    def __init__(self, program: StagedProgram, schedule: Schedule, spec: RuntimeSpec):
        topology = spec.topology
        assert topology is not None, "a distributed runtime runs one rank of a topology"
        own = topology.own_stages(schedule)
        # DDP's reducer is for plain tensors: tensor-parallel stages (DTensor parameters)
        # reduce their replicas' gradients after the step
        in_backward = spec.fsdp or (
            spec.data_parallel > 1 and topology.tensor_parallel == 1 and reduces_in_backward(
                schedule, any(s in spec.checkpoint for s in own), spec.compile_stages))
        self.sync = GradientSync(topology, program, schedule, own,
                                 sharded=spec.fsdp, replicas_reduced=in_backward)

        def replica_hooks(index: int) -> ReplicaSync:  # replicated: DDP's reducer, per step
            return ReplicaSync(program.stages[index].module, spec.microbatches,
                               self.sync.dp_group, spec.data_parallel)

        super().__init__(program, schedule, spec, own, executor_rows=[topology.position],
                         label=lambda st: f"rank {topology.rank} (stage {st})",
                         hooks=replica_hooks if in_backward and not spec.fsdp else None)
        self.topology = topology
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
            timeout=self.spec.timeout, waiter=self.waiter, store=_default_store(),
            label=lambda stage: f"rank {topology.rank} (stage {stage})")

    def _sizes(self, mb: MicroBatch) -> dict[Any, int]:
        """The size symbols' values in micro-batch `mb` (what the receive buffers are sized by)."""
        captured = self.program.captured
        return captured.sizes_of(captured.flatten_inputs(mb.args, mb.kwargs))

    def _reduce_across_ranks(self) -> Callable[[bool], None]:
        def reduce(summed: bool) -> None:
            if not self.asynchronous:
                self.sync.reduce(self.parameters, summed=summed)
        return reduce

    def mean_loss(self, losses: list[torch.Tensor], *, summed: bool = False) -> torch.Tensor:
        return reduce_mean_loss(losses, self.wiring.devices[self.own_stages[0]], summed=summed,
                                counts=self.topology.tp_index == 0)

    @property
    def norm_group(self) -> Any:
        # sharded gradients differ between replicas: the norm sums every rank's shards
        if self.sync.sharded:
            return dist.group.WORLD
        return self.sync.replica_ranks_group

    def counted_parameters(self) -> list[torch.Tensor]:
        """Tensor parallelism: a split parameter's shard counts on every rank of its group, a
        whole (replicated) one on the group's first rank only."""
        counted = super().counted_parameters()
        if self.topology.tensor_parallel == 1 or self.topology.tp_index == 0:
            return counted
        return [p for p in counted if not all(
            pl.is_replicate() for pl in getattr(p, "placements", ()))]

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Forward only across the ranks of this replica; every rank gets the outputs."""
        captured = self.program.captured
        (mb,) = split_microbatches(args, kwargs, None, 1)
        flat = captured.flatten_inputs(mb.args, mb.kwargs)
        self.ties.follow()
        with torch.no_grad():  # the caller's thread runs this rank's row, in its autocast
            ran = self.executor.run(forward_only(self.schedule), self.transport([mb]), [mb],
                                    [flat], forward_only=True)
        autocast = AutocastState.current(self.device_types) is not None
        return captured.unflatten_outputs(
            broadcast_outputs(ran.outputs.get(0), self.program, self._sizes(mb),
                              self.topology, self.sync.replica_group, self.schedule,
                              self.wiring.devices, same_dtypes=not autocast))


def _workers(program: StagedProgram, schedule: Schedule, spec: RuntimeSpec,
             own: Sequence[int], grad_values: frozenset[str],
             hooks: Callable[[int], Any] | None = None) -> dict[int, StageWorker]:
    """One worker per stage in `own`; the last computes the loss. Its behaviours are chosen
    here, once (`StageWorker`): recomputation for the stages in `spec.checkpoint`, weight
    versions and their optimizer under the asynchronous schedules, the split backward under
    the zero-bubble ones, a compiled stage's fused backward, and the data-parallel gradient
    hooks (FSDP's per micro-batch; DDP's, `hooks`, where the replicas reduce in backward)."""
    m, last = spec.microbatches, program.num_stages - 1
    asynchronous = schedule.asynchronous
    scale = (VersionRule(schedule.name, program.num_stages, 0, m).loss_scale
             if asynchronous else 1.0 / m)
    loss = LossSpec(program.captured.unflatten_outputs, spec.loss_fn, scale)
    if asynchronous and spec.compile_stages:
        raise ConfigError(
            f"compile_stages=True with schedule={schedule.name!r} is not supported (its stashed "
            f"weight versions run the uncompiled graph); use a synchronous schedule or "
            f"compile_stages=False")
    splits = schedule.splits_backward
    holders = Counter(id(p) for s in program.stages if s.index in own
                      for p in s.module.parameters())
    exclusive = frozenset(i for i, n in holders.items() if n == 1)
    workers = {}
    for s in program.stages:
        if s.index not in own:
            continue
        versions = None
        if asynchronous:
            rule = VersionRule(schedule.name, program.num_stages, s.index, m, spec.vertical_sync)
            assert spec.optimizer is not None, "resolve_options requires it for async"
            versions = WeightVersions(s.module, rule, spec.optimizer)
        module, own_streams = s.module, False
        recompute = s.index in spec.checkpoint
        if spec.rng == "global" and recompute:
            seeded, names = seed_random_ops(s.module, 0)
            module, own_streams = (seeded, True) if names else (module, False)
        workers[s.index] = StageWorker(
            s.index, compile_stage(module, s.index) if spec.compile_stages else module,
            s.inputs, s.outputs, frozenset(n for n in s.inputs if n in grad_values),
            loss if s.index == last else None, recompute, versions=versions,
            fused_backward=spec.compile_stages, own_streams=own_streams,
            split_weights=splits, exclusive_params=exclusive,
            sync=(MicrobatchSync(s.module, m, spec.data_parallel) if spec.fsdp
                  else hooks(s.index) if hooks is not None else None))
    return workers


def _optimizers(program: StagedProgram, optimizer: Callable | None,
                own_stages: Sequence[int]) -> dict[int, torch.optim.Optimizer]:
    """One optimizer per stage over the parameters it owns: a shared object by its first
    stage; a tied weight's copy on another device not at all, where this process holds the
    tie's first copy (the copies follow it: `TiedCopies`), so no copy steps before its
    gradient is summed (`stage_steps.py`)."""
    if optimizer is None:
        return {}
    owned: set[int] = set()
    for tie in program.ties:
        if program.owner_stage(tie.names[0]) in own_stages:
            owned.update(id(t) for t in program.held_copies(tie.names[0], own_stages)[1:])
    result = {}
    for stage in program.stages:
        if stage.index not in own_stages:
            continue
        params = []
        for p in stage.module.parameters():
            if p.requires_grad and id(p) not in owned:
                owned.add(id(p))
                params.append(p)
        if params:
            result[stage.index] = optimizer(params)
    return result
