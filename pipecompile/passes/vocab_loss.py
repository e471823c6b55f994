"""Vocabulary-parallel cross entropy as a graph pass: logits split along their vocabulary (an
output layer passes/tensor_shard.py splits) read only by a cross entropy are never gathered.

    logits_readers(node, vocab) -> Readers | None   who reads a logits value, if lowerable
    lower_reader(graph, n, readers, mine, env, T, vocab) one reader at one rank
    lower_loss(gm, split, T, vocab) -> fx.GraphModule | None   a traced loss graph's form

A logits value (last dim: the vocabulary V) is lowerable when every reader is one of: ops that
only reshape or cast it keeping V as the last dim (view/reshape, a float cast, contiguous, a
slice of another dim: transformers' label shift), `aten.cross_entropy_loss` of a 2-D input
(any reduction, any ignore_index, class weights of shape [V] the loss holds whole, any
constant label smoothing), or the graph's output. Lowered (Megatron-LM's
vocab_parallel_cross_entropy): the reshapes run on this rank's [.., V/T] slice, the cross
entropy becomes `vocab["cross_entropy"](local, target, reduction, ignore_index)` (with
`weight=` and `label_smoothing=` where given; all-reduces over the T ranks of the max, the
target's logit, the sum of exponentials and, smoothed, the sum of the (weighted) logits;
backward: no communication), and an output reads `vocab["output"](local, dim)`: the all-gather,
or this rank's slice in a training forward of the last stage whose loss reads the logits in
this form or not at all (runtime/vocab_loss.py decides at run time). Anything else reading
the logits (argmax, a loss that is not cross entropy, a smoothing computed from a tensor):
None, and the caller keeps today's gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from .tensor_rules import node_args, shape_of

__all__ = ["Readers", "logits_readers", "lower_reader", "whole", "lower_loss"]

aten = torch.ops.aten

_RESHAPE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_KEEP = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.to.dtype,
         aten.to.dtype_layout, aten._to_copy.default}


@dataclass(frozen=True)
class Readers:
    """The readers of one logits value: `chain` the reshapes and casts between it and the
    readers (graph order), `losses` the cross entropies, `outputs` the values (the logits or
    a chain node) the graph's output reads whole."""

    chain: tuple[fx.Node, ...]
    losses: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]


def _float_cast(node: fx.Node) -> bool:
    dtype = node.kwargs.get("dtype", node_args(node)[1] if node.target is aten.to.dtype
                            and len(node.args) > 1 else None)
    return dtype is None or getattr(dtype, "is_floating_point", False)


def _cross_entropy(node: fx.Node, source: fx.Node) -> bool:
    """Whether `node` is a cross entropy of the 2-D `source` that lowers (module docstring)."""
    if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
        return False
    weight, smoothing = _options(node)
    shape = shape_of(source)
    if shape is None or len(shape) != 2 or isinstance(smoothing, fx.Node):
        return False
    if weight is not None and (weight is source or not isinstance(weight, fx.Node)
                               or tuple(shape_of(weight) or ()) != (shape[-1],)):
        return False
    return node_args(node)[0] is source and node_args(node)[1] is not source


def _options(node: fx.Node) -> tuple[Any, Any]:
    """A cross entropy's class weights (None: none) and label smoothing (a float or a node)."""
    args = list(node_args(node)) + [None] * 6
    kwargs: dict[str, Any] = dict(node.kwargs)
    weight = kwargs.get("weight", args[2])
    smoothing = kwargs.get("label_smoothing", args[5] if args[5] is not None else 0.0)
    return weight, smoothing


def logits_readers(node: fx.Node, vocab: int) -> Readers | None:
    """Who reads `node` (logits whose last dim is the `vocab`), if each is a reshape or cast
    keeping that dim, a lowerable cross entropy or the output; else None."""
    chain: list[fx.Node] = []
    losses: list[fx.Node] = []
    outputs: list[fx.Node] = []
    todo = [node]
    while todo:
        value = todo.pop()
        for user in value.users:
            if user.op == "output":
                outputs.append(value)
                continue
            if _cross_entropy(user, value):
                losses.append(user)
                continue
            args = node_args(user)
            shape = shape_of(user)
            if (user.op != "call_function" or not args or args[0] is not value
                    or any(isinstance(a, fx.Node) for a in args[1:])
                    or any(isinstance(a, fx.Node) for a in user.kwargs.values())
                    or shape is None or not shape or shape[-1] != vocab):
                return None
            if user.target in _RESHAPE:
                sizes = list(args[1])
                if not sizes or not isinstance(sizes[-1], int) or sizes[-1] not in (vocab, -1):
                    return None
            elif user.target is aten.slice.Tensor:
                rank = len(shape_of(value) or ())
                dim = (args[1] if len(args) > 1 else 0) % max(rank, 1)
                if dim == rank - 1:
                    return None
            elif user.target not in _KEEP or not _float_cast(user):
                return None
            chain.append(user)
            todo.append(user)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return Readers(tuple(sorted(set(chain), key=order.__getitem__)), tuple(losses),
                   tuple(dict.fromkeys(outputs)))


def lower_reader(graph: fx.Graph, n: fx.Node, readers: Readers, mine: dict[fx.Node, fx.Node],
                 env: dict[fx.Node, fx.Node], degree: int,
                 vocab: Mapping[str, Callable]) -> bool:
    """Emit `n` into `graph` if it is one of `readers` (graph order; `mine` maps the logits
    and the chain emitted so far to their rank-local slices): a chain node on the local
    slice, a cross entropy vocabulary-parallel, a value the output reads through
    `vocab["output"]` (into `env`). False: `n` is none of them."""
    if n in readers.chain:
        args = list(node_args(n))
        if n.target in _RESHAPE:
            sizes = list(args[1])
            sizes[-1] = sizes[-1] // degree if sizes[-1] != -1 else -1
            args[1] = sizes
        target: Any = n.target
        new = graph.call_function(target, (mine[args[0]], *args[1:]), dict(n.kwargs))
        new.meta = dict(n.meta)
        mine[n] = new
        whole(graph, n, readers, mine, env, vocab)
        return True
    if n in readers.losses:
        args = list(node_args(n)) + [None] * 6
        given: dict[str, Any] = dict(n.kwargs)
        reduction = int(given.get("reduction", args[3] if args[3] is not None else 1))
        ignore = int(given.get("ignore_index", args[4] if args[4] is not None else -100))
        weight, smoothing = _options(n)
        options: dict[str, Any] = {}
        if weight is not None:  # the whole class weights: w[target] is a local lookup
            options["weight"] = env[weight]
        if float(smoothing):
            options["label_smoothing"] = float(smoothing)
        env[n] = graph.call_function(vocab["cross_entropy"],
                                     (mine[args[0]], env[args[1]], reduction, ignore), options)
        env[n].meta = dict(n.meta)
        return True
    return False


def whole(graph: fx.Graph, value: fx.Node, readers: Readers, mine: dict[fx.Node, fx.Node],
          env: dict[fx.Node, fx.Node], vocab: Mapping[str, Callable]) -> None:
    """`value` as the graph's output reads it (`vocab["output"]` of its local slice), if it
    does."""
    if value in readers.outputs:
        env[value] = graph.call_function(vocab["output"],
                                         (mine[value], len(shape_of(value) or (0,)) - 1))
        env[value].meta = dict(value.meta)


def lower_loss(gm: fx.GraphModule, split: Mapping[int, int], degree: int,
               vocab: Mapping[str, Callable]) -> fx.GraphModule | None:
    """A traced loss graph (placeholders: the last stage's flat outputs, then the target) run
    on the local slices of the placeholders in `split` (index -> its vocabulary dim, the
    last): each read only by a lowerable cross entropy (module docstring); None otherwise
    (the caller gathers them). A placeholder nothing reads needs no lowering."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found: dict[fx.Node, Readers] = {}
    for index, dim in split.items():
        node = placeholders[index]
        shape = shape_of(node)
        if not node.users:
            continue
        if shape is None or dim != len(shape) - 1:
            return None
        readers = logits_readers(node, int(shape[-1]))
        if readers is None or readers.outputs or not readers.losses:
            return None
        found[node] = readers
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    mine: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if any(lower_reader(graph, node, r, mine, env, degree, vocab)
               for r in found.values()):
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node in found:
            mine[node] = env[node]
    lowered = fx.GraphModule(gm, graph, class_name="VocabParallelLoss")
    lowered.graph._codegen = gm.graph._codegen  # the traced loss's pytree in/out spec
    lowered.recompile()
    return lowered
