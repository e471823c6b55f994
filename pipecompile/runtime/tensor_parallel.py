"""Tensor parallelism at run time: the group of T consecutive ranks, Megatron's two
collectives as autograd functions, and this rank's stages turned into what it runs.

    tensor_parallel_mesh(topology, device)        -> the 1-D DeviceMesh "tp" of this rank
    shard_stage_tensors(program, own, plans, mesh) -> program whose own stages run the
                                                     lowered graphs (passes/tensor_shard.py)
                                                     on DTensor parameters

Each parameter of a sharded stage becomes a `DTensor` over "tp" (torch's own TP and FSDP2
give the same): `Shard(d)` for a split one (`_StridedShard` for a fused projection, whose
`full_tensor()` is still the unsplit weight), `Replicate()` for the rest. The lowered graph
reads each parameter's local tensor (`to_local`, differentiable: the gradient comes back as a
DTensor of the same placement), so the optimizer, `state_dict()` and `clip_grad_norm_` see
DTensors while the graph runs plain local ops plus two collectives:

    copy    identity forward, all-reduce of the gradient backward (a column's input)
    reduce  all-reduce forward, identity backward (a row's output, before its bias)

One all-reduce per column/row pair forward and one backward, as Megatron-LM (Shoeybi et al.
2019). Stage boundaries stay whole (replicated): the pipeline's messages are unchanged.

A vocabulary split by the pass (`vocab_collectives`): an embedding's `Shard(0)` rows are read
by `vocab_lookup` (Megatron's VocabParallelEmbedding: indices outside this rank's rows masked,
their rows zeroed, then the `reduce` all-reduce), an output layer's partial logits are
read by the vocabulary-parallel cross entropy or all-gathered along the vocabulary (`gather`,
backward this rank's slice of the gradient, identical on every rank since the loss after it
is); runtime/vocab_loss.py. A stage with split logits outputs carries a `VocabLoss`.

With sequence parallelism (`sequence_collectives`, Korthikanti et al. 2022) each row's
all-reduce becomes a reduce-scatter along the sequence and each column's input an all-gather
(backward: the mirror). The reduce-scatter runs as an all-reduce keeping this rank's part
(gloo has no reduce-scatter; the same sums on every backend): twice the bytes of the
reduce-scatter the planner prices (planner/tensor_costs.py), a cost, not a difference in
values.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .vocab_loss import VocabLoss, cross_entropy_over, output_over

if TYPE_CHECKING:
    from ..ir.shard_plan import Placement, ShardPlan
    from ..ir.records import StagedProgram
    from .distributed import Topology

__all__ = ["tensor_parallel_mesh", "collectives", "sequence_collectives", "shard_stage_tensors",
           "vocab_lookup", "vocab_collectives",
           "placement_of", "local_slice", "to_local", "fsdp_dim", "fsdp_placement", "part_reader"]

# the graph pass that lowers a stage for its plan (passes/tensor_shard.lower), handed in by
# the planner: runtime/ imports no pass
Lower = Callable[..., torch.fx.GraphModule]


def tensor_parallel_mesh(topology: "Topology", device: torch.device) -> Any:
    """The "tp" dimension of the (P x D, T) mesh of `topology` (rank = group * T + index):
    this rank's T consecutive ranks. Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    T = topology.tensor_parallel
    mesh = init_device_mesh(device.type, (topology.world_size // T, T),
                            mesh_dim_names=("pp_dp", "tp"))
    return mesh["tp"]


def collectives(group: Any) -> tuple[Callable, Callable]:
    """(copy, reduce) over `group` (module docstring), as plain functions a graph can call."""

    class _Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad

    class _Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    def tp_copy(x: torch.Tensor) -> torch.Tensor:
        return _Copy.apply(x)

    def tp_reduce(x: torch.Tensor) -> torch.Tensor:
        return _Reduce.apply(x)

    return tp_copy, tp_reduce


def sequence_collectives(group: Any, degree: int, rank: int) -> dict[str, Callable]:
    """The four collectives of sequence parallelism over `group` (passes/sequence_shard.py),
    each a function (tensor, dim) -> tensor, autograd-aware: reduce_scatter (backward
    all-gather), gather_column (backward reduce-scatter), gather (backward this rank's 1/T),
    scatter (backward all-gather)."""

    def all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(degree)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()  # the sum (an all-reduce: gloo has no reduce-scatter), this part
        dist.all_reduce(x, group=group)
        return x.chunk(degree, dim=dim)[rank].contiguous()

    def mine(x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.chunk(degree, dim=dim)[rank].contiguous()

    def function(forward: Callable, backward: Callable) -> Callable:
        class _Op(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
                ctx.dim = dim
                return forward(x, dim)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
                return backward(grad, ctx.dim), None

        def op(x: torch.Tensor, dim: int) -> torch.Tensor:
            return _Op.apply(x, dim)

        return op

    return {"reduce_scatter": function(reduce_scatter, all_gather),
            "gather_column": function(all_gather, reduce_scatter),
            "gather": function(all_gather, mine),
            "scatter": function(mine, all_gather)}


def vocab_lookup(rank: int) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """Rank `rank`'s part of an embedding whose table is split along its rows (each rank
    N/T of them, this one rows [rank N/T, (rank+1) N/T)): the rows of the indices it holds,
    zeros for the others (summed over the ranks: the whole lookup). `padding_idx` is the
    table's (-1: none), kept where this rank holds it."""

    def lookup(local: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1
               ) -> torch.Tensor:
        rows = local.shape[0]
        start = rank * rows
        outside = (indices < start) | (indices >= start + rows)
        mine = (indices - start).masked_fill(outside, 0)
        pad = padding_idx - start if padding_idx >= 0 and 0 <= padding_idx - start < rows \
            else -1
        found = torch.nn.functional.embedding(mine, local, None if pad < 0 else pad)
        return found.masked_fill(outside.unsqueeze(-1), 0)

    return lookup


def vocab_collectives(group: Any, degree: int, rank: int) -> dict[str, Callable]:
    """What `lower` needs for a split vocabulary (passes/tensor_shard.py): this rank's
    `lookup`, the all-gather `gather(x, dim)` (backward: this rank's slice), a logits
    output `output(x, dim)` (gathered, or this rank's slice in a last stage's training
    forward) and the vocabulary-parallel `cross_entropy` (runtime/vocab_loss.py)."""
    gather = sequence_collectives(group, degree, rank)["gather"]
    return {"lookup": vocab_lookup(rank), "gather": gather, "output": output_over(gather),
            "cross_entropy": cross_entropy_over(group, degree, rank)}


def _vocab_loss(module: torch.fx.GraphModule, vocab: Mapping[str, Callable],
                lower_loss: Callable | None, degree: int) -> VocabLoss | None:
    """The `VocabLoss` of a lowered stage whose outputs include split logits (their flat
    positions and dims), None when it has none."""
    (out,) = [n for n in module.graph.nodes if n.op == "output"]
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    split = {i: int(a.args[1]) for i, a in enumerate(flat)  # type: ignore[arg-type]
             if isinstance(a, torch.fx.Node) and a.target is vocab["output"]}
    if not split or lower_loss is None:
        return None
    return VocabLoss(split, vocab["gather"],
                     lambda traced, where: lower_loss(traced, where, degree, vocab), degree)


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local tensor (differentiable), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_slice(value: torch.Tensor, placement: "Placement", degree: int, rank: int
                ) -> torch.Tensor:
    """Rank `rank`'s slice of a parameter: of each fused part its r-th 1/T, concatenated
    (one part: the r-th 1/T along the split dim)."""
    pieces = value.split(list(placement.parts), dim=placement.dim)
    return torch.cat([p.chunk(degree, dim=placement.dim)[rank] for p in pieces],
                     dim=placement.dim).contiguous()


def placement_of(placement: "Placement | None") -> Any:
    """The DTensor placement of a parameter's split (None: whole on every rank)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if placement is None:
        return Replicate()
    if len(placement.parts) > 1:
        return _StridedShard(placement.dim, split_factor=len(placement.parts))
    return Shard(placement.dim)


def fsdp_dim(shape: Sequence[int], placement: "Placement | None", replicas: int) -> int | None:
    """The dim FSDP shards a tensor-parallel parameter along over `replicas` "dp" ranks: 0,
    but for a fused projection's weight (a `_StridedShard` over "tp") another dim that
    `replicas` divides (FSDP's contiguous chunks of [q_r; k_r; v_r] along the split dim are
    no DTensor layout: `full_tensor()` would be wrong); None when it has none (a fused bias):
    it stays whole over "tp" (`shard_stage_tensors`)."""
    if placement is None or len(placement.parts) == 1:
        return 0
    return next((d for d, n in enumerate(shape) if d != placement.dim and n % replicas == 0),
                None)


def fsdp_placement(replicas: int) -> Callable[[torch.nn.Parameter], Any]:
    """FSDP2's `shard_placement_fn` for the DTensor parameters of `shard_stage_tensors`:
    `Shard(fsdp_dim)` of each (module docstring)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def shard(param: torch.nn.Parameter) -> Any:
        tp = getattr(param, "placements", (None,))[0]
        if not isinstance(tp, _StridedShard):
            return Shard(0)
        fused = _fused(tp.dim, int(tp.split_factor))
        return Shard(fsdp_dim(param.shape, fused, replicas) or 0)

    return shard


def _fused(dim: int, parts: int) -> "Placement":
    from ..ir.shard_plan import Placement

    return Placement(dim, (1,) * parts, "column")


def part_reader(placement: "Placement", group: Any, degree: int, rank: int
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rank `rank`'s slice of a parameter held whole (`local_slice`), autograd-aware: the
    gradient of the whole is this rank's slice's gradient in place, zeros elsewhere, summed
    over the group (exact: one nonzero term per element)."""

    class _Part(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, whole: torch.Tensor) -> torch.Tensor:
            ctx.shape = whole.shape
            return local_slice(whole, placement, degree, rank)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            whole = grad.new_zeros(ctx.shape)
            pieces = whole.split(list(placement.parts), dim=placement.dim)
            mine = [p.chunk(degree, dim=placement.dim)[rank] for p in pieces]
            for target, value in zip(mine, grad.split([m.shape[placement.dim] for m in mine],
                                                      dim=placement.dim)):
                target.copy_(value)
            dist.all_reduce(whole, group=group)
            return whole

    def part(whole: torch.Tensor) -> torch.Tensor:
        return _Part.apply(whole)

    return part


def _read_parts(module: torch.fx.GraphModule, readers: Mapping[str, Callable]) -> None:
    """Each read of a parameter named in `readers` (`to_local(get_attr)`) goes through its
    reader: the graph gets this rank's part of a parameter held whole."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is to_local and \
                node.args[0].op == "get_attr" and node.args[0].target in readers:
            with graph.inserting_after(node):
                part = graph.call_function(readers[node.args[0].target], (node,))
            part.meta = dict(node.meta)
            node.replace_all_uses_with(part, delete_user_cb=lambda user: user is not part)
    module.recompile()


def shard_stage_tensors(program: "StagedProgram", own: Sequence[int],
                        plans: "Mapping[int, ShardPlan]", mesh: Any, lower: Lower, *,
                        sequence: bool = False, replicas: int = 1,
                        lower_loss: Callable | None = None) -> "StagedProgram":
    """`program` with each stage of `own` lowered for its plan (by `lower`) and its
    parameters DTensors over `mesh` (1-D, "tp"): this rank's slice of each split one, the
    whole of the rest. `sequence`: with sequence parallelism (the tokens between a row and
    the next column split over the T ranks too). `replicas`: FSDP's D (fsdp=True, the
    stages fully_shard-ed after this); a fused parameter FSDP could only shard along its
    split dim (`fsdp_dim` None) stays whole over "tp", the graph reading its part
    (`part_reader`). `lower_loss`: the pass that lowers a traced loss onto split logits
    (passes/vocab_loss.py), given to the `VocabLoss` a stage with split logits outputs
    carries as `vocab_loss` (the last stage's loss reads them through it)."""
    from torch.distributed.tensor import DTensor

    T, rank = mesh.size(), mesh.get_local_rank()
    copy, reduce = collectives(mesh.get_group())
    extra: dict[str, Any] = {"vocab": vocab_collectives(mesh.get_group(), T, rank)}
    if sequence:
        extra["sequence"] = sequence_collectives(mesh.get_group(), T, rank)
    stages = list(program.stages)
    swapped: dict[int, torch.Tensor] = {}  # id(old parameter) -> its DTensor
    for index in own:
        stage, plan = program.stages[index], plans[index]
        module = lower(stage.module, plan, copy=copy, reduce=reduce, local=to_local, **extra)
        readers: dict[str, Callable] = {}
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            placement = plan.params.get(name)
            if replicas > 1 and placement is not None and \
                    fsdp_dim(param.shape, placement, replicas) is None:
                readers[name] = part_reader(placement, mesh.get_group(), T, rank)
                placement = None  # whole over "tp"
            if id(param) not in swapped:
                value = param.detach()
                local = value if placement is None else local_slice(value, placement, T, rank)
                swapped[id(param)] = torch.nn.Parameter(DTensor.from_local(
                    local, mesh, [placement_of(placement)], run_check=False,
                    shape=value.shape, stride=value.stride()),
                    requires_grad=param.requires_grad)
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, attr, swapped[id(param)])
        if readers:
            _read_parts(module, readers)
        setattr(module, "vocab_loss", _vocab_loss(module, extra["vocab"], lower_loss, T))
        stages[index] = replace(stage, module=module)
    tensors = {name: tuple((s, swapped.get(id(t), t)) for s, t in copies)
               for name, copies in program.tensors.items()}
    return replace(program, stages=tuple(stages), tensors=tensors)
