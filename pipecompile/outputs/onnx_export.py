"""ONNX export of a staged program: one ONNX file per stage plus manifest.json (format in README).

    export_onnx(program, "out/")  ->  out/stage0.onnx, out/stage1.onnx, ..., out/manifest.json

    {"inputs": ["input_ids"], "outputs": ["linear"],
     "stages": [{"file": "stage0.onnx", "inputs": ["input_ids"], "outputs": ["add_11"],
                 "parameters": {"transformer.h.0.ln_1.weight": "transformer.h.0.ln_1.weight", ...},
                 "buffers": {}},
                {"file": "stage1.onnx", "inputs": ["input_ids", "add_11"], "outputs": ["linear"],
                 ...}],
     "tied": [["transformer.wte.weight", "lm_head.weight"]],
     "dynamic_batch": true}

Value names are the fx node names of the captured graph, global to the manifest. Each stage is
exported in eval mode (`passes.eval_mode.eval_graph`: batch norm reads its running statistics,
dropout is the identity, buffers are not updated), with `torch.onnx.export(dynamo=True,
optimize=False)`, which keeps the original parameter names as ONNX initializer names; `parameters`
and `buffers` map each stage's initializers to the model's names. A tied weight is written into
every file that reads it (ONNX has no shared initializers across files); `tied` lists the names
of each such weight. When the capture had a dynamic batch, dim 0 of every value whose size is
the batch stays symbolic in the ONNX files.

Chaining the files (`pipecompile.outputs.onnx_run.run`) reproduces the model in eval mode.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx as fx

from ..errors import ConfigError
from ..ir.records import evaluate
from ..passes.eval_mode import eval_graph
from ..ir.records import Stage, StagedProgram

from ..errors import require

__all__ = ["export_onnx"]

log = logging.getLogger(__name__)


def export_onnx(program: StagedProgram, directory: str | os.PathLike) -> str:
    """Export every stage of `program` to `directory`; returns the path of manifest.json."""
    onnx = require("onnx", purpose="export_onnx")  # the top-level package
    require("onnxscript", purpose="export_onnx (torch.onnx's exporter)")

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    captured = program.captured
    examples = _example_values(program)
    entries = []
    for stage in program.stages:
        log.info("exporting stage %d of %d to ONNX", stage.index + 1, program.num_stages)
        gm, outputs = _inference_graph(stage, program)
        path = out / f"stage{stage.index}.onnx"
        args = tuple(examples[name].to(stage.device) for name in stage.inputs)
        _export(gm, args, _dynamic_shapes(stage, program), outputs, path)
        onnx.checker.check_model(str(path))
        model = onnx.load(str(path), load_external_data=False)
        entries.append({
            "file": path.name,
            "inputs": [v.name for v in model.graph.input],
            "outputs": [v.name for v in model.graph.output],
            **_initializer_names(model, stage),
        })
    manifest = {
        "inputs": [n for n in captured.input_names
                   if n in captured.values and captured.values[n].is_tensor],
        "outputs": [n for n in captured.output_names
                    if n in captured.values and captured.values[n].is_tensor],
        "stages": entries,
        "tied": [list(t.names) for t in program.ties if len(t.names) > 1],  # one tensor's names
        "dynamic_batch": bool(captured.dynamic_batch),
    }
    from .onnx_run import validate_manifest

    validate_manifest(manifest)
    path = out / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1))
    return str(path)


# ---------------------------------------------------------------------------------------------


def _inference_graph(stage: Stage, program: StagedProgram) -> tuple[fx.GraphModule, list[str]]:
    """The stage in eval mode, returning the tensors it computes, once each: ONNX outputs are
    named values, so a value returned twice, a non-tensor, or an input passed through (a model
    output computed by an earlier stage) is not an output of this file."""
    gm = eval_graph(stage.module)
    values = program.captured.values
    output = gm.graph.find_nodes(op="output")[0]
    keep: dict[str, fx.Node] = {}
    for name, value in zip(stage.outputs, output.args[0]):
        info = values.get(name)
        if (isinstance(value, fx.Node) and value.op != "placeholder" and info is not None
                and info.is_tensor):
            keep.setdefault(name, value)
    output.args = (tuple(keep.values()),)
    _for_onnx(gm)
    return gm, list(keep)


def _example_values(program: StagedProgram) -> dict[str, Any]:
    """A zero tensor of the right shape and dtype for every value a stage reads (values do not
    matter to export; zeros are valid indices for embeddings)."""
    captured = program.captured
    sizes = captured.sizes_at(max(2, captured.captured_batch_size))
    result = {}
    for stage in program.stages:
        for name in stage.inputs:
            info = captured.values.get(name)
            if info is None or not info.is_tensor:
                raise ConfigError(
                    f"stage {stage.index} reads {name!r}, which is not a tensor; ONNX stages can "
                    f"only exchange tensors (pass non-tensor model arguments as tensors)"
                )
            shape = [int(evaluate(d, sizes)) for d in info.shape]
            result[name] = torch.zeros(shape, dtype=info.dtype)
    return result


def _dynamic_shapes(stage: Stage, program: StagedProgram) -> tuple | None:
    """Dim 0 symbolic where it is the batch; other sizes that depend on it are left to export."""
    captured = program.captured
    if not captured.dynamic_batch or captured.batch_symbol is None:
        return None
    from torch.export import Dim

    batch, symbol = Dim("batch"), captured.batch_symbol
    specs = []
    for name in stage.inputs:
        spec = {}
        for axis, d in enumerate(captured.values[name].shape):
            expr = sympy.sympify(d)
            if expr == symbol:
                spec[axis] = batch
            elif symbol in expr.free_symbols:
                spec[axis] = Dim.AUTO
        specs.append(spec or None)
    return tuple(specs)


def _export(gm, args, dynamic_shapes, output_names: list[str], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eval-mode, torchvision and naming notices
        program = torch.onnx.export(gm, args, dynamo=True, optimize=False, verbose=False,
                                    dynamic_shapes=dynamic_shapes)
    assert program is not None, "dynamo=True always returns an ONNXProgram"
    _name_outputs(program.model.graph, output_names)
    program.save(str(path))


def _for_onnx(gm: fx.GraphModule) -> None:
    """Rewrites for the exporter, in place on our own copy `gm`: `aten.contiguous` becomes a
    `clone` in that memory format (torch 2.13's ONNX decompositions drop `contiguous`, after
    which a later `view` of a transposed tensor fails to trace: seen with T5's attention)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.contiguous.default:
            node.target = torch.ops.aten.clone.default
            node.kwargs = {"memory_format": node.kwargs.get("memory_format",
                                                             torch.contiguous_format)}
    gm.recompile()


def _name_outputs(graph, names: list[str]) -> None:
    """Give the ONNX graph's outputs our global value names. The exporter names values after
    the nodes of its own re-traced graph, so another value may already carry one of our names
    (a different `add_4`): such values are renamed first. An output that is a graph input, an
    initializer or another output too (the exporter merged two equal values) gets an Identity
    node, so that each output is a value of its own."""
    import onnx_ir as ir

    outputs = list(graph.outputs)
    for i, value in enumerate(outputs):
        if value.is_graph_input() or value.is_initializer() or outputs.index(value) != i:
            node = ir.Node("", "Identity", inputs=[value], num_outputs=1)
            graph.append(node)
            copy = node.outputs[0]
            copy.type, copy.shape = value.type, value.shape
            outputs[i] = graph.outputs[i] = copy
    wanted, keep = set(names), {id(v) for v in outputs}
    values = [v for node in ir.traversal.RecursiveGraphIterator(graph) for v in node.outputs]
    for k, value in enumerate(values):
        if value.name in wanted and id(value) not in keep:
            value.name = f"{value.name}__{k}"
    for value, name in zip(outputs, names):
        value.name = name


def _initializer_names(model, stage: Stage) -> dict[str, dict[str, str]]:
    """ONNX initializer name -> the model's name, for the stage's parameters and buffers."""
    state = {**{n: "parameters" for n, _ in stage.module.named_parameters(remove_duplicate=False)},
             **{n: "buffers" for n, _ in stage.module.named_buffers(remove_duplicate=False)}}
    by_key = {_key(n): n for n in state}
    result: dict[str, dict[str, str]] = {"parameters": {}, "buffers": {}}
    for init in model.graph.initializer:
        original = init.name if init.name in state else by_key.get(_key(init.name))
        if original is not None:
            result[state[original]][init.name] = original
    return result


def _key(name: str) -> str:
    """Names compared up to the exporter's sanitising of '.' into '_'."""
    return name.replace(".", "_")
