"""compile's inputs, validated once: the model with its example batch, and the options.

    CompileOptions  compile's options checked against each other, the example batch and the
                    job's ranks: devices as `DeviceSpec`s, the virtual stage count, the ranks
                    of a distributed run. The options given as "auto" are named in `auto` and
                    hold only a starting value (`starting_values`: the micro-batch count a
                    static capture is made at); a plan's `asked` is this record; what
                    the join, search and ranks passes resolve of it is the plan's
                    `resolved` (resolved.py). One option's own value is checked in
                    request.py.

Devices given by their figures (absolute `DeviceSpec`s: `flops=`, or `pipecompile.preset("h100")`)
get their relative `speed` here, at the model's compute dtype (`compute_dtype`); they need not be
on this machine (`device_present`), and a plan for absent devices can be printed and saved but
not run (`require_present`).

`schedule=` is "auto", a built-in name, or a user-written schedule (`given_schedule`): a
`Schedule`, its text or CSV form (``Schedule.from_text``/``from_csv``), or the path of a .csv/.txt
file holding one. A written schedule fixes the device, stage and micro-batch counts; it is
checked against the options and validated here, at compile time.

`resolve_options` raises a `ConfigError` naming the bad value and what to pass instead; every
pass after it trusts the options.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ..ir.compile_cache import CompileCache
from ..errors import ConfigError, ScheduleError
from ..ir.records import Example
from ..ir.devices import DeviceSpec
from .cluster import Cluster
from .request import AUTO
from ..runtime.distributed import rank_device, world_size
from ..measure.ranks import Ranks
from ..schedule.actions import Schedule
from ..schedule.schedules import (
    ASYNC_SCHEDULE_NAMES,
    SCHEDULE_NAMES,
    TWO_STAGES_PER_DEVICE,
    make_schedule,
    schedule_properties,
)

if TYPE_CHECKING:
    from ..ir.records import StagedProgram

__all__ = ["CompileOptions", "resolve_options",
           "check_async_ties", "compute_dtype", "device_present", "require_present", "AUTO",
           "starting_values"]


_RANK_BANDWIDTH = 3e9  # bytes/s between ranks when not told: gloo on loopback


@dataclass(frozen=True)
class CompileOptions:
    """compile's keyword options after validation (see `pipecompile.compile`)."""

    devices: tuple[DeviceSpec, ...]  # one per pipeline device
    microbatches: int
    schedule: str  # a built-in schedule's name, or the name of `given_schedule`
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None
    split_points: tuple[str, ...] | None = None
    capture: str = "export"
    # "auto": the batch symbolic, and every size of a batched input once a lazy pipeline meets
    # a size its plans fixed; "all": every size symbolic where the model allows (sequence
    # lengths too) from the start; "batch": the batch alone, always (other sizes fixed)
    symbolic_sizes: str = "auto"
    # seconds the torch.export attempt with every size symbolic may run (in a child process,
    # killed then) before capture gives up on it and keeps the batch alone symbolic
    capture_budget: float = 120.0
    granularity: str | None = None
    virtual_stages: int = 1  # resolved: 2 for interleaved-1f1b, zb-v, interleaved-zb unless given
    profile: bool = False
    checkpoint: bool | tuple[bool, ...] = False  # all stages, or per stage once searched
    vertical_sync: bool = False
    data_parallel: int = 1
    tensor_parallel: int = 1  # T ranks share each layer of a stage (runtime/tensor_parallel.py)
    sequence_parallel: bool = False  # and split the tokens between its layers (T > 1)
    timeout: float = 300.0
    verbose: bool = False  # capture: show torch's own output
    rng: str = "global"  # "per-microbatch": random streams from (seed, step, micro-batch, op)
    rng_seed: int = 0
    compile_stages: bool = False  # each stage graph through torch.compile (runtime/compiled.py)
    fsdp: bool = False  # each stage fully_shard-ed over the data-parallel ranks (FSDP2)
    # absent devices with their topology (`pipecompile.cluster`): `devices` are all of them,
    # the layout search chooses P x D (None: `devices` are the pipeline's)
    cluster: Cluster | None = None
    # the example is the global batch, each replica takes its slice (data_parallel="auto", or
    # a cluster); False: the example is this replica's batch (data_parallel=D under torchrun)
    global_batch: bool = False
    mesh: Any = None  # the user's DeviceMesh with "dp" and "pp" dimensions (None: built)
    ranks: Ranks = Ranks()
    auto: frozenset[str] = frozenset()  # options the search pass chooses (starting values here)
    given_schedule: Schedule | None = None  # user-written (compute order and counts), validated
    # what compiling measures or derives, kept by content (None: nothing kept; compile_cache.py)
    cache: CompileCache | None = field(default=None, compare=False, repr=False)

    def stage_checkpoint(self, stage: int) -> bool:
        """Whether `stage` recomputes its forward in backward (activation checkpointing)."""
        if isinstance(self.checkpoint, tuple):
            return self.checkpoint[stage]
        return bool(self.checkpoint)

    @property
    def num_stages(self) -> int:
        return len(self.devices) * self.virtual_stages

    @property
    def asynchronous(self) -> bool:
        """PipeDream and 2BW update the weights during a step."""
        return schedule_properties(self.schedule, self.given_schedule).asynchronous

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits backwards into input (I) and weight (W) gradients."""
        return schedule_properties(self.schedule, self.given_schedule).splits_backward


def resolve_options(
    example: Example | None, *, devices: int | Sequence[str | torch.device | DeviceSpec],
    microbatches: int | str, schedule: str | Schedule, virtual_stages: int | str | None,
    checkpoint: bool | str,
    memory_limit: float | Sequence[float] | None, bandwidth: float | None,
    data_parallel: int, timeout: float, split_points: Sequence[str] | None, **rest: Any,
) -> CompileOptions:
    """Check compile's options against each other and the example batch (None: lazy compile,
    checked again at the first call); resolve devices and ranks. `rest` are the options taken
    as given (loss_fn, optimizer, capture, ...). Each option's own value was checked by the
    `Request` (request.py)."""
    count = devices if isinstance(devices, int) else len(devices)
    if rest.get("fsdp", False) not in (True, False):
        raise ConfigError(f"fsdp must be True, False or 'auto' (with data_parallel='auto' or a "
                          f"cluster), got {rest['fsdp']!r}")
    world = world_size()  # torchrun's ranks, read without joining: compile's "join" pass joins
    T = rest.get("tensor_parallel", 1)
    if world <= 1 and T > 1:
        raise ConfigError(
            f"tensor_parallel={T} runs one rank per shard: launch devices={count} x "
            f"data_parallel={data_parallel} x tensor_parallel={T} = {count * data_parallel * T} "
            f"ranks with torchrun (in one process, device threads cannot share a layer)")
    if world <= 1 and data_parallel > 1:
        raise ConfigError(
            f"data_parallel={data_parallel} needs torch.distributed: launch "
            f"{count * data_parallel} ranks with torchrun (or init a process group)")
    if world > 1:
        if count * data_parallel * T != world:
            tp = f" × tensor_parallel={T}" if T > 1 else ""
            divides = "" if world % T == 0 else f" (tensor_parallel={T} does not divide them)"
            raise ConfigError(
                f"the job has {world} ranks{divides} but devices={count} × data_parallel="
                f"{data_parallel}{tp} = {count * data_parallel * T}; launch "
                f"{count * data_parallel * T} ranks or change devices/data_parallel"
                + ("/tensor_parallel" if tp else ""))
        devices = [rank_device()] * count
        bandwidth = bandwidth or _RANK_BANDWIDTH
    name, given = _schedule_option(schedule)
    if given is not None:  # its counts stand for "auto" and must equal those given
        microbatches, virtual_stages = _fit_given(given, count, microbatches, virtual_stages)
    auto = _auto(name, microbatches, virtual_stages, checkpoint)
    microbatches, name, virtual_stages = starting_values(auto, example, name, microbatches,
                                                         virtual_stages)
    dtype = compute_dtype(example.model) if example is not None else None
    options = CompileOptions(
        devices=tuple(_device_specs(devices, memory_limit, bandwidth, dtype)),
        microbatches=microbatches, schedule=name,
        split_points=None if split_points is None else tuple(split_points),
        virtual_stages=virtual_stages, checkpoint=checkpoint is True,
        data_parallel=data_parallel, timeout=timeout, auto=auto,
        given_schedule=given, **rest)
    _check_fsdp(options)
    _check_async(options)
    _check_tensor_parallel(options)
    if example is not None and example.batch < microbatches:
        raise ConfigError(
            f"the example batch has {example.batch} samples, fewer than microbatches="
            f"{microbatches}; use a batch of at least {microbatches} or fewer micro-batches")
    return options


def _schedule_option(value: Any) -> tuple[str, Schedule | None]:
    """`schedule=`'s name, and the user-written schedule it holds (None: "auto" or a built-in
    name)."""
    given = value if isinstance(value, Schedule) else _read_schedule(value)
    if given is None:
        return value, None
    if given.name == AUTO or given.name in ASYNC_SCHEDULE_NAMES:
        raise ConfigError(f"a written schedule cannot be named {given.name!r} (a built-in "
                          f"option's name); rename it")
    return given.name, given


def _read_schedule(value: Any) -> Schedule | None:
    """The schedule in `value`: its text or CSV form, or a .csv/.txt path (None: a name)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(f"schedule must be a name, a Schedule, its text or a .csv/.txt path, "
                          f"got {type(value).__name__}")
    if value == AUTO or value in SCHEDULE_NAMES:
        return None
    text, where = value, "the text given as schedule="
    if "\n" not in value.strip() and value.lower().endswith((".csv", ".txt")):
        if not os.path.isfile(value):
            raise ConfigError(f"schedule={value!r}: no such file; give the path of a .csv or "
                              f".txt file holding a schedule (Schedule.to_csv/to_text)")
        with open(value, encoding="utf-8") as f:
            text, where = f.read(), f"schedule file {value}"
    elif "\n" not in value.strip() and not any(c.isspace() for c in value.strip()):
        raise ConfigError(
            f"schedule={value!r} is not supported; use 'auto', one of "
            f"{', '.join(SCHEDULE_NAMES)}, a Schedule, its text or the path of a .csv/.txt "
            f"file holding one")
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    first = next((line for line in lines if line.strip()), "")
    comma = first.find(",")  # CSV: a comma before any ':' of a text header ("name: ...")
    csv = where.endswith(".csv") or (comma >= 0 and (":" not in first or comma < first.find(":")))
    try:
        return Schedule.from_csv(text) if csv else Schedule.from_text(text)
    except ScheduleError as error:
        raise ScheduleError(f"{where}: {error}") from None


def _fit_given(given: Schedule, devices: int, microbatches: int | str,
               virtual_stages: int | str | None) -> tuple[int, int]:
    """The micro-batch and virtual stage counts of a written schedule, checked against those
    given (where not "auto"), and the schedule validated (raises naming the action)."""
    name, m, p, d = given.name, given.num_microbatches, given.num_stages, given.num_devices
    if d != devices:  # under torchrun: the pipeline ranks
        raise ConfigError(f"schedule {name!r} runs on {d} devices but devices={devices}; pass "
                          f"devices={d} or write the schedule for {devices} devices")
    if microbatches != AUTO and microbatches != m:
        raise ConfigError(
            f"schedule {name!r} has {m} micro-batches but microbatches={microbatches!r}; "
            f"pass microbatches={m} (or 'auto') or write the schedule for {microbatches}")
    if p % d:
        raise ConfigError(
            f"schedule {name!r} places {p} stages on {d} devices; compile needs a multiple of "
            f"the device count ({d}, {2 * d}, ... stages)")
    if virtual_stages not in (None, AUTO) and virtual_stages != p // d:
        raise ConfigError(
            f"schedule {name!r} has {p // d} stage(s) per device ({p} stages on {d} devices) "
            f"but virtual_stages={virtual_stages!r}; pass virtual_stages={p // d} or 'auto'")
    make_schedule(given, devices, m, virtual_stages=p // d)  # validated as compile runs it
    return m, p // d


def _auto(schedule: Any, microbatches: Any, virtual_stages: Any, checkpoint: Any
          ) -> frozenset[str]:
    """The options the search pass chooses: those given as "auto" (virtual stages only along
    with the schedule: an explicit schedule implies its own)."""
    auto = {name for name, value in (("schedule", schedule), ("microbatches", microbatches),
                                     ("checkpoint", checkpoint)) if value == AUTO}
    if schedule == AUTO and virtual_stages in (None, AUTO):
        auto.add("virtual_stages")
    return frozenset(auto)


def starting_values(auto: frozenset[str], example: Example | None, name: str,
                    microbatches: Any, virtual_stages: Any) -> tuple[int, str, int]:
    """The micro-batch count, schedule name and virtual stage count the passes start from
    (the values a static capture is made at) where they are "auto": the largest divisor of the
    example batch up to 4 micro-batches (4 for a lazy compile), "gpipe", and 2 virtual stages
    for a schedule that runs two per device (else 1)."""
    if "microbatches" in auto:
        batch = example.batch if example is not None else 4
        microbatches = max(m for m in range(1, min(4, batch) + 1) if batch % m == 0)
    assert isinstance(microbatches, int)
    name = "gpipe" if name == AUTO else name
    if not isinstance(virtual_stages, int):
        virtual_stages = 2 if name in TWO_STAGES_PER_DEVICE else 1
    return microbatches, name, virtual_stages


def _check_async(options: CompileOptions) -> None:
    if options.vertical_sync and options.schedule != "pipedream":
        raise ConfigError("vertical_sync=True only applies to schedule='pipedream'")
    if not options.asynchronous:
        return
    if options.optimizer is None:
        raise ConfigError(
            f"schedule={options.schedule!r} updates the weights during the step; pass "
            f"optimizer=..., e.g. optimizer=lambda p: torch.optim.SGD(p, lr=0.01)")
    if options.data_parallel != 1:
        raise ConfigError(f"schedule={options.schedule!r} with data_parallel > 1 is not "
                          f"supported; use a synchronous schedule for data parallelism")


def _check_tensor_parallel(options: CompileOptions) -> None:
    """tensor_parallel=T > 1: built for pipeline x data x tensor parallelism with synchronous
    schedules (with or without sequence parallelism), the replicas replicated or sharded
    (fsdp=True: FSDP2 over "dp" of the (dp, pp, tp) mesh); what it is not yet built with is
    refused, saying so."""
    if options.tensor_parallel == 1:
        return
    refused = {f"schedule={options.schedule!r}": options.asynchronous,
               "compile_stages=True": options.compile_stages}
    sp = ", sequence_parallel=True" if options.sequence_parallel else ""
    for what, given in refused.items():
        if given:
            raise ConfigError(
                f"tensor_parallel={options.tensor_parallel}{sp} with {what} is not built yet; "
                f"use pipeline x data x tensor parallelism (devices=P, data_parallel=D, "
                f"tensor_parallel=T: P x D x T ranks) with a synchronous schedule, or "
                f"tensor_parallel=1" + (", or leave out " + what.split("=")[0] if sp else ""))


def _check_fsdp(options: CompileOptions) -> None:
    """fsdp=True: sharding over data-parallel ranks, with schedules whose backward is one
    autograd call per micro-batch (FSDP's hooks reduce the gradients)."""
    distributed = world_size() > 1
    if options.mesh is not None and not distributed:
        raise ConfigError("mesh= needs torch.distributed: launch the ranks with torchrun")
    if not options.fsdp:
        return
    if not distributed or options.data_parallel < 2:
        raise ConfigError(
            f"fsdp=True shards each stage over data-parallel replicas: pass data_parallel=D "
            f"(D >= 2) and launch devices x D = {len(options.devices)} x D ranks with torchrun")
    refused = {"pipedream/2bw": options.asynchronous,
               "zero-bubble (split backward)": options.split_backward,
               "compile_stages=True": options.compile_stages,
               "checkpoint=True": options.checkpoint is True}
    for what, given in refused.items():
        if given:
            raise ConfigError(
                f"fsdp=True with {what} is not supported; use schedule='gpipe', '1f1b' or "
                f"'interleaved-1f1b' (or 'auto'), without recomputation or compiled stages, "
                f"or fsdp=False")


def _device_names(devices: int | Sequence[Any]) -> list[Any]:
    if not isinstance(devices, int):
        return list(devices)
    if devices < 1:
        raise ConfigError(f"devices must be >= 1, got {devices}")
    if not torch.cuda.is_available():
        return ["cpu"] * devices
    if torch.cuda.device_count() < devices:
        raise ConfigError(
            f"devices={devices} but only {torch.cuda.device_count()} CUDA devices are "
            f"visible; pass devices=['cpu'] * {devices} to run on the CPU")
    return [f"cuda:{i}" for i in range(devices)]


def _device_name(device: Any) -> str:
    """The torch name of one entry of `devices` ("cuda:0"), or a ConfigError naming it."""
    try:
        return str(torch.device(device))
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"devices holds {device!r}, which is not a torch device; give a "
                          f"count (devices=2), a device name (devices='cpu') or a list of "
                          f"them (devices=['cuda:0', 'cuda:1'])") from None


def _device_specs(devices, memory_limit, bandwidth, dtype: str | None) -> list[DeviceSpec]:
    names = _device_names(devices)
    if not names:
        raise ConfigError("devices is empty; pass a count or a list of device names")
    limits = (memory_limit if isinstance(memory_limit, (list, tuple))
              else [memory_limit] * len(names))
    if len(limits) != len(names):
        raise ConfigError(f"memory_limit has {len(limits)} entries for {len(names)} devices")
    specs = []
    for d, limit in zip(names, limits):
        if isinstance(d, DeviceSpec):
            spec = d
        else:
            name = _device_name(d)
            spec = DeviceSpec(name=name, memory=_device_memory(name),
                              bandwidth=bandwidth or (math.inf if name == "cpu" else 10e9))
        if limit is not None:
            spec = replace(spec, memory=float(limit))
        specs.append(spec)
    return _absolute(specs, dtype) if any(s.absolute for s in specs) else specs


def _absolute(specs: list[DeviceSpec], dtype: str | None) -> list[DeviceSpec]:
    """Absolute specs (given FLOP/s): each one's `speed` relative to the first at the model's
    dtype, and plain "cuda" numbered per device when this machine has that many GPUs."""
    measured = [i for i, s in enumerate(specs) if not s.absolute]
    if measured:
        raise ConfigError(
            f"devices mixes specs with flops= (hardware described, planned without measuring) "
            f"and device {measured[0]} ({specs[measured[0]].name!r}) without (measured on this "
            f"machine); give every device flops= (e.g. pipecompile.preset('h100')) or none")
    first = specs[0].rate(dtype)
    if (all(s.name == "cuda" for s in specs) and torch.cuda.is_available()
            and torch.cuda.device_count() >= len(specs)):
        specs = [replace(s, name=f"cuda:{i}") for i, s in enumerate(specs)]
    return [replace(s, speed=s.rate(dtype) / first) for s in specs]


def compute_dtype(model: torch.nn.Module) -> str:
    """The floating dtype holding most of `model`'s parameters ("bfloat16"; "float32" if it
    has none): the dtype an absolute device's FLOP rate is taken in."""
    counts: dict[str, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            key = str(p.dtype).removeprefix("torch.")
            counts[key] = counts.get(key, 0) + p.numel()
    return max(counts, key=lambda k: counts[k]) if counts else "float32"


def device_present(name: str) -> bool:
    """Whether this machine has the torch device `name` ("cuda:3" needs 4 GPUs)."""
    device = torch.device(name)
    if device.type in ("cpu", "meta"):
        return True
    backend = getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        return False
    return device.index is None or device.index < backend.device_count()


def require_present(devices: Sequence[DeviceSpec], *, where: str) -> None:
    """Raise a `ConfigError` at `where` ("pipe.step()") when a device of the plan is absent:
    a plan for hardware that is not here can be printed, explained and saved, not run."""
    absent = [(i, d) for i, d in enumerate(devices) if not device_present(d.name)]
    if not absent:
        return
    i, spec = absent[0]
    what = spec.hardware or spec.name
    raise ConfigError(
        f"{where}: this plan is for {len(devices)} x {what} (device {i} is {spec.name!r}), which "
        f"this machine does not have; its stages were kept where the model is, for planning "
        f"only. print(pipe), pipe.explain() and pipe.save() work; to run it, compile on a "
        f"machine with these devices, or compile again with devices present here (e.g. "
        f"devices=['cpu'] * {len(devices)})")


def _device_memory(name: str) -> float:
    device = torch.device(name)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return math.inf


def check_async_ties(program: "StagedProgram", schedule: str) -> None:
    """Asynchronous stages update on their own clocks: a parameter must live in one stage."""
    for tie in program.ties:  # several names (wte = lm_head), or one read by several stages
        stages = sorted({s for s, _ in tie.copies})
        if len(stages) > 1:
            _shared_error(" = ".join(tie.names), stages, schedule)


def _shared_error(name: str, stages: list[int], schedule: str) -> None:
    raise ConfigError(
        f"schedule={schedule!r} updates each stage on its own clock, so the parameter {name} "
        f"cannot be used by stages {stages}; untie it (e.g. tie_word_embeddings=False), keep "
        f"its users in one stage with split_points, or use a synchronous schedule")
