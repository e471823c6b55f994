"""The compiler's intermediate representation: plain frozen records that every pass reads and writes.

    CapturedModel   a flat fx graph of the model: placeholders are the flattened inputs, the output
                    node returns the flattened outputs; pytree specs rebuild the user's structures.
    ValueInfo       the symbolic shape and dtype of one graph value (an fx node's result).
    Block           a contiguous run of compute nodes that the partitioner places as one unit.
    LinearGraph     the blocks in order plus, for every cut, its boundary: the values produced
                    before the cut and used after it.
    StageCost       one stage of the split program as the stage table reports it.
    StagedProgram   the split program (passes/split.py makes it): its `Stage`s, the wiring of
                    values between them, and the tensors and ties each stage holds.

Values are named by their fx node names; those names are global to a compiled program and are
the names of stage inputs/outputs and of ONNX values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._pytree import TreeSpec

from ..errors import ConfigError

from ..schedule.simulate import StageCosts

__all__ = ["CapturedModel", "ValueInfo", "Block", "LinearGraph", "NodeRole", "StageCost",
           "StageTimes", "Stage", "TiedParameter", "StagedProgram", "microbatch_size",
           "batch_size_of", "Example"]


class NodeRole:
    """How linearize classifies a graph node (plain strings so the IR stays printable)."""

    INPUT = "input"  # a placeholder: a model input, available to every stage
    PARAM = "param"  # get_attr: a parameter, buffer or constant, materialised in each stage using it
    REMAT = "remat"  # a cheap deterministic function of inputs only (sizes, masks, position ids):
    #                  recomputed in each stage that needs it instead of being sent
    COMPUTE = "compute"  # everything else: belongs to exactly one block
    OUTPUT = "output"


@dataclass(frozen=True)
class ValueInfo:
    """Shape (ints or sympy expressions of the symbolic sizes) and dtype of one value.

    `dtype` is None for non-tensor values (a SymInt size, a Python scalar, a list).
    """

    name: str
    shape: tuple[Any, ...] = ()
    dtype: torch.dtype | None = None

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*[sympy.sympify(d) for d in self.shape]) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        """Bytes of the tensor (a non-tensor value counts as 8 bytes: one int64 on the wire)."""
        if self.dtype is None:
            return sympy.Integer(8)
        return sympy.expand(self.numel * _itemsize(self.dtype))

    def bytes_at(self, sizes: Mapping[sympy.Symbol, int]) -> int:
        """Bytes of the value when the size symbols have the values `sizes` (a message's size)."""
        item = _itemsize(self.dtype) if self.dtype is not None else 8
        return item * math.prod(d if isinstance(d, int) else int(evaluate(d, sizes))
                                for d in self.shape)

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        kind = str(self.dtype).replace("torch.", "") if self.dtype is not None else "scalar"
        return f"{self.name}: {kind}[{dims}]"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CapturedModel:
    """A model captured as a flat fx graph, with what is needed to call it like the original.

    `module` computes `flat_outputs = module(*flat_inputs)` where
    `flat_inputs = torch.fx._pytree.tree_flatten_spec((args, kwargs), in_spec)` and the user's
    result is `pytree.tree_unflatten(flat_outputs, out_spec)`.
    """

    module: fx.GraphModule
    in_spec: TreeSpec
    out_spec: TreeSpec
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    values: Mapping[str, ValueInfo]
    method: str  # "export" or "fx"
    dynamic_batch: bool
    batch_symbol: sympy.Symbol | None
    example_sizes: Mapping[sympy.Symbol, int]  # every symbol's value in the example inputs
    captured_batch_size: int  # batch size of the inputs the graph was traced with
    # the sizes each symbol may take (lowest, highest or None): export assumes them, e.g. a
    # sequence length above 4 where the model's code branches on `seq > 4`
    size_ranges: Mapping[sympy.Symbol, tuple[int, int | None]] = field(default_factory=dict)
    parameter_names: tuple[str, ...] = ()  # model.named_parameters() order (ties once)
    state_keys: tuple[str, ...] = ()  # parameter and persistent buffer names (state_dict order)
    checkpoint_keys: tuple[str, ...] = ()  # model.state_dict() keys, through its hooks
    notes: tuple[str, ...] = ()
    # a meta model's tensors claimed this device while traced (claimed_device.py): the graph's
    # device literals name it, and each stage points them at its own device
    traced_device: torch.device | None = None
    # a data-dependent (unbacked) size's estimate in the other symbols (capture/unbacked.py)
    estimated_sizes: Mapping[sympy.Symbol, Any] = field(default_factory=dict)

    def flatten_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> list[Any]:
        from torch.fx._pytree import tree_flatten_spec

        positional, keywords = self.in_spec.child(0), self.in_spec.child(1)
        if (not kwargs and keywords.num_children == 0 and positional.num_children == len(args)
                and all(c.is_leaf() for c in positional.children())):
            return list(args)  # each argument a leaf, no keywords: what the walk would give
        return list(tree_flatten_spec((tuple(args), dict(kwargs)), self.in_spec))

    def unflatten_outputs(self, flat: list[Any]) -> Any:
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(list(flat), self.out_spec)

    def microbatch_size(self, microbatches: int) -> int:
        """Samples per micro-batch of the example batch (a static capture is made at that size)."""
        if not self.dynamic_batch:
            return self.captured_batch_size
        return microbatch_size(self.captured_batch_size, microbatches)

    def sizes_of(self, flat_inputs: Sequence[Any]) -> dict[sympy.Symbol, int]:
        """Every size symbol's value in a call: read from the inputs' sizes (a batch, a
        sequence length), the example's value for a symbol no input dimension names."""
        sizes = dict(self.example_sizes)
        for name, value in zip(self.input_names, flat_inputs):
            if isinstance(value, torch.Tensor):
                for dim, size in zip(self.values[name].shape, value.shape):
                    if isinstance(dim, sympy.Symbol):
                        sizes[dim] = int(size)
        return _estimated(sizes, self.estimated_sizes)

    def size_names(self) -> dict[sympy.Symbol, sympy.Symbol]:
        """A readable name for every size symbol: `batch`, or the input dimension it first
        appears as (`input_ids.size(1)`, a sequence length)."""
        names = {} if self.batch_symbol is None else {self.batch_symbol: sympy.Symbol("batch")}
        for name in self.input_names:
            for axis, dim in enumerate(self.values[name].shape):
                if isinstance(dim, sympy.Symbol) and dim not in names:
                    names[dim] = sympy.Symbol(f"{name}.size({axis})")
        return names

    def sizes_at(self, batch: int) -> dict[sympy.Symbol, int]:
        """Every size symbol's value when the batch has `batch` samples: what turns a symbolic
        shape or cost into numbers (other symbols keep their example values)."""
        sizes = dict(self.example_sizes)
        if self.batch_symbol is not None:
            sizes[self.batch_symbol] = batch
        return _estimated(sizes, self.estimated_sizes)


def _estimated(sizes: dict[sympy.Symbol, int], estimates: Mapping[sympy.Symbol, Any]
               ) -> dict[sympy.Symbol, int]:
    """`sizes` with each estimated symbol's value at those sizes (rounded up; an estimate made
    of other estimates included)."""
    for _ in range(len(estimates)):
        pending = False
        for symbol, expr in estimates.items():
            value = sympy.sympify(expr).subs(sizes)
            if value.free_symbols:
                pending = True
            else:
                sizes[symbol] = max(int(sympy.ceiling(value)), 0)
        if not pending:
            break
    return sizes


def batch_size_of(args: tuple, kwargs: Mapping[str, Any]) -> int:
    """The batch size: dim 0 of the first tensor argument (positional first, then keyword)."""
    for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ConfigError(
        "example_inputs/example_kwargs contain no tensor with a batch dimension; pass at least "
        "one tensor whose first dimension is the batch size"
    )


def microbatch_size(batch: int, microbatches: int) -> int:
    """Samples in the largest of `microbatches` pieces of a batch (`torch.chunk` sizes)."""
    return math.ceil(batch / microbatches)


@dataclass(frozen=True)
class Block:
    """A contiguous run of compute nodes, named after the module call it came from."""

    index: int
    name: str  # module path ("transformer.h.3"), or "<ops:first_node>" for top-level ops
    nodes: tuple[str, ...]

    def __repr__(self) -> str:
        return f"Block({self.index}, {self.name!r}, {len(self.nodes)} nodes)"


@dataclass(frozen=True)
class LinearGraph:
    """The captured graph as a chain of blocks; the output of `passes.linearize`.

    `boundaries[k]` lists the values live across cut k (the cut right before block k):
    produced by a block < k and used by a block >= k or by the model output. `boundaries[0]`
    and `boundaries[n]` are empty by construction (inputs are fed to every stage directly; the
    output node belongs to the last stage).
    """

    captured: CapturedModel
    blocks: tuple[Block, ...]
    boundaries: tuple[tuple[str, ...], ...]
    roles: Mapping[str, str]  # node name -> NodeRole
    block_of: Mapping[str, int]  # compute node name -> block index
    granularity: str

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_index(self, module_path: str) -> int | None:
        """Index of the first block whose name is `module_path` or lies inside it."""
        for block in self.blocks:
            if block.name == module_path or block.name.startswith(module_path + "."):
                return block.index
        return None


@dataclass(frozen=True)
class BlockCost:
    """Costs of one block per micro-batch, as sympy expressions of the symbolic sizes.

    Times are filled in by `annotate` (analytic from FLOPs, or measured when profiling) in
    seconds on the target device; `measured` says which.
    """

    forward_flops: sympy.Expr
    backward_input_flops: sympy.Expr
    backward_weight_flops: sympy.Expr
    io_bytes: sympy.Expr  # bytes written by the block's ops in forward (memory traffic proxy)
    num_ops: int
    param_count: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: sympy.Expr  # tensors autograd saves for backward, parameters excluded
    parameters: tuple[str, ...] = ()  # names of the parameters this block reads


@dataclass(frozen=True)
class NumericBlockCost:
    """A `BlockCost` evaluated at one micro-batch size, with times in seconds."""

    forward_flops: float
    backward_flops: float
    forward_time: float
    backward_input_time: float
    backward_weight_time: float
    static_bytes: float  # params + grads + optimizer state
    activation_bytes: float
    param_count: int
    measured: bool = False

    @property
    def backward_time(self) -> float:
        return self.backward_input_time + self.backward_weight_time

    @property
    def time(self) -> float:
        return self.forward_time + self.backward_time


@dataclass(frozen=True)
class CostTable:
    """Output of `passes.annotate`: symbolic costs per block and per cut, and their values."""

    symbolic: tuple[BlockCost, ...]
    cut_bytes_symbolic: tuple[sympy.Expr, ...]  # len n+1
    sizes: Mapping[sympy.Symbol, int]  # the values the expressions were evaluated at
    blocks: tuple[NumericBlockCost, ...]
    cut_bytes: tuple[float, ...]
    device_flops: float  # FLOP/s the analytic times assume
    notes: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class StageCost:
    """One stage as the stage table reports it, per micro-batch: its size and memory, and
    `times`, the simulator's costs of the stage (`stage_costs.simulator_costs`: the one source
    of a stage's times; `forward_time` and `backward_time` read them)."""

    num_blocks: int
    params: int
    forward_flops: float
    memory: float  # params + grads + optimizer state + activations of in-flight micro-batches
    inflight: int
    send_bytes: float  # boundary bytes after this stage
    times: StageCosts

    @property
    def forward_time(self) -> float:
        return self.times.forward

    @property
    def backward_time(self) -> float:
        """The fused backward, a recomputed forward included."""
        return self.times.backward


def evaluate(expr: Any, sizes: Mapping[sympy.Symbol, int]) -> float:
    """Value of a cost expression at concrete sizes (unknown symbols are an internal error).

    Remembered per (expression, sizes): the searches price the same few expressions (every
    layer of a model records the same ones) at the same sizes many times, and substituting
    into a sympy expression is most of pricing a block. The value is a pure function of the
    two, so a remembered one is the one `subs` would give again."""
    try:
        return _evaluate_at(expr, tuple(sizes.items()))
    except TypeError:  # an unhashable expression: evaluated every time
        return _evaluate_at.__wrapped__(expr, tuple(sizes.items()))


@functools.lru_cache(maxsize=1 << 16)
def _evaluate_at(expr: Any, sizes: tuple[tuple[sympy.Symbol, int], ...]) -> float:
    value = sympy.sympify(expr).subs(dict(sizes))
    assert not value.free_symbols, f"unbound symbols {value.free_symbols} in {expr}"
    result = float(value)
    return result if math.isfinite(result) else 0.0


@dataclass(frozen=True)
class StageTimes:
    """Measured seconds of one stage's actions for one micro-batch."""

    forward: float
    backward: float
    backward_input: float
    backward_weight: float
    loss: float = 0.0  # of forward + backward: the loss's own forward and backward (last stage)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its graph module, device and named inputs/outputs."""

    index: int
    module: fx.GraphModule
    device: torch.device
    inputs: tuple[str, ...]  # value names, in the order of the module's placeholders
    outputs: tuple[str, ...]  # value names, in the order of the returned tuple
    blocks: tuple[int, ...]
    parameter_names: tuple[str, ...]  # original names of the parameters this stage holds
    cost: StageCost | None = None  # attached by the compiler

    def __repr__(self) -> str:
        return (f"Stage({self.index}, {self.device}, blocks {self.blocks[0]}..{self.blocks[-1]}, "
                f"in={list(self.inputs)}, out={list(self.outputs)})")


@dataclass(frozen=True)
class TiedParameter:
    """One parameter reached under several names or read by several stages; `copies` lists
    (stage, name) for every stage that reads it, each stage holding its own leaf (an alias of
    the same memory on the same device, a copy elsewhere) whose gradients the runtime sums."""

    names: tuple[str, ...]
    copies: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class StagedProgram:
    """The split program: stages plus the wiring of values between them."""

    captured: CapturedModel
    linear: LinearGraph
    bounds: tuple[int, ...]
    stages: tuple[Stage, ...]
    producer: Mapping[str, int]  # value name -> producing stage
    consumers: Mapping[str, tuple[int, ...]]  # value name -> stages that read it
    ties: tuple[TiedParameter, ...]
    tensors: Mapping[str, tuple[tuple[int, torch.Tensor], ...]] = field(repr=False)
    # original parameter/buffer name -> (stage, tensor) for every stage holding it (-1: unused)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # Who owns a tensor held by several stages (a tied parameter, or one object read by two
    # stages) is decided here only: the first stage holding it. Its copies on other devices
    # follow it (their gradients summed into it, its value copied out after a step), its
    # optimizer steps it, and the process holding it counts it in a global norm.

    def owner_stage(self, name: str) -> int:
        """The stage whose copy of parameter or buffer `name` owns it: the first stage that
        holds it (0 for a tensor no stage reads: stage 0's process keeps it)."""
        return max(0, self.tensors[name][0][0])

    def held(self, name: str, own_stages: Collection[int]) -> list[tuple[int, torch.Tensor]]:
        """(stage, tensor) for each of `own_stages` holding `name`, in stage order (a tensor no
        stage reads is held by stage 0)."""
        return [(max(0, s), t) for s, t in self.tensors[name] if max(0, s) in own_stages]

    def held_copies(self, name: str, own_stages: Collection[int]) -> list[torch.Tensor]:
        """The distinct tensor objects of `name` that `own_stages` hold, in stage order: the
        first is the owner where `own_stages` hold the owner stage, else the copy every
        other one of theirs follows."""
        return list({id(t): t for _, t in self.held(name, own_stages)}.values())


@dataclass(frozen=True)
class Example:
    """The model being compiled and the example batch compile plans and measures with."""

    model: torch.nn.Module
    args: tuple
    kwargs: Mapping[str, Any]
    target: Any = None
    # the stages' device copies of the model's tensors by (id(tensor), device): one table for
    # every plan of a lazily compiled pipeline, so that all of them train the same tensors
    placed: dict | None = None
    # capture every size of a batched input symbolic (a lazy pipeline's new plan for a size
    # its earlier plans fixed: torch.compile's automatic dynamic shapes, one step further)
    all_sizes: bool = False

    @property
    def batch(self) -> int:
        return batch_size_of(self.args, dict(self.kwargs))

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (stages of other ranks stay there, uncopied)."""
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))
