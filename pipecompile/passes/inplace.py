"""inplace: make in-place ops on activations safe to cut around.

A stage receives its inputs as fresh autograd leaves, and a value crossing a cut is sent when its
producing stage finishes. An in-place op on a received value (`ReLU(inplace=True)` after a
residual add in the next stage) then fails ("a leaf Variable that requires grad is being used in
an in-place operation"), and a reader in a third stage would see the value before the mutation.

    functionalize(gm)     aten `foo_(x, ...)` on an activation `x` with no views becomes
                          `foo(x, ...)`, and every later reader of `x` reads the new node: the
                          same values and gradients, and nothing mutates a value that may cross
                          a cut. The new node keeps the in-place node's name.
    mutated_inputs(graph) placeholders that an op still writes to (directly or through a view),
                          with the op: `split` clones those right after the placeholder.

In-place writes to parameters/buffers (BatchNorm's running statistics) and to views are kept.

    shared_state(graph, block_of)  state written in place that several blocks use: linearize
                          joins those blocks (the unsplit model updates it use by use,
                          micro-batch by micro-batch; split, the stages' uses would interleave
                          otherwise, and ranks would hold copies of their own)
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
import torch.fx as fx

from ..ir.nodes import recreate_as_call

__all__ = ["functionalize", "mutated_inputs", "mutated_argument", "is_view", "cross_stage_writes",
           "shared_state"]


def functionalize(gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """A copy of `gm` with in-place ops on view-free activations made out-of-place.

    Returns the new module and the names of the rewritten nodes."""
    graph = gm.graph
    base = _bases(graph)
    aliased = {base[n] for n in graph.nodes if is_view(n) and mutated_argument(n) is None}
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}  # original node -> its current value in the new graph
    new._codegen = copy.deepcopy(gm.graph._codegen)  # e.g. pytree in/out handling
    members: dict[fx.Node, list[fx.Node]] = {}  # base -> the in-place results aliasing it
    rewritten: list[str] = []
    for node in graph.nodes:
        target = _functional_variant(node)
        x = mutated_argument(node)
        root = base.get(x) if x is not None else None
        if target is not None and root is not None and _fresh(root) and root not in aliased:
            value = recreate_as_call(new, node, target, env)
            group = members.setdefault(root, [root])
            group.append(node)
            for alias in group:  # later readers of any alias read the result
                env[alias] = value
            rewritten.append(node.name)
            continue
        env[node] = new.node_copy(node, lambda n: env[n])
    new.lint()
    return fx.GraphModule(gm, new), tuple(rewritten)


def mutated_argument(node: fx.Node) -> fx.Node | None:
    """The node an op writes to in place (its first argument), or None."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        args = node.target._schema.arguments
        if args and args[0].alias_info is not None and args[0].alias_info.is_write:
            first = node.args[0] if node.args else None
            return first if isinstance(first, fx.Node) else None
        return None
    # torch.fx capture: methods `x.foo_()`, modules/functions called with inplace=True
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if node.op == "call_method" and str(node.target).endswith("_") and not str(
            node.target).startswith("_"):
        return first
    if node.kwargs.get("inplace") is True:
        return first
    if node.op == "call_module":
        module = node.graph.owning_module
        try:
            sub = module.get_submodule(str(node.target)) if module is not None else None
        except AttributeError:
            sub = None
        if getattr(sub, "inplace", False) is True:
            return first
    return None


def is_view(node: fx.Node) -> bool:
    """Does `node`'s result alias its first argument (a view, or an in-place op's result)?"""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    if node.op == "call_method":
        return node.target in _VIEW_METHODS or mutated_argument(node) is not None
    return mutated_argument(node) is not None


_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "expand", "squeeze", "unsqueeze",
                 "narrow", "select", "t", "as_strided", "flatten", "unflatten", "view_as",
                 "expand_as", "chunk", "split", "unbind", "__getitem__", "contiguous"}


def mutated_inputs(graph: fx.Graph) -> dict[str, str]:
    """Placeholders an op writes to, directly or through a view: {placeholder: op node name}."""
    base = _bases(graph)
    found: dict[str, str] = {}
    for node in graph.nodes:
        x = mutated_argument(node)
        if x is not None and base[x].op == "placeholder":
            found.setdefault(base[x].name, node.name)
    return found


def _functional_variant(node: fx.Node) -> Any:
    """`aten.foo.overload` for an in-place `aten.foo_.overload`, if that exists."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    packet = node.target.overloadpacket.__name__
    if not packet.endswith("_") or packet.startswith("_"):
        return None
    functional = getattr(torch.ops.aten, packet[:-1], None)
    if functional is None or node.target.namespace != "aten":
        return None
    return getattr(functional, node.target._overloadname, None)


def _fresh(x: fx.Node) -> bool:
    """A value computed by the graph that is not a view of another (placeholders, parameters and
    buffers are written where they live)."""
    return x.op in ("call_function", "call_method", "call_module") and not is_view(x)


def _bases(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Every node's alias root: itself, or the root of the value it views or mutates."""
    base: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        base[node] = base[first] if first is not None and is_view(node) else node
    return base


def cross_stage_writes(graph: fx.Graph, stage_of: dict[str, int]) -> list[tuple[str, str, int]]:
    """In-place writes a reader in another stage would see wrongly: (op, written value, stage).

    A value crosses a cut when its producing stage finishes, and a stage writes only to its own
    tensors (received values it writes to are cloned). So a reader in stage c of an alias m of
    the written value sees the write iff the copy it reads was sent by the writer's stage, and
    it should see it iff it comes after the write in the model's order."""
    base = _bases(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    found = []
    for node in graph.nodes:
        x = mutated_argument(node)
        if x is None or base[x].op not in ("call_function", "call_method", "call_module"):
            continue
        w = stage_of.get(node.name)
        for m in (n for n in graph.nodes if base.get(n) is base[x]):
            for reader in m.users:
                c = stage_of.get(reader.name)
                if reader is node or c is None or c == w:  # None: a reader outside every stage
                    continue
                if _sees_write(m, c, w, stage_of) != (order[reader] > order[node]):
                    found.append((node.name, base[x].name, c))
    return found


def _sees_write(m: fx.Node, c: int | None, w: int | None, stage_of: dict[str, int]) -> bool:
    """Does stage c's copy of alias m hold stage w's write? (Walks m's chain of views.)"""
    local = True
    while True:
        d = stage_of.get(m.name)
        if d != c:
            local = False
        if not local and d == w:
            return True  # sent by the writer's stage after its forward
        first = m.args[0] if m.args and isinstance(m.args[0], fx.Node) else None
        if first is None or not is_view(m):
            return False
        m = first


def shared_state(graph: fx.Graph, stage_of: Mapping[str, int]
                 ) -> list[tuple[str, str, tuple[int, ...]]]:
    """Model state (a get_attr's tensor, BatchNorm's running statistics) that an op writes in
    place and more than one part of `stage_of` (node name -> stage or block) uses: (writing op,
    tensor, the parts using it)."""
    base = _bases(graph)
    users: dict[str, set[int]] = {}
    writers: dict[str, str] = {}
    for node in graph.nodes:
        stage = stage_of.get(node.name)
        if stage is None:
            continue
        for arg, written in _arguments(node):
            root = base.get(arg)
            if root is not None and root.op == "get_attr":
                users.setdefault(str(root.target), set()).add(stage)
                if written:
                    writers.setdefault(str(root.target), node.name)
        if node.op == "call_module" and _tracks_statistics(node):
            users.setdefault(str(node.target), set()).add(stage)  # torch.fx capture
            writers.setdefault(str(node.target), node.name)
    return [(op, name, tuple(sorted(users[name]))) for name, op in writers.items()
            if len(users[name]) > 1]


# composite ops whose schema does not mark the running statistics they update (arguments 3
# and 4) while their argument 5 (`training`, `use_input_stats`) is true
_STATISTICS_WRITERS = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)


def _arguments(node: fx.Node) -> list[tuple[fx.Node, bool]]:
    """(argument node, written in place?) for each node argument of `node`."""
    schema = (node.target._schema if node.op == "call_function"
              and isinstance(node.target, torch._ops.OpOverload) else None)
    statistics = (node.target in _STATISTICS_WRITERS and len(node.args) > 5
                  and node.args[5] is True)
    found = []
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node):
            info = schema.arguments[i].alias_info if schema and i < len(schema.arguments) else None
            found.append((arg, bool(info is not None and info.is_write)
                          or (i == 0 and mutated_argument(node) is arg)
                          or (statistics and i in (3, 4))))
    return found


def _tracks_statistics(node: fx.Node) -> bool:
    """A call of a normalization module that updates running statistics as it trains."""
    module = node.graph.owning_module
    try:
        sub = module.get_submodule(str(node.target)) if module is not None else None
    except AttributeError:
        return False
    return (isinstance(sub, torch.nn.modules.batchnorm._NormBase)
            and sub.track_running_stats and sub.training)
