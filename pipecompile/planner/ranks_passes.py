"""The ranks of a job under torch.distributed: validating compile's options joins nothing, two
explicit passes do (the first alone where the layout is given: devices x data_parallel).

    join_pass             before planning: join the process group; a given layout places
                          this rank at once, a searched one gives every rank a provisional
                          place (P = world, D = 1) so that what planning measures
                          (matmul rate, action cost, the planning probe) is rank 0's
                          (measure/ranks.py); the link between ranks, unless `bandwidth=` was given
                          (the devices' bandwidth is infinite until then), is measured: an
                          all-reduce over every rank timed at two sizes, fitted to the ring's
                          alpha-beta model (planner/collectives.py), rank 0's fit everywhere
    ranks_pass            once the search chose P x D (x T): this process's place, rank =
                          (replica * P + position) * T + index (the runtime builds the groups
                          and the meshes from it; FSDP's mesh in compile's "shard" pass, the
                          "tp" mesh in its "tensor" pass), and the chosen T

Every rank searches with the same numbers, so every rank chooses the same layout; compile's
"plan check" pass compares the finished plans.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..measure.ranks import Ranks
from ..runtime.distributed import Topology, topology_from_environment, world_size

if TYPE_CHECKING:
    from .options import CompileOptions
    from ..ir.records import Example
    from .plan import Plan

__all__ = ["searched_here", "join_pass", "ranks_pass", "fit_link"]

_SIZES = (4, 1 << 20)  # bytes of the two timed all-reduces
_REPEATS = 5


def searched_here(options: "CompileOptions") -> bool:
    """Whether `options` search the layout of ranks of this job (not of absent devices)."""
    return "layout" in options.auto and options.cluster is None and not any(
        d.absolute for d in options.devices)


def join_pass(plan: "Plan", example: "Example") -> "tuple[Plan, str] | None":
    """Join the process group, measure the link between ranks (module docstring)."""
    o, timeout = plan.resolved, plan.asked.timeout
    if o.ranks.distributed or world_size() <= 1:
        return None
    if not searched_here(plan.asked):  # the layout given: join as devices x data_parallel
        given = topology_from_environment(len(o.devices), o.data_parallel, timeout,
                                          o.tensor_parallel)
        if given is None:
            from ..errors import ConfigError

            raise ConfigError(f"the options were validated for {world_size()} ranks but this "
                              f"process is not one of them; launch it with torchrun")
        return replace(plan, resolved=replace(o, ranks=Ranks(given))), (
            f"rank {given.rank} of {given.world_size} joined ({len(o.devices)} pipeline "
            f"devices x {o.data_parallel} replicas"
            + (f" x {o.tensor_parallel} tensor-parallel" if o.tensor_parallel > 1 else "") + ")")
    world = len(o.devices)
    topology = topology_from_environment(world, 1, timeout)
    if topology is None:  # the group went away between validation and now
        from ..errors import ConfigError

        raise ConfigError(f"data_parallel='auto' was validated for {world} ranks but this "
                          f"process is not one of them; launch it with torchrun")
    ranks = Ranks(topology)
    note = "bandwidth given"
    devices = o.devices
    if math.isinf(o.devices[0].bandwidth):  # not given: measured
        bandwidth, latency = ranks.shared(_measure_link(world))
        devices = tuple(replace(d, bandwidth=bandwidth, latency=latency) for d in o.devices)
        note = (f"link between ranks measured: {latency * 1e6:.0f} us per message, "
                f"{bandwidth / 1e9:.2f} GB/s")
    return replace(plan, resolved=replace(o, ranks=ranks, devices=devices)), (
        f"rank {topology.rank} of {world} joined; {note}")


def ranks_pass(plan: "Plan", example: "Example") -> "tuple[Plan, str] | None":
    """This process's place in the chosen P x D grid."""
    o, layout = plan.resolved, plan.ready.choices.layout
    if layout is None or not searched_here(plan.asked) or o.ranks.topology is None:
        return None
    t = o.ranks.topology
    placed = Topology(t.rank, t.world_size, layout.pipeline, layout.data_parallel,
                      layout.tensor_parallel)
    tp = (f" x {layout.tensor_parallel}" if layout.tensor_parallel > 1 else "")
    return replace(plan, resolved=replace(
        o, ranks=Ranks(placed), tensor_parallel=layout.tensor_parallel,
        sequence_parallel=layout.sequence_parallel)), (
        f"{layout.pipeline} x {layout.data_parallel}{tp}: rank {t.rank} is position "
        f"{placed.position} of replica {placed.replica}"
        + (f", {placed.tp_index} of its tensor-parallel group" if tp else ""))


def fit_link(world: int, small: tuple[int, float], large: tuple[int, float]
             ) -> tuple[float, float]:
    """(bytes/s, seconds per message) of the ring all-reduce model
    t(S) = 2 (n-1) alpha + 2 (n-1)/n S / B fitted to two timed sizes (bytes, seconds)."""
    steps = 2 * (world - 1)
    (s0, t0), (s1, t1) = small, large
    moved = steps / world * (s1 - s0)
    bandwidth = moved / max(t1 - t0, 1e-9)
    latency = max(0.0, t0 - steps / world * s0 / bandwidth) / steps
    return bandwidth, latency


def _measure_link(world: int) -> tuple[float, float]:
    """Time all-reduces of `_SIZES` bytes over every rank (the median of `_REPEATS`)."""
    import torch.distributed as dist

    from ..runtime.distributed import local_device

    timed = []
    for size in _SIZES:
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=local_device())
        dist.all_reduce(buffer)  # warm: connections, buffers
        times = []
        for _ in range(_REPEATS):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if buffer.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        timed.append((buffer.numel() * 4, sorted(times)[_REPEATS // 2]))
    return fit_link(world, timed[0], timed[1])
