"""compile's options when the layout is searched: `data_parallel="auto"` or a `Cluster`.

    job_options(example, ...)                              -> CompileOptions (compile's entry)
    layout_options(devices, data_parallel, fsdp, example) -> (cluster, D given, FSDP given)
                                                             | None (the layout is given)
    ranks_options(world, devices, fsdp, example)           -> the same, for the ranks of a
                                                             torchrun job
    layout_resolved(...)                                   -> CompileOptions over every device

Then `devices` are all of the job's devices, the example is the global batch (each replica
takes its slice), and the search pass chooses P x D, FSDP and where each dimension goes
(planner/layout.py). Under torchrun (WORLD_SIZE > 1) `data_parallel="auto"`, or neither
`devices` nor `data_parallel` given, searches the layout of the ranks: `devices=P` then fixes
the pipeline degree (D = world / P); `tensor_parallel="auto"` adds T (P x D x T = world).
Validating joins no process group: compile's "join" pass does (planner/ranks_passes.py). Bad
values are `ConfigError`s saying what to pass.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError
from .request import Request
from .options import (
    AUTO,
    CompileOptions,
    _auto,
    _device_specs,
    _fit_given,
    _schedule_option,
    compute_dtype,
    resolve_options,
    starting_values,
)
from ..ir.records import Example
from ..ir.devices import DeviceSpec
from ..schedule.schedules import ASYNC_SCHEDULE_NAMES
from .cluster import Cluster
from .layout import check_tensor_degree
from ..runtime.distributed import rank_device, world_size

__all__ = ["job_options", "layout_options", "ranks_options", "layout_resolved"]


def job_options(example: Example | None, request: Request) -> CompileOptions:
    """The starting options of `request`: over every device of the job when the layout is
    searched (`data_parallel="auto"`, a cluster, or under torchrun neither `devices` nor
    `data_parallel`), else `options.resolve_options` (the layout given). `devices` and
    `data_parallel` None: not given (1 each outside that search); one device name or spec
    (`devices="cpu"`) is a list of that one device."""
    world = world_size()
    given = request.keywords()
    devices, data_parallel, fsdp = (given.pop(name) for name in ("devices", "data_parallel",
                                                                "fsdp"))
    tensor_parallel = given.pop("tensor_parallel")
    sequence_parallel = given.pop("sequence_parallel")
    given.pop("vocab_parallel")  # read where the vocabulary is priced (plan.request)
    ranks_tp = _ranks_tensor(world, devices, request)  # T searched over this job's ranks
    if ranks_tp and given.get("compile_stages"):
        raise ConfigError("tensor_parallel='auto' with compile_stages=True is not built yet "
                          "(the search may choose T > 1); leave out compile_stages, or pass "
                          "tensor_parallel=1")
    if tensor_parallel != 1 and not isinstance(devices, Cluster) and not ranks_tp and (
            tensor_parallel == AUTO or request.layout.searched):
        what = "with a searched layout" if request.layout.searched else "(T searched)"
        raise ConfigError(f"tensor_parallel={tensor_parallel!r} {what} is "
                          f"planned for a cluster of devices that are not here: pass "
                          f"devices=pipecompile.cluster(...); under torchrun give the layout "
                          f"(devices=P, data_parallel=D, tensor_parallel=T) or "
                          f"tensor_parallel='auto' with neither devices nor data_parallel")
    if isinstance(devices, (str, torch.device, DeviceSpec)):
        devices = [devices]
    microbatches, schedule, virtual_stages, checkpoint, memory_limit, bandwidth, timeout, \
        split_points = (given.pop(name) for name in (
            "microbatches", "schedule", "virtual_stages", "checkpoint", "memory_limit",
            "bandwidth", "timeout", "split_points"))
    rest = {**given, "fsdp": fsdp}
    if tensor_parallel != 1 and not isinstance(devices, Cluster) and not ranks_tp:
        rest["tensor_parallel"] = tensor_parallel  # the given layout, run under torchrun
        rest["sequence_parallel"] = sequence_parallel is True  # "auto": False when run
    if world > 1 and (request.layout.searched or ranks_tp) and not isinstance(devices, Cluster):
        names, ranks = ranks_options(world, devices, fsdp, example)
        return layout_resolved(example, names, ranks, microbatches, schedule, virtual_stages,
                               checkpoint, memory_limit,
                               math.inf if bandwidth is None else bandwidth,  # inf: measured
                               timeout, split_points, rest,
                               tensor_parallel=None if ranks_tp else 1)
    devices = 1 if devices is None else devices
    data_parallel = 1 if data_parallel is None else data_parallel
    layout = layout_options(devices, data_parallel, fsdp, example)
    if layout is not None:
        _check_tensor(devices, layout[1], tensor_parallel)
        return layout_resolved(example, devices, layout, microbatches, schedule,
                               virtual_stages, checkpoint, memory_limit, bandwidth, timeout,
                               split_points, rest,
                               tensor_parallel=None if tensor_parallel == AUTO
                               else tensor_parallel)
    return resolve_options(example, devices=devices, microbatches=microbatches,
                           schedule=schedule, virtual_stages=virtual_stages,
                           checkpoint=checkpoint, memory_limit=memory_limit,
                           bandwidth=bandwidth, data_parallel=data_parallel, timeout=timeout,
                           split_points=split_points, **rest)


def _ranks_tensor(world: int, devices: Any, request: Request) -> bool:
    """Whether T is searched over the ranks of this torchrun job (`tensor_parallel="auto"`,
    WORLD_SIZE > 1): the whole layout P x D x T is then the search's, so `devices` and
    `data_parallel` must be left out (or data_parallel="auto"), else a `ConfigError`."""
    asked = request.layout
    if asked.tensor_parallel != AUTO or world <= 1 or isinstance(devices, Cluster):
        return False
    if devices is not None or asked.data_parallel not in (None, AUTO):
        raise ConfigError(
            f"tensor_parallel='auto' under torch.distributed searches the whole layout of the "
            f"{world} ranks (P x D x T); leave devices and data_parallel out (or pass "
            f"data_parallel='auto'), or give the layout (devices=P, data_parallel=D, "
            f"tensor_parallel=T)")
    return True


def _check_tensor(devices: Any, data_parallel: int | None, tensor_parallel: Any) -> None:
    """A given T on a cluster meets `layout.check_tensor_degree` (the rule, written there)."""
    if tensor_parallel in (1, AUTO) or not isinstance(devices, Cluster):
        return
    check_tensor_degree(int(tensor_parallel), devices.per_node, len(devices), data_parallel)


def ranks_options(world: int, devices: Any, fsdp: Any, example: Example | None
                  ) -> tuple[list[str], tuple[Cluster | None, int | None, bool | None]]:
    """The devices (one per rank, this rank's kind) and what the search may choose of the
    layout of `world` ranks: P x D, or D = world / P where `devices=P` fixes the pipeline."""
    divisors = [p for p in range(1, world + 1) if world % p == 0]
    fixed = None
    if devices is not None:
        if isinstance(devices, bool) or not isinstance(devices, int):
            raise ConfigError(
                f"under torch.distributed with data_parallel='auto' each of the {world} ranks "
                f"runs on its own device: pass devices=P (the pipeline ranks) to fix the "
                f"pipeline degree, or leave devices out (the search chooses P x D = {world})")
        if devices < 1 or world % devices:
            raise ConfigError(
                f"devices={devices} pipeline ranks do not divide the {world} ranks; pass one "
                f"of {divisors} (D = {world} / P replicas) or leave devices out (the search "
                f"chooses)")
        fixed = world // devices
    if fsdp is True and fixed == 1:
        raise ConfigError(f"fsdp=True shards each stage over replicas, but devices={world} "
                          f"leaves one; pass fewer pipeline ranks or leave devices out")
    if example is not None and fixed is not None and example.batch < fixed:
        raise ConfigError(
            f"the global batch has {example.batch} samples, fewer than data_parallel="
            f"{fixed} replicas ({world} ranks / devices={devices}); every rank passes the "
            f"global batch: use at least {fixed} samples (a multiple of {fixed}) or more "
            f"pipeline ranks")
    return [rank_device()] * world, (None, fixed, None if fsdp == AUTO else bool(fsdp))


def layout_options(devices: Any, data_parallel: Any, fsdp: Any, example: Example | None
                    ) -> tuple[Cluster | None, int | None, bool | None] | None:
    """What the layout search may choose (a cluster, the data-parallel degree when given, FSDP
    when given), None when the layout is given (`devices` are the pipeline's)."""
    cluster = devices if isinstance(devices, Cluster) else None
    if cluster is None and data_parallel != AUTO:
        return None
    if world_size() > 1:  # ranks: job_options searched them; a cluster is planned, not run
        raise ConfigError(
            "a cluster of devices that are not here is planned in one process, not under "
            "torch.distributed; compile it without torchrun (nothing runs), or leave devices "
            "out to lay out this job's ranks")
    if cluster is None and (isinstance(devices, int) or not all(
            isinstance(d, DeviceSpec) and d.absolute for d in devices)):
        raise ConfigError(
            "data_parallel='auto' chooses the layout of devices that are not here: pass "
            "devices=pipecompile.cluster('h100', nodes=..., per_node=...) or a list of "
            "DeviceSpecs with flops= (in one process nothing runs data-parallel)")
    if example is not None and data_parallel != AUTO and example.batch < data_parallel:
        raise ConfigError(
            f"the global batch has {example.batch} samples, fewer than data_parallel="
            f"{data_parallel} replicas; use a batch of at least {data_parallel} samples (a "
            f"multiple of it) or fewer replicas")
    return (cluster, None if data_parallel == AUTO else data_parallel,
            None if fsdp == AUTO else bool(fsdp))


def layout_resolved(example: Example | None, devices: Any,
                    layout: tuple[Cluster | None, int | None, bool | None],
                    microbatches: Any, schedule: Any, virtual_stages: Any, checkpoint: Any,
                    memory_limit: Any, bandwidth: Any, timeout: float, split_points: Any,
                    rest: dict[str, Any], *, tensor_parallel: int | None = 1) -> CompileOptions:
    """The options of a compile whose layout is searched: `devices` are all of the job's,
    the example is the global batch; the search pass picks P, D, T (`tensor_parallel` None:
    "auto") and FSDP (`auto` names "layout", and "fsdp" when it is "auto")."""
    cluster, fixed, fsdp = layout
    world = len(devices) // (tensor_parallel or 1)  # P x D (T "auto": checked per T)
    if fixed is not None and world % fixed:
        raise ConfigError(f"data_parallel={fixed} does not divide the {world} devices; use a "
                          f"divisor of {world} or 'auto'")
    name, given = _schedule_option(schedule)
    if given is not None:  # a written schedule fixes P (and its counts)
        if fixed is not None and given.num_devices * fixed != world:
            raise ConfigError(
                f"schedule {given.name!r} runs on {given.num_devices} pipeline devices but "
                f"{world} devices / data_parallel={fixed} leave {world // fixed}; write it for "
                f"{world // fixed} devices or leave the pipeline degree to the schedule")
        if world % given.num_devices:
            raise ConfigError(
                f"schedule {given.name!r} runs on {given.num_devices} pipeline devices, which "
                f"does not divide the {world} devices; write it for a divisor of {world}")
        microbatches, virtual_stages = _fit_given(given, given.num_devices, microbatches,
                                                  virtual_stages)
    if name in ASYNC_SCHEDULE_NAMES:
        raise ConfigError(f"schedule={name!r} cannot be data-parallel; use a synchronous "
                          f"schedule with data_parallel='auto' or a cluster")
    auto = _auto(name, microbatches, virtual_stages, checkpoint) | {"layout"} | (
        {"fsdp"} if fsdp is None else set()) | ({"data_parallel"} if fixed is None else set()) | (
        {"tensor_parallel"} if tensor_parallel is None else set())
    start, name, virtual_stages = starting_values(auto, example, name, microbatches,
                                                  virtual_stages)
    dtype = compute_dtype(example.model) if example is not None else None
    specs = _device_specs(list(devices), memory_limit, bandwidth, dtype)
    return CompileOptions(
        devices=tuple(specs), microbatches=start, schedule=name,
        split_points=None if split_points is None else tuple(split_points),
        virtual_stages=virtual_stages, checkpoint=checkpoint is True,
        data_parallel=fixed or 1, timeout=timeout, auto=frozenset(auto), given_schedule=given,
        cluster=cluster, global_batch=True, **{**rest, "fsdp": bool(fsdp)})
