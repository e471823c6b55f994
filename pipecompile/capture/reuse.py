"""A capture reused for a structurally identical model: the graph kept, the tensors rebound.

`compile(..., cache=CompileCache(captures=N))` keeps up to N captured graphs, keyed by
everything the graph depends on (capture/fingerprint.py: the model's classes and their code,
every attribute's value, train/eval mode, parameter and buffer names, shapes, dtypes, ties, the
example inputs' spec, capture's options, torch's version and global state). A model with an
equal key gets a copy of the graph (new nodes, the same metadata) whose every attribute is the
new model's own tensor of that name, as its own capture would have made it: the same code,
the same parameters, so the same values and gradients bit for bit. Kept only when that
rebinding is exact: every `get_attr` of the graph names a parameter or buffer of the model (no
tensor constant made in forward, which export copies), no module kept opaque (the graph
would call the first model's module), no attempt cut off by the time budget. The entry holds
no tensor data: its attributes are meta tensors, so memory grows with the graph, not the
weights. The default cache keeps no captures (captures=0).
"""

from __future__ import annotations

import copy as _copy_module
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.fx as fx

from ..ir.compile_cache import CompileCache
from ..ir.records import CapturedModel
from .fingerprint import model_key

__all__ = ["reusing_capture", "rebindable", "rebind"]


@dataclass(frozen=True)
class Template:
    """A capture with its tensors replaced by meta tensors: (target, parameter?) per attribute."""

    captured: CapturedModel
    targets: tuple[tuple[str, bool], ...]


def reusing_capture(cache: CompileCache | None, model: torch.nn.Module, args: tuple,
                    kwargs: dict[str, Any], options: tuple,
                    capture: Callable[[], CapturedModel]) -> CapturedModel:
    """`capture()`, or a kept capture of an identical model rebound to `model`'s tensors;
    `options` are capture's options (they are part of the key)."""
    if cache is None or cache.captures < 1:
        return capture()
    key = model_key(model, args, kwargs, options)
    if key is None:
        return capture()
    template = cache.kept_capture(key)
    if template is not None:
        return rebind(template, model)
    captured = capture()
    kept = rebindable(captured, model)
    if kept is not None:
        cache.keep_capture(key, kept)
    return captured


def rebindable(captured: CapturedModel, model: torch.nn.Module) -> Template | None:
    """`captured` as a template without tensor data, or None when rebinding it to another
    model would not give that model's own capture."""
    gm = captured.module
    if captured.method != "export" or any(n.op == "call_module" for n in gm.graph.nodes) \
            or any("capture_budget" in note or "was not tried" in note
                   for note in captured.notes):
        return None
    targets = []
    for node in gm.graph.find_nodes(op="get_attr"):
        tensor, mine = _attribute(gm, node.target), _attribute(model, node.target)
        if tensor is None or tensor is not mine:  # a constant export made, or a copy
            return None
        targets.append((node.target, isinstance(tensor, torch.nn.Parameter)))
    targets = list(dict.fromkeys(targets))
    meta = {t: _on_meta(_attribute(gm, t), parameter) for t, parameter in targets}
    return Template(replace(captured, module=_copy(gm, meta, gm.training)), tuple(targets))


def rebind(template: Template, model: torch.nn.Module) -> CapturedModel:
    """The template's graph with `model`'s own tensor under each attribute's name."""
    return replace(template.captured, module=_copy(template.captured.module, model))


def _copy(gm: fx.GraphModule, tensors: dict[str, Any] | torch.nn.Module,
          training: bool | None = None) -> fx.GraphModule:
    """A new GraphModule of a copy of `gm`'s graph (node metadata copied shallowly, as
    `Graph.node_copy` does) over `tensors`: a model's own, registered in the graph's order
    as a capture registers them (`GraphModule(module, graph)`), or a template's by name."""
    graph = fx.Graph()
    graph._codegen = _copy_module.deepcopy(gm.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    copy = fx.GraphModule(tensors, graph)
    copy.meta = dict(gm.meta)
    copy.training = gm.training if training is None else training
    return copy


def _attribute(module: torch.nn.Module, target: str) -> Any:
    *path, name = target.split(".")
    for part in path:
        module = module._modules.get(part)  # type: ignore[assignment]
        if module is None:
            return None
    return module._parameters.get(name, module._buffers.get(name))


def _on_meta(tensor: torch.Tensor, parameter: bool) -> torch.Tensor:
    empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                device="meta")
    return torch.nn.Parameter(empty, requires_grad=tensor.requires_grad) if parameter else empty
