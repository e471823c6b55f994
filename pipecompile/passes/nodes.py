"""Small helpers for running fx nodes one at a time outside an Interpreter."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx as fx

__all__ = ["getattr_path", "call_node", "preserve_buffers"]


def getattr_path(module: torch.nn.Module, target: str) -> Any:
    """`module.a.b.c` for target "a.b.c"."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def call_node(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict) -> Any:
    """Evaluate one call_function / call_method / call_module node on given argument values."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return getattr_path(gm, node.target)(*args, **kwargs)
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
