"""eval_mode: the inference version of a graph captured in training mode.

Input: an `fx.GraphModule` captured while the model was in training mode (every stage graph of a
`StagedProgram`). Output: a NEW `fx.GraphModule` computing what the model computes after
`model.eval()`; the input graph and its module are not changed, and parameters and buffers are
shared with it (no copies).

Training mode shows up in a captured graph in three ways, each undone by one rule:

    batch norm    aten.batch_norm(x, w, b, mean, var, training=True, ...)   -> training=False
                  (so the running statistics are read, not computed and updated)
    dropout       aten.dropout(x, p, train=True), F.dropout(x, p, True)     -> x
    buffer update aten.add_(num_batches_tracked, 1), aten.copy_(buffer, v)  -> removed
                  (any in-place op writing a buffer reached by get_attr; inference must not
                  change the model's state)

Leaf modules called by `call_module` nodes (torch.fx capture) are shallow-copied with
`training=False`, so `nn.Dropout`/`nn.BatchNorm2d` behave as in eval mode while their parameters
and buffers stay shared. Nodes left without users by the rewrites (the `get_attr` of a removed
update, the value it added) are removed too.

Limits: behaviour that Python code chose at capture time from `self.training` (a branch that was
not traced) cannot be recovered from the graph; capture such a model in eval mode instead.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir.rng import unseed
from ..ir.nodes import getattr_path, node_target_str

__all__ = ["eval_graph"]

aten = torch.ops.aten

# target -> (position of the training flag, its keyword name)
_TRAINING_FLAG: dict[Callable, tuple[int, str]] = {
    aten.batch_norm.default: (5, "training"),
    aten.native_batch_norm.default: (5, "training"),
    aten._native_batch_norm_legit.default: (5, "training"),
    F.batch_norm: (5, "training"),
}
# target -> (position of the train flag, its keyword name, default when absent); replaced by x
_DROPOUT: dict[Callable, tuple[int, str, bool]] = {
    aten.dropout.default: (2, "train", True),
    aten.feature_dropout.default: (2, "train", True),
    aten.alpha_dropout.default: (2, "train", True),
    aten.feature_alpha_dropout.default: (2, "train", True),
    F.dropout: (2, "training", True),
    F.dropout1d: (2, "training", True),
    F.dropout2d: (2, "training", True),
    F.dropout3d: (2, "training", True),
    F.alpha_dropout: (2, "training", False),
    F.feature_alpha_dropout: (2, "training", False),
}


def eval_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule computing `gm` in eval mode; `gm` is left unchanged."""
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # e.g. pytree in/out handling
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    unseed(graph)  # per-micro-batch random streams: back to the plain ops, then the rules
    removed_inputs: list[fx.Node] = []
    for node in list(graph.nodes):
        if _is_training_norm(node):
            index, name = _TRAINING_FLAG[node.target]
            _set_arg(node, index, name, False)
        elif _is_training_dropout(node):
            node.replace_all_uses_with(node.args[0])
            removed_inputs.extend(node.all_input_nodes)
            graph.erase_node(node)
        elif _writes_buffer(gm, node):
            node.replace_all_uses_with(node.args[0])  # an in-place op returns its first argument
            removed_inputs.extend(node.all_input_nodes)
            graph.erase_node(node)
    _remove_dead(graph, removed_inputs)
    graph.lint()
    result = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for node in graph.find_nodes(op="call_module"):
        _install_eval_copy(result, node.target)
    result.training = False
    return result


# ---------------------------------------------------------------------------------------------


def _is_training_norm(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _TRAINING_FLAG:
        return False
    index, name = _TRAINING_FLAG[node.target]
    return _get_arg(node, index, name, False) is True


def _is_training_dropout(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _DROPOUT:
        return False
    index, name, default = _DROPOUT[node.target]
    return _get_arg(node, index, name, default) is True


def _writes_buffer(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An in-place op (aten `foo_`, or a tensor method `foo_`) whose first argument is a buffer."""
    if not node.args or not isinstance(node.args[0], fx.Node) or node.args[0].op != "get_attr":
        return False
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        first = node.target._schema.arguments[0]
        in_place = first.alias_info is not None and first.alias_info.is_write
    elif node.op == "call_method":
        method = node_target_str(node)
        in_place = method.endswith("_") and not method.startswith("_")
    else:
        return False
    if not in_place:
        return False
    value = getattr_path(gm, node_target_str(node.args[0]))
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def _get_arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _set_arg(node: fx.Node, index: int, name: str, value: Any) -> None:
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def _remove_dead(graph: fx.Graph, candidates: list[fx.Node]) -> None:
    """Erase nodes that the rewrites left without users (and are free of side effects)."""
    stack = list(candidates)
    while stack:
        node = stack.pop()
        if node.graph is not graph or node.users or node.op in ("placeholder", "output"):
            continue
        if node.op != "get_attr" and node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        stack.extend(inputs)


def _install_eval_copy(gm: fx.GraphModule, target: str) -> None:
    """Replace the leaf module at `target` by a shallow copy in eval mode (shared tensors)."""
    *parents, leaf = target.split(".")
    owner = gm
    for part in parents:
        owner = getattr(owner, part)
    module = copy.copy(getattr(owner, leaf))
    module.__dict__["_modules"] = dict(module._modules)  # children of the copy only
    for name, child in module._modules.items():
        if child is not None:
            child = copy.copy(child)
            child.training = False
            module._modules[name] = child
    module.training = False
    setattr(owner, leaf, module)
