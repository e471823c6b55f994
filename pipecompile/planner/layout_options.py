"""compile's options when the layout is searched: `data_parallel="auto"` or a `Cluster`.

    layout_options(devices, data_parallel, fsdp, example) -> (cluster, D given, FSDP given)
                                                             | None (the layout is given)
    layout_resolved(...)                                   -> CompileOptions over every device

Then `devices` are all of the job's devices, the example is the global batch (each replica
takes its slice), and the search pass chooses P x D, FSDP and where each dimension goes
(planner/layout.py). Bad values are `ConfigError`s saying what to pass.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError
from ..ir.devices import DeviceSpec
from ..ir.records import Example
from .options import (AUTO, CompileOptions, _auto, _device_specs, _fit_given, _schedule_option,
                      compute_dtype, resolve_options)
from ..schedule.schedules import ASYNC_SCHEDULE_NAMES, TWO_STAGES_PER_DEVICE
from .cluster import Cluster

__all__ = ["job_options", "layout_options", "layout_resolved"]


def job_options(example: Example | None, *, devices: Any, data_parallel: Any,
                microbatches: Any, schedule: Any, virtual_stages: Any, checkpoint: Any,
                memory_limit: Any, bandwidth: Any, timeout: float, split_points: Any,
                **rest: Any) -> CompileOptions:
    """compile's options: over every device of the job when the layout is searched
    (`data_parallel="auto"` or a cluster), else `options.resolve_options` (the layout given)."""
    layout = layout_options(devices, data_parallel, rest.get("fsdp", False), example)
    if layout is not None:
        return layout_resolved(example, devices, layout, microbatches, schedule,
                               virtual_stages, checkpoint, memory_limit, bandwidth, timeout,
                               split_points, rest)
    return resolve_options(example, devices=devices, microbatches=microbatches,
                           schedule=schedule, virtual_stages=virtual_stages,
                           checkpoint=checkpoint, memory_limit=memory_limit,
                           bandwidth=bandwidth, data_parallel=data_parallel, timeout=timeout,
                           split_points=split_points, **rest)


def layout_options(devices: Any, data_parallel: Any, fsdp: Any, example: Example | None
                    ) -> tuple[Cluster | None, int | None, bool | None] | None:
    """What the layout search may choose (a cluster, the data-parallel degree when given, FSDP
    when given), None when the layout is given (`devices` are the pipeline's)."""
    cluster = devices if isinstance(devices, Cluster) else None
    if cluster is None and data_parallel != AUTO:
        return None
    if data_parallel != AUTO and (isinstance(data_parallel, bool) or not isinstance(
            data_parallel, int) or data_parallel < 1):
        raise ConfigError(f"data_parallel must be a positive int or 'auto', got "
                          f"{data_parallel!r}")
    if fsdp not in (True, False, AUTO):
        raise ConfigError(f"fsdp must be True, False or 'auto', got {fsdp!r}")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        raise ConfigError(
            "data_parallel='auto' (or a cluster) under torch.distributed is not supported yet: "
            "pass devices=P and data_parallel=D with P x D = the ranks (each rank passing its "
            "replica's batch)")
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
                    rest: dict[str, Any]) -> CompileOptions:
    """The options of a compile whose layout is searched: `devices` are all of the job's,
    the example is the global batch; the search pass picks P, D and FSDP (`auto` names
    "layout", and "fsdp" when it is "auto")."""
    cluster, fixed, fsdp = layout
    world = len(devices)
    if fixed is not None and world % fixed:
        raise ConfigError(f"data_parallel={fixed} does not divide the {world} devices; use a "
                          f"divisor of {world} or 'auto'")
    name, given = _schedule_option(schedule)
    if given is not None:  # a written schedule fixes P (and its counts)
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
        {"fsdp"} if fsdp is None else set()) | ({"data_parallel"} if fixed is None else set())
    start = max(m for m in range(1, 5) if example is None or example.batch % m == 0) if (
        "microbatches" in auto) else microbatches
    name = "gpipe" if name == AUTO else name
    if not isinstance(virtual_stages, int):
        virtual_stages = 2 if name in TWO_STAGES_PER_DEVICE else 1
    if checkpoint not in (True, False, AUTO):
        raise ConfigError(f"checkpoint must be True, False or 'auto', got {checkpoint!r}")
    dtype = compute_dtype(example.model) if example is not None else None
    specs = _device_specs(list(devices), memory_limit, bandwidth, dtype)
    return CompileOptions(
        devices=tuple(specs), microbatches=start, schedule=name,
        split_points=None if split_points is None else tuple(split_points),
        virtual_stages=virtual_stages, checkpoint=checkpoint is True,
        data_parallel=fixed or 1, timeout=timeout, auto=frozenset(auto), given_schedule=given,
        cluster=cluster, global_batch=True, **{**rest, "fsdp": bool(fsdp)})
