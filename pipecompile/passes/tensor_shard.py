"""Tensor parallelism as a graph pass: choose each parameter's placement over T ranks from a
stage's captured ATen graph (`choose`), then rewrite the graph into what each rank runs
(`lower`): local shards plus Megatron's two collectives.

    choose(gm, T)  -> ShardPlan   column/row pairs found by propagating "this value is split
                                  along dim d" from every matmul with a parameter weight
    lower(gm, plan, copy=f, reduce=g, local=to_local) -> fx.GraphModule (the rank's graph)

A column-parallel matmul (linear's W[out, in] split on out; GPT-2's Conv1D addmm W[in, out]
split on out) makes its output split along its last dim. The split is followed through ops
whose rule is known (elementwise, views into heads, transposes, attention over heads, GQA's
expand of kv heads, a fused projection's split into its parts) until a row-parallel matmul
reduces that dim (its W split on in). Any value of the region that reaches an op without a
rule, a graph output, a shape that T does not divide (heads, kv heads), or mixes with a
parameter-derived replicated value (its gradient would be partial) removes the columns it came
from: those layers stay REPLICATED (never wrong), and the plan says why in `notes`.

A fused projection (qkv in one weight, gate/up) is split part by part: rank r holds the r-th
slice of each part, concatenated, so that its local split gives its q, k and v heads.

Lowering (Megatron-LM, Shoeybi et al. 2019): `copy` (identity forward, all-reduce backward)
on a column's input, `reduce` (all-reduce forward, identity backward) on a row's output before
its bias; view/expand/split sizes of the split dim divided by T. Collectives are handed in as
callables: this module imports no process group. The per-op rules are passes/tensor_rules.py.
With sequence parallelism the lowered graph is then rewritten by passes/sequence_shard.py.

The vocabulary (`vocabulary_layers`): a table read only by embedding lookups and/or by an
output-layer matmul (one whose product leaves the stage, reshaped or cast at most: the
logits) may be split along its vocabulary, rank r holding rows [r V/T, (r+1) V/T) of an
embedding's [V, h] (an output layer's vocabulary dim: linear's out, mm's columns). Whether
it is, is the caller's `vocabulary` choice (the planner prices it: planner/tensor_costs.py);
GPT-2's tied table is one choice for both of its readers, so both split alike or neither.
Lowered as Megatron's VocabParallelEmbedding: `lookup` (indices outside this rank's rows
masked to row 0, looked up, their rows zeroed) then `reduce`; and the output layer as a
column (its input through `copy`) whose partial logits are read in place by a cross entropy
(vocabulary-parallel) and reach the stage's outputs through `output` (all-gathered, or this
rank's slice for the last stage's loss: passes/vocab_loss.py); logits read otherwise are
all-gathered (`gather`: backward this rank's slice). Both exact. With sequence parallelism the lookup's `reduce` becomes a
reduce-scatter along the tokens like a row's (passes/sequence_shard.py).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

__all__ = ["choose", "lower", "vocabulary_layers", "Vocabulary"]

from ..ir.shard_plan import Placement, ShardPlan, VocabularyLayer
from .sequence_shard import shard_sequence
from .tensor_rules import SPLITS, VIEWS, State, node_args, rule, shape_of
from .vocab_loss import Readers, logits_readers, lower_reader, whole

aten = torch.ops.aten

#: the caller's choice for one vocabulary table: (split it?, the priced reason in words)
Vocabulary = Callable[[VocabularyLayer], tuple[bool, str]]


class _Refused(Exception):
    def __init__(self, node: fx.Node, origins: frozenset[str], why: str):
        super().__init__(why)
        self.node, self.origins, self.why = node, origins, why


def _matmul(node: fx.Node, params: Mapping[str, torch.nn.Parameter]
            ) -> tuple[fx.Node, str, int, str | None] | None:
    """(input, weight name, the weight's output-features dim, bias name) of a matmul whose
    weight is a 2-D parameter."""
    def param(arg: Any) -> str | None:
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target in params:
            return str(arg.target)
        return None

    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        x, w, b = (list(node_args(node)) + [None])[:3]
        out, bias = 0, param(b) if b is not None else None
        if b is not None and bias is None:
            return None
    elif node.target is aten.addmm.default and not node.kwargs:
        b, x, w = node_args(node)[:3]
        out, bias = 1, param(b)
        if bias is None:
            return None
    elif node.target is aten.mm.default:
        x, w = node_args(node)[:2]
        out, bias = 1, None
    else:
        return None
    weight = param(w)
    if weight is None or params[weight].dim() != 2 or not isinstance(x, fx.Node):
        return None
    return x, weight, out, bias


def _carries_grad(gm: fx.GraphModule, params: Mapping[str, Any],
                  constant: frozenset[str]) -> set[fx.Node]:
    """Nodes whose value depends on a parameter or a floating-point stage input."""
    marked: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            marked.add(node)
        elif node.op == "placeholder" and node.target not in constant:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                marked.add(node)
        elif any(i in marked for i in node.all_input_nodes):
            marked.add(node)
    return marked


def choose(gm: fx.GraphModule, degree: int, *, exclude: frozenset[str] = frozenset(),
           constant_inputs: frozenset[str] = frozenset(),
           vocabulary: Vocabulary | None = None,
           loss_reads: Mapping[int, str] | None = None) -> ShardPlan:
    """The placements of `gm`'s parameters over `degree` ranks (module docstring); parameters
    in `exclude` (tied to another stage's copy) stay whole; `constant_inputs` are stage inputs
    that need no gradient (a floating-point input otherwise counts as carrying one);
    `vocabulary` chooses for each vocabulary table whether it is split (None: none is),
    priced with `loss_reads` (`vocabulary_layers`)."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    reads: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            reads[node.target] = reads.get(node.target, 0) + len(node.users)
    ids: dict[int, int] = {}
    for p in params.values():
        ids[id(p)] = ids.get(id(p), 0) + 1
    exclusive = {n for n, p in params.items()
                 if reads.get(n) == 1 and ids[id(p)] == 1 and n not in exclude}
    matmuls = {}
    for node in gm.graph.nodes:
        found = _matmul(node, params)
        if found is not None and found[1] in exclusive and (found[3] is None
                                                            or found[3] in exclusive):
            matmuls[node.name] = found
    grads = _carries_grad(gm, params, constant_inputs)
    columns = {name for name, (_, w, out, _) in matmuls.items()
               if params[w].shape[out] % degree == 0}
    parts: dict[str, tuple[int, ...]] = {}
    notes: list[tuple[frozenset[str], str]] = []
    while True:
        try:
            split, rows = _propagate(gm, degree, matmuls, columns, parts, grads, params)
            break
        except _Refused as refused:
            if refused.why.startswith("fused:") and not _fused(refused.why).items() <= \
                    parts.items():
                parts.update(_fused(refused.why))
                continue
            columns -= refused.origins
            notes.append((refused.origins, f"{_where(gm, refused.origins, matmuls)}: "
                                           f"{refused.why} at {refused.node.name}"))
    used = {c for c in columns if any(c in s.origins for s in split.values())}
    placements: dict[str, Placement] = {}
    for name in sorted(used):
        _, weight, out, bias = matmuls[name]
        size = params[weight].shape[out]
        fused = parts.get(name, (int(size),))
        placements[weight] = Placement(out, fused, "column")
        if bias is not None:
            placements[bias] = Placement(0, fused, "column bias")
    for name in rows:
        _, weight, out, _ = matmuls[name]
        placements[weight] = Placement(1 - out, (params[weight].shape[1 - out],), "row")
    embeddings: list[str] = []
    outputs: list[str] = []
    chosen: list[str] = []
    for layer, dim, embeds, outs, biases in (vocabulary_layers(
            gm, degree, taken=frozenset(placements) | exclude, loss_reads=loss_reads)
            if vocabulary else ()):
        split_it, why = vocabulary(layer) if vocabulary else (False, "")
        chosen.append(why)
        if split_it:
            placements[layer.name] = Placement(dim, (layer.vocab,), "vocabulary")
            placements.update({b: Placement(0, (layer.vocab,), "vocabulary bias")
                               for b in biases})
            embeddings += embeds
            outputs += outs
    return ShardPlan(degree, placements, tuple(sorted(used)), tuple(rows),
                     {n: s.dim for n, s in split.items()},
                     tuple(text for origins, text in notes if not origins <= set(outputs)),
                     tuple(embeddings), tuple(outputs), tuple(chosen))


# ops that carry an output layer's product to the stage's outputs (reshaped or cast at most)
_CARRY = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.slice.Tensor, aten.clone.default, aten.contiguous.default, aten.alias.default,
          aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default}


def _leaves(node: fx.Node) -> bool:
    """Whether `node`'s value leaves the stage through ops that only reshape or cast it."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op == "output":
            return True
        if user.op != "call_function" or user.target not in _CARRY or \
                node_args(user)[0] is not node:
            return False
        node = user
    return False


def _read_as_logits(node: fx.Node, vocab: int) -> bool:
    """Whether an output layer's product is the stage's logits: it leaves the stage (reshaped
    or cast at most) and/or is read by a cross entropy (passes/vocab_loss.py), nothing else."""
    found = logits_readers(node, vocab)
    return _leaves(node) or (found is not None and bool(found.losses or found.outputs))


def _parallel_loss(gm: fx.GraphModule, node: fx.Node, vocab: int,
                   loss_reads: Mapping[int, str] | None) -> bool:
    """Whether the logits `node` are never gathered in a training step split: each reader a
    cross entropy lowered in place, and each stage output they reach read by the pipeline's
    loss only through a cross entropy, or not at all (`loss_reads`)."""
    found = logits_readers(node, vocab)
    if found is None:
        return False
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    reads = loss_reads or {}
    return all(reads.get(i, "other") in ("cross entropy", "none")
               for i, a in enumerate(flat) if a in found.outputs)


def _count(shape: tuple | None) -> int:
    """Elements of a recorded shape (a symbolic size by its hint, else 1)."""
    total = 1
    for d in shape or ():
        try:
            total *= int(d)
        except Exception:  # noqa: BLE001 - a symbolic size without a hint
            hint = getattr(getattr(d, "node", None), "hint", None)
            total *= int(hint) if hint is not None else 1
    return total


def vocabulary_layers(gm: fx.GraphModule, degree: int, *, taken: frozenset[str] = frozenset(),
                      loss_reads: Mapping[int, str] | None = None
                      ) -> list[tuple[VocabularyLayer, int, list[str], list[str], list[str]]]:
    """Each table of `gm` that could be split along its vocabulary over `degree` ranks (module
    docstring), not one of `taken`: (the layer, its vocabulary dim, the embedding nodes and the
    output-layer nodes that read it, the output layers' biases). `loss_reads`: how the
    pipeline's loss reads each flat output of `gm` ("cross entropy", "none", else "other";
    None: unknown, every output "other"), for the layer's `loss` (passes/vocab_loss.py)."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    readers: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            readers.setdefault(str(node.target), []).extend(node.users)
    ids: dict[int, int] = {}  # names read of each tensor (a tie read under two: left whole)
    for n, users in readers.items():
        ids[id(params[n])] = ids.get(id(params[n]), 0) + (1 if users else 0)
    found = []
    for name, users in readers.items():
        p = params[name]
        if name in taken or p.dim() != 2 or ids[id(p)] != 1 or not users:
            continue
        embeds, outs, biases, dims, tokens, roles = [], [], [], set(), 0, []
        parallel = True
        for user in users:
            args = node_args(user)
            if user.op == "call_function" and user.target is aten.embedding.default and \
                    args[0].target == name and not any(args[3:5]) and not user.kwargs:
                embeds.append(user.name)
                dims.add(0)
                tokens = max(tokens, _count(shape_of(args[1])))
                continue
            found_mm = _matmul(user, params)
            if found_mm is None or found_mm[1] != name or not _read_as_logits(
                    user, int(p.shape[found_mm[2]])):
                break
            x, _, out, bias = found_mm
            if bias is not None and (bias in taken or len(readers.get(bias, ())) != 1
                                     or ids[id(params[bias])] != 1):
                break
            outs.append(user.name)
            parallel = parallel and _parallel_loss(gm, user, int(p.shape[out]), loss_reads)
            biases += [bias] if bias is not None else []
            dims.add(out)
            tokens = max(tokens, _count((shape_of(x) or (1,))[:-1]))
        else:
            if len(dims) != 1:
                continue
            dim = dims.pop()
            vocab, hidden = int(p.shape[dim]), int(p.shape[1 - dim])
            if vocab % degree:
                continue
            roles = (["embedding"] if embeds else []) + (["output"] if outs else [])
            found.append((VocabularyLayer(name, vocab, hidden, tuple(roles), tokens,
                                          p.element_size(),
                                          "parallel" if parallel else "gathered"),
                          dim, embeds, outs, biases))
    return found


def _fused(why: str) -> dict[str, tuple[int, ...]]:
    _, column, sizes = why.split(":")
    return {column: tuple(int(s) for s in sizes.split(","))}


def _where(gm: fx.GraphModule, origins: frozenset[str], matmuls: Mapping[str, Any]) -> str:
    names = sorted(matmuls[o][1].rsplit(".", 1)[0] for o in origins if o in matmuls)
    return ", ".join(names) or "a layer"


def _propagate(gm: fx.GraphModule, degree: int, matmuls: Mapping[str, Any],
               columns: set[str], parts: Mapping[str, tuple[int, ...]], grads: set[fx.Node],
               params: Mapping[str, Any]) -> tuple[dict[str, State], list[str]]:
    """Follow the split from every column through the graph, in order; raise `_Refused` at
    the first node that cannot take it."""
    state: dict[fx.Node, State] = {}
    rows: list[str] = []
    for node in gm.graph.nodes:
        split_in = {i: state[i] for i in node.all_input_nodes if i in state}
        origins = frozenset().union(*(s.origins for s in split_in.values())) if split_in \
            else frozenset()
        if node.name in matmuls and (node.name in columns or split_in):
            x, weight, out, _ = matmuls[node.name]
            if node.name in columns and not split_in:
                size = params[weight].shape[out]
                state[node] = State(len(shape_of(node) or ()) - 1, parts.get(node.name, (size,)),
                                     frozenset({node.name}))
                continue
            s = state.get(x)
            rank = len(shape_of(x) or ())
            if (s is None or s.dim != rank - 1 or len(s.parts) > 1
                    or set(split_in) != {x} or params[weight].shape[1 - out] % degree):
                raise _Refused(node, origins, "a matmul reads the split value other than "
                                              "along its input features")
            rows.append(node.name)
            continue
        if not split_in:
            continue
        if node.op == "output":
            raise _Refused(node, origins, "a split value leaves the stage")
        result = rule(node, split_in, degree, grads)
        if isinstance(result, str):
            raise _Refused(node, origins, result)
        state[node] = result
    return {n.name: s for n, s in state.items()}, rows


def lower(gm: fx.GraphModule, plan: ShardPlan, *, copy: Callable, reduce: Callable,
          local: Callable | None = None, sequence: Mapping[str, Callable] | None = None,
          vocab: Mapping[str, Callable] | None = None) -> fx.GraphModule:
    """The graph rank r runs for `plan` (module docstring); the parameters stay `gm`'s
    (the caller replaces them by their local slices). `local`, if given, wraps every
    parameter read (a DTensor parameter's local tensor). `sequence`, if given, are the
    sequence-parallel collectives: the tokens between each row and the next column are
    split too (passes/sequence_shard.py). `vocab`: rank r's `lookup(local table, indices,
    padding_idx)` (its rows' part of an embedding) and `gather(x, dim)` (all-gather,
    backward this rank's slice), needed when `plan` splits a vocabulary."""
    if (plan.embeddings or plan.outputs) and vocab is None:
        raise ValueError("a plan that splits a vocabulary is lowered with `vocab`")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    T = plan.degree
    copied: dict[fx.Node, fx.Node] = {}
    params = dict(gm.named_parameters(remove_duplicate=False))
    split = plan.split
    readers: dict[fx.Node, Readers] = {}  # each split output layer's readers
    mine: dict[fx.Node, fx.Node] = {}  # its logits and their reshapes, this rank's slices
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params and local is not None:
            got = graph.get_attr(node.target)
            got.meta = dict(node.meta)
            env[node] = graph.call_function(local, (got,))
            env[node].meta = dict(node.meta)
            continue
        if any(lower_reader(graph, node, r, mine, env, T, vocab)
               for r in readers.values() if vocab is not None):
            continue
        args = fx.map_arg(node_args(node), lambda n: env[n])
        kwargs = fx.map_arg(node.kwargs, lambda n: env[n])
        if node.name in plan.embeddings and vocab is not None:
            part = graph.call_function(vocab["lookup"], (*args[:2], (list(args) + [-1])[2]))
            part.meta = dict(node.meta)
            env[node] = graph.call_function(reduce, (part,))
            env[node].meta = dict(node.meta)
            continue
        if node.name in plan.columns or node.name in plan.outputs:
            x = node_args(node)[0] if node.target is aten.linear.default or \
                node.target is aten.mm.default else node_args(node)[1]
            if x not in copied:
                copied[x] = graph.call_function(copy, (env[x],))
            at = 0 if node.target is not aten.addmm.default else 1
            args = (*args[:at], copied[x], *args[at + 1:])
        if node.name in plan.outputs and vocab is not None:
            part = graph.node_copy(node, lambda n: env[n])
            part.args, part.kwargs = args, kwargs
            found = logits_readers(node, int((shape_of(node) or (0,))[-1]))
            if found is not None and "output" in vocab:  # read in place, never gathered
                readers[node], mine[node] = found, part
                whole(graph, node, found, mine, env, vocab)
                continue
            env[node] = graph.call_function(vocab["gather"],
                                            (part, len(shape_of(node) or (0,)) - 1))
            env[node].meta = dict(node.meta)
            continue
        if node.name in plan.rows:
            env[node] = _row(graph, node, args, reduce)
            continue
        if node.name in split or (node.op == "call_function" and node.target in SPLITS
                                  and node_args(node)[0].name in split):
            args = _local_sizes(node, args, split, T)
        new = graph.node_copy(node, lambda n: env[n])
        new.args, new.kwargs = args, kwargs
        env[node] = new
    lowered = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    if sequence is not None and plan.rows:
        lowered = shard_sequence(lowered, T, sequence, copy=copy, reduce=reduce)
    return lowered


def _row(graph: fx.Graph, node: fx.Node, args: tuple, reduce: Callable) -> fx.Node:
    """A row-parallel matmul: the local product, all-reduced, then the bias (added once)."""
    if node.target is aten.addmm.default:
        bias, x, w = args[:3]
        y = graph.call_function(aten.mm.default, (x, w))
    elif node.target is aten.mm.default:
        bias, (x, w) = None, args[:2]
        y = graph.call_function(aten.mm.default, (x, w))
    else:
        x, w, bias = (list(args) + [None])[:3]
        y = graph.call_function(aten.linear.default, (x, w))
    y = graph.call_function(reduce, (y,))
    y.meta = dict(node.meta)
    if bias is not None:
        y = graph.call_function(aten.add.Tensor, (y, bias))
    y.meta = dict(node.meta)
    return y


def _local_sizes(node: fx.Node, args: tuple, split: Mapping[str, int], T: int) -> tuple:
    """The size arguments of a region op at one rank: the split dim's size divided by T."""
    target = node.target
    if target in VIEWS or target is aten.expand.default:
        sizes = list(args[1])
        k = split[node.name]
        if isinstance(sizes[k], int) and sizes[k] != -1:
            sizes[k] = sizes[k] // T
        elif isinstance(sizes[k], fx.Node):
            raise AssertionError(f"{node.name}: a symbolic size on the split dim")
        return (args[0], sizes, *args[2:])
    if target in SPLITS:
        given = node_args(node)
        source = given[0]
        dim = (given[2] if len(given) > 2 else 0) % len(shape_of(source) or (0,))
        if dim != split[source.name]:
            return args
        if target is aten.split.Tensor:
            return (args[0], args[1] // T, *args[2:])
        if target is aten.split_with_sizes.default:
            return (args[0], [p // T for p in args[1]], *args[2:])
    return args
