"""The rules by which passes/tensor_shard.py follows a split value through a stage graph: for
each ATen op a split input may reach, where its output is split, or why it cannot be followed
(the columns it came from then stay replicated).

    rule(node, {input: State}, T, grads) -> State | reason
    attention_heads_of(gm)               -> (query heads, key/value heads) of each attention

`State` is "split along `dim`" (with a fused projection's `parts` still whole in it); each rule
keeps the rank's graph exact: elementwise ops and views into/out of heads keep the split,
attention is split by heads when q, k and v are, a replicated operand must be constant along
the split dim and carry no gradient (else its gradient would be a partial sum).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx as fx

__all__ = ["State", "rule", "node_args", "shape_of", "VIEWS", "SPLITS", "attention_heads_of"]

aten = torch.ops.aten


# -- which ops a split value may pass through -------------------------------------------------

_SAME = {aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default,
         aten.sigmoid.default, aten.neg.default, aten.clone.default, aten.contiguous.default,
         aten.dropout.default, aten.alias.default, aten.to.dtype, aten.to.dtype_layout,
         aten._to_copy.default, aten.pow.Tensor_Scalar, aten.mul.Scalar, aten.div.Scalar,
         aten.add.Scalar, aten.sub.Scalar, aten.type_as.default, aten.cos.default,
         aten.sin.default, aten.exp.default, aten.rsqrt.default, aten.sqrt.default}
_BINARY = {aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_ATTENTION = {aten.scaled_dot_product_attention.default}


@dataclass(frozen=True)
class State:
    """A value split along `dim` (`parts`: the fused parts still whole in it)."""

    dim: int
    parts: tuple[int, ...]
    origins: frozenset[str]  # the column matmuls it came from
    fresh: bool = True  # the split dim is the column's output features, untouched



def node_args(node: fx.Node) -> tuple[Any, ...]:
    """A node's positional arguments, untyped (fx's argument union is not worth narrowing)."""
    return tuple(node.args)


def shape_of(node: Any) -> tuple | None:
    """A node's recorded shape (symbolic sizes kept), None if it has none."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def rule(node: fx.Node, split_in: Mapping[fx.Node, State], degree: int,
         grads: set[fx.Node]) -> State | str:
    """The split of `node`'s output, or why it cannot be followed."""
    target, args = node.target, node_args(node)
    if node.op != "call_function":
        return f"{node.op} {target}"
    first = args[0] if args else None
    s = next(iter(split_in.values()))
    if target is operator.getitem:
        return s  # a split's piece: its state was put on the split node per piece
    if target is aten.dropout.default and args[1] and (len(args) < 3 or args[2]):
        return "dropout (its mask on a shard is not the unsplit model's)"
    if target in _SAME and set(split_in) == {first}:
        return s
    if target in _BINARY or target is aten.cat.default or target in _ATTENTION:
        return _broadcast(node, split_in, grads)
    if len(split_in) != 1 or first not in split_in:
        return f"{target} reads the split value other than as its first input"
    shape, out = shape_of(first), shape_of(node)
    if shape is not None and target in SPLITS:
        return _split(node, s, shape, degree)
    if shape is None or out is None:
        return "no shape recorded"
    if target in VIEWS:
        return _view(s, shape, out, degree)
    if target is aten.transpose.int:
        a, b = (d % len(shape) for d in args[1:3])
        return _moved(s, {a: b, b: a}.get(s.dim, s.dim))
    if target is aten.permute.default:
        return _moved(s, [d % len(shape) for d in args[1]].index(s.dim))
    if target is aten.t.default:
        return _moved(s, 1 - s.dim)
    if target is aten.unsqueeze.default:
        d = args[1] % len(out)
        return _moved(s, s.dim + (1 if d <= s.dim else 0), fresh=s.fresh)
    if target is aten.expand.default:
        return _moved(s, s.dim + len(out) - len(shape), fresh=s.fresh)
    if target is aten.slice.Tensor:
        d = (args[1] if len(args) > 1 else 0) % len(shape)
        return s if d != s.dim else "a slice along the split dim"
    if target in (aten.softmax.int, aten._softmax.default, aten.mean.dim, aten.sum.dim_IntList):
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if any(d % len(shape) == s.dim for d in dims):
            return "a reduction along the split dim"
        softmax = target in (aten.softmax.int, aten._softmax.default)
        keep = softmax or (len(args) > 2 and args[2])
        return s if keep else "a reduction that drops dims"
    return f"no rule for {target}"


def _moved(s: State, dim: int, *, fresh: bool = False) -> State:
    return State(dim, s.parts, s.origins, fresh and s.fresh)


def _view(s: State, shape: tuple, out: tuple, degree: int) -> State | str:
    """A view keeps the split where the split dim is the outermost of the output dims that
    cover it (heads out of features, features out of heads)."""
    outer = 1
    for d in shape[: s.dim]:
        outer = outer * d
    size, prefix = shape[s.dim], 1
    for k, d in enumerate(out):
        if _same(prefix, outer):
            if len(s.parts) > 1:
                return State(k, s.parts, s.origins, s.fresh) if _same(d, size) else \
                    "a view of a fused projection before its split"
            if not (_divides(d, size) or _divides(size, d)) or not _divides(degree, d):
                return f"{d} (heads) does not divide by T={degree}"
            return State(k, s.parts, s.origins, s.fresh and _same(d, size))
        prefix = prefix * d
    return "a view that moves the split dim inward"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an undecidable symbolic comparison
        return False


def _divides(d: Any, n: Any) -> bool:
    try:
        return int(n) % int(d) == 0
    except Exception:  # noqa: BLE001 - symbolic: not a dim this pass splits
        return False


def _broadcast(node: fx.Node, split_in: Mapping[fx.Node, State], grads: set[fx.Node]
               ) -> State | str:
    """Elementwise ops, cat and attention: every split input split alike (right-aligned);
    each other tensor input constant along the split dim and carrying no gradient."""
    out = shape_of(node)
    if out is None:
        return "no shape recorded"
    states = list(split_in.values())
    aligned = {len(out) - len(shape_of(n) or ()) + s.dim for n, s in split_in.items()}
    first = states[0]
    if len(aligned) != 1:
        return "inputs split along different dims"
    if any(len(s.parts) > 1 for s in states) and any(s.parts != first.parts for s in states):
        return "fused projections mixed before their split"
    dim = aligned.pop()
    tensors = list(node.all_input_nodes)  # keyword inputs too (an attention mask)
    if node.target is aten.cat.default:
        if node_args(node)[1] % len(out) == dim if len(node_args(node)) > 1 else dim == 0:
            return "a cat along the split dim"
        if any(t not in split_in for t in node_args(node)[0]):
            return "a cat of split and whole values"
    if node.target in _ATTENTION:
        if any(a not in split_in for a in node_args(node)[:3]) or dim != 1:
            return "attention over heads needs q, k and v split by heads"
    for t in tensors:
        if t in split_in:
            continue
        shape = shape_of(t)
        if shape is None:
            return f"{t.name} has no shape"
        at = dim - (len(out) - len(shape))
        if at >= 0 and not _same(shape[at], 1):
            return f"{t.name} is not constant along the split dim"
        if t in grads:
            return f"{t.name} (replicated) would get a partial gradient"
    fresh = node.target in _BINARY and all(s.fresh for s in states)
    return State(dim, first.parts, frozenset().union(*(s.origins for s in states)), fresh)


def _split(node: fx.Node, s: State, shape: tuple, degree: int) -> State | str:
    """split/chunk: along another dim, each piece split alike; along the split dim, the
    pieces are the fused parts (the column learns them, or they must match)."""
    target, args = node.target, node_args(node)
    given: Any = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
    dim = int(given) % len(shape)
    if dim != s.dim:
        return s
    size = int(shape[dim])
    if target is aten.split.Tensor:
        pieces = [args[1]] * (size // args[1]) + ([size % args[1]] if size % args[1] else [])
    elif target is aten.chunk.default:
        step = -(-size // args[1])
        pieces = [min(step, size - i) for i in range(0, size, step)]
    else:
        pieces = list(args[1])
    if tuple(pieces) == s.parts and all(p % degree == 0 for p in pieces):
        return State(s.dim, (pieces[0],), s.origins, fresh=False)  # each piece: one part
    if len(s.parts) == 1 and s.fresh and len(s.origins) == 1 and all(
            p % degree == 0 for p in pieces):
        (column,) = s.origins
        return f"fused:{column}:{','.join(str(p) for p in pieces)}"
    return f"a split into {pieces} that T={degree} does not divide part by part"


_REPEAT = {aten.expand.default, aten.unsqueeze.default, aten.slice.Tensor, aten.clone.default,
           aten.contiguous.default, aten.alias.default, *VIEWS}


def attention_heads_of(gm: fx.GraphModule) -> tuple[tuple[int, int], ...]:
    """(query heads, key/value heads) of each fused attention of `gm` (q, k as (b, heads, s,
    d)), once per distinct pair: GQA's key/value heads are those before their repeat to the
    query heads (the expand and reshape of `repeat_kv`, or `enable_gqa`'s fewer heads)."""
    found: set[tuple[int, int]] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _ATTENTION:
            continue
        q, k = node_args(node)[:2]
        q_shape = shape_of(q)
        if q_shape is None or len(q_shape) != 4 or not isinstance(q_shape[1], int):
            continue
        kv, at = q_shape[1], k
        while isinstance(at, fx.Node):
            shape = shape_of(at)
            if shape is not None and len(shape) == 4 and isinstance(shape[1], int):
                kv = min(kv, shape[1])
            if at.op != "call_function" or at.target not in _REPEAT:
                break
            at = node_args(at)[0]
        found.add((q_shape[1], kv))
    return tuple(sorted(found))
