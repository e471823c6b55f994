"""A layout of the job: P pipeline positions x D data-parallel replicas x T tensor-parallel
ranks, and what it costs beyond the pipeline's own compute.

    Layout(pipeline=8, data_parallel=8, fsdp=True, inner="data")
    Layout(pipeline=2, data_parallel=32, tensor_parallel=8)      # 512 devices
    Layout(pipeline=8, data_parallel=2, tensor_parallel=4, sequence_parallel=True)

The T ranks of a tensor-parallel group are consecutive devices (rank = index * T + t), so a
group stays inside a node when T divides the devices per node; the layout's other two
dimensions are laid out over the groups (`index`) as below. What T costs per rank is priced
on the blocks (planner/tensor_costs.py), with sequence parallelism when the layout says so (the
group also splits the tokens of its norms, dropout and residuals: planned, not run).

`inner` is the dimension whose neighbours are adjacent devices, so it stays inside a node:
"pipeline" puts rank = replica * P + position (pipecompile's torch.distributed grid, pipeline
neighbours on one node), "data" puts rank = position * D + replica (a data-parallel group on
one node). Megatron-LM's rule is to keep the highest-volume traffic inside a node; the search
prices both and keeps the faster.

    layouts(world, ...)                  every (P, D, T, SP, fsdp, inner) to search
    check_tensor_degree(T, per_node, world, D)  the rule a given T must meet (ConfigError)
    sequence_choices(asked)              the sequence-parallel settings a T > 1 is searched with
    pipeline_specs(layout, cluster)      each position's spec, sending over the link it uses
    data_group(layout, cluster)          the shape (per node x nodes) of a replica group
    tensor_group(layout, cluster)        the shape of a tensor-parallel group (one node)
    Collectives(...).extras(...)         per stage: the step's collectives and optimizer step
                                         (simulate's `setup` and `teardown`)
    layout_table(table, layout)          per-block bytes a device holds under the layout

What pipecompile's runtime does, and so what is priced (runtime/data_parallel.py): FSDP2
shards each stage as one unit with `reshard_after_forward=False`, so the stage's parameters are
all-gathered at its first forward (on the critical path), held gathered, gradients accumulate
unsharded, and one reduce-scatter follows its last backward; the sharded optimizer steps
1/D of the state. Replicated stages use torch's DDP reducer, armed for the last backward of
the step, whose all-reduce overlaps that backward (not under recomputation or a split
backward: then it runs after the step). The optimizer step is priced by its bytes (AdamW
reads parameter, gradient and two moments and writes three) at memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError
from ..ir.devices import DeviceSpec
from ..passes.kernel_prices import (ADAMW_PASSES, adam_passes, master_weights_passes,
                                    optimizer_seconds)
from .cluster import Cluster, Link
from .collectives import Group, all_gather, all_reduce, reduce_scatter

__all__ = ["Layout", "layouts", "pipeline_specs", "data_group", "tensor_group", "Collectives",
           "layout_static", "describe_placement", "tensor_degrees", "check_tensor_degree",
           "sequence_choices", "LayoutCandidate"]


@dataclass(frozen=True)
class Layout:
    """P x D x T devices, whether replicas shard their stages, which dimension is inside a
    node (after the tensor-parallel groups), and this process's place (None: planned for
    devices that are not here)."""

    pipeline: int
    data_parallel: int
    fsdp: bool = False
    inner: str = "pipeline"  # "pipeline" | "data": the dimension kept inside a node
    pipeline_rank: int | None = None
    data_rank: int | None = None
    tensor_parallel: int = 1  # T ranks shard each layer of a stage (1: none)
    sequence_parallel: bool = False  # the T ranks also split the tokens (T > 1 only)

    @property
    def devices(self) -> int:
        return self.pipeline * self.data_parallel * self.tensor_parallel

    def __str__(self) -> str:
        mode = "FSDP" if self.fsdp else "replicated" if self.data_parallel > 1 else "no DP"
        tp = f" x TP{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        tp += "+SP" if self.sequence_parallel else ""
        text = f"{self.pipeline} x {self.data_parallel}{tp} ({mode}, {self.inner} inside a node)"
        if self.pipeline_rank is not None:
            text += f"; this process: position {self.pipeline_rank}, replica {self.data_rank}"
        return text


def tensor_degrees(per_node: int, tensor_parallel: int | None) -> tuple[int, ...]:
    """The tensor-parallel degrees to search: `tensor_parallel` when given, else every
    divisor of the devices per node (a group on one node, over NVLink), the largest first
    (where T pays, its fast layouts then prune the slower ones by their compute bound)."""
    if tensor_parallel is not None:
        return (tensor_parallel,)
    return tuple(t for t in range(per_node, 0, -1) if per_node % t == 0)


def check_tensor_degree(tensor_parallel: int, per_node: int, world: int,
                        data_parallel: int | None = None) -> None:
    """The rule for a given T, written once: a tensor-parallel group is T consecutive devices
    of one node, so T must divide the `per_node` devices of a node (and so the `world`), and
    with D given, D x T must divide the world (P = world / (D T)); else a `ConfigError`
    naming both."""
    t = tensor_parallel
    if per_node % t or world % t:
        divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
        raise ConfigError(
            f"tensor_parallel={t} does not divide the {per_node} GPUs per node of the cluster "
            f"({world} GPUs): a tensor-parallel group is {t} consecutive GPUs of one node; "
            f"use one of {divisors} or 'auto'")
    if data_parallel is not None and world % (data_parallel * t):
        raise ConfigError(
            f"data_parallel={data_parallel} x tensor_parallel={t} does not divide the {world} "
            f"GPUs (P = {world} / (D x T) pipeline stages); use degrees whose product divides "
            f"{world}")


def sequence_choices(asked: bool | str) -> tuple[bool, ...]:
    """The sequence-parallel settings a layout with T > 1 is searched with: the one asked, or
    with "auto" both (without first: a tie keeps the plainer plan)."""
    return (False, True) if asked == "auto" else (bool(asked),)


def layouts(world: int, *, batch: int, max_pipeline: int, fsdp: bool | None,
            nodes: int = 1, pipeline: int | None = None,
            tensor: tuple[int, ...] = (1,), sequence: tuple[bool, ...] = (False,)
            ) -> tuple[Layout, ...]:
    """Every layout of `world` devices: T in `tensor` dividing it, P dividing world / T (at
    most `max_pipeline`, the blocks; or exactly `pipeline` when a written schedule fixes it),
    D = world / (P T) dividing the global `batch`; FSDP and replicated when `fsdp` is None
    (FSDP only with D >= 2); both placements when the P x D groups span several `nodes`;
    with T > 1, each sequence-parallel setting in `sequence` (T = 1: none).
    Raises `ConfigError` when none exists."""
    found = []
    for t in tensor:
        if world % t:
            continue
        groups = world // t
        # with one group per node both placements cost the same: keep one
        several = t == 1 or (world // nodes) // t > 1
        for p in range(1, groups + 1):
            if groups % p or p > max_pipeline or (pipeline is not None and p != pipeline):
                continue
            d = groups // p
            if batch % d:
                continue
            for shard in ((False, True) if fsdp is None else (fsdp,)):
                if shard and d < 2:
                    continue
                for inner in (("pipeline", "data") if (nodes > 1 and p > 1 and d > 1
                                                       and several)
                              else ("pipeline",)):
                    found += [Layout(p, d, shard, inner, tensor_parallel=t,
                                     sequence_parallel=sp)
                              for sp in (sequence if t > 1 else (False,))]
    if not found:
        tp = "" if tensor == (1,) else f" x T (tensor parallel, one of {list(tensor)})"
        raise ConfigError(
            f"no layout of {world} devices fits: the pipeline degree P{tp} must divide {world} "
            f"and P be at most {max_pipeline} (the model's blocks)"
            + (f" and equal the written schedule's {pipeline} devices" if pipeline else "")
            + f", and D = {world} / P{'T' if tp else ''} must divide the global batch of "
            f"{batch}; use a batch that a data-parallel degree divides, or another device "
            f"count")
    return tuple(found)


def _position_device(layout: Layout, position: int, replica: int = 0) -> int:
    """The device index (node by node) of `position` in `replica` (its tensor-parallel
    group's first device)."""
    if layout.inner == "pipeline":
        index = replica * layout.pipeline + position
    else:
        index = position * layout.data_parallel + replica
    return index * layout.tensor_parallel


def pipeline_specs(layout: Layout, cluster: Cluster | None,
                   devices: Sequence[DeviceSpec]) -> tuple[DeviceSpec, ...]:
    """The P pipeline devices of replica 0 (`devices[0]` as resolved, else the cluster's),
    each sending over the link to its next position (the last over its previous one's);
    without a cluster, the first P of `devices`."""
    if cluster is None:
        return tuple(devices[:layout.pipeline])
    base = devices[0] if devices else cluster.device  # as resolved (a memory_limit applied)
    specs = []
    for p in range(layout.pipeline):
        q = p + 1 if p + 1 < layout.pipeline else max(0, p - 1)
        link = cluster.link(_position_device(layout, p), _position_device(layout, q))
        specs.append(replace(base, bandwidth=link.bandwidth, latency=link.latency))
    return tuple(specs)


def data_group(layout: Layout, cluster: Cluster | None) -> Group:
    """A replica group's shape: how many of its D devices share a node, on how many nodes."""
    d = layout.data_parallel
    if cluster is None:
        return Group(d, 1)
    members = [_position_device(layout, 0, r) for r in range(d)]
    nodes = len({cluster.node_of(m) for m in members})
    return Group(d // nodes, nodes)


def tensor_group(layout: Layout, cluster: Cluster | None) -> Group:
    """A tensor-parallel group's shape: its T consecutive devices, on one node when T divides
    the devices per node (`layouts` searches only those), else spread over ceil(T / per node)."""
    t = layout.tensor_parallel
    if cluster is None or t <= cluster.per_node:
        return Group(t, 1)
    return Group(cluster.per_node, t // cluster.per_node)


def layout_static(param: float, grad: float, optimizer: float, layout: Layout) -> float:
    """Bytes a device holds for a block's parameters, gradients and optimizer state: all of
    them replicated; under FSDP the gathered parameters and unsharded gradients of the step
    plus 1/D of the parameters and optimizer state (the shards)."""
    if not layout.fsdp:
        return param + grad + optimizer
    return param + grad + (param + optimizer) / layout.data_parallel


@dataclass(frozen=True)
class Collectives:
    """The step's collectives and optimizer step of one layout on its links."""

    layout: Layout
    group: Group
    intra: Link
    inter: Link
    # bytes/s of device memory: what the optimizer step moves at (None: not priced, for
    # the ranks of this machine, whose memory bandwidth is not measured)
    memory_bandwidth: float | None
    # the optimizer step's passes over parameters, gradients and state (`step_passes`)
    passes: tuple[float, float, float] = ADAMW_PASSES

    @classmethod
    def of(cls, layout: Layout, cluster: Cluster | None, device: DeviceSpec,
           optimizer: Callable | None = None, dtype: torch.dtype = torch.float32
           ) -> "Collectives | None":
        """The pricing of `layout`: over the cluster's links, or the link `device` sends
        over (the ranks of this machine: measured, planner/ranks_passes.py), the step of
        compile's `optimizer` over parameters of `dtype` by its kernels (`step_passes`). None
        for an absolute device without memory bandwidth."""
        if device.absolute and device.memory_bandwidth is None:
            return None
        if cluster is not None:
            intra, inter = cluster.intra, cluster.inter
        else:
            intra = inter = Link("link", device.bandwidth, device.latency)
        return cls(layout, data_group(layout, cluster), intra, inter, device.memory_bandwidth,
                   step_passes(optimizer, dtype))

    def extras(self, param: float, grad: float, optimizer: float, last_backward: float, *,
               overlap: bool) -> tuple[float, float]:
        """(setup, teardown) seconds of one stage holding `param`, `grad` and `optimizer`
        bytes whose last backward takes `last_backward` s; `overlap`: the reducer may run
        during that backward (one autograd backward per micro-batch, no recomputation)."""
        d = self.layout.data_parallel
        shard = d if self.layout.fsdp else 1
        step = (0.0 if self.memory_bandwidth is None else  # AdamW + clipping, by bytes
                optimizer_seconds(self.memory_bandwidth, param / shard, grad / shard,
                                  optimizer / shard, passes=self.passes))
        if d < 2:
            return 0.0, step
        if self.layout.fsdp:
            return (all_gather(param, self.group, self.intra, self.inter),
                    reduce_scatter(grad, self.group, self.intra, self.inter) + step)
        reduce = all_reduce(grad, self.group, self.intra, self.inter)
        hidden = last_backward if overlap else 0.0
        return 0.0, max(0.0, reduce - hidden) + step


def describe_placement(layout: Layout, cluster: Cluster | None) -> str:
    """Where the layout's traffic goes: "pipeline sends over nvlink, replica groups 8 per node
    on 1 node(s)" (and ", tensor-parallel groups of 8 on one node over nvlink")."""
    if cluster is None:
        return ""
    group = data_group(layout, cluster)
    links = {cluster.link(_position_device(layout, p), _position_device(layout, p + 1)).name
             for p in range(layout.pipeline - 1)}
    sends = "no pipeline sends" if not links else f"pipeline sends over {'/'.join(sorted(links))}"
    text = f"{sends}, replica groups {group.per_node} per node on {group.nodes} node(s)"
    if layout.tensor_parallel > 1:
        tp = tensor_group(layout, cluster)
        text += (f", tensor-parallel groups of {tp.size} on one node over {cluster.intra.name}"
                 if tp.nodes == 1 else f", tensor-parallel groups of {tp.size} on {tp.nodes} "
                 f"nodes")
        text += ", sequence parallel" if layout.sequence_parallel else ""
    return text


@dataclass(frozen=True)
class LayoutCandidate:
    """One layout the search costed: its best plan's step and memory, or why none fits."""

    layout: Layout
    step: float = math.inf
    schedule: str = ""
    microbatches: int = 0
    virtual_stages: int = 0
    recomputed: int = 0  # stages that recompute
    memory: float = 0.0  # the fullest device's predicted peak bytes
    reason: str = ""

    @property
    def fits(self) -> bool:
        return math.isfinite(self.step)

    def to_dict(self) -> dict[str, Any]:
        """Strict JSON (an infinite step as "inf")."""
        lay = self.layout
        return {"pipeline": lay.pipeline, "data_parallel": lay.data_parallel, "fsdp": lay.fsdp,
                "inner": lay.inner, "tensor_parallel": lay.tensor_parallel,
                "sequence_parallel": lay.sequence_parallel,
                "step": self.step if self.fits else "inf",
                "schedule": self.schedule, "microbatches": self.microbatches,
                "virtual_stages": self.virtual_stages, "recomputed": self.recomputed,
                "memory": self.memory, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayoutCandidate":
        layout = Layout(data["pipeline"], data["data_parallel"], data["fsdp"], data["inner"],
                        tensor_parallel=int(data.get("tensor_parallel", 1)),
                        sequence_parallel=bool(data.get("sequence_parallel", False)))
        return cls(layout, float(data["step"]), data["schedule"], data["microbatches"],
                   data["virtual_stages"], data["recomputed"], data["memory"], data["reason"])


def step_passes(optimizer: Callable | None, dtype: torch.dtype = torch.float32
                ) -> tuple[float, float, float]:
    """The passes over parameters, gradients and state of a step of the optimizer that
    `optimizer` (compile's factory) builds, read from it on a probe of `dtype` (the model's):
    one keeping fp32 copies of 16-bit parameters in its state (master weights) as Megatron-
    LM's mixed-precision step (`kernel_prices.master_weights_passes`); torch's Adam and AdamW
    by their kernels (`kernel_prices.adam_passes`: fused, or the foreach / for-loop default,
    with their weight decay); any other at AdamW's fused minimum (ADAMW_PASSES)."""
    if optimizer is None:
        return ADAMW_PASSES
    probe = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    opt = optimizer([probe])
    probe.grad = torch.zeros_like(probe)
    opt.step()
    kept = [t for s in opt.state.values() for t in s.values()
            if isinstance(t, torch.Tensor) and t.numel() == probe.numel()]
    if probe.element_size() == 2 and any(t.dtype == torch.float32 for t in kept):
        return master_weights_passes(probe.element_size())
    if not isinstance(opt, torch.optim.Adam):
        return ADAMW_PASSES
    d = opt.defaults
    return adam_passes(fused=bool(d.get("fused")), weight_decay=float(d.get("weight_decay", 0)),
                       decoupled=bool(d.get("decoupled_weight_decay",
                                            isinstance(opt, torch.optim.AdamW))))
