"""Small helpers for running fx nodes one at a time outside an Interpreter."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx as fx

__all__ = ["getattr_path", "node_target_str", "call_node", "preserve_buffers", "recreate_as_call"]


def getattr_path(module: torch.nn.Module, target: str) -> Any:
    """`module.a.b.c` for target "a.b.c"."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def node_target_str(node: fx.Node) -> str:
    """The qualified name a get_attr, call_module or call_method node targets (fx types every
    target `Callable | str`; only call_function nodes have a callable one)."""
    assert isinstance(node.target, str), f"node {node.name} ({node.op}) has no name as target"
    return node.target


def call_node(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict) -> Any:
    """Evaluate one call_function / call_method / call_module node on given argument values."""
    if node.op == "call_function":
        assert callable(node.target), f"call_function node {node.name} targets a name"
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node_target_str(node))(*args[1:], **kwargs)
    if node.op == "call_module":
        return getattr_path(gm, node_target_str(node))(*args, **kwargs)
    raise AssertionError(f"cannot call node {node.name} of op {node.op}")


@contextlib.contextmanager
def preserve_buffers(module: torch.nn.Module) -> Iterator[None]:
    """Restore every buffer's value on exit: analysis runs must not advance BatchNorm statistics."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def recreate_as_call(graph: fx.Graph, node: fx.Node, target: Any, env: dict[fx.Node, fx.Node],
                     prefix: tuple = ()) -> fx.Node:
    """`node` copied into `graph` as a call of `target` (arguments `prefix` + its own, mapped
    through `env`), keeping its name and metadata: a graph rewrite that swaps one op."""
    args = tuple(fx.map_arg(node.args, lambda n: env[n]))
    kwargs = dict(fx.map_arg(node.kwargs, lambda n: env[n]))
    new = graph.create_node("call_function", target, (*prefix, *args), kwargs, name=node.name)
    new.meta = dict(node.meta)
    return new
