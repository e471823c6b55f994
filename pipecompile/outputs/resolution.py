"""The request beside its resolution: what the user asked of compile, and what the passes made
of it, one row per resolved value (`pipe.explain()` ends with it).

    option          asked                          resolved
    layout          data_parallel=None, fsdp=False  2 pipeline x 1 replica(s)
    devices         2                              cpu, cpu
    topology        -                              one process
    schedule        'auto'                         1f1b
    microbatches    'auto'                         4
    virtual stages  'auto'                         1
    recomputation   'auto'                         stages []

A loaded plan has no request: its column says so.
"""

from __future__ import annotations

from ..planner.plan import Plan

__all__ = ["explain_resolution"]

_WIDTH = 32  # the asked column, cut short past it


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _WIDTH else text[:_WIDTH - 3] + "..."


def explain_resolution(plan: Plan) -> str:
    """A table: each value compile resolves, as asked (the `Request`) and as resolved."""
    r = plan.resolved
    stages = range(r.num_stages)
    recomputed = [s for s in stages if r.stage_checkpoint(s)]
    topology = r.ranks.topology
    resolved = {
        "layout": f"{len(r.devices)} pipeline x {r.data_parallel} replica(s)"
                  + (", fsdp" if r.fsdp else ""),
        "tensor_parallel": _tensor(plan),
        "devices": ", ".join(d.name for d in r.devices),
        "topology": (f"rank {topology.rank} of {topology.world_size}: position "
                     f"{topology.position} of replica {topology.replica}")
                    if topology is not None else "one process",
        "schedule": r.schedule,
        "microbatches": str(r.microbatches),
        "virtual stages": str(r.virtual_stages),
        "recomputation": f"stages {recomputed}",
    }
    q = plan.request
    asked = {name: "(loaded plan)" for name in resolved}
    if q is not None:
        layout = q.layout
        asked = {
            "layout": f"data_parallel={layout.data_parallel!r}, fsdp={layout.fsdp!r}",
            "tensor_parallel": _short(layout.tensor_parallel) + (
                f", sequence_parallel={layout.sequence_parallel!r}"
                if layout.sequence_parallel is not False else ""),
            "devices": _short(layout.devices),
            "topology": "-",
            "schedule": _short(q.schedule.schedule),
            "microbatches": _short(q.schedule.microbatches),
            "virtual stages": _short(q.schedule.virtual_stages),
            "recomputation": _short(q.schedule.checkpoint),
        }
    width = max(len(v) for v in asked.values())
    rows = [f"{'option':16}{'asked':{width}}  resolved"]
    rows += [f"{name:16}{asked[name]:{width}}  {resolved[name]}" for name in resolved]
    return "\n".join(rows)


def _tensor(plan: Plan) -> str:
    """The tensor-parallel degree the plan resolved (1: none), and "+ sequence parallel" when
    its groups also split the tokens."""
    chosen = plan.choices.layout if plan.choices is not None else None
    if chosen is None:  # a given layout (under torchrun): the resolved options say it
        T, sp = plan.resolved.tensor_parallel, plan.resolved.sequence_parallel
    else:
        T, sp = chosen.tensor_parallel, chosen.sequence_parallel
    return str(T) + (" + sequence parallel" if sp else "")
