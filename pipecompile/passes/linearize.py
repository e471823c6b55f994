"""linearize: group the captured graph's nodes into a chain of blocks and compute each cut's boundary.

Input: a `CapturedModel`. Output: a `LinearGraph`.

Every node gets a role (see `NodeRole`): placeholders and get_attr nodes are available to every
stage; *remat* nodes (deterministic functions of the inputs alone, e.g. a causal mask, position
ids, a sym_size) are recomputed by each stage that needs them rather than sent; all other nodes
are *compute* nodes and belong to exactly one block.

Blocks follow the model's structure (export's `nn_module_stack`). At granularity "layer" (the
default) a node's key is the outermost module on its stack that is either an element of a
container (a repeated layer: `transformer.h.3`) or a leaf module (`lm_head`); "layer+1",
"layer+2", ... go that many module levels deeper inside a layer (attention and MLP become
separate blocks); "op" makes every compute node a block. Consecutive compute nodes with the same
key form one block. Nodes with no module key (functional glue between layers) join the next
block; glue with no user (an in-place buffer update, an assert) joins the previous one. The
blocks from the first to the last use of state updated in place (one BatchNorm used at two
depths) join into one, so that no cut separates its updates.

    nodes:   [emb] [glue] [h.0 ...] [h.1 ...] [glue] [lm_head]
    blocks:   B0   |----B1-------|   B2      |----B3--------|
    cut k sits before block k; boundary(k) = values made before k and used at/after k
"""

from __future__ import annotations

import re
from typing import Mapping

import torch
import torch.fx as fx

from ..ir.nodes import getattr_path as _getattr_path, node_target_str

from ..errors import ConfigError
from ..ir.records import Block, CapturedModel, LinearGraph, NodeRole
from .inplace import shared_state

__all__ = ["linearize", "classify", "GRANULARITIES"]

GRANULARITIES = ("layer", "layer+1", "layer+2", "layer+3", "op")


def linearize(captured: CapturedModel, *, granularity: str = "layer") -> LinearGraph:
    """Blocks of `captured` at `granularity` and the boundary of every cut."""
    if granularity not in GRANULARITIES:
        raise ConfigError(f"granularity={granularity!r} is unknown; use one of {GRANULARITIES}")
    graph = captured.module.graph
    roles = classify(graph)
    layers, leaves = _module_paths(graph)
    compute = [n for n in graph.nodes if roles[n.name] == NodeRole.COMPUTE]

    keys = [_block_key(n, granularity, layers, leaves) for n in compute]
    groups = _join_shared_state(_group(compute, keys), graph)
    blocks = tuple(
        Block(i, name, tuple(n.name for n in nodes)) for i, (name, nodes) in enumerate(groups)
    )
    block_of = {name: b.index for b in blocks for name in b.nodes}
    boundaries = _boundaries(graph, roles, block_of, len(blocks))
    return LinearGraph(captured, blocks, boundaries, roles, block_of, granularity)


def classify(graph: fx.Graph) -> dict[str, str]:
    """Role of every node: input, param, remat, compute or output."""
    roles: dict[str, str] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            roles[node.name] = NodeRole.INPUT
        elif node.op == "get_attr":
            roles[node.name] = NodeRole.PARAM
        elif node.op == "output":
            roles[node.name] = NodeRole.OUTPUT
        elif _rematerializable(node, roles):
            roles[node.name] = NodeRole.REMAT
        else:
            roles[node.name] = NodeRole.COMPUTE
    return roles


def _rematerializable(node: fx.Node, roles: Mapping[str, str]) -> bool:
    """True for a pure, deterministic function call whose inputs are inputs/buffers/remat only.

    Such values (masks, position ids, sizes) are cheap to recompute in every stage and would
    otherwise be sent to every later stage. Values computed from a parameter that requires grad
    are excluded so that their gradient still flows.
    """
    if node.op != "call_function" or not node.users:
        return False
    for arg in node.all_input_nodes:
        role = roles.get(arg.name)
        if role == NodeRole.INPUT or role == NodeRole.REMAT:
            continue
        if role == NodeRole.PARAM and not _is_trainable(arg):
            continue
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            return False
        return True
    return target.__module__ in ("_operator", "operator") or getattr(target, "__name__", "") in (
        "sym_size",
        "getitem",
    )


def _is_trainable(node: fx.Node) -> bool:
    val = node.meta.get("val")
    module = node.graph.owning_module
    try:
        attr = _getattr_path(module, node_target_str(node)) if module is not None else val
    except AttributeError:
        attr = val
    return isinstance(attr, torch.Tensor) and attr.requires_grad


# ---------------------------------------------------------------------------------------------
# block keys

_INDEX = re.compile(r"^\d+$")


def _module_paths(graph: fx.Graph) -> tuple[set[str], set[str]]:
    """(repeated layers, leaf modules) among the module paths the graph's nodes were called in.

    A repeated layer is an indexed element of a container (`h.3` of a ModuleList/Sequential);
    a leaf is a path no other called path lies inside.
    """
    paths = {path for node in graph.nodes for path in _stack(node)}
    layers = {p for p in paths if _INDEX.match(p.rpartition(".")[2])}
    leaves = set()
    for path in paths:
        if not any(q.startswith(path + ".") for q in paths if len(q) > len(path)):
            leaves.add(path)
    return layers, leaves


def _stack(node: fx.Node) -> list[str]:
    """Module paths from outermost to innermost for this node ('' = root omitted)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if v and v[0]]
    if node.op == "call_module" and node.target not in paths:
        paths.append(str(node.target))
    return paths


def _block_key(node: fx.Node, granularity: str, layers: set[str], leaves: set[str]) -> str | None:
    if granularity == "op":
        return f"{'.'.join(_stack(node)[-1:]) or ''}:{node.name}"
    deeper = int(granularity.split("+")[1]) if "+" in granularity else 0
    stack = _stack(node)
    for depth, path in enumerate(stack):
        if path in layers or path in leaves:
            # A repeated layer, or a leaf module outside any layer; refine inside layers only.
            if path in layers and deeper:
                return stack[min(depth + deeper, len(stack) - 1)]
            return path
    return None  # functional glue at the top level


def _group(nodes: list[fx.Node], keys: list[str | None]) -> list[tuple[str, list[fx.Node]]]:
    """Consecutive runs of equal keys; keyless glue joins the next run (users) or the previous."""
    groups: list[tuple[str, list[fx.Node]]] = []
    pending: list[fx.Node] = []  # glue waiting for the next keyed node
    for node, key in zip(nodes, keys):
        if key is None:
            if not node.users and groups and not pending:
                groups[-1][1].append(node)  # side effect of the previous block
            else:
                pending.append(node)
            continue
        if groups and groups[-1][0] == key and not pending:
            groups[-1][1].append(node)
        elif groups and groups[-1][0] == key:
            groups[-1][1].extend(pending + [node])
        else:
            groups.append((key, pending + [node]))
        pending = []
    if pending:
        if groups:
            groups[-1][1].extend(pending)
        else:
            groups.append((f"<ops:{pending[0].name}>", pending))
    return _unique_names(groups)


def _join_shared_state(groups: list[tuple[str, list[fx.Node]]], graph: fx.Graph
                       ) -> list[tuple[str, list[fx.Node]]]:
    """The runs from the first to the last use of state updated in place (one BatchNorm at two
    depths: its running statistics) joined into one block, under the first run's name: stages
    running micro-batches at once would update it in another order than the model, so no cut
    may fall between its uses (`inplace.shared_state`)."""
    while True:
        group_of = {n.name: i for i, (_, nodes) in enumerate(groups) for n in nodes}
        spans = [(min(uses), max(uses)) for _, _, uses in shared_state(graph, group_of)]
        if not spans:
            return groups
        a, b = spans[0]
        joined = (groups[a][0], [n for _, nodes in groups[a:b + 1] for n in nodes])
        groups = [*groups[:a], joined, *groups[b + 1:]]


def _unique_names(groups):
    seen: dict[str, int] = {}
    out = []
    for name, nodes in groups:
        count = seen.get(name, 0)
        seen[name] = count + 1
        out.append((name if count == 0 else f"{name}#{count + 1}", nodes))
    return out


# ---------------------------------------------------------------------------------------------
# liveness


def _boundaries(graph: fx.Graph, roles, block_of, n: int) -> tuple[tuple[str, ...], ...]:
    """For each cut k in 0..n: compute values produced before block k and used at or after it."""
    last_use: dict[str, int] = {}
    for node in graph.nodes:
        if roles[node.name] == NodeRole.OUTPUT:
            user_block = n  # the output belongs to the last stage
        elif roles[node.name] == NodeRole.COMPUTE:
            user_block = block_of[node.name]
        else:
            continue
        for arg in compute_inputs(node, roles):
            last_use[arg.name] = max(last_use.get(arg.name, -1), user_block)
    cuts: list[list[str]] = [[] for _ in range(n + 1)]
    for node in graph.nodes:
        if roles[node.name] != NodeRole.COMPUTE or node.name not in last_use:
            continue
        for k in range(block_of[node.name] + 1, min(last_use[node.name], n - 1) + 1):
            cuts[k].append(node.name)
    return tuple(tuple(c) for c in cuts)


def compute_inputs(node: fx.Node, roles: Mapping[str, str]) -> list[fx.Node]:
    """Compute nodes `node` reads, looking through remat nodes (a stage recomputes those)."""
    out, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        arg = stack.pop()
        if arg.name in seen:
            continue
        seen.add(arg.name)
        role = roles[arg.name]
        if role == NodeRole.COMPUTE:
            out.append(arg)
        elif role == NodeRole.REMAT:
            stack.extend(arg.all_input_nodes)
    return out
