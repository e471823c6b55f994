"""Sequence parallelism (Korthikanti et al. 2022, Megatron-LM's) as a rewrite of a graph that
passes/tensor_shard.py lowered: between a row-parallel matmul and the next column-parallel
one, the T ranks each run 1/T of the tokens (the sequence dim split) instead of all of them.

    shard_sequence(gm, T, rank, ops) -> fx.GraphModule   (the same graph, tokens split)

`ops` are the collectives over the T ranks, as callables (this module imports no process
group), each an autograd-aware function of (tensor, dim):

    reduce_scatter  sum of the ranks' partials, this rank's 1/T along dim (backward: all-gather)
    gather_column   all-gather along dim (backward: reduce-scatter): a column's input
    gather          all-gather along dim (backward: this rank's 1/T): a value leaving the
                    split tokens for ops that need all of them
    scatter         this rank's 1/T along dim (backward: all-gather): a whole value entering

and `copy`, `reduce` the tensor-parallel pair the graph already calls (identity forward,
all-reduce backward; all-reduce forward, identity backward).

The rewrite: each `reduce` after a row-parallel matmul whose output is (batch, sequence, ...)
becomes a `reduce_scatter` along the sequence (dim 1), then the split follows the ops that
treat every token apart: elementwise ops, norms (`layer_norm`; a mean or sum over other dims,
kept), dtype casts. A whole operand that is constant along the sequence (a norm's weight, a
row's bias) is read through `copy`: each rank's gradient of it counts its own tokens only, so
it is all-reduced over the T ranks (Megatron's all-reduce of the sequence-parallel
parameters' gradients). A whole operand that varies along the sequence is `scatter`ed (a
residual stream that entered the stage whole). A column's `copy` of a split value becomes a
`gather_column`. Any other reader of a split value (an op mixing tokens, one without a rule,
the stage's outputs) reads it `gather`ed: whole again, never wrong. The stage's inputs and
outputs stay whole, so pipeline messages are unchanged (each rank of a group sends its full
boundary). A sequence length that T does not divide is a `ConfigError` naming both.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from ..errors import ConfigError
from .tensor_rules import node_args, shape_of

__all__ = ["shard_sequence", "SEQUENCE_OPS"]

aten = torch.ops.aten

SEQUENCE_OPS = ("reduce_scatter", "gather_column", "gather", "scatter")

# ops whose output token i depends only on input token i (their first input the split one)
_UNARY = {aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default,
          aten.sigmoid.default, aten.neg.default, aten.clone.default, aten.contiguous.default,
          aten.alias.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
          aten.pow.Tensor_Scalar, aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar,
          aten.sub.Scalar, aten.rsqrt.default, aten.sqrt.default, aten.exp.default}
_BINARY = {aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor}
_REDUCE = {aten.mean.dim, aten.sum.dim_IntList}
_DIM = 1  # the sequence dim of (batch, sequence, hidden) activations


def shard_sequence(gm: fx.GraphModule, degree: int, ops: Mapping[str, Callable], *,
                   copy: Callable, reduce: Callable) -> fx.GraphModule:
    """`gm` (a graph lowered by passes/tensor_shard.lower with `copy` and `reduce`) with the
    tokens between each row and the next column split over `degree` ranks (module
    docstring)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    split: dict[fx.Node, int] = {}  # new-graph node -> its split dim
    gathered: dict[fx.Node, fx.Node] = {}
    region: set[fx.Node] = set()  # split along features (a column's output, to its row)
    for node in gm.graph.nodes:
        if node.target is not reduce and any(
                i in region or (i.op == "call_function" and i.target is copy)
                for i in node.all_input_nodes) and node.op != "output":
            region.add(node)
        if node.op == "call_function" and node.target is reduce and _sequence(node, degree):
            new = graph.call_function(ops["reduce_scatter"], (env[node.args[0]], _DIM))
            new.meta = dict(node.meta)
            env[node], split[new] = new, _DIM
            continue
        inputs = [env[i] for i in node.all_input_nodes]
        if not any(i in split for i in inputs):
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        if node.op == "call_function" and node.target is copy:
            x = env[node.args[0]]
            new = graph.call_function(ops["gather_column"], (x, split[x]))
            new.meta = dict(node.meta)
            env[node] = new
            continue
        kept = _rule(node, env, split, region) if node.op == "call_function" else None
        if kept is None:  # read whole: gather each split input once
            def whole(n: fx.Node) -> fx.Node:
                value = env[n]
                if value not in split:
                    return value
                if value not in gathered:
                    gathered[value] = graph.call_function(ops["gather"], (value, split[value]))
                    gathered[value].meta = dict(n.meta)
                return gathered[value]
            env[node] = graph.node_copy(node, whole)
            continue
        dim, wrap = kept
        args = fx.map_arg(node.args, lambda n: _read(graph, env[n], wrap.get(n), ops, copy))
        kwargs = fx.map_arg(node.kwargs, lambda n: _read(graph, env[n], wrap.get(n), ops,
                                                         copy))
        new = graph.node_copy(node, lambda n: env[n])
        new.args, new.kwargs = args, kwargs
        env[node], split[new] = new, dim
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def _sequence(node: fx.Node, degree: int) -> bool:
    """Whether a row's output is (batch, sequence, ...) with a sequence T divides; a length
    that T does not divide is refused."""
    shape = shape_of(node)
    if shape is None or len(shape) < 3 or not isinstance(shape[_DIM], int):
        return False
    if shape[_DIM] % degree:
        raise ConfigError(
            f"sequence_parallel=True splits the sequence of {shape[_DIM]} tokens over "
            f"tensor_parallel={degree} ranks, which does not divide it: use a sequence length "
            f"that is a multiple of {degree}, or sequence_parallel=False")
    return True


def _read(graph: fx.Graph, value: fx.Node, how: str | None, ops: Mapping[str, Callable],
          copy: Callable) -> fx.Node:
    if how is None:
        return value
    if how == "copy":
        read = graph.call_function(copy, (value,))
    else:
        dim = int(how.split(":")[1])
        read = graph.call_function(ops["scatter"], (value, dim))
    read.meta = dict(value.meta)
    return read


def _rule(node: fx.Node, env: Mapping[fx.Node, fx.Node], split: Mapping[fx.Node, int],
          region: set[fx.Node]) -> tuple[int, dict[fx.Node, str]] | None:
    """(the output's split dim, how each whole tensor input is read: "copy" or "scatter:d")
    when `node` treats every token apart, else None (its split inputs are gathered)."""
    target, args = node.target, node_args(node)
    first = args[0] if args else None
    out = shape_of(node)
    if out is None or node in region or any(shape_of(i) is None for i in node.all_input_nodes):
        return None
    dims = {len(out) - len(shape_of(i) or ()) + split[env[i]] for i in node.all_input_nodes
            if env[i] in split}
    if len(dims) != 1:
        return None
    dim = dims.pop()
    if target is operator.getitem or not isinstance(first, fx.Node):
        return None
    if target in _UNARY:
        return (dim, {}) if env[first] in split and len(node.all_input_nodes) == 1 else None
    if target in _REDUCE:
        shape = shape_of(first)
        if env[first] not in split or shape is None or len(args) < 3 or not args[2]:
            return None
        reduced = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        return None if any(d % len(shape) == dim for d in reduced) else (dim, {})
    if target is aten.layer_norm.default:
        shape = shape_of(first)
        if env[first] not in split or shape is None or dim >= len(shape) - len(args[1]):
            return None
        return dim, {t: "copy" for t in node.all_input_nodes if t is not first}
    if target in _BINARY:
        wrap: dict[fx.Node, str] = {}
        for t in node.all_input_nodes:
            shape = shape_of(t) or ()
            if t in region:
                return None  # split along features on this rank: not a whole value
            at = dim - (len(out) - len(shape))
            if env[t] in split:
                if at != split[env[t]]:
                    return None
            elif at < 0 or _one(shape[at]):
                wrap[t] = "copy"  # constant along the tokens: its gradient all-reduced
            elif _same(shape[at], out[dim]):
                wrap[t] = f"scatter:{at}"
            else:
                return None
        return dim, wrap
    return None


def _one(size: Any) -> bool:
    return _same(size, 1)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an undecidable symbolic comparison
        return False
