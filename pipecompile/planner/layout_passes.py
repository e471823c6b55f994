"""The search pass when the layout is searched (data_parallel="auto", or a cluster): every
layout of the devices (planner/layout.py) is searched with the schedule search over the
replica's slice of the global batch, its devices' links, the bytes its devices hold and its
collectives, and the fastest is kept (planner/layout_search.py). With `tensor_parallel="auto"`
the layouts include every T dividing the devices per node (under torchrun: its ranks per
node), each priced as one rank's share of the blocks (planner/tensor_costs.py); a given T is
the only one. With T > 1 each layout is priced with sequence parallelism as asked
(`sequence_parallel="auto"`: without and with).

    layout_search_pass(plan, example, profile) -> plan with choices (layout, P devices) and
                                                  search (the winner's candidates + layouts)
"""

from __future__ import annotations

from dataclasses import replace

from .resolved import Choices
from .block_tables import (BlockTables, coarsest, enough_blocks, given_vocabulary,
                           pipeline_loss_reads,
                           model_dtype)
from ..errors import ConfigError
from ..ir.records import CapturedModel, LinearGraph
from ..ir.records import Example
from ..passes.annotate import optimizer_state_factor
from ..passes.linearize import GRANULARITIES
from .plan import Plan
from ..ir.devices import DeviceSpec
from ..ir.formats import format_bytes, format_stages
from .schedule_search import FSDP_SCHEDULES, SYNC_SCHEDULES, BlockTable, Space, microbatch_choices
from .schedule_search import search as search_plans
from .layout import (Collectives, Layout, check_tensor_degree, layouts, pipeline_specs,
                     sequence_choices, tensor_degrees)
from .block_tables import tensor_share
from .tensor_costs import attention_heads, shard_costs, vocabulary_choices
from ..passes.tensor_rules import attention_heads_of
from ..ir.records import CostTable
from .layout_search import StateTooLarge, search_layouts
from .ranks_passes import searched_here
from ..runtime.distributed import ranks_per_node

__all__ = ["layout_search_pass"]


def layout_search_pass(plan: Plan, example: Example, profile: bool) -> tuple[Plan, str]:
    """Choose P x D, FSDP, placement and, per layout, the "auto" options (schedule_search.py)."""
    o, devices = plan.asked, plan.resolved.devices  # the search starts from what was asked
    captured, dtype = plan.ready.captured, model_dtype(plan)
    world = len(devices)
    tables = BlockTables(plan, example, plan.calibration)  # calibrated by the probe
    finest = coarsest(captured, o.granularity or GRANULARITIES[-1], 0, tables.levels)
    given_p = o.given_schedule.num_devices if o.given_schedule is not None else None
    fixed_d = None if "data_parallel" in o.auto else o.data_parallel
    degrees = _tensor_degrees(plan, world, tables, example)
    candidates = [lay for lay in layouts(
        world, batch=example.batch, max_pipeline=finest.num_blocks,
        fsdp=None if "fsdp" in o.auto else o.fsdp,
        nodes=o.cluster.nodes if o.cluster is not None else 1, pipeline=given_p,
        tensor=degrees, sequence=_sequence(plan))
        if fixed_d is None or lay.data_parallel == fixed_d]
    if not candidates:  # D given: it must divide the batch, P = world / D fit the blocks
        enough_blocks(finest, world // (fixed_d or 1), o.granularity)
        raise ConfigError(
            f"data_parallel={fixed_d} replicas cannot share the global batch of "
            f"{example.batch} samples; use a batch that is a multiple of {fixed_d}, or "
            f"data_parallel='auto'")
    # what one rank of T runs per (granularity, micro-batch size, T, sequence parallel), and
    # the bytes a device holds under FSDP per (that key, D): each priced once, since every
    # layout, schedule, micro-batch count and virtual stage count that shares the key prices
    # the same table (a pure function of the key: the captured costs, T's share and the
    # cluster's link)
    shared: dict[tuple[str, int, int, bool], CostTable] = {}
    priced: dict[tuple[str, int, int, bool], BlockTable] = {}
    sharded: dict[tuple[str, int, int, bool, int], BlockTable] = {}
    shapes = {n: tuple(p.shape) for n, p in captured.module.named_parameters(
        remove_duplicate=False)}
    optimizer_factor = optimizer_state_factor(o.optimizer, dtype)

    def costs_for(layout: Layout, m: int, stages: int) -> BlockTable | None:
        size = captured.microbatch_size(m * layout.data_parallel)
        found = tables.at(stages, size, m)
        if found is None:
            return None
        linear, costs = found
        key = (linear.granularity, size, layout.tensor_parallel, layout.sequence_parallel)
        if key not in shared:
            shared[key] = _rank_share(costs, layout, size)
            priced[key] = BlockTable.of(shared[key], linear)
        table = priced[key]
        if not layout.fsdp:
            return table
        held = (*key, layout.data_parallel)
        if held not in sharded:
            fsdp = BlockTable.of(shared[key], None, layout)
            sharded[held] = replace(table, static_bytes=fsdp.static_bytes)
        return sharded[held]

    def _rank_share(costs: CostTable, layout: Layout, size: int) -> CostTable:
        share = tensor_share(layout, o.cluster, devices[0])
        if share is None:
            return costs
        vocabulary = vocabulary_choices(
            captured.module, share, flops=plan.ready.device_model.flops,
            optimizer_factor=optimizer_factor,
            given=given_vocabulary(plan),
            loss_reads=pipeline_loss_reads(plan, example))
        return shard_costs(costs, share, shapes=shapes, rates=plan.ready.device_model.kernels,
                           batch_size=size, vocabulary=vocabulary)

    def run(layout: Layout, above: float):
        local = example.batch // layout.data_parallel
        specs = pipeline_specs(layout, o.cluster, devices)
        _check_state_fits(costs_for(layout, 1, layout.pipeline), layout, specs)
        space = Space(
            schedules=(FSDP_SCHEDULES if layout.fsdp else SYNC_SCHEDULES)
            if "schedule" in o.auto else (o.schedule,),
            microbatches=(_enough(microbatch_choices(local, cap=local), layout.pipeline)
                          if "microbatches" in o.auto and captured.dynamic_batch
                          else (o.microbatches,)),
            virtual_stages=None if "virtual_stages" in o.auto else (o.virtual_stages,),
            checkpoint=None if "checkpoint" in o.auto and not layout.fsdp
            else bool(o.checkpoint) and not layout.fsdp,
            interleave=_interleave(captured, o.granularity, layout.pipeline, tables.levels))
        return search_plans(space, specs, lambda m, s: costs_for(layout, m, s),
                            overhead=plan.overhead, split_ratio=plan.split_ratio,
                            efficiency=plan.efficiency, searched=tuple(sorted(o.auto)),
                            collectives=Collectives.of(layout, o.cluster, devices[0],
                                                        o.optimizer, dtype),
                            memo=memo, written=o.given_schedule, advise=False, above=above)

    memo: dict = {}  # the schedules built, shared by every layout's search

    def floor(layout: Layout) -> float:  # a replica's compute over its P devices, no bubble
        table = costs_for(layout, 1, layout.pipeline)
        if table is None:
            return 0.0
        work = sum(table.forward) + sum(table.backward_input) + sum(table.backward_weight)
        return work / layout.pipeline / max(d.speed for d in devices)

    found, tried = search_layouts(candidates, run, bound=floor, above=True)
    chosen = tried[0].layout
    best = found.best
    stages = chosen.pipeline * best.virtual_stages
    recompute = (tuple(best.recompute) if "checkpoint" in o.auto
                 else (bool(o.checkpoint) and not chosen.fsdp,) * stages)
    choices = Choices(best.schedule, best.microbatches, best.virtual_stages, recompute, profile,
                      layout=chosen, devices=pipeline_specs(chosen, o.cluster, devices))
    fits = sum(c.fits for c in tried)
    share = tensor_share(chosen, o.cluster, devices[0])
    vocabulary = "" if share is None else "".join(
        f"; vocabulary: {p}" for p in vocabulary_choices(
            captured.module, share, flops=plan.ready.device_model.flops,
            optimizer_factor=optimizer_factor, given=given_vocabulary(plan),
            loss_reads=pipeline_loss_reads(plan, example)).values())
    return replace(plan, choices=choices, search=replace(found, layouts=tried)), (
        f"layout {chosen}: {best.schedule}, {best.microbatches} micro-batches of "
        f"{example.batch // chosen.data_parallel // best.microbatches} per replica, "
        f"{best.virtual_stages} virtual stage(s), recompute stages "
        f"{format_stages(best.recomputed)}: predicted step {best.step * 1e3:.3f} ms "
        f"({len(tried)} layouts, {fits} fit){vocabulary}")


def _tensor_degrees(plan: Plan, world: int, tables: BlockTables, example: Example
                    ) -> tuple[int, ...]:
    """The tensor-parallel degrees to search: the one asked (it must divide the devices per
    node, the devices, the query and the key/value heads of every attention the capture
    shows: else a `ConfigError` naming both), or with "auto" every divisor of the devices per
    node that divides the heads (query and key/value)."""
    asked = plan.request.layout.tensor_parallel if plan.request is not None else 1
    cluster = plan.asked.cluster
    per_node = cluster.per_node if cluster is not None else (
        ranks_per_node(world) if searched_here(plan.asked) else world)
    given = None if asked == "auto" else int(asked)
    if given == 1:
        return (1,)
    size = plan.ready.captured.captured_batch_size
    found = tables.at(1, size, 1)
    heads = attention_heads(found[1], size) if found is not None else ()
    if given is not None:
        check_tensor_degree(given, per_node, world)
        bad = [h for h in heads if h % given]
        if bad:
            raise ConfigError(
                f"tensor_parallel={given} does not divide the {bad[0]} attention heads of the "
                f"model (each rank runs heads / T of them): use a divisor of {bad[0]}")
        _check_kv_heads(plan, given)
        return (given,)
    kv = [k for _, k in attention_heads_of(plan.ready.captured.module)]
    return tuple(t for t in tensor_degrees(per_node, None)
                 if all(h % t == 0 for h in (*heads, *kv)))


def _sequence(plan: Plan) -> tuple[bool, ...]:
    """The sequence-parallel settings to search: as asked, except that over this job's ranks
    "auto" is False (what runs under torchrun: sequence_parallel=True only when given)."""
    asked = plan.request.layout.sequence_parallel if plan.request is not None else False
    if asked == "auto" and searched_here(plan.asked):
        return (False,)
    return sequence_choices(asked)


def _check_kv_heads(plan: Plan, given: int) -> None:
    """A given T must divide the key/value heads of each GQA attention too (each rank runs
    1/T of them beside its queries): else a `ConfigError` naming both."""
    for q, kv in attention_heads_of(plan.ready.captured.module):
        if kv % given:
            divisors = [d for d in range(1, kv + 1) if kv % d == 0]
            raise ConfigError(
                f"tensor_parallel={given} does not divide the {kv} key/value heads of the "
                f"model's attention ({q} query heads share them, GQA): each rank runs heads / T "
                f"of them; use one of {divisors}")


def _check_state_fits(table: BlockTable | None, layout: Layout,
                      specs: tuple[DeviceSpec, ...]) -> None:
    """Refuse `layout` before searching it when the bytes held whatever the plan (parameters,
    gradients, optimizer state: `table`'s static bytes under the layout) spread evenly over
    its P devices already exceed the smallest device: no placement, schedule or recomputation
    fits then (`StateTooLarge`, its need a lower bound)."""
    if table is None:
        return
    floor = sum(table.static_bytes) / layout.pipeline
    limit = min(d.memory for d in specs)
    if floor > limit:
        raise StateTooLarge(
            f"{layout}: parameters, gradients and optimizer state alone need "
            f"{format_bytes(floor)} per device over {layout.pipeline} device(s) > limit "
            f"{format_bytes(limit)}", memory_needed=floor, devices_needed=None)


def _interleave(captured: CapturedModel, granularity: str | None, p: int,
                levels: dict[str, LinearGraph]) -> tuple[int, ...]:
    """The virtual stage counts an interleaved schedule may use on `p` devices: 2 up to one
    block per stage of the coarsest linearization with a block per device (Megatron-LM
    interleaves down to one layer per stage: the bubble (p-1)/(v m + p-1) shrinks with v)."""
    return tuple(range(2, coarsest(captured, granularity, p, levels).num_blocks // p + 1))


def _enough(choices: tuple[int, ...], stages: int) -> tuple[int, ...]:
    """The micro-batch counts worth searching for `stages` pipeline stages: those >= the stage
    count (fewer leave the bubble larger, (p-1)/(m+p-1), and hold at least as much memory: the
    same in-flight count of larger micro-batches), else the largest."""
    return tuple(m for m in choices if m >= stages) or choices[-1:]
