"""A compiled pipeline on disk: `pipe.save(directory)` and `pipecompile.load(directory)`.

    directory/
      plan.json            the plan: stage bounds, inputs/outputs, devices, wiring, tied and
                           shared tensors, micro-batches, captured input/output names and
                           pytree specs, blocks, stage costs, predicted timeline, pass log
      schedule.json        the schedule: name, placement, one action list per device ("1F3")
      stage0.py, ...       each stage's graph as the Python code torch.fx generates for it
      stage0.safetensors   the parameters and buffers that stage reads, by original name
      unused.safetensors   state no stage reads (kept so that state_dict() stays complete)

Nothing is pickled: weights are safetensors, everything else is JSON or Python source. `load`
needs only torch, pipecompile and these files, not the model's code: each stage's GraphModule
is rebuilt by executing its source and tracing it (`graph_code.build_module`; executing the
source means: load only directories you trust). A tensor reached under several names (a tied
weight) is stored once per stage file that reads it and becomes one tensor per device again on
load, as `split` made it.

Output structures: the captured input/output pytree specs are stored with
`torch.utils._pytree.treespec_dumps`. A type registered with a serialized name (transformers'
`ModelOutput`s are) is rebuilt if its module can be imported when loading; otherwise, and for
types that have no serialized name, `load` returns a plain `dict` (keyed types) or `tuple` in its
place, with the same leaves in the same order.

The loaded pipeline has no captured model graph (`program.captured.module` is a stand-in
holding the state tensors) and no per-block costs, so it can run, train, print, explain, draw,
save and export, but not be re-partitioned.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .errors import ConfigError
from .graph_code import build_module, install, module_source
from .ir import Block, CapturedModel, LinearGraph, NodeRole, ValueInfo
from .passes.split import Stage, StagedProgram, _Placement, _tensor_copies
from .report import StageCost
from .runtime.actions import Action, Schedule
from .runtime.simulate import Timeline

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = ["save", "load"]

FORMAT = "pipecompile-program"
VERSION = 1


def save(pipe: "Pipeline", directory: str | os.PathLike) -> str:
    """Write `pipe` to `directory` (created if needed); returns the path of plan.json."""
    from safetensors.torch import save_file

    program = pipe.program
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    groups = _tensor_groups(program)
    stages = []
    for stage in program.stages:
        name = f"Stage{stage.index}"
        doc = (f"Stage {stage.index} of {program.num_stages} ({stage.device}): blocks "
               f"{stage.blocks[0]}..{stage.blocks[-1]}.\n\ninputs:  {', '.join(stage.inputs)}\n"
               f"outputs: {', '.join(stage.outputs)}\n")
        (out / f"stage{stage.index}.py").write_text(module_source(stage.module, class_name=name,
                                                                  doc=doc))
        state = _state(stage.module)
        save_file(_unique(state), str(out / f"stage{stage.index}.safetensors"))
        stages.append({
            "index": stage.index, "code": f"stage{stage.index}.py", "class": name,
            "weights": f"stage{stage.index}.safetensors", "device": str(stage.device),
            "inputs": list(stage.inputs), "outputs": list(stage.outputs),
            "blocks": list(stage.blocks), "parameter_names": list(stage.parameter_names),
            "attributes": list(state), "cost": _plain(asdict(stage.cost)) if stage.cost else None,
        })
    used = {id(t) for stage in program.stages for t in _state(stage.module).values()}
    unused = {n: t for n, t in _state(program.captured.module).items() if id(t) not in used}
    if unused:
        save_file(_unique(unused), str(out / "unused.safetensors"))
    worker = next(iter(_workers(pipe)), None)
    plan = {
        "format": FORMAT, "version": VERSION,
        "microbatches": pipe.microbatches,
        "checkpoint": bool(getattr(worker, "checkpoint", False)),
        "timeout": float(getattr(pipe, "timeout", 300.0)),
        "schedule": "schedule.json",
        "bounds": list(program.bounds),
        "stages": stages,
        "producer": dict(program.producer),
        "consumers": {k: list(v) for k, v in program.consumers.items()},
        "tensors": groups,
        "unused_weights": "unused.safetensors" if unused else None,
        "ties": [{"names": list(t.names), "copies": [list(c) for c in t.copies]}
                 for t in program.ties],
        "captured": _captured_to_json(program),
        "linear": {"granularity": program.linear.granularity,
                   "blocks": [[b.index, b.name, list(b.nodes)] for b in program.linear.blocks],
                   "boundaries": [list(b) for b in program.linear.boundaries]},
        "predicted": pipe.predicted.to_dict() if pipe.predicted is not None else None,
        "passes": [{"name": r.name, "seconds": r.seconds, "summary": r.summary}
                   for r in pipe.passes],
    }
    (out / "schedule.json").write_text(json.dumps(_schedule_to_json(pipe.schedule), indent=1))
    path = out / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    return str(path)


def load(
    directory: str | os.PathLike,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    devices: Sequence[str | torch.device] | None = None,
) -> "Pipeline":
    """Rebuild the Pipeline saved in `directory` (or from its plan.json path).

    `devices` overrides the saved placement: one device per schedule device (a count of
    `pipe.schedule.num_devices`), e.g. `["cpu"] * 4` to run a CUDA-saved pipeline on the CPU.
    """
    from safetensors.torch import load_file

    from .pipeline import PassRecord, Pipeline

    start = time.perf_counter()
    root = Path(directory)
    if root.is_file():
        root = root.parent
    plan = _read_json(root / "plan.json")
    if plan.get("format") != FORMAT or plan.get("version") != VERSION:
        raise ConfigError(f"{root / 'plan.json'} is not a pipecompile program of version "
                          f"{VERSION} (format {plan.get('format')!r}, version "
                          f"{plan.get('version')!r}); save it again with this pipecompile")
    schedule = _schedule_from_json(_read_json(root / plan["schedule"]))
    stage_devices = _stage_devices(plan, schedule, devices)

    files = [s["weights"] for s in plan["stages"]] + ([plan["unused_weights"]]
                                                       if plan["unused_weights"] else [])
    stored = [load_file(str(root / f)) for f in files]
    state: dict[str, torch.Tensor] = {}  # original name -> the tensor (tied names: one object)
    for group in plan["tensors"]:
        tensor = next((s[n] for s in stored for n in group["names"] if n in s), None)
        if tensor is None:
            raise ConfigError(f"{root}: no weights file holds {group['names'][0]!r}; the "
                              f"directory is incomplete")
        if group["parameter"]:
            tensor = torch.nn.Parameter(tensor, requires_grad=group["requires_grad"])
        for name in group["names"]:
            state[name] = tensor

    captured = _captured_from_json(plan["captured"], state)
    placed = _Placement(stage_devices)
    stages = []
    for entry in plan["stages"]:
        j = entry["index"]
        tensors = {n: placed.get(j, n, state[n]) for n in entry["attributes"]}
        source = (root / entry["code"]).read_text()
        module = build_module(source, entry["class"], tensors, filename=str(root / entry["code"]))
        cost = StageCost(**{k: float(v) if isinstance(v, str) else v
                            for k, v in entry["cost"].items()}) if entry["cost"] else None
        stages.append(Stage(j, module, stage_devices[j], tuple(entry["inputs"]),
                            tuple(entry["outputs"]), tuple(entry["blocks"]),
                            tuple(n for n, _ in module.named_parameters()), cost))
    tensors, ties = _tensor_copies(captured.module, stages)
    linear = _linear_from_json(plan["linear"], captured)
    program = StagedProgram(captured, linear, tuple(plan["bounds"]), tuple(stages),
                            dict(plan["producer"]),
                            {k: tuple(v) for k, v in plan["consumers"].items()}, ties, tensors)
    passes = [PassRecord(p["name"], p["seconds"], p["summary"]) for p in plan["passes"]]
    passes.append(PassRecord("load", time.perf_counter() - start,
                             f"{program.num_stages} stages from {root}"))
    predicted = Timeline.from_dict(plan["predicted"]) if plan["predicted"] else None
    return Pipeline(program, schedule, microbatches=plan["microbatches"], loss_fn=loss_fn,
                    optimizer=optimizer, checkpoint=plan["checkpoint"], predicted=predicted,
                    passes=passes, timeout=plan["timeout"])


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


def _tensor_groups(program: StagedProgram) -> list[dict[str, Any]]:
    """Every state tensor of the model: all its names, whether a parameter, requires_grad."""
    by_id: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in _state(program.captured.module).items():
        by_id.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    return [{"names": names, "parameter": isinstance(tensors[k], torch.nn.Parameter),
             "requires_grad": bool(tensors[k].requires_grad)} for k, names in by_id.items()]


def _workers(pipe: "Pipeline") -> list:
    workers = pipe.workers
    return list(workers.values()) if isinstance(workers, dict) else list(workers)


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
        "in_spec": _dump_spec(c.in_spec), "out_spec": _dump_spec(c.out_spec),
        "method": c.method, "dynamic_batch": c.dynamic_batch,
        "batch_symbol": str(c.batch_symbol) if c.batch_symbol is not None else None,
        "example_sizes": {str(k): int(v) for k, v in c.example_sizes.items()},
        "captured_batch_size": c.captured_batch_size,
        "parameter_names": list(c.parameter_names), "state_keys": list(c.state_keys),
        "notes": list(c.notes),
        "values": {n: {"shape": [str(d) for d in v.shape],
                       "dtype": str(v.dtype).replace("torch.", "") if v.dtype else None}
                   for n, v in c.values.items() if n in names},
    }


def _captured_from_json(data: dict[str, Any], state: dict[str, torch.Tensor]) -> CapturedModel:
    symbols = {name: sympy.Symbol(name, integer=True, positive=True)
               for name in data["example_sizes"]}
    if data["batch_symbol"]:
        symbols.setdefault(data["batch_symbol"],
                           sympy.Symbol(data["batch_symbol"], integer=True, positive=True))

    def dim(text: str) -> Any:
        return int(text) if text.lstrip("-").isdigit() else sympy.sympify(text, locals=symbols)

    values = {n: ValueInfo(n, tuple(dim(d) for d in v["shape"]),
                           getattr(torch, v["dtype"]) if v["dtype"] else None)
              for n, v in data["values"].items()}
    return CapturedModel(
        module=_state_holder(data["input_names"], state),
        in_spec=_load_spec(data["in_spec"]), out_spec=_load_spec(data["out_spec"]),
        input_names=tuple(data["input_names"]), output_names=tuple(data["output_names"]),
        values=values, method=data["method"], dynamic_batch=data["dynamic_batch"],
        batch_symbol=symbols[data["batch_symbol"]] if data["batch_symbol"] else None,
        example_sizes={symbols[k]: v for k, v in data["example_sizes"].items()},
        captured_batch_size=data["captured_batch_size"],
        parameter_names=tuple(data["parameter_names"]), state_keys=tuple(data["state_keys"]),
        notes=tuple(data["notes"]),
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
    return Schedule(data["name"], data["num_stages"], data["num_microbatches"],
                    tuple(data["stage_to_device"]),
                    tuple(tuple(Action.parse(a) for a in row) for row in data["actions"]))


# -- pytree specs ------------------------------------------------------------------------------


def _dump_spec(spec: pytree.TreeSpec) -> str:
    """`treespec_dumps`, or the same JSON layout written by hand for unregistered types."""
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # noqa: BLE001 - a type without a serialized name: describe it
        return json.dumps([1, _spec_json(spec)])


def _spec_json(spec: pytree.TreeSpec) -> dict[str, Any]:
    if spec.is_leaf():
        return {"type": None, "context": None, "children_spec": []}
    try:
        context = json.dumps(list(spec.context) if isinstance(spec.context, (list, tuple))
                             else spec.context)
    except TypeError:
        context = "null"
    return {"type": f"{spec.type.__module__}.{spec.type.__qualname__}", "context": context,
            "children_spec": [_spec_json(c) for c in spec.children_specs]}


def _load_spec(text: str) -> pytree.TreeSpec:
    """The spec back; types that cannot be rebuilt here become dict (keyed) or tuple."""
    try:
        return pytree.treespec_loads(text)
    except Exception:  # noqa: BLE001 - perhaps the type's module is not imported yet
        pass
    protocol, root = json.loads(text)
    for type_name in _type_names(root):
        module = type_name.rpartition(".")[0]
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - not available here: use the fallback
            continue
    try:
        return pytree.treespec_loads(text)
    except Exception:  # noqa: BLE001
        return pytree.tree_flatten(_plain_tree(root))[1]


def _type_names(node: dict[str, Any]) -> set[str]:
    names = {node["type"]} if node["type"] else set()
    for child in node["children_spec"]:
        names |= _type_names(child)
    return names


def _plain_tree(node: dict[str, Any]) -> Any:
    """A structure of tuples, lists and dicts with leaves 0, shaped like the spec `node`."""
    if node["type"] is None:
        return 0
    children = [_plain_tree(c) for c in node["children_spec"]]
    kind = node["type"]
    if kind == "builtins.list":
        return children
    context = json.loads(node["context"]) if node["context"] else None
    if isinstance(context, list) and len(context) == len(children) and all(
        isinstance(k, (str, int)) for k in context
    ):
        return dict(zip(context, children))
    return tuple(children)


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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; pass the directory written by pipe.save()") \
            from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error})") from None
