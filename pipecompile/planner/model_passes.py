"""The passes that take the model from a graph to a costed, split program, and what follows.

    capture   the model as a flat fx graph                              -> plan.captured
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
    tensor    tensor_parallel=T: each of this rank's stages split over its T ranks
              (passes/tensor_shard.py chooses and lowers, runtime/tensor_parallel.py
              holds the DTensor parameters); with fsdp=True then fully_shard-ed over
              "dp" of the same (dp, pp, tp) mesh                          (updates program)

Each is `run(plan, example) -> (plan, summary) | None`; the order and contracts are the recipe's
(planner/recipe.py). The mechanisms are those of capture/, passes/, measure/ and runtime/; the
decisions those of decisions.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from ..capture.capture import capture as capture_model, seed_captured
from ..capture.claimed_device import claimable
from ..ir.compile_cache import CompileCache
from ..ir.formats import format_count
from ..ir.records import CapturedModel, Example
from ..ir.shard_plan import VocabularyLayer
from ..ir.tensors import local_tensor
from ..measure.probe import efficiency, measure
from ..measure.stages import loss_runs
from ..passes.calibrate import calibrate_blocks, fit_calibration
from ..passes.split import split
from ..runtime.data_parallel import data_parallel_mesh, shard_stages
from ..runtime.distributed import local_device
from ..schedule.lowering import relower
from ..schedule.messages import Dataflow
from ..weights.materialize import is_meta_model, on_meta
from .block_tables import coarsest, cost_model, enough_blocks, pipeline_loss_reads
from .decisions import Choice, cost, place, refine
from .options import check_async_ties, device_present
from .resolved import example_microbatch_size
from .plan import Plan
from .shape_passes import collectives, target
from .stage_costs import (
    BlockTable,
    message_costs,
    predict,
    shared_cores,
    simulator_costs,
    with_collectives,
    with_stage_costs,
)

if TYPE_CHECKING:
    from ..ir.records import StagedProgram
    from ..ir.shard_plan import ShardPlan
    from ..passes.tensor_shard import Vocabulary

__all__ = ["capture_pass", "linearize_pass", "annotate_pass", "partition_pass", "calibrate_pass",
           "refine_pass", "split_pass", "threads_pass", "simulate_pass", "agree_pass",
           "shard_pass", "tensor_pass", "tensor_plans", "lower_tensor_stages"]


def _first_sizes(symbolic_sizes: str, example: Example) -> str:
    """The sizes capture's first attempt makes symbolic: "all" or "batch"."""
    grow = symbolic_sizes == "auto" and example.all_sizes
    return "all" if symbolic_sizes == "all" or grow else "batch"


def capture_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    o, asked = plan.resolved, plan.asked
    meta = is_meta_model(example.model)
    inputs = (example.args, dict(example.kwargs))
    claim = claimable([d.name for d in o.devices]) if meta else None

    def capture(args: tuple, kwargs: dict, cache: CompileCache | None = None) -> CapturedModel:
        return capture_model(example.model, args, kwargs, method=asked.capture, cache=cache,
                             static_batch_size=example_microbatch_size(example, asked, o),
                             verbose=asked.verbose,
                             sizes=_first_sizes(asked.symbolic_sizes, example),
                             budget=asked.capture_budget, claim=claim)

    if meta and claim is None:  # a plan for devices this torch cannot fake: traced on meta
        captured = capture(*on_meta(inputs))
    else:  # a meta model's code sees the device it will run on (claimed); a kept capture of
        # an identical model may be reused (capture/reuse.py)
        captured = capture(*inputs, cache=asked.cache)
    if asked.rng == "per-microbatch":
        captured = seed_captured(captured, asked.rng_seed)
    if meta:  # traced on meta inputs too (no op mixes devices); nothing can be timed
        note = ("model on the meta device: analytic costs only (no planning probe"
                + (", profile=True ignored" if o.profile else "") + ")")
        captured = replace(captured, notes=captured.notes + (note,))
    return replace(plan, captured=captured), (
        f"{asked.capture}: {len(captured.module.graph.nodes)} nodes, "
        f"{'dynamic' if captured.dynamic_batch else 'static'} batch"
        + "".join(f"\n{'':24}{note}" for note in captured.notes))


def linearize_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    o, granularity = plan.resolved, plan.asked.granularity
    linear = coarsest(plan.ready.captured, granularity, o.num_stages)
    enough_blocks(linear, o.num_stages, granularity)
    widest = max((len(b) for b in linear.boundaries), default=0)
    return replace(plan, linear=linear), (
        f"{linear.num_blocks} blocks ({linear.granularity}), max boundary {widest} values")


def annotate_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.resolved
    costs = cost(plan.ready.linear, cost_model(plan, example), example, o.ranks)
    total = sum(b.forward_flops for b in costs.blocks)
    return replace(plan, costs=costs), (
        f"{format_count(total)}FLOP forward per micro-batch of "
        f"{example_microbatch_size(example, plan.asked, o)}" + (" (measured times)" if o.profile else ""))


def partition_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    placement = place(plan.ready.linear, plan.ready.costs, target(plan))
    how = "split_points" if plan.asked.split_points is not None else "optimal DP"
    recomputed = [s for s, r in enumerate(plan.ready.choices.checkpoint) if r]
    return replace(plan, placement=placement), (
        f"{how}: bounds {placement.bounds}, bottleneck {placement.bottleneck * 1e3:.3f} ms/mb"
        + (f", recompute stages {recomputed}" if recomputed else ""))


def calibrate_pass(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """Time the stages as the runtime runs them; re-place on the corrected costs."""
    o = plan.resolved
    if not o.profile:
        return None
    linear, estimated = plan.ready.linear, plan.ready.costs
    before = plan.ready.placement.bounds
    program = split(linear, before, _stage_devices(plan, example), placed=example.placed)
    measured = measure(program, plan.ready.schedule, example,
                       microbatches=o.microbatches, loss_fn=plan.asked.loss_fn, ranks=o.ranks)
    calibration = fit_calibration(estimated, before, measured,
                                  loss_timed=loss_runs(plan.asked.loss_fn, example.target))
    costs = calibrate_blocks(estimated, calibration)
    placement = place(linear, costs, target(plan))
    return replace(plan, calibration=calibration, costs=costs, placement=placement), (
        f"stages measured: {calibration}; bounds {before} -> {placement.bounds}, "
        f"bottleneck {placement.bottleneck * 1e3:.3f} ms/mb")


def refine_pass(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    o, asked = plan.resolved, plan.asked
    if asked.granularity is not None or asked.split_points is not None:
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


def split_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    o = plan.resolved
    costs, placement, schedule = plan.ready.costs, plan.ready.placement, plan.ready.schedule
    program = split(plan.ready.linear, placement.bounds, _stage_devices(plan, example),
                    placed=example.placed)
    measured = (measure(program, schedule, example, microbatches=o.microbatches,
                        loss_fn=plan.asked.loss_fn, ranks=o.ranks) if o.profile else None)
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


def shard_pass(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """fsdp=True: this rank's stages fully_shard-ed over its data-parallel group (with
    tensor_parallel=T the "tensor" pass shards them, after lowering: FSDP2 over the TP
    DTensors)."""
    o = plan.resolved
    if not o.fsdp or o.ranks.topology is None or o.tensor_parallel > 1:
        return None
    topology = o.ranks.topology
    own = o.ranks.own_stages(plan.ready.schedule)
    mesh = data_parallel_mesh(topology, local_device(), plan.asked.mesh)
    program = shard_stages(plan.ready.program, own, mesh)
    local = sum(local_tensor(p).numel() for s in own for p in program.stages[s].module.parameters())
    return replace(plan, program=program), (
        f"stages {list(own)} fully_shard-ed over {topology.data_parallel} data-parallel ranks "
        f"(mesh dp x pp = {topology.data_parallel} x {topology.pipeline_size}): "
        f"{local:,} parameter elements held here")


def tensor_plans(program: "StagedProgram", stages: "Sequence[int]", degree: int,
                 vocabulary: "Vocabulary | None" = None,
                 loss_reads: "Mapping[int, str] | None" = None) -> "dict[int, ShardPlan]":
    """What the tensor-shard pass chooses for each of `stages` of the unsharded `program` at
    `degree` (a pure function of the stage graphs and the priced `vocabulary` choices: every
    rank, and a saved plan, agree); `loss_reads`: how the loss reads the last stage's
    outputs (the price of its output layer's split: planner/logits_loss.py)."""
    from ..passes.tensor_shard import choose
    from ..schedule.messages import gradient_values

    # a parameter whose copies live on several stages stays whole (one stage's own tie, as
    # GPT-2's wte/lm_head on one stage, is one table to the pass: split alike or not at all)
    tied = frozenset(n for tie in program.ties if len({s for s, _ in tie.copies}) > 1
                     for n in (*tie.names, *(name for _, name in tie.copies)))
    needs_grad = gradient_values(program)
    return {s: choose(program.stages[s].module, degree, exclude=tied,
                      constant_inputs=frozenset(n for n in program.stages[s].inputs
                                                if n not in needs_grad),
                      vocabulary=vocabulary,
                      loss_reads=loss_reads if s == program.num_stages - 1 else None)
            for s in stages}


def tensor_pass(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """tensor_parallel=T: this rank's stages lowered to their local shards (one all-reduce
    per column/row pair; with sequence_parallel=True a reduce-scatter and an all-gather, the
    tokens between them split), parameters DTensors over the "tp" mesh dimension."""
    o = plan.resolved
    if o.tensor_parallel == 1 or o.ranks.topology is None:
        return None
    own = o.ranks.own_stages(plan.ready.schedule)
    return lower_tensor_stages(plan, tensor_plans(plan.ready.program, own, o.tensor_parallel,
                                                  _vocabulary(plan, example),
                                                  pipeline_loss_reads(plan, example)))


def lower_tensor_stages(plan: Plan, plans: "Mapping[int, ShardPlan]") -> tuple[Plan, str]:
    """The tensor pass for the given `plans` of this rank's stages (chosen now, or read from a
    saved pipeline): the program lowered, the unsharded one kept as `plan.unsharded` (what
    `pipe.save` writes)."""
    from ..runtime.tensor_parallel import (fsdp_placement, shard_stage_tensors,
                                           tensor_parallel_mesh)
    from ..passes.tensor_shard import lower
    from ..passes.vocab_loss import lower_loss

    o = plan.resolved
    topology = o.ranks.topology
    assert topology is not None, "tensor parallelism runs under torch.distributed"
    unsharded = plan.ready.program
    own = o.ranks.own_stages(plan.ready.schedule)
    # fsdp=True: one (dp, pp, tp) mesh, FSDP2 shards the "tp" DTensors over its "dp" (as
    # torchtitan's 2-D parallelism: both dimensions must share their root mesh)
    root = data_parallel_mesh(topology, local_device(), plan.asked.mesh) if o.fsdp else None
    mesh = root["tp"] if root is not None else tensor_parallel_mesh(topology, local_device())
    replicas = topology.data_parallel if o.fsdp else 1
    program = shard_stage_tensors(unsharded, own, plans, mesh, lower,
                                  sequence=o.sequence_parallel, replicas=replicas,
                                  lower_loss=lower_loss)
    notes = "; ".join(f"stage {s}: {p.summary()}" for s, p in plans.items())
    if root is not None:
        program = shard_stages(program, own, root, fsdp_placement(replicas))
        local = sum(local_tensor(p).numel() for s in own
                    for p in program.stages[s].module.parameters())
        notes += (f"; fully_shard-ed over {topology.data_parallel} data-parallel ranks (mesh "
                  f"dp x pp x tp = {topology.data_parallel} x {topology.pipeline_size} x "
                  f"{o.tensor_parallel}): {local:,} parameter elements held here")
    if o.sequence_parallel:
        notes += ("; sequence parallel: the tokens between each row and the next column split "
                  f"over the {o.tensor_parallel} ranks (reduce-scatter / all-gather), pipeline "
                  "messages whole")
    if not any(p.params for p in plans.values()):
        notes += (f" -- nothing worth sharding: every rank of a tensor-parallel group computes "
                  f"the whole stage (use tensor_parallel=1)")
    return replace(plan, program=program, unsharded=unsharded), (
        f"rank {topology.rank} is {topology.tp_index} of {o.tensor_parallel} tensor-parallel "
        f"ranks; {notes}")


def _vocabulary(plan: Plan, example: Example) -> "Vocabulary":
    """The tensor pass's choice for each vocabulary table: priced by planner/tensor_costs.py
    over the link between the group's ranks (compile's vocab_parallel=True/False: as given)."""
    from .cluster import Link
    from .tensor_costs import TensorShare, vocabulary_price

    o = plan.resolved
    model = cost_model(plan, example)
    device = o.devices[0]
    share = model.tensor or TensorShare(o.tensor_parallel,
                                        Link("link", device.bandwidth, device.latency),
                                        o.sequence_parallel, device.memory)

    def choice(layer: VocabularyLayer) -> tuple[bool, str]:
        price = vocabulary_price(layer, share, flops=model.device.flops,
                                 optimizer_factor=model.optimizer_factor,
                                 given=model.vocabulary)
        return price.chosen, str(price)

    return choice


def threads_pass(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    """CPU device threads of one process share the cores: measure how much they slow down."""
    o = plan.resolved
    cores = shared_cores(plan.stage_specs, o.ranks)
    if not o.profile or cores is None or len(o.devices) < 2:
        return None
    value = efficiency(plan.ready.program, plan.ready.schedule, example,
                       microbatches=o.microbatches, cores=cores)
    return replace(plan, efficiency=value), (
        f"{len(o.devices)} device threads on {cores} cores run at {value:.2f} of their share")


def simulate_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    schedule = plan.ready.schedule
    plan = replace(plan, cores=shared_cores(plan.stage_specs, plan.resolved.ranks))
    predicted = predict(schedule, plan)
    return replace(plan, predicted=predicted), (
        f"{schedule.name}: predicted step {predicted.makespan * 1e3:.3f} ms, bubble "
        f"{predicted.bubble_fraction:.1%}")


def agree_pass(plan: Plan, example: Example) -> tuple[Plan, str] | None:
    summary = plan.resolved.ranks.check(plan.ready.program, plan.ready.schedule)
    return None if summary is None else (plan, summary)


def _stage_devices(plan: Plan, example: Example) -> list[torch.device]:
    """Each stage's device; under torch.distributed other ranks' stages stay where the model
    is (nothing is copied for them), and so do the stages of a device this machine lacks (a
    plan for hardware that is not here: printed and saved, not run)."""
    devices = [torch.device(s.name) if device_present(s.name) else example.device
               for s in plan.stage_specs]
    ranks = plan.resolved.ranks
    if not ranks.distributed:
        return devices
    own = set(ranks.own_stages(plan.ready.schedule))
    return [d if i in own else example.device for i, d in enumerate(devices)]
