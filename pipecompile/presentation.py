"""What a pipeline shows its user, from its plan and its last step's measured timeline.

    describe(plan)                 the stage table `print(pipe)` shows           (report.py)
    explain(plan)                  the pass log and the search's candidates      (report.py)
    draw(plan, path)               the partition as SVG or PNG                   (draw.py)
    plot_timeline(plan, t, path)   predicted and measured Gantt charts           (runtime/plot.py)
    write_chrome_trace(t, path)    a measured timeline as Chrome trace JSON (Perfetto)

They read plan data and timelines, never a `Pipeline`, so a loaded plan shows the same.
"""

from __future__ import annotations

import json

from .draw import draw_partition
from .plan import Plan
from .report import explain_passes, explain_search, stage_table
from .schedule.simulate import Timeline

__all__ = ["describe", "explain", "draw", "plot_timeline", "write_chrome_trace"]


def describe(plan: Plan) -> str:
    """The stage table: blocks, parameters, FLOPs, predicted time and memory per stage."""
    ready = plan.ready
    return stage_table(ready.program, ready.schedule, microbatches=plan.options.microbatches,
                       predicted=plan.predicted, specs=plan.stage_specs)


def explain(plan: Plan) -> str:
    """The passes the compiler ran, how long each took and what it produced; the plan the
    search chose and its best candidates."""
    return explain_passes(plan.passes) + "\n\n" + explain_search(plan.search)


def draw(plan: Plan, path: str, *, backend: str = "auto") -> str:
    """The partition (blocks coloured by stage, cuts with their boundary sizes) drawn to
    `path`, SVG or PNG by its extension; returns the path."""
    return draw_partition(plan.ready.program, path, microbatches=plan.options.microbatches,
                          backend=backend)


def plot_timeline(plan: Plan, measured: Timeline, path: str) -> str:
    """The predicted and the `measured` timeline as a Gantt chart (PNG or SVG); returns path."""
    from .runtime.plot import plot_timelines

    timelines = {"predicted": plan.predicted, "measured": measured}
    title = (f"{plan.ready.schedule.name}, {plan.ready.program.num_stages} stages, "
             f"{plan.options.microbatches} micro-batches")
    return plot_timelines({k: t for k, t in timelines.items() if t is not None and t.events},
                          path, title=title)


def write_chrome_trace(timeline: Timeline, path: str) -> str:
    """`timeline` as Chrome trace JSON at `path` (open it in Perfetto); returns the path."""
    with open(path, "w") as f:
        json.dump(timeline.to_chrome_trace(), f)
    return path
