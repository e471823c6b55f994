"""What a pipeline shows its user, from its plan and its last step's measured timeline.

    describe(plan)                 the stage table `print(pipe)` shows           (report.py)
    explain(plan)                  asked beside resolved (resolution.py), the pass log and
                                   the search's candidates                       (report.py)
    draw(plan, path)               the partition as SVG or PNG                   (draw.py)
    plot_timeline(plan, t, path)   predicted and measured Gantt charts           (runtime/plot.py)
    write_chrome_trace(t, path)    a measured timeline as Chrome trace JSON (Perfetto)

They read plan data and timelines, never a `Pipeline`, so a loaded plan shows the same.
"""

from __future__ import annotations

import json

from .draw import draw_partition
from ..planner.plan import Plan
from ..planner.layout import Layout, describe_placement
from ..planner.breakdown import step_breakdown
from ..planner.throughput import throughput
from .resolution import explain_resolution
from .report import explain_layouts, explain_passes, explain_search, stage_table
from ..schedule.simulate import Timeline

__all__ = ["describe", "explain", "draw", "plot_timeline", "write_chrome_trace", "layout"]


def layout(plan: Plan) -> Layout:
    """The plan's layout: P pipeline positions x D replicas, FSDP, and this process's place
    (None for a plan of devices that are not here or one process)."""
    o = plan.resolved
    chosen = plan.choices.layout if plan.choices is not None else None
    topology = o.ranks.topology
    base = chosen or Layout(len(o.devices), o.data_parallel, o.fsdp,
                            tensor_parallel=o.tensor_parallel,  # a given T, under torchrun
                            sequence_parallel=o.sequence_parallel)
    if topology is None:
        return base
    return Layout(base.pipeline, base.data_parallel, base.fsdp, base.inner,
                  topology.position, topology.replica, tensor_parallel=base.tensor_parallel,
                  sequence_parallel=base.sequence_parallel)


def describe(plan: Plan) -> str:
    """The stage table: blocks, parameters, FLOPs, predicted time and memory per stage; the
    layout (searched, or data-parallel) and, for hardware described by its figures, the
    predicted throughput (tokens per second per device, MFU)."""
    ready = plan.ready
    table = stage_table(ready.program, ready.schedule, microbatches=plan.resolved.microbatches,
                        predicted=plan.predicted, specs=plan.stage_specs)
    lines = [table]
    o = plan.resolved
    if (plan.choices is not None and plan.choices.layout is not None) or o.data_parallel > 1:
        lines.append(f"layout {layout(plan)}")
        placement = describe_placement(layout(plan), plan.asked.cluster)
        if placement:
            lines[-1] += f": {placement}"
    rate = throughput(plan) if o.devices[0].absolute else None  # planned hardware
    if rate is not None:
        lines.append(str(rate))
    return "\n".join(lines)


def explain(plan: Plan) -> str:
    """The passes the compiler ran, how long each took and what it produced; the layouts
    compared (when searched), where the predicted step goes (`planner.breakdown`: compute by
    kernel kind, optimizer, communication, bubble), the plan the search chose with its best
    candidates; and what was asked beside what was resolved."""
    text = explain_passes(plan.passes)
    if plan.search is not None and plan.search.layouts:
        text += "\n\n" + explain_layouts(plan.search.layouts)
    parts = step_breakdown(plan)  # before the search, whose table follows
    if parts is not None:
        text += "\n\n" + str(parts)
    return (text + "\n\n" + explain_search(plan.search) + "\n\n"
            + explain_resolution(plan))


def draw(plan: Plan, path: str, *, backend: str = "auto") -> str:
    """The partition (blocks coloured by stage, cuts with their boundary sizes) drawn to
    `path`, SVG or PNG by its extension; returns the path."""
    return draw_partition(plan.ready.program, path, microbatches=plan.resolved.microbatches,
                          backend=backend)


def plot_timeline(plan: Plan, measured: Timeline, path: str) -> str:
    """The predicted and the `measured` timeline as a Gantt chart (PNG or SVG); returns path."""
    from ..runtime.plot import plot_timelines

    timelines = {"predicted": plan.predicted, "measured": measured}
    title = (f"{plan.ready.schedule.name}, {plan.ready.program.num_stages} stages, "
             f"{plan.resolved.microbatches} micro-batches")
    return plot_timelines({k: t for k, t in timelines.items() if t is not None and t.events},
                          path, title=title)


def write_chrome_trace(timeline: Timeline, path: str) -> str:
    """`timeline` as Chrome trace JSON at `path` (open it in Perfetto); returns the path."""
    with open(path, "w") as f:
        json.dump(timeline.to_chrome_trace(), f)
    return path
