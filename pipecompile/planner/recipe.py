"""compile as a recipe: one flat list of passes over one frozen `Plan`.

    join      the layout of torchrun's ranks searched: the process group joined, the
              link between ranks measured (ranks_passes.py)                  (updates resolved)
    capture   the model as a flat fx graph (model_passes.py)                -> plan.captured
    probe     this machine's rates, and the planning probe when a searched option
              depends on time (shape_passes.py)                         -> plan.probe, ...
    search    the "auto" options: schedule, micro-batches, virtual stages,
              recomputation per stage (and the layout: layout_passes.py), by predicted
              step time; measures nothing (shape_passes.py)   -> plan.choices, plan.search
    ranks     the layout of torchrun's ranks searched: this process's place in the
              chosen P x D (ranks_passes.py)                                 (updates resolved)
    schedule  the action lists per device and peak in-flight counts      -> plan.schedule
    linearize, annotate, partition, calibrate, refine, split, threads, simulate, plan check,
    shard, tensor  the model cut, costed, split and predicted; sharded over the replicas
              (fsdp) and the tensor-parallel ranks (model_passes.py)

Each pass is a `Pass` (plan.py) that declares the plan fields it requires, produces and
updates; `run_passes` checks them. `plan_for` is what `pipecompile.compile` runs for one
example batch (None: the options checked only, for a lazy compile).
"""

from __future__ import annotations

from ..ir.records import Example
from .layout_options import job_options
from .model_passes import (
    agree_pass,
    annotate_pass,
    calibrate_pass,
    capture_pass,
    linearize_pass,
    partition_pass,
    refine_pass,
    shard_pass,
    simulate_pass,
    tensor_pass,
    split_pass,
    threads_pass,
)
from .plan import Pass, Plan, run_passes
from .ranks_passes import join_pass, ranks_pass
from .request import Request
from .shape_passes import probe_pass, schedule_pass, search_pass

__all__ = ["PASSES", "plan_for"]

_MEASURED = ("probe", "device_model", "overhead", "calibration", "efficiency", "split_ratio")
_PLACED = ("linear", "costs", "placement", "schedule", "inflight", "choices")

PASSES: tuple[Pass, ...] = (  # the recipe: in this order, each with its contract
    Pass("join", join_pass, updates=("resolved",)),
    Pass("capture", capture_pass, produces=("captured",)),
    Pass("probe", probe_pass, requires=("captured",), produces=_MEASURED),
    Pass("search", search_pass, requires=("captured", *_MEASURED), produces=("choices", "search"),
         updates=("resolved",)),
    Pass("ranks", ranks_pass, requires=("choices",), updates=("resolved",)),
    Pass("schedule", schedule_pass, requires=("choices",), produces=("schedule", "inflight")),
    Pass("linearize", linearize_pass, requires=("captured", "choices"), produces=("linear",)),
    Pass("annotate", annotate_pass, requires=("linear", "choices", "device_model", "calibration"),
         produces=("costs",)),
    Pass("partition", partition_pass, requires=("linear", "costs", "schedule", "inflight", "choices"),
         produces=("placement",)),
    Pass("calibrate", calibrate_pass, requires=_PLACED, updates=("calibration", "costs", "placement")),
    Pass("refine", refine_pass, requires=(*_PLACED, "captured", "device_model", "calibration"),
         updates=("linear", "costs", "placement")),
    Pass("split", split_pass, requires=(*_PLACED, "split_ratio"), updates=("schedule",),
         produces=("program", "measured", "stage_costs", "transfers")),
    Pass("threads", threads_pass, requires=("program", "schedule", "choices"),
         updates=("efficiency",)),
    Pass("simulate", simulate_pass, requires=("schedule", "stage_costs", "transfers", "overhead",
                                          "efficiency", "choices"),
         produces=("cores", "predicted")),
    Pass("plan check", agree_pass, requires=("program", "schedule", "choices")),
    Pass("shard", shard_pass, requires=("program", "schedule", "choices"), updates=("program",)),
    Pass("tensor", tensor_pass, requires=("program", "schedule", "choices"),
         updates=("program",), produces=("unsharded",)),
)




def plan_for(example: Example | None, request: Request) -> Plan:
    """The plan of `request` for `example`, every pass run; for None, the options checked and
    nothing run (a lazy compile plans at its first call)."""
    plan = Plan(job_options(example, request), request=request)
    return run_passes(plan, PASSES, example) if example is not None else plan
