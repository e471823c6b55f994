"""A compiled pipeline on disk: `pipe.save(directory)` and `pipecompile.load(directory)`.

    directory/
      plan.json            the plan: options (micro-batches, schedule, checkpoint, vertical
                           sync, ...), stage bounds, inputs/outputs, devices, wiring, tied and
                           shared tensors, captured input/output names and pytree specs, blocks,
                           stage costs (table and simulator), cores, thread efficiency and
                           per-action overhead, predicted timeline, pass log
      schedule.json        the schedule: name, placement, one action list per device ("1F3")
      stage0.py, ...       each stage's graph as the Python code torch.fx generates for it
      stage0.safetensors   the parameters and buffers that stage reads, by original name
      unused.safetensors   state no stage reads (kept so that state_dict() stays complete)

Nothing is pickled: weights are safetensors, everything else is JSON or Python source. `load`
needs only torch, pipecompile and these files, not the model's code: each stage's GraphModule
is rebuilt by executing its source and tracing it (`graph_code.build_module`), after checking
that the source holds only the statement forms torch.fx writes (`stage_check`: a file edited to
do anything else is refused, naming its line, and nothing of it runs; `trust_code=True` skips
the check). A tensor reached under several names (a tied
weight) is stored once per stage file that reads it and becomes one tensor per device again on
load, as `split` made it.

Output structures: the captured input/output pytree specs are stored with
`torch.utils._pytree.treespec_dumps`. A type registered with a serialized name (transformers'
`ModelOutput`s are) is rebuilt if its module can be imported when loading; otherwise, and for
types that have no serialized name, `load` returns a plain `dict` (keyed types) or `tuple` in its
place, with the same leaves in the same order.

`save_plan` writes a finished `Plan`; `load_plan` gives one back, which `pipecompile.load`
turns into a `Pipeline`. The loaded plan has no captured model graph (`program.captured.module`
is a stand-in holding the state tensors) and no per-block costs, so its pipeline can run, train,
print, explain, simulate, draw, save and export, but not be re-partitioned.

A tensor-parallel pipeline (tensor_parallel=T under torchrun) is saved by every rank at once:
the unsharded stages, whole weights and each stage's sharding plan; loading it under the same
ranks runs the tensor pass again (outputs/persist_tensor.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx

from ..errors import ConfigError
from .graph_code import build_module, install, module_source
from ..ir.records import Block, CapturedModel, LinearGraph, NodeRole, StageCost, ValueInfo
from ..planner.resolved import Choices, Resolved, resolve
from ..measure.ranks import Ranks
from ..planner.layout import Layout
from .persist_tensor import layout_to_json, tensor_options, written
from ..runtime.distributed import local_device
from ..planner.options import CompileOptions
from ..ir.devices import DeviceSpec
from ..ir.records import Stage, StagedProgram
from ..passes.split import TensorPlacement, tensor_copies
from ..planner.plan import PassRecord, Plan
from ..schedule.actions import Action, Schedule
from ..schedule.simulate import StageCosts, Timeline
from ..planner.schedule_search import SearchResult
from .treespec import dump_spec, load_spec

__all__ = ["save_plan", "load_plan"]

FORMAT = "pipecompile-program"
VERSION = 1


def save_plan(plan: Plan, directory: str | os.PathLike) -> str:
    """Write the finished `plan` to `directory` (created if needed); returns plan.json's path."""
    program, options, asked = plan.program, plan.resolved, plan.asked
    assert program is not None and plan.schedule is not None, "only a finished plan is saved"
    sharded = plan.unsharded is not None  # tensor_parallel=T under torchrun: persist_tensor.py
    whole: dict[int, dict[str, torch.Tensor]] = {}
    if sharded:
        from .persist_tensor import full_stage_weights, writes_stage

        whole = full_stage_weights(plan)  # collective over this rank's tp (and dp) group
        program = plan.unsharded
        assert program is not None and options.ranks.topology is not None
    lead = not sharded or options.ranks.topology.rank == 0  # type: ignore[union-attr]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stages = [_write_stage(stage, program, out, code=lead, weights=(
        (whole[stage.index] if writes_stage(plan, stage.index) else None) if sharded
        else _state(stage.module))) for stage in program.stages]
    if not lead:
        return written(out / "plan.json", sharded)
    used = {id(t) for stage in program.stages for t in _state(stage.module).values()}
    unused = {n: t for n, t in _state(program.captured.module).items() if id(t) not in used}
    if unused:
        _save_tensors(unused, out / "unused.safetensors")
    data = {
        "format": FORMAT, "version": VERSION,
        "microbatches": options.microbatches,
        "checkpoint": (list(options.checkpoint) if isinstance(options.checkpoint, tuple)
                       else options.checkpoint),  # per stage, or one flag for all
        "timeout": float(asked.timeout), "vertical_sync": asked.vertical_sync,
        "compile_stages": asked.compile_stages,
        "rng": asked.rng, "rng_seed": asked.rng_seed,  # the seeded ops' streams
        "layout": layout_to_json(plan),
        "schedule": "schedule.json", "bounds": list(program.bounds), "stages": stages,
        "producer": dict(program.producer),
        "consumers": {k: list(v) for k, v in program.consumers.items()},
        "tensors": _tensor_groups(program),
        "unused_weights": "unused.safetensors" if unused else None,
        "ties": [{"names": list(t.names), "copies": [list(c) for c in t.copies]}
                 for t in program.ties],
        "captured": _captured_to_json(program),
        "linear": {"granularity": program.linear.granularity,
                   "blocks": [[b.index, b.name, list(b.nodes)] for b in program.linear.blocks],
                   "boundaries": [list(b) for b in program.linear.boundaries]},
        "stage_costs": [_plain(asdict(c)) for c in plan.stage_costs],
        "cores": plan.cores, "efficiency": plan.efficiency, "overhead": plan.overhead,
        "split_ratio": plan.split_ratio,
        "search": plan.search.to_dict() if plan.search is not None else None,
        "transfers": [[*key, seconds] for key, seconds in (plan.transfers or {}).items()],
        "predicted": plan.predicted.to_dict() if plan.predicted is not None else None,
        "passes": [asdict(r) for r in plan.passes],
        "global_batch": asked.global_batch,
    }
    if sharded:
        from .persist_tensor import tensor_entry

        data["tensor_parallel"] = tensor_entry(plan)
    (out / "schedule.json").write_text(json.dumps(_schedule_to_json(plan.schedule), indent=1))
    path = out / "plan.json"
    path.write_text(json.dumps(data, indent=1))
    return written(path, sharded)


def load_plan(
    directory: str | os.PathLike,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    devices: Sequence[str | torch.device] | None = None,
    compile_stages: bool | None = None,
    trust_code: bool = False,
) -> Plan:
    """The plan saved in `directory` (or from its plan.json path), with everything compile
    produced except the block costs; `devices` overrides the saved placement (one device per
    schedule device), `compile_stages` the saved setting. `loss_fn` and `optimizer` are code,
    so they are given again here. Stage files are checked to hold only what torch.fx writes,
    and output types are imported only from packages already imported, unless `trust_code`."""
    start = time.perf_counter()
    root = Path(directory)
    if root.is_file():
        root = root.parent
    data = _read_json(root / "plan.json")
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ConfigError(f"{root / 'plan.json'} is not a pipecompile program of version "
                          f"{VERSION} (format {data.get('format')!r}, version "
                          f"{data.get('version')!r}); save it again with this pipecompile")
    schedule = _schedule_from_json(_read_json(root / data["schedule"]))
    tensor, ranks = data.get("tensor_parallel"), Ranks()
    if tensor is not None:  # under torchrun: this rank's place, its stages on its device
        from .persist_tensor import join_saved

        ranks = Ranks(join_saved(data["layout"], float(data["timeout"])))
        own = ranks.own_stages(schedule)
        devices = [local_device() if d in own else "cpu" for d in range(schedule.num_devices)] \
            if devices is None else devices
    stage_devices = _stage_devices(data, schedule, devices)
    stage_costs = tuple(StageCosts(**_floats(c)) for c in data.get("stage_costs", []))
    program = _program_from_json(root, data, stage_devices, stage_costs, trust_code)
    options = CompileOptions(
        devices=tuple(DeviceSpec(name=str(stage_devices[schedule.stage_to_device.index(d)]))
                      for d in range(schedule.num_devices)),
        microbatches=data["microbatches"], schedule=schedule.name, loss_fn=loss_fn,
        optimizer=optimizer, checkpoint=(tuple(map(bool, data["checkpoint"]))
                                          if isinstance(data["checkpoint"], list)
                                          else bool(data["checkpoint"])),
        timeout=data["timeout"],
        vertical_sync=data.get("vertical_sync", False),
        rng=data.get("rng", "global"), rng_seed=int(data.get("rng_seed", 0)),
        compile_stages=(bool(data.get("compile_stages", False)) if compile_stages is None
                        else compile_stages),
        virtual_stages=schedule.num_stages // schedule.num_devices,
        capture=program.captured.method, granularity=program.linear.granularity,
        global_batch=bool(data.get("global_batch", False)),
        **({} if tensor is None else tensor_options(data["layout"], ranks)))
    passes = tuple(PassRecord(**p) for p in data["passes"])
    choices = _choices_from_json(data.get("layout"), options)
    resolved = Resolved.start(options)
    plan = Plan(options, resolved=resolved if choices is None else resolve(resolved, choices),
                choices=choices,
                captured=program.captured, schedule=schedule, linear=program.linear,
                program=program,
                stage_costs=stage_costs,
                cores=data.get("cores"), efficiency=data.get("efficiency", 1.0),
                overhead=float(data.get("overhead", 0.0)),  # absent before it was saved
                transfers={(int(a), int(b), str(d)): float(t)
                           for a, b, d, t in data.get("transfers", [])},
                predicted=Timeline.from_dict(data["predicted"]) if data["predicted"] else None,
                split_ratio=data.get("split_ratio"),
                search=SearchResult.from_dict(data["search"]) if data.get("search") else None)
    summary = f"{program.num_stages} stages from {root}"
    if tensor is not None:  # the tensor pass again, with the saved plans
        from .persist_tensor import lower_saved

        plan, lowered = lower_saved(plan, tensor)
        summary += f"; tensor pass: {lowered}"
    record = PassRecord("load", time.perf_counter() - start, summary)
    return replace(plan, passes=(*passes, record))


# -- stages ------------------------------------------------------------------------------------


def _choices_from_json(entry: dict[str, Any] | None, options: CompileOptions) -> Choices | None:
    """The saved layout as the plan's choices (what `resolved.resolve` applies to the loaded
    plan's `Resolved`), or None."""
    if entry is None:
        return None
    checkpoint = options.checkpoint
    stages = len(options.devices) * options.virtual_stages
    flags = checkpoint if isinstance(checkpoint, tuple) else (bool(checkpoint),) * stages
    return Choices(options.schedule, options.microbatches, options.virtual_stages, flags,
                   layout=Layout(int(entry["pipeline"]), int(entry["data_parallel"]),
                                 bool(entry["fsdp"]), str(entry["inner"]),
                                 tensor_parallel=int(entry.get("tensor_parallel", 1)),
                                 sequence_parallel=bool(entry.get("sequence_parallel",
                                                                  False))),
                   devices=options.devices)


def _write_stage(stage: Stage, program: StagedProgram, out: Path, *, code: bool = True,
                 weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Write a stage's code (unless not `code`) and `weights` (if given); its plan.json entry."""
    name = f"Stage{stage.index}"
    doc = (f"Stage {stage.index} of {program.num_stages} ({stage.device}): blocks "
           f"{stage.blocks[0]}..{stage.blocks[-1]}.\n\ninputs:  {', '.join(stage.inputs)}\n"
           f"outputs: {', '.join(stage.outputs)}\n")
    if code:
        (out / f"stage{stage.index}.py").write_text(module_source(stage.module, class_name=name,
                                                                  doc=doc))
    if weights is not None:
        _save_tensors(weights, out / f"stage{stage.index}.safetensors")
    return {
        "index": stage.index, "code": f"stage{stage.index}.py", "class": name,
        "weights": f"stage{stage.index}.safetensors", "device": str(stage.device),
        "inputs": list(stage.inputs), "outputs": list(stage.outputs),
        "blocks": list(stage.blocks), "parameter_names": list(stage.parameter_names),
        "attributes": list(_state(stage.module)), "cost": _cost_to_json(stage.cost),
    }


def _cost_to_json(cost: StageCost | None) -> dict[str, Any] | None:
    """A stage's `StageCost` without its times: those are the plan's "stage_costs"."""
    if cost is None:
        return None
    return _plain({f.name: getattr(cost, f.name) for f in fields(StageCost) if f.name != "times"})


def _cost_from_json(entry: dict[str, Any] | None, times: StageCosts | None) -> StageCost | None:
    """A saved `StageCost` with the stage's simulator times (a plan saved before they were its
    "stage_costs" kept them as forward_time and backward_time)."""
    if entry is None:
        return None
    values = _floats(entry)
    if times is None:
        times = StageCosts(forward=values["forward_time"], backward=values["backward_time"])
    known = {f.name for f in fields(StageCost)} - {"times"}
    return StageCost(**{k: v for k, v in values.items() if k in known}, times=times)


def _program_from_json(root: Path, data: dict[str, Any], stage_devices: list[torch.device],
                       times: Sequence[StageCosts], trust_code: bool) -> StagedProgram:
    """The staged program: weights read, each stage's module rebuilt from its code."""
    state = _read_state(root, data)
    captured = _captured_from_json(data["captured"], state, trust_code)
    placed = TensorPlacement(stage_devices, {})
    stages = []
    for entry in data["stages"]:
        j = entry["index"]
        tensors = {n: placed.get(j, n, state[n]) for n in entry["attributes"]}
        module = build_module((root / entry["code"]).read_text(), entry["class"], tensors,
                              filename=str(root / entry["code"]), trust_code=trust_code)
        cost = _cost_from_json(entry["cost"], times[j] if j < len(times) else None)
        stages.append(Stage(j, module, stage_devices[j], tuple(entry["inputs"]),
                            tuple(entry["outputs"]), tuple(entry["blocks"]),
                            tuple(n for n, _ in module.named_parameters()), cost))
    tensors, ties = tensor_copies(captured.module, stages)
    return StagedProgram(captured, _linear_from_json(data["linear"], captured),
                         tuple(data["bounds"]), tuple(stages), dict(data["producer"]),
                         {k: tuple(v) for k, v in data["consumers"].items()}, ties, tensors)


# -- tensors -----------------------------------------------------------------------------------


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(list(module.named_parameters(remove_duplicate=False))
                + list(module.named_buffers(remove_duplicate=False)))


def _unique(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One entry per tensor object (its first name), as contiguous CPU copies."""
    seen: set[int] = set()
    result = {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            result[name] = t.detach().to("cpu", copy=True).contiguous()
    return result


def _save_tensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(_unique(state), str(path))


def _read_state(root: Path, data: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Original name -> tensor, from the weights files (tied names: one object)."""
    from safetensors.torch import load_file

    files = [s["weights"] for s in data["stages"]] + ([data["unused_weights"]]
                                                       if data["unused_weights"] else [])
    stored = [load_file(str(root / f)) for f in files]
    state: dict[str, torch.Tensor] = {}
    for group in data["tensors"]:
        tensor = next((s[n] for s in stored for n in group["names"] if n in s), None)
        if tensor is None:
            raise ConfigError(f"{root}: no weights file holds {group['names'][0]!r}; the "
                              f"directory is incomplete")
        if group["parameter"]:
            tensor = torch.nn.Parameter(tensor, requires_grad=group["requires_grad"])
        for name in group["names"]:
            state[name] = tensor
    return state


def _tensor_groups(program: StagedProgram) -> list[dict[str, Any]]:
    """Every state tensor of the model: all its names, whether a parameter, requires_grad."""
    by_id: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in _state(program.captured.module).items():
        by_id.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    return [{"names": names, "parameter": isinstance(tensors[k], torch.nn.Parameter),
             "requires_grad": bool(tensors[k].requires_grad)} for k, names in by_id.items()]


def _stage_devices(plan: dict, schedule: Schedule, devices) -> list[torch.device]:
    if devices is None:
        result = [torch.device(s["device"]) for s in plan["stages"]]
    else:
        devices = [devices] if isinstance(devices, (str, torch.device)) else list(devices)
        if len(devices) == 1:
            devices = devices * schedule.num_devices
        if len(devices) != schedule.num_devices:
            raise ConfigError(f"devices has {len(devices)} entries but the saved schedule runs on "
                              f"{schedule.num_devices} devices; give one device per schedule "
                              f"device")
        result = [torch.device(devices[schedule.stage_to_device[s["index"]]])
                  for s in plan["stages"]]
    for d in result:
        if d.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"the program was saved for {d}, but CUDA is not available here; "
                              f"pass devices=['cpu'] * {schedule.num_devices} to load it on the "
                              f"CPU")
    return result


# -- the captured model, blocks and schedule -------------------------------------------------


def _captured_to_json(program: StagedProgram) -> dict[str, Any]:
    c = program.captured
    names = set(c.input_names) | set(c.output_names) | set(program.producer)
    return {
        "input_names": list(c.input_names), "output_names": list(c.output_names),
        "in_spec": dump_spec(c.in_spec), "out_spec": dump_spec(c.out_spec),
        "method": c.method, "dynamic_batch": c.dynamic_batch,
        "batch_symbol": str(c.batch_symbol) if c.batch_symbol is not None else None,
        "example_sizes": {str(k): int(v) for k, v in c.example_sizes.items()},
        "size_ranges": {str(k): list(v) for k, v in c.size_ranges.items()},
        "captured_batch_size": c.captured_batch_size,
        "estimated_sizes": {str(k): str(v) for k, v in c.estimated_sizes.items()},
        "parameter_names": list(c.parameter_names), "state_keys": list(c.state_keys),
        "notes": list(c.notes),
        "values": {n: {"shape": [str(d) for d in v.shape],
                       "dtype": str(v.dtype).replace("torch.", "") if v.dtype else None}
                   for n, v in c.values.items() if n in names},
    }


def _captured_from_json(data: dict[str, Any], state: dict[str, torch.Tensor],
                        trust_code: bool) -> CapturedModel:
    symbols = {name: sympy.Symbol(name, integer=True, positive=True)
               for name in data["example_sizes"]}
    if data["batch_symbol"]:
        symbols.setdefault(data["batch_symbol"],
                           sympy.Symbol(data["batch_symbol"], integer=True, positive=True))
    estimated = data.get("estimated_sizes", {})  # data-dependent sizes (capture/unbacked.py)
    for name in estimated:
        symbols.setdefault(name, sympy.Symbol(name, integer=True, nonnegative=True))

    def dim(text: str) -> Any:
        return int(text) if text.lstrip("-").isdigit() else sympy.sympify(text, locals=symbols)

    values = {n: ValueInfo(n, tuple(dim(d) for d in v["shape"]),
                           getattr(torch, v["dtype"]) if v["dtype"] else None)
              for n, v in data["values"].items()}
    return CapturedModel(
        module=_state_holder(data["input_names"], state),
        in_spec=load_spec(data["in_spec"], import_new=trust_code),
        out_spec=load_spec(data["out_spec"], import_new=trust_code),
        input_names=tuple(data["input_names"]), output_names=tuple(data["output_names"]),
        values=values, method=data["method"], dynamic_batch=data["dynamic_batch"],
        batch_symbol=symbols[data["batch_symbol"]] if data["batch_symbol"] else None,
        example_sizes={symbols[k]: v for k, v in data["example_sizes"].items()},
        size_ranges={symbols[k]: (v[0], v[1]) for k, v in data.get("size_ranges", {}).items()},
        captured_batch_size=data["captured_batch_size"],
        estimated_sizes={symbols[k]: sympy.sympify(v, locals=symbols)
                         for k, v in estimated.items()},
        parameter_names=tuple(data["parameter_names"]), state_keys=tuple(data["state_keys"]),
        # no model code, so no state-dict hooks: the checkpoint keys are the tensor names
        checkpoint_keys=tuple(data["state_keys"]), notes=tuple(data["notes"]),
    )


def _state_holder(input_names: list[str], state: dict[str, torch.Tensor]) -> fx.GraphModule:
    """Stand-in for the captured graph module: takes the inputs, computes nothing, and holds
    every state tensor under its original names (tied names share one object)."""
    graph = fx.Graph()
    for name in input_names:
        graph.placeholder(name)
    graph.output(())
    gm = fx.GraphModule(torch.nn.Module(), graph, class_name="LoadedModel")
    for name, tensor in state.items():
        install(gm, name, tensor)
    return gm


def _linear_from_json(data: dict[str, Any], captured: CapturedModel) -> LinearGraph:
    blocks = tuple(Block(i, name, tuple(nodes)) for i, name, nodes in data["blocks"])
    block_of = {n: b.index for b in blocks for n in b.nodes}
    roles = {**{n: NodeRole.INPUT for n in captured.input_names},
             **{n: NodeRole.COMPUTE for n in block_of}}
    return LinearGraph(captured, blocks, tuple(tuple(b) for b in data["boundaries"]), roles,
                       block_of, data["granularity"])


def _schedule_to_json(schedule: Schedule) -> dict[str, Any]:
    return {"name": schedule.name, "num_stages": schedule.num_stages,
            "num_microbatches": schedule.num_microbatches,
            "stage_to_device": list(schedule.stage_to_device),
            "actions": [[str(a) for a in row] for row in schedule.actions]}


def _schedule_from_json(data: dict[str, Any]) -> Schedule:
    """The saved action lists (a built-in schedule's or a hand-written one's)."""
    return Schedule(data["name"], data["num_stages"], data["num_microbatches"],
                    tuple(data["stage_to_device"]),
                    tuple(tuple(Action.parse(a) for a in row) for row in data["actions"]))


# -- JSON helpers ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Strict JSON: non-finite floats as strings ("inf"), read back with float()."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _floats(record: dict[str, Any]) -> dict[str, Any]:
    """A record written by `_plain`: "inf" and "nan" strings back to floats."""
    return {k: float(v) if isinstance(v, str) else v for k, v in record.items()}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; pass the directory written by pipe.save()") \
            from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error})") from None
