"""Pipeline × data parallelism with torch's FSDP2: each stage sharded over the "dp" dimension.

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
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..passes.split import StagedProgram
    from .distributed import Topology

__all__ = ["data_parallel_mesh", "shard_stages", "MicrobatchSync", "local_tensor"]


def data_parallel_mesh(topology: "Topology", device: torch.device, mesh: Any = None) -> Any:
    """The ("dp", "pp") mesh of `topology`: `mesh` checked against it, or a new one."""
    from torch.distributed.device_mesh import init_device_mesh

    D, P = topology.data_parallel, topology.pipeline_size
    if mesh is None:
        return init_device_mesh(device.type, (D, P), mesh_dim_names=("dp", "pp"))
    names = tuple(mesh.mesh_dim_names or ())
    if not {"dp", "pp"} <= set(names):
        raise ConfigError(
            f"mesh= has dimensions {names or 'without names'}; it needs one named 'dp' (the "
            f"{D} replicas) and one named 'pp' (the {P} pipeline positions), e.g. "
            f"init_device_mesh('{device.type}', ({D}, {P}), mesh_dim_names=('dp', 'pp'))")
    grid = mesh.mesh.permute(names.index("dp"), names.index("pp")) if mesh.ndim == 2 else None
    want = [[d * P + p for p in range(P)] for d in range(D)]
    if grid is None or grid.tolist() != want:
        raise ConfigError(
            f"mesh= places the ranks as {mesh.mesh.tolist()} over {names}; pipecompile puts "
            f"rank = replica * {P} + position, i.e. ('dp', 'pp') = {want}: build it with "
            f"init_device_mesh('{device.type}', ({D}, {P}), mesh_dim_names=('dp', 'pp'))")
    return mesh


def shard_stages(program: "StagedProgram", own: Sequence[int], mesh: Any) -> "StagedProgram":
    """`fully_shard` every stage in `own` over `mesh["dp"]`; the program with its tensor table
    pointing at the sharded parameters (DTensors) of those stages."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh["dp"]
    tensors = {name: list(copies) for name, copies in program.tensors.items()}
    for stage in program.stages:
        if stage.index not in own:
            continue
        # where the stage holds each parameter (a tied one: under the name this stage reads)
        path = {id(p): n for n, p in stage.module.named_parameters(remove_duplicate=False)}
        fully_shard(stage.module, mesh=dp, reshard_after_forward=False)
        for copies in tensors.values():
            for i, (s, tensor) in enumerate(copies):
                if s == stage.index and id(tensor) in path:
                    copies[i] = (s, stage.module.get_parameter(path[id(tensor)]))
    return replace(program, tensors={n: tuple(c) for n, c in tensors.items()})


class MicrobatchSync:
    """A sharded stage's gradient reduction once per step: before each backward of the
    step, FSDP's gradient sync and resharding are on only for the last (the `m`-th)."""

    def __init__(self, module: Any, microbatches: int, replicas: int):
        self.module = module
        self.microbatches = microbatches
        self.replicas = replicas
        self.done = 0
        self.divide_factor: float | None = None  # None: FSDP's own mean over replicas

    def begin_step(self) -> None:
        self.done = 0

    def summed(self, summed: bool) -> None:
        """Sum the replicas' gradients (the loss was normalised by the global item count), or
        average them (FSDP's default)."""
        factor = 1.0 if summed else (float(self.replicas) if self.divide_factor else None)
        if factor != self.divide_factor and factor is not None:
            self.module.set_gradient_divide_factor(factor)
        self.divide_factor = factor

    def before_backward(self) -> None:
        self.done += 1
        last = self.done >= self.microbatches
        self.module.set_is_last_backward(last)
        self.module.set_requires_gradient_sync(last)
        self.module.set_reshard_after_backward(last)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its shard), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
