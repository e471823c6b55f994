"""The IR parts of a captured graph, shared by both capture front ends: the graph with a flat
tuple output, each node's `ValueInfo`, and the size symbols with their example values and the
ranges export assumed for them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..ir.records import ValueInfo

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["flat_graph", "drop_body_checks", "values_from_meta", "value_info", "symbols", "ranges", "output_names"]


# torch.export's checks that a tensor has the dtype and device it had while traced (emitted
# before each `.to(...)`): under the caller's torch.autocast a stage's inputs and its
# linears' outputs are bfloat16 where the trace saw float32, so the check fails although the
# conversion that follows computes what the eager model computes; on another device than the
# traced one the device check fails the same way. Guards, not computation: dropped with them.
_METADATA_CHECKS = tuple(getattr(torch.ops.aten, name).default
                         for name in ("_assert_tensor_metadata",)
                         if hasattr(torch.ops.aten, name))


def flat_graph(graph: fx.Graph, *, drop_guards: bool) -> fx.Graph:
    """A copy of `graph` with plain codegen, a flat tuple output and, with `drop_guards`, no
    export guard calls and no trace-time metadata checks (`_METADATA_CHECKS`)."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if drop_guards and (node.op == "call_module" and node.target == "_guards_fn"
                            or node.op == "call_function" and node.target in _METADATA_CHECKS):
            continue
        if node.op == "output":
            flat = pytree.tree_leaves(node.args[0], is_leaf=lambda x: isinstance(x, fx.Node))
            new.output(tuple(env[x] if isinstance(x, fx.Node) else x for x in flat))
            continue
        env[node] = new.node_copy(node, lambda n: env[n])
    new.lint()
    return new


def drop_body_checks(gm: fx.GraphModule) -> int:
    """Remove `_METADATA_CHECKS` from the bodies of `gm`'s higher-order ops (the graph modules
    it holds: a `torch.no_grad()` or `torch.autocast(enabled=False)` region of the model, as
    `wrap_with_set_grad_enabled` / `wrap_with_autocast` calls); `flat_graph` drops the top
    level's. Returns how many were removed."""
    removed = 0
    for name, sub in gm.named_modules():
        if not name or not isinstance(sub, fx.GraphModule):
            continue
        checks = [n for n in sub.graph.nodes
                  if n.op == "call_function" and n.target in _METADATA_CHECKS and not n.users]
        for node in checks:
            sub.graph.erase_node(node)
        if checks:
            sub.recompile()
            removed += len(checks)
    return removed


def values_from_meta(graph: fx.Graph) -> dict[str, ValueInfo]:
    """Every node's `ValueInfo` from its `meta['val']`, by node name."""
    values = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        values[node.name] = value_info(node.name, node.meta.get("val"))
    return values


def value_info(name: str, val: Any) -> ValueInfo:
    """ValueInfo of a node's `meta['val']` (a FakeTensor, SymInt, or anything else)."""
    if isinstance(val, torch.Tensor):
        return ValueInfo(name, tuple(_expr(d) for d in val.shape), val.dtype)
    if isinstance(val, torch.SymInt):
        return ValueInfo(name, (), None)
    return ValueInfo(name, (), None)


def _expr(d: Any) -> Any:
    if isinstance(d, torch.SymInt):
        return d.node.expr
    return int(d)


def symbols(graph: fx.Graph, values: Mapping[str, ValueInfo], batch: int
            ) -> tuple[sympy.Symbol | None, dict]:
    """The batch size's symbol, and every symbol's example value (from the shape env hints)."""
    batch_symbol = None
    for node in graph.find_nodes(op="placeholder"):
        info = values[node.name]
        if info.shape and isinstance(info.shape[0], sympy.Symbol):
            batch_symbol = info.shape[0]
            break
    sizes: dict[sympy.Symbol, int] = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d in val.shape:
                if isinstance(d, torch.SymInt):
                    for sym in d.node.expr.free_symbols:
                        env = d.node.shape_env
                        hints = getattr(env, "backed_var_to_val", None) or env.var_to_val
                        hint = hints.get(sym)
                        if hint is not None:
                            sizes[sym] = int(hint)
    if batch_symbol is not None:
        sizes[batch_symbol] = batch
    return batch_symbol, sizes


def ranges(ep: ExportedProgram, sizes: Mapping[sympy.Symbol, int]
            ) -> dict[sympy.Symbol, tuple[int, int | None]]:
    """The range export assumed for each size symbol, where it is narrower than any size."""
    ranges = {}
    for symbol, vr in ep.range_constraints.items():
        if symbol not in sizes:
            continue
        low = _finite(vr.lower) or 0
        high = _finite(vr.upper)
        if low > 2 or high is not None:  # export's own floor (0 or 2) needs no check
            ranges[symbol] = (low, high)
    return ranges


def _finite(bound: Any) -> int | None:
    """A value range's bound as an int; None for an infinite one (sympy's or torch's int_oo)."""
    return None if "oo" in str(bound) else int(bound)


def output_names(graph: fx.Graph) -> tuple[str, ...]:
    """The names of the values the graph returns, in order (a constant as its repr)."""
    out = graph.find_nodes(op="output")[0]
    return tuple(x.name if isinstance(x, fx.Node) else repr(x) for x in out.args[0])
