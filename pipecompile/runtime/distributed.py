"""torch.distributed set-up for pipelines: topology, plan check, gradient and loss reductions.

Ranks form a (data_parallel × pipeline) grid: rank = replica * P + position, where position p
runs the stages the schedule puts on device p (several with interleaving) and replica d is one
of D copies of the whole pipeline.

    P = 2, D = 2:      position 0   position 1
        replica 0       rank 0   ──▶  rank 1
        replica 1       rank 2   ──▶  rank 3      DP groups: {0, 2}, {1, 3}

After the step's backward passes, `GradientSync.reduce` sums the gradients of a tied parameter
over the ranks of a replica holding a copy and, unless torch's hooks already did it during the
last backward (runtime/data_parallel.py), averages every gradient over the replicas of its
stage, so every copy of every parameter sees the same gradient and stays bit-identical.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..ir.tensors import local_tensor

if TYPE_CHECKING:
    from ..ir.records import StagedProgram
    from ..schedule.actions import Schedule
    from .p2p import ValueSpec

__all__ = ["Topology", "world_size", "ranks_per_node", "rank_device", "topology_from_environment",
           "local_device", "check_same_plan", "plan_digest", "GradientSync", "reduce_mean_loss",
           "value_specs", "forward_only", "broadcast_outputs"]


@dataclass(frozen=True)
class Topology:
    """This rank's place in the data-parallel × pipeline × tensor-parallel grid:
    rank = (replica * P + position) * T + index (a tensor-parallel group's T ranks
    consecutive, inside a node)."""

    rank: int
    world_size: int
    pipeline_size: int  # P: ranks per pipeline
    data_parallel: int  # D: replicas
    tensor_parallel: int = 1  # T: ranks sharing each layer of a stage

    @property
    def position(self) -> int:
        return (self.rank // self.tensor_parallel) % self.pipeline_size

    @property
    def replica(self) -> int:
        return self.rank // (self.tensor_parallel * self.pipeline_size)

    @property
    def tp_index(self) -> int:
        """This rank's place in its tensor-parallel group."""
        return self.rank % self.tensor_parallel

    def rank_of(self, position: int, replica: int | None = None,
                tp_index: int | None = None) -> int:
        replica = self.replica if replica is None else replica
        index = self.tp_index if tp_index is None else tp_index
        return (replica * self.pipeline_size + position) * self.tensor_parallel + index

    def own_stages(self, schedule: Schedule) -> tuple[int, ...]:
        """The stages this rank runs: those `schedule` puts on its pipeline position."""
        return tuple(s for s in range(schedule.num_stages)
                     if schedule.stage_to_device[s] == self.position)


_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets


def world_size() -> int:
    """The ranks of this job: the initialised process group's, else torchrun's environment's
    (nothing is joined), else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if all(k in os.environ for k in _TORCHRUN):
        return int(os.environ["WORLD_SIZE"])
    return 1


def ranks_per_node(world: int) -> int:
    """The ranks on each node of this job: torchrun's LOCAL_WORLD_SIZE, else all `world` (one
    node, as the tests' spawned ranks). A tensor-parallel group stays inside a node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    return local if local > 0 and world % local == 0 else world


def rank_device() -> str:
    """The device this rank will run on once joined (`local_device`, read without joining):
    its CUDA device (torchrun's LOCAL_RANK) where CUDA is, else the CPU."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def _destroy_at_exit() -> None:
    """The process group pipecompile started is destroyed before the interpreter tears down:
    left to teardown, a backend thread can die joinable and abort the rank after its work
    ("terminate called without an active exception", seen once in a two-launcher test)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def topology_from_environment(pipeline_size: int, data_parallel: int,
                              timeout: float, tensor_parallel: int = 1) -> Topology | None:
    """The topology if this process is one rank of several (initialising the process group
    from torchrun's environment if needed); None for a single process."""
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if not all(k in os.environ for k in _TORCHRUN):
            return None
        if int(os.environ["WORLD_SIZE"]) == 1:
            return None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        atexit.register(_destroy_at_exit)
    world = dist.get_world_size()
    if world == 1:
        return None
    need = pipeline_size * data_parallel * tensor_parallel
    if world != need:
        tp = f" × tensor_parallel={tensor_parallel}" if tensor_parallel > 1 else ""
        raise ConfigError(
            f"the process group has {world} ranks but devices={pipeline_size} × "
            f"data_parallel={data_parallel}{tp} = {need}; launch {need} ranks or change "
            f"devices/data_parallel" + ("/tensor_parallel" if tp else "")
        )
    return Topology(dist.get_rank(), world, pipeline_size, data_parallel, tensor_parallel)


def local_device() -> torch.device:
    """This rank's device: its CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def plan_digest(program: StagedProgram, schedule: Schedule) -> int:
    """A hash of everything every rank must agree on: cuts, wiring, shapes and the schedule."""
    values = program.captured.values
    plan = {
        "bounds": list(program.bounds),
        "stages": [[list(s.inputs), list(s.outputs)] for s in program.stages],
        "values": {v: repr(values[v]) for v in sorted(program.producer)},
        "schedule": schedule.to_text(),
    }
    digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def check_same_plan(digest: int, device: torch.device) -> None:
    """Raise on every rank if the ranks compiled different plans, naming who differs."""
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    digests = [int(t.item()) for t in everyone]
    if len(set(digests)) > 1:
        groups: dict[int, list[int]] = {}
        for rank, d in enumerate(digests):
            groups.setdefault(d, []).append(rank)
        listing = "; ".join(f"ranks {ranks}: plan {d:016x}" for d, ranks in groups.items())
        raise ConfigError(
            f"the ranks compiled different pipeline plans ({listing}). Every rank must call "
            f"compile with the same model, example inputs and options (seed the model's "
            f"initialisation identically, or load the same weights)"
        )


class GradientSync:
    """Process groups and reductions for tied parameters and data-parallel replicas."""

    def __init__(self, topology: Topology, program: StagedProgram, schedule: Schedule,
                 own_stages: Sequence[int], *, sharded: bool = False,
                 replicas_reduced: bool = False):
        self.topology = topology
        self.sharded = sharded  # fsdp=True: each replica holds a shard of every gradient
        # torch's hooks reduced the replicas' gradients during backward (FSDP, DDP's reducer)
        self.replicas_reduced = replicas_reduced
        position = schedule.stage_to_device
        P, D, T = topology.pipeline_size, topology.data_parallel, topology.tensor_parallel
        # Every rank must create every group, in the same order (one per tensor-parallel
        # index: the pipeline's messages and the replicas' reductions stay within it).
        self.replica_group = None
        for d in range(D):
            for t in range(T):
                group = dist.new_group([topology.rank_of(p, d, t) for p in range(P)])
                if d == topology.replica and t == topology.tp_index:
                    self.replica_group = group
        # the whole replica, every tensor-parallel index: a norm over split gradients
        self.replica_ranks_group = self.replica_group
        if T > 1:
            for d in range(D):
                group = dist.new_group([topology.rank_of(p, d, t) for p in range(P)
                                        for t in range(T)])
                if d == topology.replica:
                    self.replica_ranks_group = group
        self.dp_group = None
        if D > 1:
            for p in range(P):
                for t in range(T):
                    group = dist.new_group([topology.rank_of(p, d, t) for d in range(D)])
                    if p == topology.position and t == topology.tp_index:
                        self.dp_group = group
        self.ties: list[tuple[Any, torch.Tensor]] = []  # (group, this rank's copy)
        own = set(own_stages)
        for tie in program.ties:
            positions = sorted({position[stage] for stage, _ in tie.copies})
            if len(positions) < 2:
                continue
            for d, t in [(d, t) for d in range(D) for t in range(T)]:
                group = dist.new_group([topology.rank_of(p, d, t) for p in positions])
                if (d, t) == (topology.replica, topology.tp_index) and \
                        topology.position in positions:
                    copy = program.held_copies(tie.names[0], own)[0]
                    self.ties.append((group, copy))

    def reduce(self, params: Sequence[torch.Tensor], *, summed: bool = False) -> None:
        """Sum tied copies' gradients within the replica, then average over replicas (sum,
        when the loss was normalised by the global item count)."""
        for group, tensor in self.ties:
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)
            dist.all_reduce(local_tensor(tensor.grad), group=group)  # a shard: the same part
        if self.dp_group is None or self.replicas_reduced:
            return
        grads: dict[int, torch.Tensor] = {}  # a tie's copies here share their summed grad
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.setdefault(id(p.grad), local_tensor(p.grad))  # tensor-parallel: the shard
        if not grads:
            return
        unique = list(grads.values())
        flat = torch._utils._flatten_dense_tensors(unique)
        dist.all_reduce(flat, group=self.dp_group)
        if not summed:
            flat /= self.topology.data_parallel
        for g, reduced in zip(unique, torch._utils._unflatten_dense_tensors(flat, unique)):
            g.copy_(reduced)


def reduce_mean_loss(losses: Sequence[torch.Tensor], device: torch.device, *,
                     summed: bool = False, counts: bool = True) -> torch.Tensor:
    """Mean (or with `summed`, sum) of every replica's micro-batch losses, on every rank (only
    last stages have any; `counts` False: this rank's copy is another tensor-parallel
    rank's, counted there)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    if losses and counts:
        total[0] = sum(float(l) for l in losses)
        total[1] = len(losses)
    dist.all_reduce(total)
    return total[0] if summed else total[0] / total[1]


def value_specs(program: StagedProgram) -> dict[str, ValueSpec]:
    """Receive-buffer specs of every boundary value: its symbolic shape at given sizes."""
    from .values import value_shape
    from .p2p import ValueSpec

    values = program.captured.values
    return {name: ValueSpec(functools.partial(value_shape, program, name), values[name].dtype)
            for name in program.producer}


def forward_only(schedule: Schedule, microbatches: int = 1) -> Schedule:
    """A schedule of forwards only over the first `microbatches` micro-batches: their F
    actions and forward messages of the (lowered) ``schedule``, in its order on every device
    (each device's forwards stay in micro-batch order, so no wait can deadlock)."""
    from ..schedule.actions import Kind, Schedule

    keep = (Kind.F, Kind.SEND_F, Kind.RECV_F)
    rows = [tuple(a for a in row if a.kind in keep and a.microbatch is not None
                  and a.microbatch < microbatches)
            for row in schedule.actions]
    return Schedule(f"{schedule.name}-forward", schedule.num_stages, microbatches,
                    schedule.stage_to_device, tuple(rows))


def broadcast_outputs(outputs: Mapping[str, Any] | None, program: StagedProgram,
                      sizes: Mapping[Any, int],
                      topology: Topology, group: dist.ProcessGroup | None, schedule: Schedule,
                      devices: Sequence[torch.device], *, same_dtypes: bool = True) -> list[Any]:
    """The model's flat outputs on every rank of the replica, sent by the last stage's rank.
    `same_dtypes=False` (under autocast, where an output may not have its captured dtype):
    the sender tells the others each output's dtype first. `sizes`: the size symbols' values
    in the call (`CapturedModel.sizes_of`)."""
    from ..ir.records import evaluate

    captured = program.captured
    last = program.num_stages - 1
    src = topology.rank_of(schedule.stage_to_device[last])
    device = devices[last] if src == topology.rank else local_device()
    dtypes = {n: v.dtype for n, v in captured.values.items() if n in captured.output_names}
    if not same_dtypes:
        sent = outputs if src == topology.rank else None
        box: list[dict[str, torch.dtype] | None] = [
            None if sent is None else
            {n: sent[n].dtype for n in dtypes if isinstance(sent[n], torch.Tensor)}]
        dist.broadcast_object_list(box, src=src, group=group)
        dtypes.update(box[0] or {})
    flat = []
    for name in captured.output_names:
        info = captured.values.get(name)
        if info is None or info.dtype is None:  # a constant or non-tensor output
            flat.append(outputs[name] if outputs is not None else None)
            continue
        if src == topology.rank:
            assert outputs is not None, "the last stage ran here: the executor kept its outputs"
            tensor = outputs[name].contiguous()
        else:
            shape = tuple(int(evaluate(d, sizes)) for d in info.shape)
            tensor = torch.empty(shape, dtype=dtypes[name], device=device)
        dist.broadcast(tensor, src=src, group=group)
        flat.append(tensor)
    return flat


def _default_store():
    """The default process group's key-value store (used to post a rank's failure)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not every init method exposes a store
        return None
