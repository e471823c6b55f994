"""split: one fx.GraphModule per stage, with explicit named inputs and outputs.

Input: a `LinearGraph`, the stage bounds chosen by `partition` (stage j holds blocks
[bounds[j], bounds[j+1])) and one device per stage. Output: a `StagedProgram`.

Each stage graph has one placeholder per value it reads from elsewhere, named after that value:
model inputs (fed to every stage directly) and values produced by earlier stages (sent straight
from the producing stage, so a skip connection never passes through the stages in between). It
returns, as a tuple, the values later stages read; the last stage returns the model's flat
outputs. Parameters and buffers keep their original dotted names (`transformer.h.3.attn.c_attn.
weight`); a stage reads only those its nodes use. Remat nodes (masks, sizes) are recomputed in each
stage that reads them.

A parameter reached under several names (a tied weight such as GPT-2's `wte`/`lm_head`) or read
by several stages under one name (an encoder's weight reused, transposed, by the decoder) is a
tie (`StagedProgram.ties`): each stage that reads it holds its own leaf (an alias of the same
memory on the same device, a copy on another device or rank), and the runtime sums their
gradients in stage order before the step.

The records (`Stage`, `TiedParameter`, `StagedProgram`) live in `ir/records.py`, beside the other
IR every floor reads. `TensorPlacement` and `tensor_copies` are how a stage's tensors are placed
and their copies found; outputs/persist.py places a loaded program's stages with them too.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from ..errors import ConfigError, InPlaceError
from ..ir.records import LinearGraph, NodeRole, Stage, StagedProgram, TiedParameter
from .inplace import cross_stage_writes, mutated_inputs
from .linearize import compute_inputs
from ..ir.nodes import getattr_path as _getattr_path

__all__ = ["BlockWiring", "block_wiring", "split", "TensorPlacement", "tensor_copies"]


def split(
    linear: LinearGraph, bounds: Sequence[int], devices: Sequence[torch.device | str], *,
    placed: dict | None = None,
) -> StagedProgram:
    """Split `linear` at `bounds` into stages placed on `devices` (one per stage). `placed`
    holds the device copies of the model's tensors made so far, by (id(tensor), device): given,
    a copy is made once for all the programs that share the table (and recorded in it)."""
    n = linear.num_blocks
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n or any(
        a >= b for a, b in zip(bounds, bounds[1:])
    ):
        raise ConfigError(f"stage bounds {bounds} must rise strictly from 0 to {n}")
    if len(devices) != len(bounds) - 1:
        raise ConfigError(f"{len(bounds) - 1} stages need {len(bounds) - 1} devices, got {len(devices)}")
    gm = linear.captured.module
    graph = gm.graph
    wiring = block_wiring(linear)
    stage_of_block = _stage_of_block(bounds)
    stage_of = {name: stage_of_block[b] for name, b in wiring.home.items()}
    last = len(bounds) - 1 - 1
    output_node = graph.find_nodes(op="output")[0]

    _check_writes(graph, stage_of, output_node, last)
    producer, consumers = wiring.at(bounds)
    placement = TensorPlacement([torch.device(d) for d in devices],
                           {} if placed is None else placed)
    traced = linear.captured.traced_device or _held_device(gm)
    stages = []
    for j in range(len(bounds) - 1):
        members = [n for n in graph.nodes if stage_of.get(n.name) == j]
        if j == last:  # the last stage returns the model's flat outputs
            outputs = linear.captured.output_names
        else:
            outputs = tuple(v for v in consumers if producer[v] == j)
        stage_graph, inputs, attrs = _stage_graph(
            members, outputs, output_node, j == last, linear.roles, stage_of, j
        )
        root = {target: placement.get(j, target, _getattr_path(gm, target)) for target in attrs}
        module = fx.GraphModule(root, stage_graph, class_name=f"Stage{j}")
        if _clone_written_inputs(module.graph):
            module.recompile()
        _meta_to(module, placement.devices[j], traced)
        names = tuple(name for name, _ in module.named_parameters())
        stages.append(Stage(j, module, placement.devices[j], inputs, outputs,
                            tuple(range(bounds[j], bounds[j + 1])), names))

    tensors, ties = tensor_copies(gm, stages)
    return StagedProgram(linear.captured, linear, bounds, tuple(stages), producer,
                         consumers, ties, tensors)


@dataclass(frozen=True)
class BlockWiring:
    """Where each compute value of a `LinearGraph` is computed and which blocks read it: the
    one source of a program's wiring, for any cut (`at`). A `getitem` of a multi-output node
    runs in that node's block, so a tuple (an opaque module's outputs, an op's several results)
    never crosses a cut: its tensors do, each with its own gradient."""

    home: Mapping[str, int]  # compute node -> the block it runs in
    readers: Mapping[str, tuple[int, ...]]  # value read by another block -> those blocks
    #                                         (graph order; the model output: the last block)

    def at(self, bounds: Sequence[int]) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
        """The stage that produces each value read by another stage, and the stages that read
        it, when stage j holds blocks [bounds[j], bounds[j+1])."""
        stage = _stage_of_block(bounds)
        producer: dict[str, int] = {}
        consumers: dict[str, tuple[int, ...]] = {}
        for name, blocks in self.readers.items():
            src = stage[self.home[name]]
            dsts = tuple(sorted({stage[b] for b in blocks} - {src}))
            if dsts:
                producer[name], consumers[name] = src, dsts
        return producer, consumers


def block_wiring(linear: LinearGraph) -> BlockWiring:
    """The `BlockWiring` of `linear`'s graph (remat nodes looked through: each stage that needs
    one recomputes it)."""
    graph, roles = linear.captured.module.graph, linear.roles
    home = dict(linear.block_of)
    for node in graph.nodes:
        source = node.args[0] if node.args else None
        if (node.op == "call_function" and node.target is operator.getitem
                and isinstance(source, fx.Node) and node.name in home and source.name in home):
            home[node.name] = home[source.name]
    readers: dict[str, set[int]] = {}
    for node in graph.nodes:
        role = roles[node.name]
        if role not in (NodeRole.COMPUTE, NodeRole.OUTPUT):
            continue
        block = linear.num_blocks - 1 if role == NodeRole.OUTPUT else home[node.name]
        for arg in compute_inputs(node, roles):
            if home[arg.name] != block:
                readers.setdefault(arg.name, set()).add(block)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    return BlockWiring(home, {v: tuple(sorted(b)) for v, b in
                              sorted(readers.items(), key=lambda kv: order[kv[0]])})


def _stage_of_block(bounds: Sequence[int]) -> list[int]:
    return [j for j in range(len(bounds) - 1) for _ in range(bounds[j], bounds[j + 1])]


def _stage_graph(members, outputs, output_node, is_last, roles, stage_of, j):
    """A stage's graph; returns (graph, input value names, attribute targets it reads)."""
    inputs: set[str] = set()
    copied: set[str] = set(n.name for n in members)  # nodes copied into this stage

    def discover(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            role = roles[arg.name]
            if role == NodeRole.INPUT or (role == NodeRole.COMPUTE and stage_of[arg.name] != j):
                inputs.add(arg.name)
            elif arg.name not in copied:  # a parameter/buffer, or a remat node to recompute
                copied.add(arg.name)
                discover(arg)

    for node in members + ([output_node] if is_last else []):
        discover(node)

    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    source = output_node.graph  # the model's graph (its output node is read by the last stage)
    ordered = list(source.nodes)  # the original order is topological
    for node in ordered:
        if node.name in inputs:
            env[node.name] = graph.placeholder(node.name)
            env[node.name].meta = dict(node.meta)
    attrs = []
    for node in ordered:
        if node.name in copied:
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
            if node.op in ("get_attr", "call_module"):
                attrs.append(node.target)
    if is_last:
        result = [env[x.name] if isinstance(x, fx.Node) else x for x in output_node.args[0]]
    else:
        result = [env[name] for name in outputs]
    graph.output(tuple(result))
    graph.lint()
    input_names = tuple(n.name for n in ordered if n.name in inputs)
    return graph, input_names, attrs


def _clone_written_inputs(graph: fx.Graph) -> bool:
    """Clone each received value an op writes to in place, right after the placeholders.

    A stage's inputs are autograd leaves (and may be shared with other readers): an in-place op
    must write to a copy; autograd routes the copy's gradient back to the leaf exactly."""
    written = mutated_inputs(graph)
    if not written:
        return False
    placeholders = list(graph.find_nodes(op="placeholder"))
    for node in placeholders:
        val = node.meta.get("val")
        if node.name not in written or (val is not None and not isinstance(val, torch.Tensor)):
            continue
        with graph.inserting_after(placeholders[-1]):
            copy = graph.call_function(torch.ops.aten.clone.default, (node,))
        copy.meta = dict(node.meta)
        node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
    return True


def _held_device(gm: fx.GraphModule) -> torch.device | None:
    """The one device the captured module's parameters and buffers are on (the device its
    graph's literals name, such as a position table made on the embedding's device), or None
    when they are on several (a literal may then mean any of them: left as it is)."""
    devices = {t.device for t in (*gm.parameters(), *gm.buffers())}
    return devices.pop() if len(devices) == 1 else None


def _meta_to(module: fx.GraphModule, device: torch.device,
             traced: torch.device | None) -> None:
    """Point the device literals of the captured graph (a position table made on its
    embedding's device) at the stage's device, in the stage graph and the graphs of its
    higher-order ops (`wrap_with_set_grad_enabled` bodies): `device=meta`, or the device the
    model's tensors were on, or claimed, while traced (`traced`, see capture/claimed_device.py): a
    model left on the CPU and compiled for a GPU otherwise made such tables on the CPU."""
    meta = torch.device("meta")
    claimed = {meta} | ({traced} if traced is not None else set())

    def move(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value in claimed else value

    def rewrite(gm: fx.GraphModule) -> bool:
        changed = False
        for node in gm.graph.nodes:
            args, kwargs = (fx.node.map_aggregate(node.args, move),
                            fx.node.map_aggregate(node.kwargs, move))
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                changed = True
        if changed:
            gm.recompile()
        return changed

    rewrite(module)
    for name, body in list(module.named_children()):
        if isinstance(body, fx.GraphModule):  # shared with the captured graph: a stage copy
            mine = copy.deepcopy(body)
            if rewrite(mine):
                setattr(module, name, mine)


def _check_writes(graph: fx.Graph, stage_of: Mapping[str, int], output_node, last: int) -> None:
    """Refuse cuts that would let a stage miss another stage's in-place write."""
    hazards = cross_stage_writes(graph, {**stage_of, output_node.name: last})
    if hazards:
        op, value, reader = hazards[0]
        raise InPlaceError(
            f"in-place op {op!r} (stage {stage_of.get(op)}) writes to {value!r} or a view of it, "
            f"a value stage {reader} reads across a cut and would see without the write (or "
            f"with it, before it happens). A write through a view cannot be made out-of-place: "
            f"move the cut (split_points=...) so that {value!r}'s readers and its in-place update "
            f"are in one stage, or make the op out-of-place in the model"
        )


class TensorPlacement:
    """The tensor each stage uses for an attribute: the original, or one copy per device; a
    trained parameter that a second stage on the same device reads is an alias there (its own
    autograd leaf over the same memory), so each stage accumulates its own gradient, in its
    own order, and the step sums them in stage order: two stage threads adding into one
    `.grad` would add in whichever order they reach it, not bit-reproducibly."""

    def __init__(self, devices: list[torch.device],
                 copies: dict[tuple[int, torch.device], torch.Tensor]):
        self.devices = devices
        self._copies = copies
        self._held: dict[tuple[int, torch.device], dict[int, torch.Tensor]] = {}

    def get(self, stage: int, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value  # a submodule (fx capture) or a constant
        device = self.devices[stage]
        key = (id(value), device)
        if key not in self._copies:
            if value.is_meta:  # no data to copy: allocated later (Pipeline.to_empty)
                self._copies[key] = self._meta(value, device)
            else:
                self._copies[key] = _to_device(value, device)
        held = self._held.setdefault(key, {})  # stage -> its object (one per stage and name)
        if stage not in held:
            base = self._copies[key]
            trained = isinstance(base, torch.nn.Parameter) and base.requires_grad
            held[stage] = _alias(base) if held and trained else base
        return held[stage]

    def _meta(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The model's own meta tensor for the first real device that uses it (so the model's
        modules hold what this process materialises), a meta copy for any other device; a
        stage of another rank (device meta) always gets a copy that is never allocated."""
        taken = any(k[0] == id(value) and k[1].type != "meta" and c is value
                    for k, c in self._copies.items())
        return value if device.type != "meta" and not taken else _meta_copy(value)


def _alias(param: torch.Tensor) -> torch.nn.Parameter:
    """Another leaf over `param`'s memory: an optimizer's in-place update of either is seen by
    both, and each keeps its own `.grad` (a meta one gets its own memory from to_empty)."""
    return torch.nn.Parameter(param.detach(), requires_grad=True)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device or (device.type == tensor.device.type == "cpu"):
        return tensor  # shared with the user's model, as torchgpipe does
    moved = tensor.detach().to(device)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved


def _meta_copy(tensor: torch.Tensor) -> torch.Tensor:
    """Another meta tensor like `tensor` (a tied weight's copy for a second device): the
    stages' meta tensors get their memory from `Pipeline.to_empty` on their stage's device."""
    copy = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy


def _state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    )


def tensor_copies(gm: fx.GraphModule, stages: list[Stage]
                  ) -> tuple[dict[str, tuple[tuple[int, torch.Tensor], ...]],
                             tuple[TiedParameter, ...]]:
    """Every state tensor's copies by original name, and the tied-parameter groups."""
    names_of: dict[int, list[str]] = {}
    for name, t in _state(gm):
        names_of.setdefault(id(t), []).append(name)
    original_of = {name: key for key, names in names_of.items() for name in names}
    copies_of: dict[int, dict[int, tuple[int, torch.Tensor, str]]] = {}
    for stage in stages:
        for name, t in _state(stage.module):
            key = original_of.get(name)
            if key is not None:  # one entry per stage (stages on one device share the object)
                copies_of.setdefault(key, {}).setdefault(stage.index, (stage.index, t, name))
    tensors: dict[str, tuple[tuple[int, torch.Tensor], ...]] = {}
    ties: list[TiedParameter] = []
    for key, names in names_of.items():
        copies = copies_of.get(key)
        if not copies:  # unused by the graph: keep the original so state_dict stays complete
            copies = {key: (-1, _getattr_path(gm, names[0]), names[0])}
        entry = tuple((s, t) for s, t, _ in copies.values())
        for name in names:
            tensors[name] = entry
        # a tie: several names, or one name read by several stages (each may hold a copy)
        if isinstance(entry[0][1], torch.nn.Parameter) and (len(names) > 1 or len(entry) > 1):
            ties.append(TiedParameter(tuple(names), tuple((s, a) for s, _, a in copies.values())))
    return tensors, tuple(ties)
