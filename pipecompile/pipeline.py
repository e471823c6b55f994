"""Pipeline: the compiled, runnable program returned by `pipecompile.compile`.

It owns the `StagedProgram` (stages and wiring), the schedule, one `StageWorker` per stage, the
per-stage optimizers and the executor; it offers the user-facing API of DESIGN.md:
`pipe(*args)`, `pipe.step(*args, target=y)`, `named_parameters()`, `state_dict()`, printing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from .capture import batch_size_of
from .errors import ConfigError
from .passes.split import Stage, StagedProgram
from .report import explain_passes, stage_table
from .runtime.actions import Schedule
from .runtime.distributed import (
    GradientSync,
    Topology,
    broadcast_outputs,
    forward_only,
    reduce_mean_loss,
    value_specs,
    _default_store,
)
from .runtime.executor import Executor, Wiring
from .runtime.mailbox import Mailbox
from .runtime.p2p import P2PTransport, Waiter
from .runtime.microbatch import split_microbatches
from .runtime.schedules import make_schedule
from .runtime.simulate import StageCosts, Timeline, simulate
from .runtime.stage_worker import LossSpec, StageWorker
from .runtime.versions import VersionRule, WeightVersions

__all__ = ["Pipeline", "PassRecord"]


@dataclass(frozen=True)
class PassRecord:
    """What one compiler pass did: its name, wall time and a one-line summary."""

    name: str
    seconds: float
    summary: str


class Pipeline:
    """A model split into pipeline stages, trained by interpreting a schedule."""

    def __init__(
        self,
        program: StagedProgram,
        schedule: Schedule,
        *,
        microbatches: int,
        loss_fn: Callable | None,
        optimizer: Callable | None,
        checkpoint: bool,
        predicted: Timeline | None,
        passes: Sequence[PassRecord],
        stage_costs: Sequence[StageCosts] = (),
        cores: int | None = None,
        efficiency: float = 1.0,
        timeout: float = 300.0,
        topology: Topology | None = None,
        vertical_sync: bool = False,
    ):
        self.program = program
        self.schedule = schedule
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.predicted = predicted
        self.stage_costs = tuple(stage_costs)
        self.cores = cores  # compute actions the devices can run at once (None: one per device)
        self.efficiency = efficiency  # their speed when several run at once (see simulate)
        self.passes = tuple(passes)
        self.topology = topology
        captured = program.captured
        self.grad_values = values_needing_grad(program)
        self.asynchronous = schedule.name in ("pipedream", "2bw")
        self.vertical_sync = vertical_sync
        scale = (VersionRule(schedule.name, program.num_stages, 0, microbatches).loss_scale
                 if self.asynchronous else 1.0 / microbatches)
        loss = LossSpec(captured.unflatten_outputs, loss_fn, scale)
        self.last_stage = program.num_stages - 1
        # Under torch.distributed a rank runs only the stages of its pipeline position.
        self.own_stages = tuple(
            s.index for s in program.stages
            if topology is None or schedule.stage_to_device[s.index] == topology.position
        )
        self.workers = {
            s.index: StageWorker(s.index, s.module, s.inputs, s.outputs,
                                 frozenset(n for n in s.inputs if n in self.grad_values),
                                 loss if s.index == self.last_stage else None, checkpoint)
            for s in program.stages if s.index in self.own_stages
        }
        self.wiring = Wiring(program.producer, program.consumers, captured.input_names,
                             tuple(s.device for s in program.stages),
                             frozenset(self.grad_values))
        self.timeout = timeout
        if topology is None:
            self.executor = Executor(self.workers, self.wiring)
            self.sync = None
        else:
            self.executor = Executor(self.workers, self.wiring, rows=[topology.position],
                                     label=lambda st: f"rank {topology.rank} (stage {st})")
            self.sync = GradientSync(topology, program, schedule, self.own_stages)
            self._waiter = Waiter()
        if self.asynchronous:  # each stage owns versions of its weights and their optimizer
            for index, worker in self.workers.items():
                rule = VersionRule(schedule.name, program.num_stages, index, microbatches,
                                   vertical_sync)
                worker.versions = WeightVersions(worker.module, rule, optimizer)
            self.optimizers = []
        else:
            self.optimizers = _build_optimizers(program, optimizer, self.own_stages)

    # -- the model's API ------------------------------------------------------------------

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.program.stages

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, stage after stage on the whole batch: returns what the model returns.

        A model captured with static shapes runs in chunks of its captured batch size, and
        outputs with that leading size are concatenated.
        """
        captured = self.program.captured
        batch = batch_size_of(args, kwargs)
        if not captured.dynamic_batch and batch != captured.captured_batch_size:
            return self._call_in_chunks(args, kwargs, batch)
        if self.topology is not None:
            return self._call_distributed(args, kwargs)
        flat = captured.flatten_inputs(args, kwargs)
        env = dict(zip(captured.input_names, flat))
        outputs: tuple = ()
        for stage in self.stages:
            ins = [_to(env[name], stage.device) for name in stage.inputs]
            outputs = tuple(stage.module(*ins))
            env.update(zip(stage.outputs, outputs))
        return captured.unflatten_outputs(list(outputs))

    def _call_in_chunks(self, args: tuple, kwargs: dict, batch: int) -> Any:
        size = self.program.captured.captured_batch_size
        if batch % size:
            raise ConfigError(
                f"this model was captured with static shapes for batch {size} "
                f"({'; '.join(self.program.captured.notes)}); call it with a multiple of {size}"
            )
        chunks = split_microbatches(args, kwargs, None, batch // size)
        results = [self(*c.args, **c.kwargs) for c in chunks]
        leaves = [pytree.tree_flatten(r) for r in results]
        merged = []
        for parts in zip(*[l for l, _ in leaves]):
            if isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0 and parts[0].shape[0] == size:
                merged.append(torch.cat(parts))
            else:
                raise ConfigError(
                    "a statically captured model's output has no batch dimension to join chunks "
                    f"along; call it with the captured batch size {size}"
                )
        return pytree.tree_unflatten(merged, leaves[0][1])

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step over `microbatches` micro-batches; returns the mean loss.

        Synchronous schedules: gradients start from zero and end as those of the mean
        micro-batch loss; with an optimizer, every stage's parameters are updated. PipeDream
        and 2BW update during the step (see `runtime/versions.py`) and drain at its end.
        """
        mbs = split_microbatches(args, kwargs, target, self.microbatches)
        return self._run(mbs, self.schedule, batches=1)[0]

    def fit(self, batches: Iterable[tuple]) -> list[torch.Tensor]:
        """Train on a stream of batches; returns each batch's mean loss.

        Each batch is `(args, target)` or `(args, kwargs, target)`, `args` a tuple of positional
        inputs. PipeDream and 2BW run the whole stream as one schedule, without draining the
        pipeline between batches; synchronous schedules flush after every batch (a `step` each).
        """
        batches = [_batch_parts(b) for b in batches]
        if not self.asynchronous:
            return [self.step(*a, target=t, **k) for a, k, t in batches]
        mbs = []
        for a, k, t in batches:
            for mb in split_microbatches(a, k, t, self.microbatches):
                mbs.append(replace(mb, index=len(mbs)))
        schedule = make_schedule(self.schedule.name, self.schedule.num_devices,
                                 self.microbatches, batches=len(batches),
                                 dataflow=self.wiring.dataflow())
        return self._run(mbs, schedule, batches=len(batches))

    def _run(self, mbs: list, schedule: Schedule, *, batches: int) -> list[torch.Tensor]:
        """Run `schedule` over micro-batches `mbs`; the mean loss of each batch."""
        captured = self.program.captured
        flat = [captured.flatten_inputs(mb.args, mb.kwargs) for mb in mbs]
        params = self._all_parameters()
        if not self.asynchronous:
            for p in params:
                p.grad = None
        for worker in self.workers.values():
            worker.peak_inflight = 0
            if worker.versions is not None:
                worker.versions.begin_call()
        transport = self._transport(mbs)
        steps = self.executor.run(schedule, transport, mbs, flat)
        self.last_schedule = schedule
        self.communication = getattr(transport, "stats", None)  # P2P: messages, bytes, waits
        last = self.workers.get(self.last_stage)
        losses = [last.losses.pop(mb.index) for mb in mbs] if last is not None else []
        m = self.microbatches
        per_batch = [losses[b * m:(b + 1) * m] for b in range(batches)]
        if self.sync is not None:
            if not self.asynchronous:
                self.sync.reduce(params)
            device = self.wiring.devices[self.own_stages[0]]
            result = [reduce_mean_loss(chunk, device) for chunk in per_batch]
        else:
            self._sum_tied_gradients()
            result = [torch.stack([l.to(chunk[0].device) for l in chunk]).mean()
                      for chunk in per_batch]
        if steps:
            for opt in self.optimizers:
                opt.step()
        return result

    def weight_versions(self) -> dict[int, int]:
        """Asynchronous schedules: per stage, the most weight versions held at once so far."""
        return {i: w.versions.peak_versions for i, w in self.workers.items()
                if w.versions is not None}

    def _transport(self, mbs):
        """The step's transport: in-process queues, or point-to-point messages between ranks."""
        if self.topology is None:
            return Mailbox(self.wiring.devices, self.timeout)
        topology, position = self.topology, self.schedule.stage_to_device
        return P2PTransport(
            rank=topology.rank,
            rank_of_stage=lambda stage: topology.rank_of(position[stage]),
            specs=value_specs(self.program),
            devices=self.wiring.devices, microbatch_sizes=[mb.size for mb in mbs],
            timeout=self.timeout, waiter=self._waiter, store=_default_store(),
            label=lambda stage: f"rank {topology.rank} (stage {stage})")

    def _call_distributed(self, args: tuple, kwargs: dict) -> Any:
        """Forward only across the ranks of this replica; every rank gets the outputs."""
        captured = self.program.captured
        (mb,) = split_microbatches(args, kwargs, None, 1)
        flat = captured.flatten_inputs(mb.args, mb.kwargs)
        plan = forward_only(self.schedule)
        with torch.no_grad():
            self.executor.run(plan, self._transport([mb]), [mb], [flat], forward_only=True)
        return captured.unflatten_outputs(
            broadcast_outputs(self.executor.outputs.get(0), self.program, mb.size, self.topology,
                              self.sync.replica_group, self.schedule, self.wiring.devices))

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameter names in the model's order (a tied parameter once)."""
        for name in self.program.captured.parameter_names:
            tensor = self._own_copy(name)
            if tensor is not None:
                yield name, tensor

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Original keys, interchangeable with `model.state_dict()`."""
        keys = self.program.captured.state_keys
        own = {k: self._own_copy(k) for k in keys}
        return {k: t.detach() for k, t in own.items() if t is not None}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy `state` into every copy of every tensor (tied copies on all their devices)."""
        keys = set(self.program.captured.state_keys)
        missing, unexpected = keys - set(state), set(state) - keys
        if strict and (missing or unexpected):
            raise ConfigError(
                f"load_state_dict: missing keys {sorted(missing)[:5]}, unexpected keys "
                f"{sorted(unexpected)[:5]}; pass strict=False to load a subset"
            )
        with torch.no_grad():
            for key in keys & set(state):
                for _, tensor in self.program.tensors[key]:
                    tensor.copy_(state[key])

    def timeline(self) -> Timeline:
        """Measured start/end of every action of the last step, in the simulator's format."""
        return Timeline(tuple(self.executor.records), self.schedule.num_devices)

    def simulate(self, schedule: Schedule | None = None) -> Timeline:
        """Predicted timeline of `schedule` (default: the last one run, else the step's)."""
        plan = schedule or getattr(self, "last_schedule", None) or self.schedule
        return simulate(plan, self.stage_costs, cores=self.cores, efficiency=self.efficiency)

    def peak_inflight(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose activations were held at once in the last
        step (compare with `pipe.predicted.peak_inflight(stage)`)."""
        return tuple(w.peak_inflight for _, w in sorted(self.workers.items()))

    def plot_timeline(self, path: str) -> str:
        """Draw the predicted and the last measured timeline as a Gantt chart (PNG or SVG)."""
        from .runtime.plot import plot_timelines

        timelines = {"predicted": self.predicted, "measured": self.timeline()}
        return plot_timelines({k: t for k, t in timelines.items() if t is not None and t.events},
                              path, title=f"{self.schedule.name}, {len(self.stages)} stages, "
                                          f"{self.microbatches} micro-batches")

    def write_chrome_trace(self, path: str) -> str:
        """Write the last measured timeline as Chrome trace JSON (open it in Perfetto)."""
        import json

        with open(path, "w") as f:
            json.dump(self.timeline().to_chrome_trace(), f)
        return path

    # -- inspection -----------------------------------------------------------------------

    def __repr__(self) -> str:
        return stage_table(self)

    def explain(self) -> str:
        """The passes the compiler ran, how long each took and what it produced."""
        return explain_passes(self.passes)

    # -- internals -------------------------------------------------------------------------

    def _own_copy(self, name: str) -> torch.Tensor | None:
        """This process's copy of a parameter or buffer (under torch.distributed: only those
        of this rank's stages; a tensor no stage reads stays with the first position)."""
        for stage, tensor in self.program.tensors[name]:
            if stage in self.own_stages or (stage == -1 and 0 in self.own_stages):
                return tensor
        return None

    def _all_parameters(self) -> list[torch.Tensor]:
        seen = {}
        for copies in self.program.tensors.values():
            for stage, t in copies:
                if isinstance(t, torch.nn.Parameter) and (stage in self.own_stages or stage == -1):
                    seen[id(t)] = t
        return list(seen.values())

    def _sum_tied_gradients(self) -> None:
        """Copies of a tied parameter on different devices each get the sum of their grads."""
        for tie in self.program.ties:
            copies = {id(t): t for _, t in self.program.tensors[tie.names[0]]}
            if len(copies) < 2:
                continue  # one object shared by the stages: autograd already summed
            tensors = list(copies.values())
            grads = [t.grad for t in tensors if t.grad is not None]
            if not grads:
                continue
            total = grads[0].clone()
            for g in grads[1:]:
                total += g.to(total.device)
            for t in tensors:
                t.grad = total.to(t.device)

    # -- export and persistence (issue 6) --

    def export_onnx(self, directory: str) -> str:
        """Write one ONNX file per stage (eval mode) and manifest.json; returns its path."""
        from .export import export_onnx

        return export_onnx(self.program, directory)

    def save(self, directory: str) -> str:
        """Write the staged program (code, weights, plan, schedule); returns plan.json's path.
        `pipecompile.load(directory)` rebuilds the pipeline without the model's code."""
        from .persist import save

        return save(self, directory)

    def draw(self, path: str, *, backend: str = "auto") -> str:
        """Draw the partition (blocks coloured by stage, cuts with their boundary sizes) as
        SVG or PNG by the extension of `path`; graphviz's `dot` if present, else matplotlib."""
        from .draw import draw_partition

        return draw_partition(self, path, backend=backend)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value


def _batch_parts(batch: tuple) -> tuple[tuple, dict, Any]:
    """(args, kwargs, target) of one `fit` batch given as (args, target) or (args, kwargs, target)."""
    if len(batch) == 2:
        args, target = batch
        kwargs = {}
    elif len(batch) == 3:
        args, kwargs, target = batch
    else:
        raise ConfigError("each fit batch must be (args, target) or (args, kwargs, target)")
    return (args if isinstance(args, tuple) else (args,)), dict(kwargs), target


def values_needing_grad(program: StagedProgram) -> set[str]:
    """Boundary values that are floating point (gradients flow back through them)."""
    values = program.captured.values
    return {
        name for name in program.producer
        if values[name].dtype is not None and values[name].dtype.is_floating_point
    }


def _build_optimizers(program: StagedProgram, optimizer: Callable | None,
                      own_stages: Sequence[int]) -> list:
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
