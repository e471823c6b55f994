"""annotate: the cost of every block and cut, symbolic in the batch (and other dynamic) sizes.

Input: a `LinearGraph`. Output: a `CostTable`.

Each block is run once on *fake* tensors (no memory, no compute) carrying the captured symbolic
shapes, under torch's `FlopCounterMode` (passes/flops.py: with the CPU's attention) and a saved-tensors hook:

    forward FLOPs          counted while the block's ops run
    backward-input FLOPs   counted during autograd.grad(outputs, block inputs)      (zero-bubble I)
    backward-weight FLOPs  counted during autograd.grad(outputs, block parameters)  (zero-bubble W)
    activation bytes       tensors autograd saved for backward, parameters excluded, storages once

A value saved by several blocks is charged once: a block's input saved by the block that
produced it (ReLU saves its output, the next Linear its input) belongs to the producer, and one
saved only by its consumers belongs to the first of them (`_charge_inputs`); without this, a
stage of Linear/ReLU blocks was predicted to hold 1.6x the saved bytes it keeps.

FLOP counts come back as SymInts, i.e. sympy expressions such as `1536*s0`. Parameter, gradient
and optimizer-state bytes are static. The analytic time of a block on a device is

    t = flops / device_flops + io_bytes / device_bandwidth + num_ops * op_overhead

(a roofline with a per-op launch cost), with backward traffic taken as twice forward's. With
`profile=True` the times are measured instead (`measure.profile`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import sympy
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..ir.compile_cache import CompileCache, digest
from ..ir.records import BlockCost, CostTable, LinearGraph, NodeRole, NumericBlockCost, evaluate
from .fake_values import FakeValues, fake_mode_of, run_on_fakes, unguarded
from .flops import flop_counter
from .kernel_prices import Chip
from .kernels import (
    ATTENTION_OPS,
    HardwareRates,
    Kernels,
    Recorder,
    fused_attention,
    is_causal_mask,
)
from ..ir.nodes import call_node, getattr_path as _getattr_path, node_target_str, preserve_buffers

__all__ = ["annotate", "DeviceModel", "optimizer_state_factor", "symbolic_block_costs",
           "PricedBlockCost"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PricedBlockCost(BlockCost):
    """A `BlockCost` with its ops as a GPU's kernels (`planner.kernels`): costed for hardware
    described by its figures, where attention is fused."""

    kernels: Kernels = Kernels()


@dataclass(frozen=True)
class DeviceModel:
    """What the analytic cost model assumes about a device. With `attention` (FLOP/s of fused
    attention) the device is priced op by op as a GPU runs it (`planner.kernels`): matmul
    rooflines, fused attention, memory-bound ops by their bytes."""

    flops: float = 50e9  # sustained FLOP/s on matmuls
    bandwidth: float = 10e9  # bytes/s of memory traffic for elementwise ops
    op_overhead: float = 5e-6  # seconds of fixed cost per op (dispatch, kernel launch)
    attention: float | None = None  # FLOP/s of fused attention: kernel pricing (None: off)
    chip: Chip | None = None  # a preset's kernel figures: each kernel priced by its shape
    dtype: str | None = None  # the compute dtype the chip's peak is read in

    @property
    def kernels(self) -> HardwareRates | None:
        """The kernel model's rates, None for the FLOPs-and-bytes formula of `time`."""
        if self.attention is None:
            return None
        return HardwareRates(self.flops, self.attention, self.bandwidth, self.op_overhead,
                             self.chip, self.dtype)

    def time(self, flops: float, io_bytes: float, num_ops: int) -> float:
        return flops / self.flops + io_bytes / self.bandwidth + num_ops * self.op_overhead


def annotate(
    linear: LinearGraph,
    *,
    microbatch_size: int,
    device: DeviceModel | None = None,
    optimizer_factor: float = 0.0,
    cache: CompileCache | None = None,
) -> CostTable:
    """Costs of `linear`'s blocks evaluated at `microbatch_size`.

    `optimizer_factor` is optimizer-state bytes per parameter byte (see `optimizer_state_factor`);
    `cache` keeps the symbolic costs (see `symbolic_block_costs`).
    """
    device = device or DeviceModel()
    symbolic = symbolic_block_costs(linear, optimizer_factor=optimizer_factor, cache=cache,
                                    fused=device.kernels is not None)
    values = linear.captured.values
    cut_exprs = tuple(
        sympy.Add(*[values[v].nbytes for v in cut]) if cut else sympy.Integer(0)
        for cut in linear.boundaries
    )
    sizes = linear.captured.sizes_at(microbatch_size)
    blocks = tuple(
        _numeric(cost, sizes, device) for cost in symbolic
    )
    return CostTable(
        symbolic=symbolic,
        cut_bytes_symbolic=cut_exprs,
        sizes=sizes,
        blocks=blocks,
        cut_bytes=tuple(evaluate(e, sizes) for e in cut_exprs),
        device_flops=device.flops,
    )


def _numeric(cost: BlockCost, sizes, device: DeviceModel) -> NumericBlockCost:
    fwd = evaluate(cost.forward_flops, sizes)
    bwd_i = evaluate(cost.backward_input_flops, sizes)
    bwd_w = evaluate(cost.backward_weight_flops, sizes)
    io = evaluate(cost.io_bytes, sizes)
    rates = device.kernels
    if rates is not None and isinstance(cost, PricedBlockCost):
        t_f, t_b = cost.kernels.times(bwd_i + bwd_w, rates, lambda e: evaluate(e, sizes))
    else:
        t_f = device.time(fwd, io, cost.num_ops)
        # Backward reads the saved tensors and writes gradients: about twice forward's
        # traffic, split between input and weight gradients in proportion to their FLOPs.
        t_b = device.time(bwd_i + bwd_w, 2 * io, 2 * cost.num_ops)
    share = bwd_w / (bwd_i + bwd_w) if bwd_i + bwd_w > 0 else 0.0
    t_i, t_w = t_b * (1 - share), t_b * share
    return NumericBlockCost(
        forward_flops=fwd,
        backward_flops=bwd_i + bwd_w,
        forward_time=t_f,
        backward_input_time=t_i,
        backward_weight_time=t_w,
        static_bytes=float(cost.param_bytes + cost.grad_bytes + cost.optimizer_bytes),
        activation_bytes=evaluate(cost.activation_bytes, sizes),
        param_count=cost.param_count,
    )


def optimizer_state_factor(optimizer: Callable | None,
                           dtype: torch.dtype = torch.float32) -> float:
    """Optimizer-state bytes per parameter byte, stepping the optimizer on a probe of `dtype`
    (the model's): SGD 0, with momentum 1, Adam/AdamW 2 (a scalar step counter ignored); one
    keeping fp32 master weights and moments of 16-bit parameters in its state, 6."""
    if optimizer is None:
        return 0.0
    probe = torch.nn.Parameter(torch.zeros(1024, dtype=dtype))
    opt = optimizer([probe])
    probe.grad = torch.ones_like(probe)
    opt.step()
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    )
    return state_bytes / (probe.numel() * probe.element_size())


# ---------------------------------------------------------------------------------------------
# symbolic costs on fake tensors


def symbolic_block_costs(linear: LinearGraph, *, optimizer_factor: float = 0.0,
                         cache: CompileCache | None = None, fused: bool = False
                         ) -> tuple[BlockCost, ...]:
    """Per-block symbolic costs; one fake forward and two fake backward passes per block.
    `fused`: attention runs as a fused kernel and every op is recorded as a GPU kernel
    (`PricedBlockCost`; for hardware described by its figures).
    Kept in `cache` (None: computed afresh) for a graph, its blocks and its tensors' shapes:
    compiling one model several ways (schedules, devices, a benchmark grid) reuses them, since
    the fake passes over symbolic shapes take seconds on a transformer."""
    if cache is None:
        costs, estimated = _symbolic_block_costs(linear, optimizer_factor, fused)
    else:
        costs, estimated = cache.get(
            ("symbolic costs", _cost_key(linear, optimizer_factor), fused),
            lambda: _symbolic_block_costs(linear, optimizer_factor, fused))
    if estimated:  # every compile that uses such costs says so, from the cache too
        shown = "; ".join(estimated[:3]) + ("; ..." if len(estimated) > 3 else "")
        warnings.warn(
            f"pipecompile: {len(estimated)} of {len(linear.blocks)} blocks could not be costed "
            f"on fake tensors ({shown}); their FLOPs are taken as 0 and their activation memory "
            f"as their output bytes, so the partition and schedule may be chosen on too little "
            f"compute: use profile=True to measure the blocks, or report the failing op",
            RuntimeWarning, stacklevel=3)
    return costs


def _cost_key(linear: LinearGraph, optimizer_factor: float) -> str:
    """A hash of what the symbolic costs depend on: the graph's code, each value's symbolic
    shape and dtype (naming the size symbols), the blocks, the parameters' and buffers' shapes,
    dtypes, devices and training, and the device a meta model's tensors claimed in tracing."""
    gm = linear.captured.module
    values = tuple((name, str(info.shape), str(info.dtype))
                   for name, info in linear.captured.values.items())
    state = tuple((name, tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad)
                  for name, t in (*gm.named_parameters(), *gm.named_buffers()))
    return digest(gm.code, values, state, tuple(tuple(b.nodes) for b in linear.blocks),
                  tuple(sorted(linear.roles.items())), optimizer_factor,
                  str(linear.captured.traced_device))


def _symbolic_block_costs(linear: LinearGraph, optimizer_factor: float, fused: bool = False
                          ) -> tuple[tuple[BlockCost, ...], tuple[str, ...]]:
    """The blocks' costs, and for each block that could not run on fake tensors its name and
    the reason (its FLOPs are then 0: the caller warns)."""
    captured = linear.captured
    gm, nodes, costs = captured.module, {n.name: n for n in captured.module.graph.nodes}, []
    measured: dict[tuple, tuple] = {}  # repeated layers have one signature: run them once
    fakes = FakeValues(fake_mode_of(gm.graph), captured.traced_device,
                       estimates=captured.estimated_sizes)
    estimated: list[str] = []
    saved_inputs = []
    for block in linear.blocks:
        tensors = _block_state(block.nodes, nodes, linear.roles, gm)
        trainable = {n: t for n, t in tensors.items() if isinstance(t, torch.nn.Parameter)}
        unique = {id(t): t for t in trainable.values()}.values()
        param_count = sum(t.numel() for t in unique)
        param_bytes = sum(t.numel() * t.element_size() for t in unique)
        signature = _signature(block.nodes, nodes, linear)
        if signature not in measured:
            measured[signature] = _fake_costs(block, nodes, linear, gm, fakes, fused)
        flops, act, own_saved, inputs_saved, kernels, failure = measured[signature]
        if failure is not None:
            estimated.append(f"block {block.name}: {failure}")
        external = _external_inputs(block.nodes, nodes)
        saved_inputs.append(([block.nodes[i] for i in own_saved],
                             [external[i] for i in inputs_saved]))
        costs.append(
            (PricedBlockCost if fused else BlockCost)(
                forward_flops=flops[0],
                backward_input_flops=flops[1],
                backward_weight_flops=flops[2],
                io_bytes=_output_bytes(block.nodes, linear),
                num_ops=len(block.nodes),
                param_count=param_count,
                param_bytes=param_bytes,
                grad_bytes=param_bytes,
                optimizer_bytes=int(param_bytes * optimizer_factor),
                activation_bytes=act,
                parameters=tuple(trainable),
                **({"kernels": kernels} if fused else {}),
            )
        )
    charged = _charge_inputs(linear, saved_inputs)
    return tuple(replace(c, activation_bytes=c.activation_bytes + extra)
                 for c, extra in zip(costs, charged)), tuple(estimated)


def _external_inputs(block_nodes, nodes) -> list[str]:
    """The values a block reads from outside itself, in a fixed order (first use)."""
    inside = set(block_nodes)
    found: dict[str, None] = {}
    for name in block_nodes:
        for arg in nodes[name].all_input_nodes:
            if arg.name not in inside:
                found.setdefault(arg.name)
    return list(found)


def _charge_inputs(linear: LinearGraph, saved: list[tuple[list[str], list[str]]]) -> list[sympy.Expr]:
    """Bytes of the inputs each block saves that no earlier block already holds: an input
    the producing block saved itself is counted there; one only consumers save is charged
    to the first of them. Graph inputs saved by a block are charged to it too."""
    values = linear.captured.values
    producer = {n: i for i, b in enumerate(linear.blocks) for n in b.nodes}
    saved_own = [set(own) for own, _ in saved]
    charged: set[str] = set()
    extra = []
    for _, inputs in saved:
        total: sympy.Expr = sympy.Integer(0)
        for name in inputs:
            source = producer.get(name)
            if name in charged or (source is not None and name in saved_own[source]):
                continue
            charged.add(name)
            info = values.get(name)
            if info is not None and info.is_tensor:
                total += info.nbytes
        extra.append(total)
    return extra


def _fake_costs(block, nodes, linear: LinearGraph, gm, fakes: FakeValues, fused: bool = False
                ) -> tuple[tuple, sympy.Expr, tuple[int, ...], tuple[int, ...], Kernels,
                           str | None]:
    """FLOPs, own saved bytes, which values and inputs the block saves, its kernels (see
    `_run_block_fake`) and None; from output sizes where the block cannot run on fake tensors,
    with the reason last.

    A block that fails with every size symbolic runs again with fewer (`run_on_fakes`)."""
    def run(stand_ins: FakeValues) -> tuple:
        with preserve_buffers(gm):
            return _run_block_fake(block.nodes, nodes, linear.roles, gm, stand_ins, fused)

    captured = linear.captured
    try:
        return (*run_on_fakes(run, fakes, example_sizes=captured.example_sizes,
                              batch=captured.batch_symbol, name=block.name), None)
    except Exception as exc:  # noqa: BLE001 - an op without a fake kernel: estimate instead
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.info("block %s could not run on fake tensors (%s); "
                 "estimating its cost from output sizes", block.name, exc)
        written = _output_bytes(block.nodes, linear)
        return ((sympy.Integer(0),) * 3, written, (), (),
                Kernels(memory=2 * written, launches=len(block.nodes)), reason)


def _signature(block_nodes, nodes, linear: LinearGraph) -> tuple:
    """What a block computes, up to names: its ops, and the shapes, dtypes and roles of what
    they read. Two blocks with one signature have the same costs."""
    values = linear.captured.values
    position = {name: i for i, name in enumerate(block_nodes)}

    def describe(arg):
        if isinstance(arg, fx.Node):
            if arg.name in position:
                return ("local", position[arg.name])
            info = values.get(arg.name)
            role = linear.roles[arg.name]
            shape = (tuple(str(d) for d in info.shape), str(info.dtype)) if info else ()
            if role == NodeRole.PARAM:
                value = _getattr_path(arg.graph.owning_module, arg.target)
                return ("param", shape, getattr(value, "requires_grad", None))
            return (role, shape)
        return repr(arg)

    out = []
    for name in block_nodes:
        node = nodes[name]
        if node.op == "call_module":  # fx capture: modules differ by parameters we can't see
            return ("unique", name)
        args = fx.node.map_aggregate(node.args, describe)
        kwargs = fx.node.map_aggregate(node.kwargs, describe)
        users_outside = any(u.name not in position for u in node.users)
        out.append((node.op, str(node.target), repr(args), repr(kwargs), users_outside))
    return tuple(out)


def _block_state(block_nodes, nodes, roles, gm) -> dict[str, Any]:
    """Original name -> tensor of what a block reads: get_attr targets, and for an fx
    call_module node its module's parameters."""
    state: dict[str, Any] = {}
    for name in block_nodes:
        node = nodes[name]
        if node.op == "call_module":
            prefix = node.target
            for p, t in _getattr_path(gm, prefix).named_parameters():
                state.setdefault(f"{prefix}.{p}", t)
        for arg in node.all_input_nodes:
            if roles[arg.name] == NodeRole.PARAM:
                state.setdefault(arg.target, _getattr_path(gm, arg.target))
    return state


def _output_bytes(block_nodes, linear: LinearGraph) -> sympy.Expr:
    values = linear.captured.values
    return sympy.Add(*[values[n].nbytes for n in block_nodes if values[n].is_tensor])


def _run_block_fake(block_nodes, nodes, roles, gm, fakes: FakeValues, fused: bool = False):
    """(fwd, bwd-input, bwd-weight) FLOPs, the bytes of the block's own values autograd saves
    for backward, which of its values (positions in `block_nodes`) and of its external
    inputs (positions in `_external_inputs`) were saved (storages counted once), and its ops
    as kernels. `fused`: attention runs as FlashAttention (`planner.kernels`)."""
    fake_mode = fakes.mode
    recorder = Recorder(_sym)
    block = set(block_nodes)
    env: dict[str, Any] = {}
    inputs: list[torch.Tensor] = []
    params: dict[int, torch.Tensor] = {}
    saved: dict[Any, Any] = {}  # storage -> bytes

    def pack(t):
        root = t
        while root._base is not None:
            root = root._base
        if id(root) not in params:
            saved.setdefault(StorageWeakRef(t.untyped_storage()), root.numel() * root.element_size())
        return t

    prev = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:  # no guards, backward on this thread (`unguarded`): the batch stays symbolic
        with unguarded(fake_mode), fake_mode, flop_counter() as counter:
            for name in block_nodes:
                node = nodes[name]
                if node.op == "call_module":  # fx capture: the module holds its parameters
                    for p in _getattr_path(gm, node.target).parameters():
                        if p.requires_grad:
                            params[id(p)] = p
                for arg in node.all_input_nodes:
                    if arg.name not in env:
                        env[arg.name] = _external(arg, roles, gm, fakes, inputs, params)
                before = counter.get_total_flops()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    args = fx.node.map_arg(node.args, lambda n: env[n.name])
                    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
                    causal = fused and node.target in ATTENTION_OPS and is_causal_mask(node)
                    if fused and node.target in ATTENTION_OPS:
                        env[name] = fused_attention(args, kwargs, causal)
                    elif (scalar := fakes.data_scalar(node.meta.get("val"))) is not None:
                        env[name] = scalar  # a data-dependent size: its stated estimate
                    else:
                        env[name] = call_node(gm, node, args, kwargs)
                if fused:
                    recorder.record(node, args, kwargs, env[name],
                                    counter.get_total_flops() - before, causal)
            forward = counter.get_total_flops()
            outputs = [
                env[n] for n in block_nodes
                if isinstance(env[n], torch.Tensor) and env[n].requires_grad
                and any(u.name not in block for u in nodes[n].users)
            ]
            grads = [torch.ones_like(o) for o in outputs]
            if outputs and inputs:
                torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
            after_input = counter.get_total_flops()
            # Weight gradients alone would recompute the input-gradient chain; count the full
            # backward once and attribute what it adds beyond the input gradients to W.
            everything = inputs + list(params.values())
            if outputs and everything:
                torch.autograd.grad(outputs, everything, grads, allow_unused=True)
            after_weight = counter.get_total_flops() - (after_input - forward)
    finally:
        fake_mode.allow_non_fake_inputs = prev
    flops = (_sym(forward), _sym(after_input - forward), _sym(after_weight - after_input))
    external = _external_inputs(block_nodes, nodes)
    storage = {name: _storage_of(env.get(name)) for name in [*external, *block_nodes]}
    inputs_saved = tuple(i for i, n in enumerate(external) if storage[n] in saved)
    own_saved = tuple(i for i, n in enumerate(block_nodes) if storage[n] in saved)
    own = {storage[n] for n in external} - {None}
    own_bytes = sympy.Add(*[_sym(b) for k, b in saved.items() if k not in own])
    return flops, own_bytes, own_saved, inputs_saved, recorder.kernels()


def _storage_of(value: Any) -> Any:
    """A hashable key of a tensor's storage (None for anything else)."""
    if isinstance(value, torch.Tensor):
        return StorageWeakRef(value.untyped_storage())
    return None


def _external(arg: fx.Node, roles, gm, fakes: FakeValues, inputs, params):
    """A fake stand-in for a value the block reads from outside itself."""
    if roles[arg.name] == NodeRole.PARAM:
        real = _getattr_path(gm, node_target_str(arg))
        if not isinstance(real, torch.Tensor):
            return real
        fake = fakes.module_tensor(real)
        if isinstance(real, torch.nn.Parameter) and real.requires_grad:
            fake.requires_grad_(True)
            params[id(fake)] = fake
        return fake
    val = fakes.graph_value(arg.meta.get("val"))
    if isinstance(val, torch.Tensor):
        if val.is_floating_point() and roles[arg.name] == NodeRole.COMPUTE:
            val.requires_grad_(True)
            inputs.append(val)
            # the block reads a view: a module hook (FlopCounterMode's module tracker) may not
            # be handed a leaf while autograd.grad runs (fx capture's call_module blocks)
            return val.view_as(val)
    return val


def _sym(x: Any) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return sympy.expand(x.node.expr)
    return sympy.Integer(int(x))


def with_measured_times(table: CostTable, measured: Mapping[int, tuple[float, float, float]]) -> CostTable:
    """A copy of `table` whose listed blocks use measured (forward, bwd-input, bwd-weight) times."""
    blocks = list(table.blocks)
    for i, (t_f, t_i, t_w) in measured.items():
        blocks[i] = replace(blocks[i], forward_time=t_f, backward_input_time=t_i,
                            backward_weight_time=t_w, measured=True)
    return replace(table, blocks=tuple(blocks))
