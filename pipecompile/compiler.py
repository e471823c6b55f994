"""`compile`: a list of passes over one frozen `Plan`, then a `Pipeline` that runs it.

    options   resolve_options: the keyword arguments checked once (options.py)
    capture   the model as a flat fx graph                              -> plan.captured
    search    the "auto" options: schedule, micro-batches, virtual stages,
              recomputation per stage, by predicted step time (search.py) -> plan.search
    schedule  the action lists per device and peak in-flight counts      -> plan.schedule
    linearize blocks in order, as coarse as still gives every stage one  -> plan.linear
    annotate  block costs (analytic, or measured with profile=True)      -> plan.costs
    partition the cuts (optimal DP, or split_points)                     -> plan.placement
    calibrate profile=True: stages timed as they run, costs corrected    -> plan.calibration
    refine    a finer granularity when layers cannot balance             -> plan.linear, ...
    split     one GraphModule per stage, with their costs                -> plan.program
    threads   profile=True: how much CPU device threads slow each other  -> plan.efficiency
    simulate  the predicted timeline                                     -> plan.predicted
    agree     under torch.distributed: every rank planned the same       (checked)
    shard     fsdp=True: this rank's stages fully_shard-ed over "dp"      -> plan.program

Each pass is `pass(plan, example) -> (plan, summary) | None` (plan.py); the decisions are the
pure functions of planning.py. `pipe.explain()` prints the pass records.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from .capture import capture as capture_model, seed_captured
from .deferred import Planner
from .errors import ConfigError, PartitionError
from .ir import CapturedModel, CostTable, LinearGraph
from .materialize import is_meta_model, on_meta
from .options import (CompileOptions, Example, check_async_ties, compute_dtype, device_present,
                      example_microbatch_size, resolve_options)
from .passes.annotate import optimizer_state_factor
from .passes.calibrate import calibrate_blocks, fit_calibration
from .passes.linearize import GRANULARITIES, linearize
from .passes.partition import DeviceSpec
from .passes.split import split
from .pipeline import Pipeline
from .plan import Pass, Plan, need, run_passes
from .planning import (Choice, CostModel, Target, action_cost, analytic as all_described, cost,
                       device_model, inflight, place, refine)
from .search import (FSDP_SCHEDULES, SPLIT_BACKWARD_RATIO, SYNC_SCHEDULES, BlockTable, Space,
                     microbatch_choices)
from .search import search as search_plans
from .report import describe_devices, format_count, format_stages
from .runtime.data_parallel import data_parallel_mesh, shard_stages
from .runtime.distributed import local_device
from .runtime.values import message_bytes
from .schedule.actions import Schedule
from .schedule.lowering import relower
from .schedule.messages import Dataflow, transfer_seconds
from .schedule.schedules import make_schedule
from .schedule.simulate import simulate
from .tensors import local_tensor
from .measure.probe import Probe, efficiency, measure, probe
from .measure.stages import loss_runs
from .stage_costs import shared_cores, simulator_costs, with_stage_costs

__all__ = ["compile", "PASSES"]


def compile(  # noqa: A001 - the public name of the design
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    devices: int | Sequence[str | torch.device | DeviceSpec] = 1,
    microbatches: int | str = "auto",
    schedule: str | Schedule = "auto",
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: Any = None,
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    split_points: Sequence[str] | None = None,
    capture: str = "export",
    symbolic_sizes: str = "all",
    granularity: str | None = None,
    virtual_stages: int | str | None = "auto",
    profile: bool = False,
    memory_limit: float | Sequence[float] | None = None,
    bandwidth: float | None = None,
    checkpoint: bool | str = "auto",
    vertical_sync: bool = False,
    data_parallel: int = 1,
    timeout: float = 300.0,
    verbose: bool = False,
    rng: str = "global",
    rng_seed: int = 0,
    compile_stages: bool = False,
    fsdp: bool = False,
    mesh: Any = None,
) -> Pipeline:
    """Compile `model` into a pipeline over `devices`.

    Without `example_inputs`/`example_kwargs` the pipeline plans lazily: its first
    `step(...)` or call captures and plans from those inputs, and a later call whose inputs the
    plan cannot run is planned again (see `deferred.py`). With them, it plans now.

    `devices` is a count (CUDA devices if present, else that many CPU workers), a list of
    device names, or a list of `DeviceSpec` (relative speed, memory) for heterogeneous devices.
    `memory_limit` (bytes, per device or one for all) caps each stage's predicted memory.
    `example_target` (the target of the example batch) lets `profile=True` time `loss_fn` too.
    `rng="per-microbatch"` draws every random op from a stream of (`rng_seed`, step,
    micro-batch, op); `verbose=True` shows torch's output while capturing; `compile_stages`
    runs each stage graph through `torch.compile`. `symbolic_sizes="all"` captures every size
    of a batched input symbolic where the model allows; `"batch"` the batch alone (faster
    torch.export on deep models, fixed-length training).

    `schedule`, `microbatches`, `virtual_stages` and `checkpoint` default to "auto": the search
    pass costs every combination (synchronous schedules, micro-batch counts dividing the batch,
    recomputation only on the stages whose memory needs it) and keeps the fastest predicted
    plan that fits; a value given explicitly is kept as given. `pipe.explain()` shows the
    candidates. A hand-written `schedule` (a `Schedule`, its text or CSV, or a .csv/.txt path)
    fixes devices, virtual stages and micro-batches (which must agree); it is validated now.

    Under torch.distributed (an initialised process group, or torchrun's environment) the same
    call runs on every rank: `devices` is the number of pipeline ranks and `data_parallel` the
    number of pipeline replicas; each rank keeps only its own stages. `fsdp=True` shards each
    stage over the replicas (`fully_shard`); `mesh` is a ("dp", "pp") DeviceMesh to use.
    """
    def plan_for(example: Example | None) -> Plan:
        options = resolve_options(
            example, devices=devices, microbatches=microbatches, schedule=schedule,
            virtual_stages=virtual_stages, memory_limit=memory_limit, bandwidth=bandwidth,
            data_parallel=data_parallel, timeout=timeout, split_points=split_points,
            loss_fn=loss_fn, optimizer=optimizer, capture=capture,
            symbolic_sizes=symbolic_sizes, granularity=granularity,
            profile=profile, checkpoint=checkpoint, vertical_sync=vertical_sync,
            verbose=verbose, rng=rng, rng_seed=rng_seed, compile_stages=compile_stages,
            fsdp=fsdp, mesh=mesh)
        return run_passes(Plan(options), PASSES, example) if example is not None else Plan(options)

    if not example_inputs and not example_kwargs:  # lazy: plans on the first call
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        plan_for(None)  # check the options now, not at the first step
        return Pipeline(planner=Planner(model, plan_for))
    return Pipeline(plan_for(Example(model, tuple(example_inputs), dict(example_kwargs or {}),
                                     example_target)), model=model)


# -- the passes ---------------------------------------------------------------------------------


def _capture(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.options
    meta = is_meta_model(example.model)
    args, kwargs = (on_meta((example.args, dict(example.kwargs))) if meta
                    else (example.args, dict(example.kwargs)))
    captured = capture_model(example.model, args, kwargs, method=o.capture,
                             static_batch_size=example_microbatch_size(example, o),
                             verbose=o.verbose, batch_only=o.symbolic_sizes == "batch")
    if o.rng == "per-microbatch":
        captured = seed_captured(captured, o.rng_seed)
    if meta:  # traced on meta inputs too (no op mixes devices); nothing can be timed
        note = ("model on the meta device: analytic costs only (no planning probe"
                + (", profile=True ignored" if o.profile else "") + ")")
        captured = replace(captured, notes=captured.notes + (note,))
        plan = replace(plan, options=replace(o, profile=False))
    return replace(plan, captured=captured), (
        f"{o.capture}: {len(captured.module.graph.nodes)} nodes, "
        f"{'dynamic' if captured.dynamic_batch else 'static'} batch"
        + "".join(f"\n{'':24}{note}" for note in captured.notes))


def _schedule(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.options
    schedule = make_schedule(o.given_schedule or o.schedule, len(o.devices), o.microbatches,
                             virtual_stages=o.virtual_stages)
    peaks = inflight(schedule)
    return replace(plan, schedule=schedule, inflight=peaks), (
        f"{o.schedule}: {sum(len(a) for a in schedule.actions)} actions on {len(o.devices)} "
        f"devices, peak in-flight micro-batches {list(peaks)}")


def _search(plan: Plan, example: Example) -> tuple[Plan, str]:
    """Choose the "auto" options by predicted step time (search.py); record the candidates."""
    o = plan.options
    captured = need(plan.captured, "capture")
    dtype = compute_dtype(example.model)
    plan = replace(plan, device_model=device_model(o.devices[0], o.ranks, dtype),
                   overhead=action_cost(o.devices[0], o.ranks))
    # every device described by its figures (hardware that need not be here): nothing measured
    described = f"; {describe_devices(o.devices, dtype)}" if all_described(o.devices) else ""
    if not o.auto:
        return plan, ("nothing searched: schedule, micro-batches, virtual stages and "
                      "checkpoint were given" + described)
    if o.given_schedule is not None:  # it fixes all but recomputation
        return _recompute_for(plan, example, o.given_schedule, described)
    fewest = len(o.devices) * (1 if "virtual_stages" in o.auto else o.virtual_stages)
    _enough_blocks(_coarsest(captured, o.granularity, fewest), fewest, o.granularity)
    linears: dict[int, LinearGraph | None] = {}
    tables: dict[tuple[str, int], CostTable] = {}
    analytic: dict[str, CostTable] = {}  # per granularity: symbolic costs to evaluate again

    def costs_for(m: int, stages: int) -> BlockTable | None:
        if stages not in linears:
            coarsest = _coarsest(captured, o.granularity, stages)
            linears[stages] = coarsest if coarsest.num_blocks >= stages else None
        linear = linears[stages]
        if linear is None:
            return None
        size = captured.microbatch_size(m)
        if (linear.granularity, size) not in tables:
            model = replace(_cost_model(plan, example), microbatch_size=size, microbatches=m)
            like = analytic.get(linear.granularity) or next(
                (t for (g, _), t in tables.items() if g == linear.granularity), None)
            tables[linear.granularity, size] = cost(linear, model, example, o.ranks, like)
        return BlockTable.of(tables[linear.granularity, size])

    choices = microbatch_choices(example.batch)
    # recomputation alone is chosen by memory (it only ever adds time): measured times could
    # not change the choice, so the probe's forward and backward passes are saved
    measured = None if o.auto <= {"checkpoint"} else _probe(plan, example, choices, analytic)
    if measured is not None:
        plan = replace(plan, efficiency=measured.efficiency, split_ratio=measured.split_ratio,
                       calibration=None if o.profile else measured.calibration)
    space = Space(
        schedules=(FSDP_SCHEDULES if o.fsdp else SYNC_SCHEDULES) if "schedule" in o.auto
        else (o.schedule,),
        microbatches=(choices if "microbatches" in o.auto and captured.dynamic_batch
                      else (o.microbatches,)),
        virtual_stages=(_split_point_stages(o) if "virtual_stages" in o.auto
                        else (o.virtual_stages,)),
        checkpoint=None if "checkpoint" in o.auto and not o.fsdp else bool(o.checkpoint))
    found = search_plans(space, o.devices, costs_for, overhead=plan.overhead,
                         split_ratio=plan.split_ratio or SPLIT_BACKWARD_RATIO,
                         cores=shared_cores(o.devices, o.ranks), efficiency=plan.efficiency,
                         searched=tuple(sorted(o.auto)))
    best = found.best
    options = replace(o, schedule=best.schedule, microbatches=best.microbatches,
                      virtual_stages=best.virtual_stages,
                      checkpoint=best.recompute if "checkpoint" in o.auto else o.checkpoint)
    fits = sum(c.fits for c in found.candidates)
    stages = len(o.devices) * best.virtual_stages  # the annotate pass reuses the winner's costs
    linear = linears[stages]
    plan = replace(plan, linear=linear, costs=tables[need(linear, "search").granularity,
                                                     captured.microbatch_size(best.microbatches)])
    return replace(plan, options=options, search=found), (
        f"{best.schedule}, {best.microbatches} micro-batches, {best.virtual_stages} virtual "
        f"stage(s), recompute stages {format_stages(best.recomputed)}: predicted step "
        f"{best.step * 1e3:.3f} ms ({len(found.candidates)} candidates, {fits} fit"
        + ("" if captured.dynamic_batch else "; static batch: micro-batches fixed") + ")"
        + ("" if measured is None else f"; measured: {measured}") + described)


def _recompute_for(plan: Plan, example: Example, given: Schedule, described: str
                   ) -> tuple[Plan, str]:
    """A written schedule, checkpoint="auto": recompute where memory needs it (as the search)."""
    o = plan.options
    schedule = make_schedule(given, len(o.devices), o.microbatches, virtual_stages=o.virtual_stages)
    linear = _coarsest(need(plan.captured, "capture"), o.granularity, o.num_stages)
    _enough_blocks(linear, o.num_stages, o.granularity)
    costs = cost(linear, _cost_model(plan, example), example, o.ranks)
    staged = replace(plan, schedule=schedule, inflight=inflight(schedule))  # for _target only
    target = replace(_target(staged), recompute=(False if o.fsdp else None,) * o.num_stages)
    recompute = place(linear, costs, target).recompute or (False,) * o.num_stages
    return replace(plan, linear=linear, costs=costs, options=replace(o, checkpoint=recompute)), (
        f"{o.schedule} given, recompute stages {[s for s, r in enumerate(recompute) if r]}"
        + described)


def _probe(plan: Plan, example: Example, choices: Sequence[int],
           analytic: dict[str, CostTable]) -> Probe | None:
    """What the analytic costs miss on this machine, measured on the model cut after its first
    block at about 4 micro-batches (`measure.probe.probe`); rank 0's numbers under
    torch.distributed. None for a model of one block, or for devices described by their
    figures (`planning.analytic`: they need not be here). The analytic cost table it compares
    with is kept in `analytic` for the search to evaluate at other sizes."""
    o = plan.options
    if all_described(o.devices):
        return None
    captured = need(plan.captured, "capture")
    linear = _coarsest(captured, o.granularity, 2)
    if linear.num_blocks < 2 or is_meta_model(example.model):  # no weights to run: analytic
        return None
    m = (min(choices, key=lambda c: (abs(c - 4), c)) if "microbatches" in o.auto
         else o.microbatches)
    model = replace(_cost_model(plan, example), profile=False, calibration=None,
                    microbatch_size=captured.microbatch_size(m), microbatches=m)
    if o.ranks.topology is not None and o.ranks.topology.rank != 0:
        return o.ranks.shared(None)  # rank 0 measures, the others wait for its numbers
    table = cost(linear, model, example, o.ranks, analytic.get(linear.granularity))
    analytic.setdefault(linear.granularity, table)
    device = local_device() if o.ranks.distributed else torch.device(o.devices[0].name)
    found = probe(linear, table, example, device,
                  microbatches=m, loss_fn=o.loss_fn, threads=len(o.devices),
                  cores=shared_cores(o.devices, o.ranks))
    return o.ranks.shared(found)


def _split_point_stages(o: CompileOptions) -> tuple[int, ...] | None:
    """With split_points the stage count is given: only the matching virtual stage count."""
    if o.split_points is None:
        return None
    return ((len(o.split_points) + 1) // len(o.devices),)


def _coarsest(captured: CapturedModel, granularity: str | None, stages: int) -> LinearGraph:
    """The coarsest linearization with a block for every stage (or the finest tried)."""
    for level in [granularity] if granularity else list(GRANULARITIES):
        linear = linearize(captured, granularity=level)
        if linear.num_blocks >= stages:
            break
    return linear


def _enough_blocks(linear: LinearGraph, stages: int, granularity: str | None) -> None:
    if linear.num_blocks < stages:
        raise PartitionError(
            f"the model has only {linear.num_blocks} blocks at granularity "
            f"{linear.granularity!r}, fewer than the {stages} stages asked for; use at "
            f"most {linear.num_blocks} devices"
            + ("" if granularity is None else " or a finer granularity"))


def _linearize(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.options
    linear = plan.linear or _coarsest(need(plan.captured, "capture"), o.granularity,
                                      o.num_stages)
    _enough_blocks(linear, o.num_stages, o.granularity)
    widest = max((len(b) for b in linear.boundaries), default=0)
    return replace(plan, linear=linear), (
        f"{linear.num_blocks} blocks ({linear.granularity}), max boundary {widest} values")


def _annotate(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.options
    costs = plan.costs or cost(need(plan.linear, "linearize"), _cost_model(plan, example),
                               example, o.ranks)
    total = sum(b.forward_flops for b in costs.blocks)
    return replace(plan, costs=costs), (
        f"{format_count(total)}FLOP forward per micro-batch of "
        f"{example_microbatch_size(example, o)}" + (" (measured times)" if o.profile else ""))


def _partition(plan: Plan, example: Example) -> tuple[Plan, str]:
    placement = place(need(plan.linear, "linearize"), need(plan.costs, "annotate"),
                      _target(plan))
    o = plan.options
    how = "split_points" if o.split_points is not None else "optimal DP"
    checkpoint = placement.recompute or tuple(o.stage_checkpoint(s) for s in range(o.num_stages))
    recomputed = [s for s, r in enumerate(checkpoint) if r]
    return replace(plan, placement=placement, options=replace(o, checkpoint=checkpoint)), (
        f"{how}: bounds {placement.bounds}, bottleneck {placement.bottleneck * 1e3:.3f} ms/mb"
        + (f", recompute stages {recomputed}" if recomputed else ""))


def _calibrate(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """Time the stages as the runtime runs them; re-place on the corrected costs."""
    o = plan.options
    if not o.profile:
        return None
    linear, estimated = need(plan.linear, "linearize"), need(plan.costs, "annotate")
    before = need(plan.placement, "partition").bounds
    program = split(linear, before, _stage_devices(plan, example), placed=example.placed)
    measured = measure(program, need(plan.schedule, "schedule"), example,
                       microbatches=o.microbatches, loss_fn=o.loss_fn, ranks=o.ranks)
    calibration = fit_calibration(estimated, before, measured,
                                  loss_timed=loss_runs(o.loss_fn, example.target))
    costs = calibrate_blocks(estimated, calibration)
    placement = place(linear, costs, _target(plan))
    kept = program if placement.bounds == before else None
    return replace(plan, calibration=calibration, costs=costs, placement=placement,
                   program=kept), (
        f"stages measured: {calibration}; bounds {before} -> {placement.bounds}, "
        f"bottleneck {placement.bottleneck * 1e3:.3f} ms/mb")


def _refine(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    o = plan.options
    if o.granularity is not None or o.split_points is not None:
        return None
    start = Choice(need(plan.linear, "linearize"), need(plan.costs, "annotate"),
                   need(plan.placement, "partition"))
    better = refine(need(plan.captured, "capture"), start, model=_cost_model(plan, example),
                    target=_target(plan), example=example, ranks=o.ranks)
    if better is None:
        return None
    linear, placement = better.linear, better.placement
    return replace(plan, linear=linear, costs=better.costs, placement=placement, program=None), (
        f"{start.linear.granularity} -> {linear.granularity} ({linear.num_blocks} blocks): "
        f"bottleneck {start.placement.bottleneck * 1e3:.3f} -> "
        f"{placement.bottleneck * 1e3:.3f} ms/mb, bounds {placement.bounds}")


def _split(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.options
    costs, placement = need(plan.costs, "annotate"), need(plan.placement, "partition")
    schedule = need(plan.schedule, "schedule")
    program = plan.program or split(need(plan.linear, "linearize"), placement.bounds,
                                    _stage_devices(plan, example), placed=example.placed)
    measured = (measure(program, schedule, example, microbatches=o.microbatches,
                        loss_fn=o.loss_fn, ranks=o.ranks) if o.profile else None)
    program = with_stage_costs(program, costs, placement, plan.inflight)
    if o.asynchronous:
        check_async_ties(program, o.schedule)
    specs = plan.stage_specs
    stage_costs = tuple(simulator_costs(s, costs, specs[s.index],
                                        measured[s.index] if measured else None,
                                        recompute=o.stage_checkpoint(s.index),
                                        split_ratio=plan.split_ratio or SPLIT_BACKWARD_RATIO)
                        for s in program.stages)
    # the schedule that runs moves the program's messages: relower it with the real wiring
    schedule = relower(schedule, Dataflow.of(program))
    transfers = transfer_seconds(message_bytes(program, example_microbatch_size(example, o)),
                                 lambda stage: specs[stage].bandwidth,
                                 lambda stage: specs[stage].latency)
    return replace(plan, program=program, measured=measured, stage_costs=stage_costs,
                   schedule=schedule, transfers=transfers), (
        f"{program.num_stages} stage graphs, {len(program.ties)} tied parameter groups")


def _shard(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """fsdp=True: this rank's stages fully_shard-ed over its data-parallel group."""
    o = plan.options
    if not o.fsdp or o.ranks.topology is None:
        return None
    topology = o.ranks.topology
    own = o.ranks.own_stages(need(plan.schedule, "schedule"))
    mesh = data_parallel_mesh(topology, local_device(), o.mesh)
    program = shard_stages(need(plan.program, "split"), own, mesh)
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
    value = efficiency(need(plan.program, "split"), need(plan.schedule, "schedule"), example,
                       microbatches=o.microbatches, cores=cores)
    return replace(plan, efficiency=value), (
        f"{len(o.devices)} device threads on {cores} cores run at {value:.2f} of their share")


def _simulate(plan: Plan, example: Example) -> tuple[Plan, str]:
    schedule = need(plan.schedule, "schedule")
    cores = shared_cores(plan.stage_specs, plan.options.ranks)
    predicted = simulate(schedule, plan.stage_costs, cores=cores, efficiency=plan.efficiency,
                         transfers=plan.transfers, overhead=plan.overhead)
    return replace(plan, cores=cores, predicted=predicted), (
        f"{schedule.name}: predicted step {predicted.makespan * 1e3:.3f} ms, bubble "
        f"{predicted.bubble_fraction:.1%}")


def _agree(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    summary = plan.options.ranks.check(need(plan.program, "split"),
                                       need(plan.schedule, "schedule"))
    return None if summary is None else (plan, summary)


PASSES: tuple[tuple[str, Pass], ...] = (
    ("capture", _capture), ("search", _search), ("schedule", _schedule), ("linearize", _linearize),
    ("annotate", _annotate), ("partition", _partition), ("calibrate", _calibrate),
    ("refine", _refine), ("split", _split), ("threads", _threads), ("simulate", _simulate),
    ("plan check", _agree), ("shard", _shard),
)


# -- what the passes derive from the plan -------------------------------------------------------


def _cost_model(plan: Plan, example: Example) -> CostModel:
    o = plan.options
    return CostModel(device=need(plan.device_model, "annotate"),
                     microbatch_size=example_microbatch_size(example, o),
                     microbatches=o.microbatches,
                     optimizer_factor=optimizer_state_factor(o.optimizer), profile=o.profile,
                     calibration=plan.calibration)


def _target(plan: Plan) -> Target:
    o = plan.options
    recompute = (None if o.checkpoint is False
                 else tuple(o.stage_checkpoint(s) for s in range(o.num_stages)))
    return Target(stage_specs=plan.stage_specs, inflight=plan.inflight, schedule=o.schedule,
                  microbatches=o.microbatches, virtual_stages=o.virtual_stages,
                  split_points=o.split_points, recompute=recompute)


def _stage_devices(plan: Plan, example: Example) -> list[torch.device]:
    """Each stage's device; under torch.distributed other ranks' stages stay where the model
    is (nothing is copied for them), and so do the stages of a device this machine lacks (a
    plan for hardware that is not here: printed and saved, not run)."""
    devices = [torch.device(s.name) if device_present(s.name) else example.device
               for s in plan.stage_specs]
    ranks = plan.options.ranks
    if not ranks.distributed:
        return devices
    own = set(ranks.own_stages(need(plan.schedule, "schedule")))
    return [d if i in own else example.device for i, d in enumerate(devices)]
