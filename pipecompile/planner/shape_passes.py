"""The passes that choose the plan's shape before the model is cut, and what the later passes
derive from the plan.

    probe     this machine measured: the matmul rate, the cost of one action and, when a
              searched option depends on time, the planning probe  -> plan.probe, device_model,
                                                                     overhead, calibration, ...
    search    the "auto" options by predicted step time (schedule_search.py), over the analytic costs
              and the probe's numbers; measures nothing                   -> plan.choices
    schedule  the action lists per device and peak in-flight counts      -> plan.schedule

`cost_model`, `target`, `coarsest` and `enough_blocks` are shared with the passes of
compiler.py: how blocks are costed and placed for this plan.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .block_tables import BlockTables, coarsest, cost_model, enough_blocks, model_dtype
from .resolved import Choices, resolve
from ..weights.materialize import is_meta_model
from ..measure.probe import Probe, probe
from .options import CompileOptions, compute_dtype
from ..ir.records import Example
from .plan import Plan
from .layout import Collectives, Layout
from .decisions import (
    Target,
    action_cost,
    analytic as all_described,
    cost,
    device_model,
    inflight,
    place,
)
from .hardware import describe_devices
from ..ir.formats import format_count, format_stages
from ..runtime.distributed import local_device
from ..schedule.actions import Schedule
from ..schedule.schedules import make_schedule
from .schedule_search import FSDP_SCHEDULES, SYNC_SCHEDULES, BlockTable, Space, microbatch_choices
from .schedule_search import search as search_plans
from .stage_costs import placement_ratio, shared_cores

__all__ = ["probe_pass", "search_pass", "schedule_pass", "cost_model", "target", "coarsest",
           "enough_blocks", "collectives"]


def probe_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    """Measure what the search needs of this machine (`measure.rates`, `measure.probe`):
    nothing for devices described by their figures."""
    o, cache = plan.resolved, plan.asked.cache
    dtype = compute_dtype(example.model)
    model = device_model(o.devices[0], o.ranks, dtype, cache=cache)
    overhead = action_cost(o.devices[0], o.ranks, cache=cache)
    plan = replace(plan, device_model=model, overhead=overhead)
    rates = (describe_devices(o.devices, dtype) if all_described(o.devices) else
             f"matmul {format_count(model.flops)}FLOP/s, {overhead * 1e6:.0f} us per action")
    found, skipped = _probe(plan, example)
    if found is None:
        return plan, f"{rates}; no planning probe: {skipped}"
    # profile=True measures the blocks themselves: no calibration of analytic ones then
    return replace(plan, probe=found, efficiency=found.efficiency, split_ratio=found.split_ratio,
                   calibration=None if o.profile else found.calibration), (
        f"{rates}; measured: {found}")


def _probe(plan: Plan, example: Example) -> tuple[Probe | None, str]:
    """What the analytic costs miss on this machine, measured on the model cut after its first
    block at about 4 micro-batches (`measure.probe.probe`); rank 0's numbers under
    torch.distributed. None, and why, where nothing searched depends on time, for devices
    described by their figures (they need not be here), a meta model or one of one block."""
    o, asked = plan.resolved, plan.asked
    # recomputation alone is chosen by memory (it only ever adds time): measured times could
    # not change the choice, so the probe's forward and backward passes are saved
    if asked.auto <= {"checkpoint"}:
        return None, "no searched option depends on time"
    if all_described(o.devices):
        return None, "devices described by their figures"
    if is_meta_model(example.model):  # no weights to run: analytic
        return None, "model on the meta device"
    captured = plan.ready.captured
    linear = coarsest(captured, asked.granularity, 2)
    if linear.num_blocks < 2:
        return None, "the model is one block"
    m = (min(microbatch_choices(example.batch), key=lambda c: (abs(c - 4), c))
         if "microbatches" in asked.auto else o.microbatches)
    if o.ranks.topology is not None and o.ranks.topology.rank != 0:
        return o.ranks.shared(None), ""  # rank 0 measures, the others wait for its numbers
    model = replace(cost_model(plan, example), profile=False, calibration=None,
                    microbatch_size=captured.microbatch_size(m), microbatches=m)
    table = cost(linear, model, example, o.ranks)
    device = local_device() if o.ranks.distributed else torch.device(o.devices[0].name)
    found = probe(linear, table, example, device, microbatches=m,
                  loss_fn=asked.loss_fn, threads=len(o.devices),
                  cores=shared_cores(o.devices, o.ranks), cache=asked.cache)
    return o.ranks.shared(found), ""


def search_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    """The "auto" options chosen (`_search`), and what is resolved with them (resolved.py):
    `plan.choices` and `plan.resolved`."""
    searched, summary = _search(plan, example)
    choices = searched.ready.choices
    return replace(searched, resolved=resolve(plan.resolved, choices)), summary


def _search(plan: Plan, example: Example) -> tuple[Plan, str]:
    """Choose the "auto" options by predicted step time (schedule_search.py), over the analytic costs
    calibrated by the probe; record the candidates. Given options are kept as given."""
    o, asked = plan.resolved, plan.asked
    captured = plan.ready.captured
    profile = o.profile and not is_meta_model(example.model)
    if not asked.auto:
        given = Choices(o.schedule, o.microbatches, o.virtual_stages,
                        (bool(o.checkpoint),) * o.num_stages, profile)
        return replace(plan, choices=given), (
            "nothing searched: schedule, micro-batches, virtual stages and checkpoint were given")
    if "layout" in asked.auto:  # P x D too (planner/layout_search.py)
        from .layout_passes import layout_search_pass

        return layout_search_pass(plan, example, profile)
    if o.given_schedule is not None:  # it fixes all but recomputation
        return _recompute_for(plan, example, o.given_schedule, profile)
    fewest = len(o.devices) * (1 if "virtual_stages" in asked.auto else o.virtual_stages)
    enough_blocks(coarsest(captured, asked.granularity, fewest), fewest, asked.granularity)
    tables = BlockTables(plan, example,
                         plan.probe.calibration if plan.probe is not None else None)

    def costs_for(m: int, stages: int) -> BlockTable | None:
        found = tables.at(stages, captured.microbatch_size(m), m)
        return BlockTable.of(found[1], found[0]) if found is not None else None

    space = Space(
        schedules=(FSDP_SCHEDULES if o.fsdp else SYNC_SCHEDULES) if "schedule" in asked.auto
        else (o.schedule,),
        microbatches=(microbatch_choices(example.batch)
                      if "microbatches" in asked.auto and captured.dynamic_batch
                      else (o.microbatches,)),
        virtual_stages=(_split_point_stages(asked) if "virtual_stages" in asked.auto
                        else (o.virtual_stages,)),
        checkpoint=None if "checkpoint" in asked.auto and not o.fsdp else bool(o.checkpoint))
    found = search_plans(space, o.devices, costs_for, overhead=plan.overhead,
                         split_ratio=plan.split_ratio,
                         cores=shared_cores(o.devices, o.ranks), efficiency=plan.efficiency,
                         searched=tuple(sorted(asked.auto)),
                         collectives=_one_replica(asked, model_dtype(plan)))
    best = found.best
    stages = len(o.devices) * best.virtual_stages
    recompute = (tuple(best.recompute) if "checkpoint" in asked.auto
                 else (bool(o.checkpoint),) * stages)
    choices = Choices(best.schedule, best.microbatches, best.virtual_stages, recompute, profile)
    fits = sum(c.fits for c in found.candidates)
    return replace(plan, choices=choices, search=found), (
        f"{best.schedule}, {best.microbatches} micro-batches, {best.virtual_stages} virtual "
        f"stage(s), recompute stages {format_stages(best.recomputed)}: predicted step "
        f"{best.step * 1e3:.3f} ms ({len(found.candidates)} candidates, {fits} fit"
        + ("" if captured.dynamic_batch else "; static batch: micro-batches fixed") + ")")


def _recompute_for(plan: Plan, example: Example, given: Schedule, profile: bool
                   ) -> tuple[Plan, str]:
    """A written schedule, checkpoint="auto": recompute where memory needs it (as the search)."""
    o, granularity = plan.resolved, plan.asked.granularity
    schedule = make_schedule(given, len(o.devices), o.microbatches, virtual_stages=o.virtual_stages)
    linear = coarsest(plan.ready.captured, granularity, o.num_stages)
    enough_blocks(linear, o.num_stages, granularity)
    costs = cost(linear, replace(cost_model(plan, example), profile=False), example, o.ranks)
    staged = replace(plan, schedule=schedule, inflight=inflight(schedule))  # for target only
    goal = replace(target(staged), recompute=(False if o.fsdp else None,) * o.num_stages)
    recompute = place(linear, costs, goal).recompute or (False,) * o.num_stages
    choices = Choices(o.schedule, o.microbatches, o.virtual_stages, tuple(recompute), profile)
    return replace(plan, choices=choices), (
        f"{o.schedule} given, recompute stages {[s for s, r in enumerate(recompute) if r]}")


def schedule_pass(plan: Plan, example: Example) -> tuple[Plan, str]:
    """The action lists per device of the chosen schedule, and each stage's peak in-flight
    micro-batches."""
    c, devices = plan.ready.choices, len(plan.resolved.devices)
    schedule = make_schedule(plan.asked.given_schedule or c.schedule, devices, c.microbatches,
                             virtual_stages=c.virtual_stages)
    peaks = inflight(schedule)
    return replace(plan, schedule=schedule, inflight=peaks), (
        f"{c.schedule}: {sum(len(a) for a in schedule.actions)} actions on {devices} "
        f"devices, peak in-flight micro-batches {list(peaks)}")


def _split_point_stages(o: CompileOptions) -> tuple[int, ...] | None:
    """With split_points the stage count is given: only the matching virtual stage count."""
    if o.split_points is None:
        return None
    return ((len(o.split_points) + 1) // len(o.devices),)


def target(plan: Plan) -> Target:
    """What this plan's blocks are placed on: its stages' devices and the schedule's demands
    (no layout before the search has chosen one: a written schedule's recomputation pass)."""
    o, asked = plan.resolved, plan.asked
    recompute = (None if asked.checkpoint is False and "checkpoint" not in asked.auto
                 else tuple(o.stage_checkpoint(s) for s in range(o.num_stages)))
    return Target(stage_specs=plan.stage_specs, inflight=plan.inflight, schedule=o.schedule,
                  microbatches=o.microbatches, virtual_stages=o.virtual_stages,
                  split_points=asked.split_points, recompute=recompute,
                  backward_ratio=placement_ratio(plan.ready.schedule, plan.split_ratio),
                  layout=plan.choices.layout if plan.choices is not None else None,
                  stage_to_device=tuple(plan.ready.schedule.stage_to_device))


def collectives(plan: Plan) -> Collectives | None:
    """The searched layout's collectives and optimizer step (no layout searched: the
    optimizer step alone on absent devices, else None)."""
    layout, dtype = plan.ready.choices.layout, model_dtype(plan)
    if layout is None:
        return _one_replica(plan.asked, dtype)
    return Collectives.of(layout, plan.asked.cluster, plan.resolved.devices[0],
                          plan.asked.optimizer, dtype)


def _one_replica(o: CompileOptions, dtype: torch.dtype) -> Collectives | None:
    """Devices described by their figures, no layout searched: one replica's optimizer step
    (priced by its bytes; no collectives). None for devices measured here."""
    if o.data_parallel > 1 or not all(d.absolute for d in o.devices):
        return None
    return Collectives.of(Layout(len(o.devices), 1), o.cluster, o.devices[0], o.optimizer,
                          dtype)
