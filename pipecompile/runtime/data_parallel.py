"""Pipeline × data parallelism: each stage's gradients reduced over its replicas by torch.

Replicated (`fsdp=False`, `ReplicaSync`): torch's DDP `Reducer` on each stage's parameters
(bucketed all-reduce, started by autograd hooks as gradients become ready), armed only for the
step's last backward of the stage, so the reduction overlaps that backward. The stage graphs run
as they are (the reducer needs no forward of its own). Schedules whose backward bypasses the
hooks (zero-bubble's split backward), recomputation and compiled stages reduce after the step
instead (`GradientSync.reduce`).

Sharded (`fsdp=True`): torch's FSDP2, each stage sharded over the "dp" dimension.

The ranks form a torch `DeviceMesh` of shape (D, P) named ("dp", "pp"), the layout of
`Topology` (rank = replica * P + position). With `fsdp=True` the compiler shards every stage of
this rank with torch's `fully_shard` over the rank's "dp" group, following the contract of
torchtitan and torch's pipelining `stage.py`:

    split on meta or real tensors -> fully_shard(stage, mesh=dp, reshard_after_forward=False)
      -> (meta: to_empty -> load or init) -> train

- `reshard_after_forward=False`: a step's micro-batches reuse the gathered weights instead of
  all-gathering them again for every forward.
- Gradient sync and resharding are off for every backward of a stage but its last in the step
  (`MicrobatchSync.before_backward`), whose post-backward hooks reduce-scatter the summed
  micro-batch gradients once and free the gathered weights.
- The stage's parameters become `DTensor`s (Shard(0) over "dp"): `pipe.parameters()` yields them,
  so the user's optimizer, clipping and `torch.distributed.checkpoint` see what torchtitan's do.

Every rank must run `shard_stages` (the mesh and the sharding are collective).

With `data_parallel="auto"` every rank passes the global batch to `step()`: replica r of D
takes its rows [r B/D, (r+1) B/D) (`replica_microbatches`), split into the plan's
micro-batches; the loss the step returns is the mean over every replica's micro-batches, the
global batch's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..errors import ConfigError
from ..ir.records import batch_size_of
from .microbatch import MicroBatch, split_microbatches

if TYPE_CHECKING:
    from ..ir.records import StagedProgram
    from ..schedule.actions import Schedule
    from .distributed import Topology

__all__ = ["data_parallel_mesh", "shard_stages", "MicrobatchSync", "ReplicaSync",
           "reduces_in_backward", "replica_microbatches"]


def data_parallel_mesh(topology: "Topology", device: torch.device, mesh: Any = None) -> Any:
    """The ("dp", "pp") mesh of `topology` (with tensor parallelism the ("dp", "pp", "tp")
    mesh: FSDP shards over "dp" the DTensors of "tp", one root mesh for both): `mesh` checked
    against it, or a new one."""
    from torch.distributed.device_mesh import init_device_mesh

    D, P, T = topology.data_parallel, topology.pipeline_size, topology.tensor_parallel
    shape, names = ((D, P), ("dp", "pp")) if T == 1 else ((D, P, T), ("dp", "pp", "tp"))
    each = [f"one named '{n}' ({k})" for n, k in zip(names, (
        f"the {D} replicas", f"the {P} pipeline positions", f"the {T} tensor-parallel ranks"))]
    what = ", ".join(each[:-1]) + " and " + each[-1]
    build = f"init_device_mesh('{device.type}', {shape}, mesh_dim_names={names})"
    if mesh is None:
        return init_device_mesh(device.type, shape, mesh_dim_names=names)
    given = tuple(mesh.mesh_dim_names or ())
    if not set(names) <= set(given):
        raise ConfigError(
            f"mesh= has dimensions {given or 'without names'}; it needs {what}, e.g. "
            f"{build}")
    grid = (mesh.mesh.permute(*(given.index(n) for n in names))
            if mesh.ndim == len(names) else None)
    want = torch.arange(D * P * T).reshape(shape)
    if grid is None or not torch.equal(grid, want):
        rule = (f"replica * {P} + position" if T == 1
                else f"(replica * {P} + position) * {T} + index")
        raise ConfigError(
            f"mesh= places the ranks as {mesh.mesh.tolist()} over {given}; pipecompile puts "
            f"rank = {rule}, i.e. {names} = {want.tolist()}: build it with {build}")
    return mesh


def replica_microbatches(args: tuple, kwargs: Mapping[str, Any], target: Any, *,
                         microbatches: int, replica: int, replicas: int) -> list[MicroBatch]:
    """The micro-batches of `replica` (of `replicas`) in a global batch: its rows
    [replica B/D, (replica + 1) B/D) of every batched input and the target, split in
    `microbatches`. A batch that D does not divide is a `ConfigError` saying what to pass."""
    batch = batch_size_of(args, kwargs)
    if batch < replicas or batch % replicas:
        raise ConfigError(
            f"the global batch of {batch} samples does not split into {replicas} replicas "
            f"(data_parallel='auto': every rank passes the global batch, each replica takes "
            f"its 1/{replicas} of the rows); pass a global batch that is a multiple of "
            f"{replicas}, the same on every rank")
    mine = split_microbatches(args, kwargs, target, replicas)[replica]
    return split_microbatches(mine.args, mine.kwargs, mine.target, microbatches)


def shard_stages(program: "StagedProgram", own: Sequence[int], mesh: Any,
                 placement: Any = None) -> "StagedProgram":
    """`fully_shard` every stage in `own` over `mesh["dp"]` (`placement`: FSDP2's
    `shard_placement_fn`, None: dim 0); the program with its tensor table pointing at the
    sharded parameters (DTensors) of those stages."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh["dp"]
    tensors = {name: list(copies) for name, copies in program.tensors.items()}
    for stage in program.stages:
        if stage.index not in own:
            continue
        # where the stage holds each parameter (a tied one: under the name this stage reads)
        path = {id(p): n for n, p in stage.module.named_parameters(remove_duplicate=False)}
        fully_shard(stage.module, mesh=dp, reshard_after_forward=False,
                    shard_placement_fn=placement)
        for copies in tensors.values():
            for i, (s, tensor) in enumerate(copies):
                if s == stage.index and id(tensor) in path:
                    copies[i] = (s, stage.module.get_parameter(path[id(tensor)]))
    return replace(program, tensors={n: tuple(c) for n, c in tensors.items()})


class _OncePerStep:
    """Counts a stage's backwards within a step: the `microbatches`-th is the last."""

    def __init__(self, microbatches: int):
        self.microbatches = microbatches
        self.done = 0

    def begin_step(self) -> None:
        self.done = 0

    def _last(self) -> bool:
        """Count one more backward; True for the step's last."""
        self.done += 1
        return self.done >= self.microbatches


class MicrobatchSync(_OncePerStep):
    """A sharded stage's gradient reduction once per step: before each backward of the
    step, FSDP's gradient sync and resharding are on only for the last (the `m`-th)."""

    def __init__(self, module: Any, microbatches: int, replicas: int):
        super().__init__(microbatches)
        self.module = module
        self.replicas = replicas
        self.divide_factor: float | None = None  # None: FSDP's own mean, never changed

    def summed(self, summed: bool) -> None:
        """Sum the replicas' gradients (the loss was normalised by the global item count), or
        average them (FSDP's default, set back explicitly after a summed step)."""
        if not summed and self.divide_factor is None:
            return
        factor = 1.0 if summed else float(self.replicas)
        if factor != self.divide_factor:
            self.module.set_gradient_divide_factor(factor)
            self.divide_factor = factor

    def before_backward(self) -> None:
        last = self._last()
        self.module.set_is_last_backward(last)
        self.module.set_requires_gradient_sync(last)
        self.module.set_reshard_after_backward(last)


def reduces_in_backward(schedule: "Schedule", checkpoint: bool, compiled: bool) -> bool:
    """Whether torch's hooks can reduce a replicated stage's gradients during its backward:
    one autograd backward (B) per micro-batch, through the captured graph."""
    return not schedule.splits_backward and not checkpoint and not compiled


class ReplicaSync(_OncePerStep):
    """A replicated stage's gradients averaged (or summed) over the replicas by torch's DDP
    reducer, during the step's last backward of the stage: the micro-batches before it
    accumulate locally (as under DDP's `no_sync`), the last one's hooks all-reduce the
    buckets as they fill. The reducer is made at the first step, when the parameters are real
    (a meta model is materialised after compile)."""

    def __init__(self, module: torch.nn.Module, microbatches: int, group: Any, replicas: int):
        super().__init__(microbatches)
        self.module = module
        self.group = group
        self.replicas = replicas
        self.sum = False
        self.ddp: Any = None
        self.buckets = 0  # buckets all-reduced by the hook so far (each during a backward)

    def begin_step(self) -> None:
        super().begin_step()
        if self.ddp is None:
            self.ddp = self._reducer()

    def summed(self, summed: bool) -> None:
        self.sum = summed

    def before_backward(self) -> None:
        if self._last():
            # what DDP's forward does when gradients are to be synced, at the last backward
            # (torch.distributed.pipelining arms its DDP stages the same way)
            self.ddp.reducer.prepare_for_backward([])

    def _reducer(self) -> Any:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        # every parameter of a stage graph is used by it (split keeps only what its nodes
        # read), so the reducer need not search the graph for unused ones
        ddp = DistributedDataParallel(self.module, process_group=self.group, init_sync=False)
        ddp.require_backward_grad_sync = False  # forwards never arm it (they do not run)

        # torch checks a comm hook's annotations: none, or dist.GradBucket (this module's
        # annotations are strings, which it refuses)
        def all_reduce(state, bucket):
            self.buckets += 1
            work = dist.all_reduce(bucket.buffer(), group=self.group, async_op=True)
            divide = not self.sum
            return work.get_future().then(
                lambda f: f.value()[0].div_(self.replicas) if divide else f.value()[0])

        ddp.register_comm_hook(None, all_reduce)
        return ddp
