"""`compile`: capture → linearize → annotate → partition → split → schedule → Pipeline.

Each pass is timed and summarised in a `PassRecord`; `pipe.explain()` prints them.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Callable, Sequence

import torch

from .capture import batch_size_of, capture as capture_model, seed_captured
from .errors import ConfigError, PartitionError
from .ir import LinearGraph
from .passes.annotate import DeviceModel, annotate, optimizer_state_factor
from .passes.calibrate import calibrate_blocks, fit_calibration, measure_stages, thread_efficiency
from .passes.profile import profile_blocks, record_values
from .passes.linearize import GRANULARITIES, linearize
from .passes.partition import DeviceSpec, PartitionProblem, evaluate, lower_bound, partition
from .passes.split import split
from .pipeline import PassRecord, Pipeline, values_needing_grad
from .report import StageCost, format_count
from .rng import RNG_MODES
from .runtime.distributed import check_same_plan, local_device, plan_digest, topology_from_environment
from .runtime.schedules import make_schedule
from .runtime.microbatch import split_microbatches
from .runtime.simulate import StageCosts, simulate
from .runtime.stage_worker import LossSpec

__all__ = ["compile"]

_SUPPORTED = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "pipedream", "2bw")
_ASYNC = ("pipedream", "2bw")
_RANK_BANDWIDTH = 3e9  # bytes/s between ranks when not told: gloo on loopback (FACTS.md)


def compile(  # noqa: A001 - the public name of DESIGN.md
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    devices: int | Sequence[str | torch.device | DeviceSpec] = 1,
    microbatches: int = 4,
    schedule: str = "gpipe",
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: Any = None,
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    split_points: Sequence[str] | None = None,
    capture: str = "export",
    granularity: str | None = None,
    virtual_stages: int | None = None,
    profile: bool = False,
    memory_limit: float | Sequence[float] | None = None,
    bandwidth: float | None = None,
    checkpoint: bool = False,
    vertical_sync: bool = False,
    data_parallel: int = 1,
    timeout: float = 300.0,
    verbose: bool = False,
    rng: str = "global",
    rng_seed: int = 0,
) -> Pipeline:
    """Compile `model` into a pipeline over `devices`; see DESIGN.md for the contract.

    `devices` is a count (CUDA devices if present, else that many CPU workers), a list of
    device names, or a list of `DeviceSpec` (relative speed, memory) for heterogeneous devices.
    `memory_limit` (bytes, per device or one for all) caps each stage's predicted memory.
    `example_target` (the target of the example batch) lets `profile=True` time `loss_fn` too.

    Under torch.distributed (an initialised process group, or torchrun's environment) the same
    call runs on every rank: `devices` is the number of pipeline ranks and `data_parallel` the
    number of pipeline replicas; each rank keeps only its own stages.
    """
    records: list[PassRecord] = []
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    count = devices if isinstance(devices, int) else len(devices)
    if not isinstance(data_parallel, int) or data_parallel < 1:
        raise ConfigError(f"data_parallel must be a positive int, got {data_parallel!r}")
    topology = topology_from_environment(count, data_parallel, timeout)
    if topology is None and data_parallel > 1:
        raise ConfigError(
            f"data_parallel={data_parallel} needs torch.distributed: launch "
            f"{count * data_parallel} ranks with torchrun (or init a process group)")
    if topology is not None:
        devices = [str(local_device())] * count
        bandwidth = bandwidth or _RANK_BANDWIDTH
    specs = _device_specs(devices, memory_limit, bandwidth)
    if schedule not in _SUPPORTED:
        raise ConfigError(
            f"schedule={schedule!r} is not supported; use one of {', '.join(_SUPPORTED)}")
    _check_async_options(schedule, vertical_sync, optimizer, data_parallel)
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches must be a positive int, got {microbatches!r}")
    batch = batch_size_of(args, kwargs)
    if batch < microbatches:
        raise ConfigError(
            f"the example batch has {batch} samples, fewer than microbatches={microbatches}; "
            f"use a batch of at least {microbatches} or fewer micro-batches"
        )
    mb_size = math.ceil(batch / microbatches)
    v = virtual_stages or (2 if schedule == "interleaved-1f1b" else 1)
    num_stages = len(specs) * v

    if rng not in RNG_MODES:
        raise ConfigError(f"rng={rng!r} is not a random-stream mode; use one of {RNG_MODES}")
    t = time.perf_counter()
    captured = capture_model(model, args, kwargs, method=capture, static_batch_size=mb_size,
                             verbose=verbose)
    if rng == "per-microbatch":
        captured = seed_captured(captured, rng_seed)
    records.append(PassRecord("capture", time.perf_counter() - t,
                              f"{capture}: {len(captured.module.graph.nodes)} nodes, "
                              f"{'dynamic' if captured.dynamic_batch else 'static'} batch"
                              + "".join(f"\n{'':24}{note}" for note in captured.notes)))

    t = time.perf_counter()
    levels = [granularity] if granularity else list(GRANULARITIES)
    for level in levels:  # refine blocks until every stage can get one
        linear = linearize(captured, granularity=level)
        if linear.num_blocks >= num_stages:
            break
    if linear.num_blocks < num_stages:
        raise PartitionError(
            f"the model has only {linear.num_blocks} blocks at granularity "
            f"{linear.granularity!r}, fewer than the {num_stages} stages asked for; use at most "
            f"{linear.num_blocks} devices" + ("" if granularity is None else " or a finer granularity")
        )
    records.append(PassRecord("linearize", time.perf_counter() - t,
                              f"{linear.num_blocks} blocks ({linear.granularity}), max boundary "
                              f"{max((len(b) for b in linear.boundaries), default=0)} values"))

    plan = make_schedule(schedule, len(specs), microbatches, virtual_stages=v)
    inflight = _inflight(plan)
    stage_specs = tuple(specs[plan.stage_to_device[s]] for s in range(num_stages))
    stage_devices = [torch.device(s.name) for s in stage_specs]
    if topology is not None:  # other ranks' stages stay where the model is: nothing is copied
        home = _model_device(model)
        stage_devices = [d if plan.stage_to_device[i] == topology.position else home
                         for i, d in enumerate(stage_devices)]
    device_model = _device_model(specs[0], topology)
    calibration = None

    def cost(linear: LinearGraph):
        """The cost table of `linear`'s blocks (measured with profile=True, then calibrated)."""
        costs = annotate(linear, microbatch_size=mb_size, device=device_model,
                         optimizer_factor=optimizer_state_factor(optimizer))
        if profile:
            costs = profile_blocks(linear, costs, args, kwargs, microbatches=microbatches)
            if topology is not None:  # every rank must plan with the same numbers: rank 0's
                costs = _agree_on_costs(costs)
        return costs if calibration is None else calibrate_blocks(costs, calibration)

    def place(linear: LinearGraph, costs):
        problem = _problem(costs, stage_specs, inflight)
        if split_points is not None:
            return evaluate(problem, _bounds_from_split_points(linear, split_points, num_stages))
        return partition(problem, inflight_for=lambda k: _inflight_for(schedule, k, microbatches, v))

    def measure(program):
        return _measure_stages(program, linear=program.linear, args=args, kwargs=kwargs,
                               target=example_target, microbatches=microbatches,
                               loss_fn=loss_fn, topology=topology, plan=plan)

    t = time.perf_counter()
    costs = cost(linear)
    total = sum(b.forward_flops for b in costs.blocks)
    records.append(PassRecord("annotate", time.perf_counter() - t,
                              f"{format_count(total)}FLOP forward per micro-batch of {mb_size}"
                              + (" (measured times)" if profile else "")))

    t = time.perf_counter()
    chosen = place(linear, costs)
    how = "split_points" if split_points is not None else "optimal DP"
    records.append(PassRecord("partition", time.perf_counter() - t,
                              f"{how}: bounds {chosen.bounds}, bottleneck "
                              f"{chosen.bottleneck * 1e3:.3f} ms/mb"))

    program = measured = None
    if profile:  # time the stages as the runtime runs them; re-plan on the corrected costs
        t = time.perf_counter()
        program = split(linear, chosen.bounds, stage_devices)
        calibration = fit_calibration(costs, chosen.bounds, measure(program))
        costs = calibrate_blocks(costs, calibration)
        before, chosen = chosen.bounds, place(linear, costs)
        records.append(PassRecord("calibrate", time.perf_counter() - t,
                                  f"stages measured: {calibration}; bounds {before} -> "
                                  f"{chosen.bounds}, bottleneck {chosen.bottleneck * 1e3:.3f} ms/mb"))
        if chosen.bounds != before:
            program = None

    if granularity is None and split_points is None:
        t = time.perf_counter()
        bound = lambda c: lower_bound(_problem(c, stage_specs, inflight))  # noqa: E731
        refined = _refine(captured, linear, costs, chosen, cost, place, bound, num_stages)
        if refined is not None:
            linear, costs, chosen, note = refined
            program = None
            records.append(PassRecord("refine", time.perf_counter() - t, note))

    t = time.perf_counter()
    if program is None:
        program = split(linear, chosen.bounds, stage_devices)
    if profile:  # the simulator uses the final stages' measured times
        measured = measure(program)
    program = _with_costs(program, costs, chosen, inflight)
    if schedule in _ASYNC:
        _check_no_cross_stage_ties(program, schedule)
    records.append(PassRecord("split", time.perf_counter() - t,
                              f"{program.num_stages} stage graphs, {len(program.ties)} tied "
                              f"parameter groups"))

    stage_costs = [_stage_costs(s, costs, stage_specs[s.index],
                                measured[s.index] if measured else None)
                   for s in program.stages]
    cores = _shared_cores(stage_specs, topology)
    efficiency = 1.0
    if profile and cores is not None and len(specs) > 1:  # device threads slow each other down
        t = time.perf_counter()
        efficiency = _thread_efficiency(program, linear, args, kwargs, microbatches, plan, cores)
        records.append(PassRecord("threads", time.perf_counter() - t, f"{len(specs)} device threads on {cores} "
                                  f"cores run at {efficiency:.2f} of their share"))
    predicted = simulate(plan, stage_costs, cores=cores, efficiency=efficiency)
    records.append(PassRecord("schedule", 0.0, f"{schedule}: {sum(len(a) for a in plan.actions)} "
                              f"actions, predicted bubble {predicted.bubble_fraction:.1%}"))
    if topology is not None:
        t = time.perf_counter()
        check_same_plan(plan_digest(program, plan), local_device())
        records.append(PassRecord("plan check", time.perf_counter() - t,
                                  f"same plan on all {topology.world_size} ranks; this is rank "
                                  f"{topology.rank} (position {topology.position}, replica "
                                  f"{topology.replica})"))
    return Pipeline(program, plan, microbatches=microbatches, loss_fn=loss_fn,
                    optimizer=optimizer, checkpoint=checkpoint, predicted=predicted,
                    stage_costs=stage_costs, cores=cores, efficiency=efficiency,
                    passes=records, timeout=timeout, topology=topology,
                    vertical_sync=vertical_sync)


# ---------------------------------------------------------------------------------------------


def _check_async_options(schedule, vertical_sync, optimizer, data_parallel) -> None:
    if vertical_sync and schedule != "pipedream":
        raise ConfigError("vertical_sync=True only applies to schedule='pipedream'")
    if schedule not in _ASYNC:
        return
    if optimizer is None:
        raise ConfigError(
            f"schedule={schedule!r} updates the weights during the step; pass optimizer=..., "
            f"e.g. optimizer=lambda p: torch.optim.SGD(p, lr=0.01)")
    if data_parallel != 1:
        raise ConfigError(f"schedule={schedule!r} with data_parallel > 1 is not supported; "
                          f"use a synchronous schedule for data parallelism")


def _check_no_cross_stage_ties(program, schedule) -> None:
    """Asynchronous stages update on their own clocks: a parameter must live in one stage."""
    for tie in program.ties:  # one parameter under several names (wte = lm_head)
        stages = sorted({s for s, _ in tie.copies})
        if len(stages) > 1:
            _shared_error(" = ".join(tie.names), stages, schedule)
    for name in program.captured.parameter_names:  # one name read by several stages
        stages = sorted({s for s, _ in program.tensors[name] if s >= 0})
        if len(stages) > 1:
            _shared_error(name, stages, schedule)


def _shared_error(name: str, stages: list[int], schedule: str) -> None:
    raise ConfigError(
        f"schedule={schedule!r} updates each stage on its own clock, so the parameter {name} "
        f"cannot be used by stages {stages}; untie it (e.g. tie_word_embeddings=False), keep "
        f"its users in one stage with split_points, or use a synchronous schedule")


def _device_specs(devices, memory_limit, bandwidth) -> list[DeviceSpec]:
    if isinstance(devices, int):
        if devices < 1:
            raise ConfigError(f"devices must be >= 1, got {devices}")
        if torch.cuda.is_available():
            if torch.cuda.device_count() < devices:
                raise ConfigError(
                    f"devices={devices} but only {torch.cuda.device_count()} CUDA devices are "
                    f"visible; pass devices=['cpu'] * {devices} to run on the CPU"
                )
            names = [f"cuda:{i}" for i in range(devices)]
        else:
            names = ["cpu"] * devices
        devices = names
    if not devices:
        raise ConfigError("devices is empty; pass a count or a list of device names")
    limits = memory_limit if isinstance(memory_limit, (list, tuple)) else [memory_limit] * len(devices)
    if len(limits) != len(devices):
        raise ConfigError(f"memory_limit has {len(limits)} entries for {len(devices)} devices")
    specs = []
    for d, limit in zip(devices, limits):
        if isinstance(d, DeviceSpec):
            spec = d
        else:
            name = str(torch.device(d))
            spec = DeviceSpec(name=name, memory=_device_memory(name),
                              bandwidth=bandwidth or (math.inf if name == "cpu" else 10e9))
        if limit is not None:
            spec = DeviceSpec(spec.name, spec.speed, float(limit), spec.bandwidth)
        specs.append(spec)
    return specs


def _agree_on_costs(costs):
    """Rank 0's measured block times on every rank (measurements differ between processes)."""
    import torch.distributed as dist

    from .passes.annotate import with_measured_times

    times = [[b.forward_time, b.backward_input_time, b.backward_weight_time] for b in costs.blocks]
    box = [times]
    dist.broadcast_object_list(box, src=0)
    return with_measured_times(costs, {i: tuple(t) for i, t in enumerate(box[0])})


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _device_memory(name: str) -> float:
    device = torch.device(name)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return math.inf


def _device_model(spec: DeviceSpec, topology) -> DeviceModel:
    """The analytic model's FLOP rate, measured on the first device (rank 0's under
    torch.distributed, so that every rank plans with the same numbers)."""
    rate = _matmul_rate(spec.name)
    if topology is not None:
        import torch.distributed as dist

        box = [rate]
        dist.broadcast_object_list(box, src=0)
        rate = box[0]
    return DeviceModel(flops=rate)


@functools.lru_cache(maxsize=None)
def _matmul_rate(device: str, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of an n×n×n fp32 matmul on `device` (median of a few runs, ~10 ms on a CPU)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    times = []
    for _ in range(repeats + 1):
        if a.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if a.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times[1:])[repeats // 2]


def _shared_cores(specs: Sequence[DeviceSpec], topology) -> int | None:
    """How many CPU device threads of this process can compute at full speed at once.

    In one process every CPU "device" is a worker thread on the same cores, each op using
    torch's intra-op threads; more devices than that oversubscribes the cores, and the simulator
    must share them. None (no sharing) for accelerators and for one rank per process."""
    if topology is not None or any(torch.device(s.name).type != "cpu" for s in specs):
        return None
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (available or 1) // max(1, torch.get_num_threads()))


def _refine(captured, linear, costs, chosen, cost, place, bound, num_stages):
    """A finer block granularity when it beats the current placement.

    Whole layers cannot balance a model whose stages come out uneven (a heavy head, a few
    large layers on few devices). While the bottleneck is more than 5 % above the lower bound
    (`partition.lower_bound`), try the next granularity and keep it if its optimum is at least
    10 % faster: smaller gains are within the cost model's error between different kinds of
    sub-layer blocks (measured: a 5 % predicted gain on GPT-2 ran 10 % slower). Returns None when the first granularity stays, else (linear, costs, chosen,
    summary)."""
    start = (linear.granularity, chosen.bottleneck)
    best = None
    levels = list(GRANULARITIES)
    for level in levels[levels.index(linear.granularity) + 1:]:
        if chosen.bottleneck <= 1.05 * bound(costs):
            break
        finer = linearize(captured, granularity=level)
        if finer.num_blocks < num_stages or finer.num_blocks == linear.num_blocks:
            continue
        finer_costs = cost(finer)
        finer_chosen = place(finer, finer_costs)
        if finer_chosen.bottleneck > 0.9 * chosen.bottleneck:
            break
        linear, costs, chosen = finer, finer_costs, finer_chosen
        best = (linear, costs, chosen)
    if best is None:
        return None
    return (*best, f"{start[0]} -> {linear.granularity} ({linear.num_blocks} blocks): bottleneck "
                   f"{start[1] * 1e3:.3f} -> {chosen.bottleneck * 1e3:.3f} ms/mb, bounds "
                   f"{chosen.bounds}")


def _problem(costs, stage_specs, inflight) -> PartitionProblem:
    return PartitionProblem(
        block_times=tuple(b.time for b in costs.blocks),
        cut_bytes=costs.cut_bytes,
        static_bytes=tuple(b.static_bytes for b in costs.blocks),
        activation_bytes=tuple(b.activation_bytes for b in costs.blocks),
        devices=stage_specs,
        inflight=inflight,
    )


def _measure_stages(program, *, linear, args, kwargs, target, microbatches, loss_fn, topology,
                    plan) -> dict:
    """Every stage's measured F/B/I/W on the first micro-batch (`passes.calibrate`). Under
    torch.distributed each rank times its own stages and all ranks share the results."""
    values, mb_target = _first_microbatch_values(linear, args, kwargs, target, microbatches)
    own = None if topology is None else [s for s in range(program.num_stages)
                                         if plan.stage_to_device[s] == topology.position]
    measured = measure_stages(program, values, grad_values=values_needing_grad(program),
                              loss=LossSpec(linear.captured.unflatten_outputs, loss_fn,
                                            1.0 / microbatches),
                              target=mb_target, stages=own)
    if topology is not None:
        import torch.distributed as dist

        gathered = [None] * topology.world_size
        dist.all_gather_object(gathered, measured)
        for part in gathered[: topology.pipeline_size]:  # the first replica's measurements
            measured.update(part)
    return measured


def _first_microbatch_values(linear, args, kwargs, target, microbatches):
    """Every graph value on the first micro-batch, and that micro-batch's target."""
    mb = split_microbatches(args, kwargs, target, microbatches)[0]
    captured = linear.captured
    return record_values(captured.module, captured.flatten_inputs(mb.args, mb.kwargs)), mb.target


def _thread_efficiency(program, linear, args, kwargs, microbatches, plan, cores) -> float:
    values, _ = _first_microbatch_values(linear, args, kwargs, None, microbatches)
    firsts = [min(s for s in range(plan.num_stages) if plan.stage_to_device[s] == d)
              for d in range(plan.num_devices)]
    return thread_efficiency(program, values, grad_values=values_needing_grad(program),
                             device_stages=firsts, cores=cores)


def _stage_costs(stage, costs, spec: DeviceSpec, measured=None) -> StageCosts:
    """Simulator costs of a stage: measured (`profile=True`) or the sum of its blocks'. A stage
    that receives no gradient-carrying input (the first) has nothing to do in I: its whole
    backward is weight gradients."""
    first = stage.blocks[0]
    transfers = dict(send_forward=_transfer(stage.cost.send_bytes, spec),
                     send_backward=_transfer(costs.cut_bytes[first], spec))
    if measured is not None:
        return StageCosts(forward=measured.forward, backward=measured.backward,
                          backward_input=measured.backward_input,
                          backward_weight=measured.backward_weight, **transfers)
    blocks = [costs.blocks[b] for b in stage.blocks]
    if costs.cut_bytes[first] == 0:
        i_time, w_time = 0.0, stage.cost.backward_time
    else:
        i_time = sum(b.backward_input_time for b in blocks)
        w_time = sum(b.backward_weight_time for b in blocks)
    return StageCosts(forward=stage.cost.forward_time, backward=stage.cost.backward_time,
                      backward_input=i_time, backward_weight=w_time, **transfers)


def _transfer(nbytes: float, spec: DeviceSpec) -> float:
    return 0.0 if math.isinf(spec.bandwidth) else nbytes / spec.bandwidth


def _inflight(plan) -> tuple[int, ...]:
    """Peak in-flight micro-batches per stage, from a unit-cost simulation of the schedule."""
    timeline = simulate(plan, [StageCosts(1.0, 2.0)] * plan.num_stages)
    return tuple(max(1, timeline.peak_inflight(s)) for s in range(plan.num_stages))


def _inflight_for(schedule: str, devices: int, m: int, v: int) -> tuple[int, ...]:
    """In-flight counts if the pipeline had `devices` devices (for the out-of-memory advice)."""
    try:
        return _inflight(make_schedule(schedule, devices // v if v > 1 else devices, m,
                                       virtual_stages=v))
    except Exception:  # noqa: BLE001 - e.g. interleaving constraints: assume the worst
        return (m,) * devices


def _bounds_from_split_points(linear, split_points, num_stages) -> tuple[int, ...]:
    if len(split_points) != num_stages - 1:
        raise ConfigError(
            f"split_points has {len(split_points)} names but {num_stages} stages need "
            f"{num_stages - 1} cuts"
        )
    cuts = []
    for name in split_points:
        index = linear.block_index(name)
        if index is None:
            known = ", ".join(b.name for b in linear.blocks[:12])
            raise ConfigError(f"split point {name!r} names no block; blocks are: {known}, ...")
        cuts.append(index)
    bounds = (0, *cuts, linear.num_blocks)
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(
            f"split_points {list(split_points)} give cut positions {cuts}: they must be in "
            f"model order, distinct, and not at the first block"
        )
    return bounds


def _with_costs(program, costs, chosen, inflight):
    from dataclasses import replace

    stages = []
    for s in program.stages:
        blocks = [costs.blocks[b] for b in s.blocks]
        cost = StageCost(
            num_blocks=len(blocks),
            params=sum(p.numel() for p in {id(p): p for p in s.module.parameters()}.values()),
            forward_flops=sum(b.forward_flops for b in blocks),
            forward_time=sum(b.forward_time for b in blocks),
            backward_time=sum(b.backward_time for b in blocks),
            memory=chosen.stage_memory[s.index],
            inflight=inflight[s.index],
            send_bytes=costs.cut_bytes[s.blocks[-1] + 1],
        )
        stages.append(replace(s, cost=cost))
    return replace(program, stages=tuple(stages))
