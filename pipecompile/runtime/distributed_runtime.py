"""`DistributedRuntime`: this rank's stages of a torch.distributed job.

Values move as point-to-point messages (`P2PTransport`); the gradients of replicas are reduced
in backward (DDP's reducer or FSDP's hooks, data_parallel.py) or after the step
(`GradientSync`); a batch's loss is averaged over every replica; the forward-only path runs
this replica's ranks and broadcasts the outputs to all of them. The step driver it inherits is
step_driver.py's `Runtime`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..ir.records import StagedProgram
from ..schedule.actions import Schedule
from .data_parallel import ReplicaSync, reduces_in_backward
from .distributed import (GradientSync, _default_store, broadcast_outputs, forward_only,
                          reduce_mean_loss, value_specs)
from .microbatch import MicroBatch, split_microbatches
from .p2p import P2PTransport, Waiter
from .spec import RuntimeSpec
from .step_driver import Runtime
from .training import AutocastState

__all__ = ["DistributedRuntime"]


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
        whole (replicated over "tp") one on the group's first rank only (with FSDP its "dp"
        shard: each replica holds another part)."""
        counted = super().counted_parameters()
        if self.topology.tensor_parallel == 1 or self.topology.tp_index == 0:
            return counted
        return [p for p in counted if not _replicated_over_tp(p)]

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


def _replicated_over_tp(tensor: torch.Tensor) -> bool:
    """Whether a parameter is whole on every rank of its tensor-parallel group: a DTensor
    `Replicate()` on its "tp" mesh dimension (a 1-D "tp" mesh, or FSDP's (dp, tp))."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return True
    names = tensor.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
    if "tp" in names:
        return placements[names.index("tp")].is_replicate()
    return all(p.is_replicate() for p in placements)
