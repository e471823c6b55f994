"""`compile`: a list of passes over one frozen `Plan`, then a `Pipeline` that runs it.

    options   job_options: the keyword arguments checked once (planner/options.py, or
              planner/layout_options.py when the layout is searched) -> plan.asked
    join      the layout of torchrun's ranks searched: the process group joined, the
              link between ranks measured (planner/ranks_passes.py)  (updates asked)
    capture   the model as a flat fx graph                              -> plan.captured
    probe     this machine's rates, and the planning probe when a searched option
              depends on time (planner/shape_passes.py)                             -> plan.probe, ...
    search    the "auto" options: schedule, micro-batches, virtual stages,
              recomputation per stage, by predicted step time; measures
              nothing (planner/schedule_search.py, planner/shape_passes.py)                  -> plan.choices, plan.search
    ranks     the layout of torchrun's ranks searched: this process's place in the
              chosen P x D (planner/ranks_passes.py)                   (updates asked)
    schedule  the action lists per device and peak in-flight counts      -> plan.schedule
    linearize blocks in order, as coarse as still gives every stage one  -> plan.linear
    annotate  block costs (analytic, or measured with profile=True)      -> plan.costs
    partition the cuts (optimal DP, or split_points)                     -> plan.placement
    calibrate profile=True: stages timed as they run, costs corrected    (updates costs, ...)
    refine    a finer granularity when layers cannot balance             (updates linear, ...)
    split     one GraphModule per stage, with their costs                -> plan.program
    threads   profile=True: how much CPU device threads slow each other  (updates efficiency)
    simulate  the predicted timeline                                     -> plan.predicted
    agree     under torch.distributed: every rank planned the same       (checked)
    shard     fsdp=True: this rank's stages fully_shard-ed over "dp"      (updates program)

Each pass is a `Pass` (planner/plan.py) that declares the plan fields it requires, produces and
updates; `run_passes` checks them. The decisions are the pure functions of planner/decisions.py.
`pipe.explain()` prints the pass records. What compile measures or derives is kept in the
`CompileCache` it is given (`compile_cache.default_cache` unless told otherwise).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from .capture.capture import capture as capture_model, require_module, seed_captured
from .planner.block_tables import coarsest, cost_model, enough_blocks
from .planner.shape_passes import collectives, probe_pass, schedule_pass, search_pass, target
from .capture.claimed_device import claimable, claiming, restore_tensors
from .ir.compile_cache import CompileCache, default_cache
from .deferred import Planner
from .ir.records import CapturedModel
from .weights.materialize import is_meta_model, on_meta
from .ir.records import Example
from .planner.options import check_async_ties, device_present, example_microbatch_size
from .passes.calibrate import calibrate_blocks, fit_calibration
from .ir.devices import DeviceSpec
from .planner.layout_options import job_options
from .planner.ranks_passes import join_pass, ranks_pass
from .passes.split import split
from .pipeline import Pipeline
from .planner.plan import Pass, Plan, run_passes
from .planner.decisions import Choice, cost, place, refine
from .ir.formats import format_count
from .runtime.data_parallel import data_parallel_mesh, shard_stages
from .runtime.distributed import local_device
from .schedule.actions import Schedule
from .schedule.lowering import relower
from .schedule.messages import Dataflow
from .ir.tensors import local_tensor
from .measure.probe import efficiency, measure
from .measure.stages import loss_runs
from .planner.stage_costs import (
    BlockTable,
    message_costs,
    predict,
    shared_cores,
    simulator_costs,
    with_collectives,
    with_stage_costs,
)

__all__ = ["compile", "PASSES"]


def compile(  # noqa: A001 - the public name of the design
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    devices: int | Sequence[str | torch.device | DeviceSpec] | None = None,
    microbatches: int | str = "auto",
    schedule: str | Schedule = "auto",
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: Any = None,
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    split_points: Sequence[str] | None = None,
    capture: str = "export",
    symbolic_sizes: str = "all",
    capture_budget: float = 120.0,
    granularity: str | None = None,
    virtual_stages: int | str | None = "auto",
    profile: bool = False,
    memory_limit: float | Sequence[float] | None = None,
    bandwidth: float | None = None,
    checkpoint: bool | str = "auto",
    vertical_sync: bool = False,
    data_parallel: int | str | None = None,
    timeout: float = 300.0,
    verbose: bool = False,
    rng: str = "global",
    rng_seed: int = 0,
    compile_stages: bool = False,
    fsdp: bool | str = False,
    mesh: Any = None,
    cache: CompileCache | None = default_cache,
) -> Pipeline:
    """Compile `model` into a pipeline over `devices`.

    Without `example_inputs`/`example_kwargs` the pipeline plans lazily: its first
    `step(...)` or call captures and plans from those inputs, and a later call whose inputs the
    plan cannot run is planned again (see `deferred.py`). With them, it plans now.

    `devices` is a count (CUDA devices if present, else that many CPU workers; 1 when not
    given), a list of device names, or a list of `DeviceSpec` (relative speed, memory) for
    heterogeneous devices.
    `memory_limit` (bytes, per device or one for all) caps each stage's predicted memory.
    `example_target` (the target of the example batch) lets `profile=True` time `loss_fn` too.
    `rng="per-microbatch"` draws every random op from a stream of (`rng_seed`, step,
    micro-batch, op); `verbose=True` shows torch's output while capturing; `compile_stages`
    runs each stage graph through `torch.compile`. `symbolic_sizes="all"` captures every size
    of a batched input symbolic where the model allows; `"batch"` the batch alone (faster
    torch.export on deep models, fixed-length training). `capture_budget` is the seconds a
    torch.export attempt with symbolic sizes may take: past it capture tries fewer (batch only,
    then static), noted in `explain()`; a static attempt past ten budgets is a `CaptureError`.

    `schedule`, `microbatches`, `virtual_stages` and `checkpoint` default to "auto": the search
    pass costs every combination (synchronous schedules, micro-batch counts dividing the batch,
    recomputation only on the stages whose memory needs it) and keeps the fastest predicted
    plan that fits; a value given explicitly is kept as given. `pipe.explain()` shows the
    candidates. A hand-written `schedule` (a `Schedule`, its text or CSV, or a .csv/.txt path)
    fixes devices, virtual stages and micro-batches (which must agree); it is validated now.

    Under torch.distributed (an initialised process group, or torchrun's environment) the same
    call runs on every rank: `devices` is the number of pipeline ranks and `data_parallel` the
    number of pipeline replicas; each rank keeps only its own stages. `fsdp=True` shards each
    stage over the replicas (`fully_shard`); `mesh` is a ("dp", "pp") DeviceMesh to use. Each
    rank then passes its replica's batch. With `data_parallel="auto"`, or neither `devices`
    nor `data_parallel` given, the search chooses P x D = the ranks (and FSDP with
    `fsdp="auto"`; `devices=P` or a written schedule fixes P) by this machine's measured
    costs, and every rank passes the GLOBAL batch: replica r of D takes its rows
    [r B/D, (r+1) B/D), the loss returned is the global batch's.

    `cache` keeps what compiling measures or derives (this machine's rates, the planning probe,
    symbolic block costs), keyed by content: the process-wide `compile_cache.default_cache`
    unless another `CompileCache` is given (`.clear()` empties one); None caches nothing.
    """
    def plan_for(example: Example | None) -> Plan:
        options = job_options(
            example, devices=devices, microbatches=microbatches, schedule=schedule,
            virtual_stages=virtual_stages, memory_limit=memory_limit, bandwidth=bandwidth,
            data_parallel=data_parallel, timeout=timeout, split_points=split_points,
            loss_fn=loss_fn, optimizer=optimizer, capture=capture,
            symbolic_sizes=symbolic_sizes, capture_budget=capture_budget, granularity=granularity,
            profile=profile, checkpoint=checkpoint, vertical_sync=vertical_sync,
            verbose=verbose, rng=rng, rng_seed=rng_seed, compile_stages=compile_stages,
            fsdp=fsdp, mesh=mesh, cache=cache)
        return run_passes(Plan(options), PASSES, example) if example is not None else Plan(options)

    require_module(model)
    if not example_inputs and not example_kwargs:  # lazy: plans on the first call
        plan_for(None)  # check the options now, not at the first step
        return Pipeline(planner=Planner(model, plan_for))
    return Pipeline(plan_for(Example(model, tuple(example_inputs), dict(example_kwargs or {}),
                                     example_target)), model=model)


# -- the passes ---------------------------------------------------------------------------------


def _capture(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.asked
    meta = is_meta_model(example.model)
    inputs = (example.args, dict(example.kwargs))
    claim = claimable([d.name for d in o.devices]) if meta else None

    def capture(args: tuple, kwargs: dict) -> CapturedModel:
        return capture_model(example.model, args, kwargs, method=o.capture,
                             static_batch_size=example_microbatch_size(example, o),
                             verbose=o.verbose, batch_only=o.symbolic_sizes == "batch",
                             budget=o.capture_budget)

    if claim is not None:  # the model's code sees the device it will run on
        with claiming(example.model, inputs, claim) as ((args, kwargs), originals):
            captured = capture(args, kwargs)
        captured = restore_tensors(captured, example.model, originals, claim)
    else:  # real tensors, or a plan for devices this torch cannot fake: traced on meta
        captured = capture(*(on_meta(inputs) if meta else inputs))
    if o.rng == "per-microbatch":
        captured = seed_captured(captured, o.rng_seed)
    if meta:  # traced on meta inputs too (no op mixes devices); nothing can be timed
        note = ("model on the meta device: analytic costs only (no planning probe"
                + (", profile=True ignored" if o.profile else "") + ")")
        captured = replace(captured, notes=captured.notes + (note,))
    return replace(plan, captured=captured), (
        f"{o.capture}: {len(captured.module.graph.nodes)} nodes, "
        f"{'dynamic' if captured.dynamic_batch else 'static'} batch"
        + "".join(f"\n{'':24}{note}" for note in captured.notes))


def _linearize(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.options
    linear = coarsest(plan.ready.captured, o.granularity, o.num_stages)
    enough_blocks(linear, o.num_stages, o.granularity)
    widest = max((len(b) for b in linear.boundaries), default=0)
    return replace(plan, linear=linear), (
        f"{linear.num_blocks} blocks ({linear.granularity}), max boundary {widest} values")


def _annotate(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.options
    costs = cost(plan.ready.linear, cost_model(plan, example), example, o.ranks)
    total = sum(b.forward_flops for b in costs.blocks)
    return replace(plan, costs=costs), (
        f"{format_count(total)}FLOP forward per micro-batch of "
        f"{example_microbatch_size(example, o)}" + (" (measured times)" if o.profile else ""))


def _partition(plan: Plan, example: Example) -> tuple[Plan, str]:
    placement = place(plan.ready.linear, plan.ready.costs, target(plan))
    how = "split_points" if plan.options.split_points is not None else "optimal DP"
    recomputed = [s for s, r in enumerate(plan.ready.choices.checkpoint) if r]
    return replace(plan, placement=placement), (
        f"{how}: bounds {placement.bounds}, bottleneck {placement.bottleneck * 1e3:.3f} ms/mb"
        + (f", recompute stages {recomputed}" if recomputed else ""))


def _calibrate(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """Time the stages as the runtime runs them; re-place on the corrected costs."""
    o = plan.options
    if not o.profile:
        return None
    linear, estimated = plan.ready.linear, plan.ready.costs
    before = plan.ready.placement.bounds
    program = split(linear, before, _stage_devices(plan, example), placed=example.placed)
    measured = measure(program, plan.ready.schedule, example,
                       microbatches=o.microbatches, loss_fn=o.loss_fn, ranks=o.ranks)
    calibration = fit_calibration(estimated, before, measured,
                                  loss_timed=loss_runs(o.loss_fn, example.target))
    costs = calibrate_blocks(estimated, calibration)
    placement = place(linear, costs, target(plan))
    return replace(plan, calibration=calibration, costs=costs, placement=placement), (
        f"stages measured: {calibration}; bounds {before} -> {placement.bounds}, "
        f"bottleneck {placement.bottleneck * 1e3:.3f} ms/mb")


def _refine(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    o = plan.options
    if o.granularity is not None or o.split_points is not None:
        return None
    start = Choice(plan.ready.linear, plan.ready.costs, plan.ready.placement)
    better = refine(plan.ready.captured, start, model=cost_model(plan, example),
                    target=target(plan), example=example, ranks=o.ranks)
    if better is None:
        return None
    linear, placement = better.linear, better.placement
    return replace(plan, linear=linear, costs=better.costs, placement=placement), (
        f"{start.linear.granularity} -> {linear.granularity} ({linear.num_blocks} blocks): "
        f"bottleneck {start.placement.bottleneck * 1e3:.3f} -> "
        f"{placement.bottleneck * 1e3:.3f} ms/mb, bounds {placement.bounds}")


def _split(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.options
    costs, placement, schedule = plan.ready.costs, plan.ready.placement, plan.ready.schedule
    program = split(plan.ready.linear, placement.bounds, _stage_devices(plan, example),
                    placed=example.placed)
    measured = (measure(program, schedule, example, microbatches=o.microbatches,
                        loss_fn=o.loss_fn, ranks=o.ranks) if o.profile else None)
    specs = plan.stage_specs
    table = BlockTable.of(costs, plan.ready.linear)  # priced as the search priced it
    stage_costs = simulator_costs(table, placement.bounds, specs,
                                  recompute=[o.stage_checkpoint(s) for s in range(len(specs))],
                                  split_ratio=plan.split_ratio, measured=measured)
    stage_costs = with_collectives(  # the layout's collectives, as the search priced them
        stage_costs, table, placement.bounds, collectives(plan),
        recompute=[o.stage_checkpoint(s) for s in range(len(specs))], split=o.split_backward)
    program = with_stage_costs(program, costs, placement, plan.inflight, stage_costs)
    if o.asynchronous:
        check_async_ties(program, o.schedule)
    # the schedule that runs moves the program's messages: relower it with the real wiring
    schedule = relower(schedule, Dataflow.of(program))
    transfers = message_costs(table, placement.bounds, specs)
    return replace(plan, program=program, measured=measured, stage_costs=stage_costs,
                   schedule=schedule, transfers=transfers), (
        f"{program.num_stages} stage graphs, {len(program.ties)} tied parameter groups")


def _shard(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """fsdp=True: this rank's stages fully_shard-ed over its data-parallel group."""
    o = plan.options
    if not o.fsdp or o.ranks.topology is None:
        return None
    topology = o.ranks.topology
    own = o.ranks.own_stages(plan.ready.schedule)
    mesh = data_parallel_mesh(topology, local_device(), o.mesh)
    program = shard_stages(plan.ready.program, own, mesh)
    local = sum(local_tensor(p).numel() for s in own for p in program.stages[s].module.parameters())
    return replace(plan, program=program), (
        f"stages {list(own)} fully_shard-ed over {topology.data_parallel} data-parallel ranks "
        f"(mesh dp x pp = {topology.data_parallel} x {topology.pipeline_size}): "
        f"{local:,} parameter elements held here")


def _threads(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """CPU device threads of one process share the cores: measure how much they slow down."""
    o = plan.options
    cores = shared_cores(plan.stage_specs, o.ranks)
    if not o.profile or cores is None or len(o.devices) < 2:
        return None
    value = efficiency(plan.ready.program, plan.ready.schedule, example,
                       microbatches=o.microbatches, cores=cores)
    return replace(plan, efficiency=value), (
        f"{len(o.devices)} device threads on {cores} cores run at {value:.2f} of their share")


def _simulate(plan: Plan, example: Example) -> tuple[Plan, str]:
    schedule = plan.ready.schedule
    plan = replace(plan, cores=shared_cores(plan.stage_specs, plan.options.ranks))
    predicted = predict(schedule, plan)
    return replace(plan, predicted=predicted), (
        f"{schedule.name}: predicted step {predicted.makespan * 1e3:.3f} ms, bubble "
        f"{predicted.bubble_fraction:.1%}")


def _agree(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    summary = plan.options.ranks.check(plan.ready.program, plan.ready.schedule)
    return None if summary is None else (plan, summary)


_MEASURED = ("probe", "device_model", "overhead", "calibration", "efficiency", "split_ratio")
_PLACED = ("linear", "costs", "placement", "schedule", "inflight", "choices")

PASSES: tuple[Pass, ...] = (
    Pass("join", join_pass, updates=("asked",)),
    Pass("capture", _capture, produces=("captured",)),
    Pass("probe", probe_pass, requires=("captured",), produces=_MEASURED),
    Pass("search", search_pass, requires=("captured", *_MEASURED), produces=("choices", "search")),
    Pass("ranks", ranks_pass, requires=("choices",), updates=("asked",)),
    Pass("schedule", schedule_pass, requires=("choices",), produces=("schedule", "inflight")),
    Pass("linearize", _linearize, requires=("captured", "choices"), produces=("linear",)),
    Pass("annotate", _annotate, requires=("linear", "choices", "device_model", "calibration"),
         produces=("costs",)),
    Pass("partition", _partition, requires=("linear", "costs", "schedule", "inflight", "choices"),
         produces=("placement",)),
    Pass("calibrate", _calibrate, requires=_PLACED, updates=("calibration", "costs", "placement")),
    Pass("refine", _refine, requires=(*_PLACED, "captured", "device_model", "calibration"),
         updates=("linear", "costs", "placement")),
    Pass("split", _split, requires=(*_PLACED, "split_ratio"), updates=("schedule",),
         produces=("program", "measured", "stage_costs", "transfers")),
    Pass("threads", _threads, requires=("program", "schedule", "choices"),
         updates=("efficiency",)),
    Pass("simulate", _simulate, requires=("schedule", "stage_costs", "transfers", "overhead",
                                          "efficiency", "choices"),
         produces=("cores", "predicted")),
    Pass("plan check", _agree, requires=("program", "schedule", "choices")),
    Pass("shard", _shard, requires=("program", "schedule", "choices"), updates=("program",)),
)


# -- what the passes derive from the plan -------------------------------------------------------


def _stage_devices(plan: Plan, example: Example) -> list[torch.device]:
    """Each stage's device; under torch.distributed other ranks' stages stay where the model
    is (nothing is copied for them), and so do the stages of a device this machine lacks (a
    plan for hardware that is not here: printed and saved, not run)."""
    devices = [torch.device(s.name) if device_present(s.name) else example.device
               for s in plan.stage_specs]
    ranks = plan.options.ranks
    if not ranks.distributed:
        return devices
    own = set(ranks.own_stages(plan.ready.schedule))
    return [d if i in own else example.device for i, d in enumerate(devices)]
