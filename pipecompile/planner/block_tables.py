"""The block costs a search prices its candidates with, each worked out once per search.

A candidate with `stages` stages needs the captured model linearised coarsely enough to give
every stage a block (`coarsest`), and the blocks costed at the candidate's micro-batch size
(`cost_model`). Many candidates share both, so `BlockTables` keeps them: the schedule search
(shape_passes.py) and the layout search (layout_passes.py) ask it the same way.

    tables = BlockTables(plan, example, calibration)
    found = tables.at(stages=4, size=2, microbatches=8)   # (LinearGraph, CostTable) or None
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import PartitionError
from ..ir.records import CapturedModel, CostTable, Example, LinearGraph
from ..passes.annotate import optimizer_state_factor
from ..passes.calibrate import Calibration
from ..passes.linearize import GRANULARITIES, linearize
from .options import compute_dtype
from .resolved import example_microbatch_size
from .plan import Plan
from .decisions import CostModel, cost
from .cluster import Cluster, Link
from .layout import Layout
from .tensor_costs import TensorShare
from ..ir.devices import DeviceSpec

__all__ = ["BlockTables", "coarsest", "enough_blocks", "cost_model", "tensor_share",
           "model_dtype"]


def coarsest(captured: CapturedModel, granularity: str | None, stages: int,
             levels: dict[str, LinearGraph] | None = None) -> LinearGraph:
    """The coarsest linearization with a block for every stage (or the finest tried);
    `levels` keeps each granularity's linearization of `captured` for the next call (seconds
    each for an 80-layer model)."""
    levels = {} if levels is None else levels
    for level in [granularity] if granularity else list(GRANULARITIES):
        if level not in levels:
            levels[level] = linearize(captured, granularity=level)
        linear = levels[level]
        if linear.num_blocks >= stages:
            break
    return linear


def enough_blocks(linear: LinearGraph, stages: int, granularity: str | None) -> None:
    """Raise a `PartitionError` when `linear` has fewer blocks than `stages`."""
    if linear.num_blocks < stages:
        raise PartitionError(
            f"the model has only {linear.num_blocks} blocks at granularity "
            f"{linear.granularity!r}, fewer than the {stages} stages asked for; use at "
            f"most {linear.num_blocks} devices"
            + ("" if granularity is None else " or a finer granularity"))


def tensor_share(layout: Layout | None, cluster: Cluster | None, device: DeviceSpec
                 ) -> TensorShare | None:
    """What one rank of `layout`'s tensor-parallel groups runs, over the link inside a node
    (the cluster's, else the link `device` sends over); None without tensor parallelism."""
    if layout is None or layout.tensor_parallel <= 1:
        return None
    link = (cluster.intra if cluster is not None
            else Link("link", device.bandwidth, device.latency))
    return TensorShare(layout.tensor_parallel, link, layout.sequence_parallel, device.memory)


def pipeline_loss_reads(plan: Plan, example: Example) -> dict[int, str]:
    """How the pipeline's loss reads each flat output of the captured model (the price of a
    split output layer: planner/logits_loss.py); {} before capture."""
    from .logits_loss import loss_reads

    captured = plan.captured
    if captured is None:
        return {}
    return dict(loss_reads(captured, plan.asked.loss_fn, example.target))


def given_vocabulary(plan: Plan) -> bool | None:
    """compile's `vocab_parallel` when True or False; None: "auto", priced
    (planner/tensor_costs.py)."""
    given = plan.request.layout.vocab_parallel if plan.request is not None else None
    return given if isinstance(given, bool) else None


def cost_model(plan: Plan, example: Example) -> CostModel:
    """How this plan's blocks are costed: the measured device model, the resolved micro-batch
    size, profiling, the calibration so far, the compile cache, and once the layout is chosen
    one rank's share under its tensor parallelism."""
    o, asked = plan.resolved, plan.asked
    chosen = plan.choices.layout if plan.choices is not None else None
    share = tensor_share(chosen, plan.asked.cluster, o.devices[0])
    return CostModel(device=plan.ready.device_model,
                     microbatch_size=example_microbatch_size(example, asked, o),
                     microbatches=o.microbatches,
                     optimizer_factor=optimizer_state_factor(asked.optimizer, model_dtype(plan)),
                     profile=o.profile,
                     calibration=plan.calibration, cache=asked.cache,
                     tensor=share, vocabulary=given_vocabulary(plan),
                     loss_reads=tuple(sorted(pipeline_loss_reads(plan, example).items()))
                     if share is not None else ())


class BlockTables:
    """The linearisation for each stage count and the cost table for each (granularity,
    micro-batch size) of one search, computed on first use."""

    def __init__(self, plan: Plan, example: Example, calibration: Calibration | None) -> None:
        self.plan, self.example, self.calibration = plan, example, calibration
        self._linears: dict[int, LinearGraph | None] = {}
        self.levels: dict[str, LinearGraph] = {}  # each granularity's linearization
        self._tables: dict[tuple[str, int], CostTable] = {}

    def at(self, stages: int, size: int, microbatches: int
           ) -> tuple[LinearGraph, CostTable] | None:
        """The linear graph for `stages` stages and its blocks' costs at micro-batch `size`
        (`microbatches` of them), or None when no granularity gives `stages` blocks."""
        captured, o = self.plan.ready.captured, self.plan.resolved
        if stages not in self._linears:
            found = coarsest(captured, self.plan.asked.granularity, stages, self.levels)
            self._linears[stages] = found if found.num_blocks >= stages else None
        linear = self._linears[stages]
        if linear is None:
            return None
        key = (linear.granularity, size)
        if key not in self._tables:
            model = replace(cost_model(self.plan, self.example), microbatch_size=size,
                            microbatches=microbatches, profile=False,
                            calibration=self.calibration, tensor=None)  # shared by every T
            like = next((t for (g, _), t in self._tables.items() if g == linear.granularity),
                        None)  # the symbolic costs of a granularity are shared across sizes
            self._tables[key] = cost(linear, model, self.example, o.ranks, like)
        return linear, self._tables[key]


def model_dtype(plan: Plan) -> torch.dtype:
    """The dtype holding most of the captured model's parameters (options.compute_dtype)."""
    captured = plan.ready.captured
    return torch.float32 if captured is None else getattr(torch, compute_dtype(captured.module))
