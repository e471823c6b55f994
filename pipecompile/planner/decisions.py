"""The planner's decisions as pure functions of typed records: cost, place, refine.

    cost(linear, model, example, ranks)       -> CostTable   (analytic, or measured and agreed)
    place(linear, costs, target)              -> Partition   (optimal DP, or the user's cuts)
    refine(captured, choice, model, target, example, ranks) -> a finer Choice, or None

`CostModel` says how blocks are costed (device FLOP rate, micro-batch size, profiling,
calibration); `Target` what they are placed on (one `DeviceSpec` per stage, in-flight
micro-batches per stage, the schedule). The compiler's passes call these; they read no globals
and change nothing they are given. The FLOP rate and the fixed cost per action are measured on
this machine (`matmul_rate`, `action_overhead`) unless every device is an absolute `DeviceSpec`
(its own FLOP/s, bandwidths and overheads: `analytic`), which `device_model` and `action_cost`
then read instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Sequence


from ..ir.compile_cache import CompileCache
from ..errors import ConfigError
from ..ir.records import CapturedModel, CostTable, LinearGraph
from ..ir.records import Example
from ..ir.records import evaluate as evaluate_expr
from .hardware import accelerator_of
from ..passes.annotate import DeviceModel, annotate
from ..passes.annotate import _numeric as numeric_cost  # one block's costs at given sizes
from ..passes.calibrate import Calibration, calibrate_blocks
from ..passes.linearize import GRANULARITIES, linearize
from ..ir.devices import DeviceSpec
from ..passes.partition import (
    Partition,
    PartitionMemoryError,
    PartitionProblem,
    evaluate,
    lower_bound,
    partition,
)
from ..measure.profile import profile_blocks
from ..measure.rates import action_overhead, matmul_rate
from .device_share import fit_devices
from .layout import Layout
from ..measure.ranks import Ranks
from ..schedule.simulate import inflight  # the passes' in-flight counts (one home: simulate)
from .stage_costs import BlockTable, inflight_for, partition_problem
from .tensor_costs import TensorShare, shard_costs, vocabulary_choices

__all__ = ["CostModel", "Target", "Choice", "cost", "place", "refine", "device_model",
           "action_cost", "analytic", "inflight"]


@dataclass(frozen=True)
class CostModel:
    """How blocks are costed: analytic at `device`'s rate, measured with `profile`, then
    corrected by `calibration` (from the measured stages) when there is one."""

    device: DeviceModel
    microbatch_size: int
    microbatches: int
    optimizer_factor: float = 0.0
    profile: bool = False
    calibration: Calibration | None = None
    cache: CompileCache | None = None  # keeps the symbolic block costs (None: derived afresh)
    tensor: TensorShare | None = None  # one rank's share under tensor parallelism (None: all)
    vocabulary: bool | None = None  # compile's vocab_parallel (None: "auto", priced)
    # how the pipeline's loss reads each flat model output: (index, "cross entropy" | "none"
    # | "other"), the price of a split output layer (planner/logits_loss.py)
    loss_reads: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Target:
    """What the blocks are placed on: one device per stage and the schedule's demands."""

    stage_specs: tuple[DeviceSpec, ...]
    inflight: tuple[int, ...]  # peak in-flight micro-batches per stage
    schedule: str
    microbatches: int
    virtual_stages: int
    split_points: tuple[str, ...] | None = None
    recompute: tuple[bool | None, ...] | None = None  # per stage (see PartitionProblem)
    # a block's backward in the placement, relative to its cost: (I + W) / B where the schedule
    # splits it (`stage_costs.backward_ratio`), as the search placed it
    backward_ratio: float = 1.0
    layout: Layout | None = None  # the searched layout: what a device holds (FSDP shards)
    # each stage's device (virtual stages share its memory: device_share.fit_devices)
    stage_to_device: tuple[int, ...] | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stage_specs)


@dataclass(frozen=True)
class Choice:
    """One way to cut the model: its blocks, their costs and where the cuts go."""

    linear: LinearGraph
    costs: CostTable
    placement: Partition


def cost(linear: LinearGraph, model: CostModel, example: Example, ranks: Ranks,
         like: CostTable | None = None) -> CostTable:
    """The cost table of `linear`'s blocks (measured with profiling, agreed, calibrated).
    `like`: a table of the same blocks at another micro-batch size, whose symbolic costs are
    evaluated again instead of derived anew (the search costs many sizes)."""
    if like is not None and not model.profile and len(like.blocks) == linear.num_blocks:
        sizes = linear.captured.sizes_at(model.microbatch_size)
        costs = replace(like, sizes=sizes, cut_bytes=tuple(evaluate_expr(e, sizes)
                                                           for e in like.cut_bytes_symbolic),
                        blocks=tuple(numeric_cost(c, sizes, model.device) for c in like.symbolic))
        return _sharded(linear, _calibrated(costs, model), model)
    costs = annotate(linear, microbatch_size=model.microbatch_size, device=model.device,
                     optimizer_factor=model.optimizer_factor, cache=model.cache)
    if model.profile:
        costs = profile_blocks(linear, costs, example.args, dict(example.kwargs),
                               microbatches=model.microbatches)
        costs = ranks.block_times(costs)  # every rank must plan with the same numbers
    return _sharded(linear, _calibrated(costs, model), model)


def _sharded(linear: LinearGraph, costs: CostTable, model: CostModel) -> CostTable:
    """One rank's share of `costs` under the model's tensor parallelism (tensor_costs.py)."""
    if model.tensor is None:
        return costs
    gm = linear.captured.module
    shapes = {n: tuple(p.shape) for n, p in gm.named_parameters(remove_duplicate=False)}
    vocabulary = vocabulary_choices(gm, model.tensor, flops=model.device.flops,
                                    optimizer_factor=model.optimizer_factor,
                                    given=model.vocabulary,
                                    loss_reads=dict(model.loss_reads))
    return shard_costs(costs, model.tensor, shapes=shapes, rates=model.device.kernels,
                       batch_size=model.microbatch_size, vocabulary=vocabulary)


def _calibrated(costs: CostTable, model: CostModel) -> CostTable:
    if model.calibration is None:
        return costs
    return calibrate_blocks(costs, model.calibration.at(model.microbatch_size))


def place(linear: LinearGraph, costs: CostTable, target: Target, *,
          advise: bool = True) -> Partition:
    """The optimal cuts for `target`, or the user's `split_points` evaluated. Where nothing
    fits, the error advises how many devices would (`advise`; it tries every device count, so
    a caller that drops the error passes False)."""
    problem = _problem(costs, target)
    if target.split_points is not None:
        return evaluate(problem, bounds_from_split_points(linear, target.split_points,
                                                          target.num_stages))
    advice = functools.partial(inflight_for, target.schedule, microbatches=target.microbatches,
                               virtual_stages=target.virtual_stages) if advise else None
    return fit_devices(problem, target.stage_to_device,
                       lambda placed: partition(placed, inflight_for=advice))


def refine(captured: CapturedModel, current: Choice, *, model: CostModel, target: Target,
           example: Example, ranks: Ranks) -> Choice | None:
    """A finer block granularity when it beats `current`, else None.

    Whole layers cannot balance a model whose stages come out uneven (a heavy head, a few
    large layers on few devices). While the bottleneck is more than 5 % above the lower bound
    (`partition.lower_bound`), try the next granularity and keep it if its optimum is at least
    10 % faster: smaller gains are within the cost model's error between different kinds of
    sub-layer blocks (measured: a 5 % predicted gain on GPT-2 ran 10 % slower)."""
    best = None
    levels = list(GRANULARITIES)
    for level in levels[levels.index(current.linear.granularity) + 1:]:
        if current.placement.bottleneck <= 1.05 * lower_bound(_problem(current.costs, target)):
            break
        finer = linearize(captured, granularity=level)
        if finer.num_blocks < target.num_stages or finer.num_blocks == current.linear.num_blocks:
            continue
        finer_costs = cost(finer, model, example, ranks)
        try:
            candidate = Choice(finer, finer_costs,
                               place(finer, finer_costs, target, advise=False))
        except PartitionMemoryError:  # the stages' recomputation was chosen for coarser blocks
            break
        if candidate.placement.bottleneck > 0.9 * current.placement.bottleneck:
            break
        current = best = candidate
    return best


def device_model(spec: DeviceSpec, ranks: Ranks, dtype: str | None = None, *,
                 cache: CompileCache | None = None) -> DeviceModel:
    """The analytic model of the first device. An absolute spec (`spec.flops` given: hardware
    that need not be here) gives its own figures, at its rate for the model's `dtype`; a figure
    it leaves out costs nothing. Otherwise the FLOP rate is measured on this machine (rank 0's
    under torch.distributed, so that every rank plans with the same numbers)."""
    if spec.absolute:  # priced op by op as the device runs it (passes/kernels.py, passes/kernel_prices.py)
        rate = spec.rate(dtype)
        accelerator = accelerator_of(spec)
        attention = (rate if accelerator is None  # a spec of one's own: at the matmul rate
                     else accelerator.attention * accelerator.peak(dtype))
        chip = None if accelerator is None or accelerator.chip is None else (
            accelerator.chip.with_ceiling(rate / accelerator.peak(dtype)))  # efficiency=
        return DeviceModel(flops=rate, bandwidth=spec.memory_bandwidth or math.inf,
                           op_overhead=spec.op_overhead or 0.0, attention=attention,
                           chip=chip, dtype=dtype)
    return DeviceModel(flops=ranks.rate(matmul_rate(spec.name, cache=cache)))


def action_cost(spec: DeviceSpec, ranks: Ranks, *, cache: CompileCache | None = None) -> float:
    """Fixed seconds per pipeline action and message: an absolute spec's `action_overhead`
    (0 if it gives none), else `action_overhead` measured on this machine (rank 0's)."""
    if spec.absolute:
        return spec.action_overhead or 0.0
    return ranks.rate(action_overhead(spec.name, cache=cache))


def analytic(specs: Sequence[DeviceSpec]) -> bool:
    """Whether a compile for `specs` measures nothing: every device gives its own figures."""
    return all(s.absolute for s in specs)


def bounds_from_split_points(linear: LinearGraph, split_points: Sequence[str],
                             num_stages: int) -> tuple[int, ...]:
    """Stage bounds with a cut right before each named module."""
    if len(split_points) != num_stages - 1:
        raise ConfigError(
            f"split_points has {len(split_points)} names but {num_stages} stages need "
            f"{num_stages - 1} cuts")
    cuts = []
    for name in split_points:
        index = linear.block_index(name)
        if index is None:
            known = ", ".join(b.name for b in linear.blocks[:12])
            raise ConfigError(f"split point {name!r} names no block; blocks are: {known}, ...")
        cuts.append(index)
    bounds = (0, *cuts, linear.num_blocks)
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(
            f"split_points {list(split_points)} give cut positions {cuts}: they must be in "
            f"model order, distinct, and not at the first block")
    return bounds


def _problem(costs: CostTable, target: Target) -> PartitionProblem:
    return partition_problem(BlockTable.of(costs, layout=target.layout), target.stage_specs,
                             target.inflight,
                             recompute=target.recompute, ratio=target.backward_ratio)
