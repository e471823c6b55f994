"""A tensor-parallel pipeline on disk (tensor_parallel=T, under torchrun): `pipe.save` and
`pipecompile.load` of outputs/persist.py, the parts that differ.

The lowered stages call collectives as closures (runtime/tensor_parallel.py) and hold 1/T of
each split weight, so they are not what is written. What is written is what the pass started
from, and what it decided:

    stageN.py, stageN.safetensors  the UNSHARDED stage graph (`plan.unsharded`) and its whole
                                   weights (each DTensor's `full_tensor()`, gathered over "tp"
                                   and, with FSDP, "dp")
    plan.json "tensor_parallel"    T, sequence parallelism, and every stage's `ShardPlan`
                                   (passes/tensor_shard.choose, a pure function of the graph)
    plan.json "layout"             P x D x T and FSDP

`pipe.save(directory)` is collective: every rank calls it with the same directory (one file
system). Rank 0 writes plan.json, the schedule and every stage's code; the first
tensor-parallel rank of the first replica at each pipeline position writes its stages'
weights; all ranks wait for each other before it returns.

`pipecompile.load(directory)` under torchrun with the same P x D x T ranks joins the process
group as compile's "join" pass does, rebuilds every stage from its code, gives this rank's
stages their captured values again (fake tensors at the example's sizes, which the lowering
reads) and runs compile's "tensor" pass with the saved plans (planner/model_passes.py
`lower_tensor_stages`): the same sharded pipeline, DTensor parameters, FSDP2 over "dp" with
fsdp=True. In one process a tensor-parallel directory is refused (run under torchrun).

    full_stage_weights(plan)          -> {stage: {name: whole tensor}} of this rank's stages
    tensor_entry(plan)                -> plan.json's "tensor_parallel" entry
    join_saved(layout, timeout)       -> this process's `Topology` for a saved layout
    layout_to_json(plan)              -> plan.json's "layout" (P x D x T, FSDP; any plan)
    tensor_options(layout, ranks)     -> the options a loaded tensor-parallel plan runs with
    written(path, collective)         -> path, once every rank wrote its part
    lower_saved(plan, entry)          -> (the loaded plan, this rank's stages lowered, what
                                         the tensor pass says of it)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

    from ..measure.ranks import Ranks
    from ..planner.plan import Plan
    from ..runtime.distributed import Topology

__all__ = ["full_stage_weights", "tensor_entry", "join_saved", "lower_saved", "writes_stage",
           "written", "tensor_options", "layout_to_json"]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_stage_weights(plan: "Plan") -> dict[int, dict[str, torch.Tensor]]:
    """The whole value of every parameter and buffer of this rank's stages, by the unsharded
    stage's attribute names. Collective over this rank's tensor-parallel (and FSDP) group:
    every rank of it calls this, in the same order."""
    unsharded, program = plan.unsharded, plan.ready.program
    assert unsharded is not None, "the tensor pass keeps the unsharded program"
    own = plan.resolved.ranks.own_stages(plan.ready.schedule)
    result = {}
    for s in own:
        held = dict(list(program.stages[s].module.named_parameters(remove_duplicate=False))
                    + list(program.stages[s].module.named_buffers(remove_duplicate=False)))
        names = [n for n, _ in unsharded.stages[s].module.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in unsharded.stages[s].module.named_buffers(remove_duplicate=False)]
        result[s] = {n: _whole(held[n]).detach() for n in names}
    return result


def writes_stage(plan: "Plan", stage: int) -> bool:
    """Whether this rank writes `stage`'s weights: the first tensor-parallel rank of the first
    replica at the stage's pipeline position."""
    topology = plan.resolved.ranks.topology
    assert topology is not None
    return (topology.replica == 0 and topology.tp_index == 0
            and stage in plan.resolved.ranks.own_stages(plan.ready.schedule))


def tensor_entry(plan: "Plan") -> dict[str, Any]:
    """plan.json's "tensor_parallel": T, sequence parallelism, every stage's sharding plan
    (chosen again from the unsharded graphs: the same on every rank)."""
    from ..planner.model_passes import tensor_plans

    unsharded = plan.unsharded
    assert unsharded is not None
    o = plan.resolved
    plans = tensor_plans(unsharded, range(unsharded.num_stages), o.tensor_parallel)
    return {"degree": o.tensor_parallel, "sequence_parallel": o.sequence_parallel,
            "plans": {str(s): p.to_json() for s, p in plans.items()}}


def join_saved(layout: Mapping[str, Any], timeout: float) -> "Topology":
    """This process's place in the saved P x D x T layout (the process group joined)."""
    from ..runtime.distributed import topology_from_environment, world_size

    P, D, T = int(layout["pipeline"]), int(layout["data_parallel"]), int(layout["tensor_parallel"])
    need = P * D * T
    if world_size() != need:
        raise ConfigError(
            f"the pipeline was saved with tensor_parallel={T} for {P} pipeline x {D} "
            f"data-parallel x {T} tensor-parallel = {need} ranks, but this job has "
            f"{world_size()}; load it under torchrun --nproc-per-node {need}")
    topology = topology_from_environment(P, D, timeout, T)
    if topology is None:
        raise ConfigError(f"loading a tensor_parallel={T} pipeline needs this process to be "
                          f"one of the job's {need} ranks; launch it with torchrun")
    return topology


def _with_values(plan: "Plan", stage: int) -> None:
    """Record each node's value (fake tensors at the example's sizes) on a loaded stage graph,
    as capture left them on the compiled one: the lowering reads their shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from ..ir.records import evaluate

    program = plan.ready.program
    captured, module = program.captured, program.stages[stage].module
    sizes = dict(captured.example_sizes)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    for name in program.stages[stage].inputs:
        info = captured.values[name]
        shape = [d if isinstance(d, int) else int(evaluate(d, sizes)) for d in info.shape]
        if info.dtype is None:
            raise ConfigError(f"stage {stage} of the saved tensor-parallel pipeline takes the "
                              f"scalar {name!r}; its sharding cannot be rebuilt on load: "
                              f"compile the model again")
        with mode:
            inputs.append(torch.empty(shape, dtype=info.dtype))
    try:
        FakeTensorProp(module, mode).propagate_dont_convert_inputs(*inputs)
    except Exception as error:  # noqa: BLE001 - any failure: the sharding cannot be rebuilt
        raise ConfigError(f"stage {stage} of the saved tensor-parallel pipeline could not be "
                          f"run on fake inputs to rebuild its sharding ({error}); compile the "
                          f"model again") from None


def lower_saved(plan: "Plan", entry: Mapping[str, Any]) -> "tuple[Plan, str]":
    """`plan` (loaded, unsharded) with this rank's stages lowered by the saved plans, and the
    tensor pass's summary."""
    from ..ir.shard_plan import ShardPlan
    from ..planner.model_passes import lower_tensor_stages

    own = plan.resolved.ranks.own_stages(plan.ready.schedule)
    plans = {s: ShardPlan.from_json(entry["plans"][str(s)]) for s in own}
    for s in own:
        graph = plan.ready.program.stages[s].module.graph
        names = {n.name for n in graph.nodes}
        missing = sorted({*plans[s].columns, *plans[s].rows, *plans[s].split} - names)
        if missing:
            raise ConfigError(f"stage {s}'s saved sharding names nodes its code does not have "
                              f"({missing[:3]}); was stage{s}.py edited? save it again")
        _with_values(plan, s)
    return lower_tensor_stages(plan, plans)


def written(path: "Path", collective: bool) -> str:
    """`path`, once every rank wrote its part (`collective`: a tensor-parallel save)."""
    if collective:
        import torch.distributed as dist

        dist.barrier()
    return str(path)


def tensor_options(layout: Mapping[str, Any], ranks: "Ranks") -> dict[str, Any]:
    """The saved P x D x T layout as options, with this process's ranks."""
    return {"data_parallel": int(layout["data_parallel"]), "fsdp": bool(layout["fsdp"]),
            "tensor_parallel": int(layout["tensor_parallel"]),
            "sequence_parallel": bool(layout["sequence_parallel"]), "ranks": ranks}


def layout_to_json(plan: "Plan") -> dict[str, Any] | None:
    """The layout the plan was made for (P x D, FSDP, the dimension inside a node), without this
    process's ranks (each process finds its own place again); None for a pipeline alone."""
    chosen = plan.choices.layout if plan.choices is not None else None
    o = plan.resolved
    if chosen is None and o.data_parallel <= 1 and o.tensor_parallel <= 1:
        return None
    from ..planner.layout import Layout

    layout = chosen or Layout(len(o.devices), o.data_parallel, o.fsdp,
                              tensor_parallel=o.tensor_parallel,
                              sequence_parallel=o.sequence_parallel)
    return {"pipeline": layout.pipeline, "data_parallel": layout.data_parallel,
            "fsdp": layout.fsdp, "inner": layout.inner, "tensor_parallel": layout.tensor_parallel,
            "sequence_parallel": layout.sequence_parallel}
