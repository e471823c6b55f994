"""Layouts (P x D, FSDP, what a node holds): enumeration, placement on links, the bytes a
device holds and the step's collectives; the layout search over them."""

from __future__ import annotations

import math

import pytest

from pipecompile.errors import ConfigError
from pipecompile.passes.partition import PartitionMemoryError
from pipecompile.planner.cluster import cluster
from pipecompile.planner.collectives import Group, all_gather, all_reduce, reduce_scatter
from pipecompile.planner.layout import (
    Collectives,
    Layout,
    data_group,
    describe_placement,
    layout_static,
    layouts,
    pipeline_specs,
)
from pipecompile.planner.layout import LayoutCandidate
from pipecompile.planner.layout_search import TENSOR_PARALLEL_NOTE, search_layouts

C = cluster("h100", nodes=8, per_node=8)


def test_layouts_divide_the_devices_and_the_global_batch():
    found = layouts(8, batch=4, max_pipeline=8, fsdp=None)
    assert [(x.pipeline, x.data_parallel, x.fsdp) for x in found] == [
        (2, 4, False), (2, 4, True), (4, 2, False), (4, 2, True), (8, 1, False)]
    # P = 1 is legal where the batch allows; both placements on several nodes
    many = layouts(64, batch=128, max_pipeline=80, fsdp=False, nodes=8)
    assert Layout(1, 64) in many and Layout(64, 1) in many
    assert {x.inner for x in many if x.pipeline == 8} == {"pipeline", "data"}
    assert layouts(8, batch=8, max_pipeline=8, fsdp=None, pipeline=4) == (
        Layout(4, 2, False), Layout(4, 2, True))
    with pytest.raises(ConfigError, match=r"D = 6 / P must divide the global batch of 5"):
        layouts(6, batch=5, max_pipeline=3, fsdp=None)


def test_pipeline_neighbours_and_replica_groups_sit_on_the_links_of_the_placement():
    inside = Layout(8, 8, False, "pipeline")  # a pipeline per node
    assert {s.bandwidth for s in pipeline_specs(inside, C, [])} == {C.intra.bandwidth}
    assert data_group(inside, C) == Group(1, 8)
    across = Layout(8, 8, True, "data")  # a replica group per node
    assert {s.bandwidth for s in pipeline_specs(across, C, [])} == {C.inter.bandwidth}
    assert data_group(across, C) == Group(8, 1)
    mixed = Layout(16, 4, False, "pipeline")  # 16 positions span two nodes
    links = [s.bandwidth for s in pipeline_specs(mixed, C, [])]
    assert links[7] == C.inter.bandwidth and links.count(C.inter.bandwidth) == 1
    assert "infiniband/nvlink" in describe_placement(mixed, C)
    assert data_group(Layout(2, 32, True, "data"), C) == Group(8, 4)


def test_a_device_holds_full_bytes_replicated_and_shards_under_fsdp():
    assert layout_static(2.0, 2.0, 4.0, Layout(1, 8)) == 8.0
    # gathered parameters and unsharded gradients for the step, 1/D of params and state
    assert layout_static(2.0, 2.0, 4.0, Layout(1, 8, True)) == pytest.approx(4 + 6 / 8)


def test_collectives_of_a_layout_on_its_links():
    fsdp = Collectives.of(Layout(8, 8, True, "data"), C, C.device)
    assert fsdp is not None
    group = Group(8, 1)
    setup, teardown = fsdp.extras(16e9, 16e9, 32e9, 1.0, overlap=True)
    # AdamW: 2 x parameters + gradients + 2 x state; torch's clipping: 6 x gradients (the
    # shards; kernel_prices.TORCH_CLIP_PASSES, measured)
    step = (2 * 16e9 + 16e9 + 2 * 32e9 + 6 * 16e9) / 8 / C.device.memory_bandwidth
    assert setup == pytest.approx(all_gather(16e9, group, C.intra, C.inter))
    assert teardown == pytest.approx(reduce_scatter(16e9, group, C.intra, C.inter) + step)
    ddp = Collectives.of(Layout(8, 8, False, "pipeline"), C, C.device)
    assert ddp is not None
    reduce = all_reduce(16e9, Group(1, 8), C.intra, C.inter)
    plain = (2 * 16e9 + 16e9 + 2 * 32e9 + 6 * 16e9) / C.device.memory_bandwidth
    # the reducer overlaps the last backward; recomputation or a split backward: after it
    assert ddp.extras(16e9, 16e9, 32e9, 0.1, overlap=True) == pytest.approx(
        (0.0, max(0.0, reduce - 0.1) + plain))
    assert ddp.extras(16e9, 16e9, 32e9, 0.1, overlap=False) == pytest.approx((0.0, reduce + plain))
    assert Collectives.of(Layout(2, 1), None, C.device).extras(1e9, 1e9, 0, 1.0, overlap=True) == (
        0.0, pytest.approx(9e9 / C.device.memory_bandwidth))  # 2 + 1 + 6 gradient-sizes


class _Best:
    def __init__(self, step):
        self.step, self.schedule, self.microbatches, self.virtual_stages = step, "1f1b", 4, 1
        self.recomputed, self.memory = (), (1e9,)


class _Result:
    def __init__(self, step):
        self.best = _Best(step)


def test_the_search_keeps_the_fastest_layout_and_says_why_others_lost():
    steps = {Layout(1, 4): None, Layout(2, 2): 2.0, Layout(4, 1): 3.0}

    def run(layout):
        if steps[layout] is None:
            raise PartitionMemoryError("too big", memory_needed=90e9, devices_needed=None)
        return _Result(steps[layout])

    result, tried = search_layouts(list(steps), run)
    assert result.best.step == 2.0 and tried[0] == LayoutCandidate(
        Layout(2, 2), 2.0, "1f1b", 4, 1, 0, 1e9)
    assert tried[1].reason == "slower (+50.0%)" and not tried[2].fits
    assert "does not fit: needs" in tried[2].reason
    assert LayoutCandidate.from_dict(tried[0].to_dict()) == tried[0]
    # a layout whose compute alone exceeds the best is not searched
    _, pruned = search_layouts([Layout(2, 2), Layout(4, 1)], run,
                               bound=lambda lay: 10.0 if lay.pipeline == 4 else 0.0)
    assert "not searched" in pruned[1].reason and math.isinf(pruned[1].step)


def test_no_layout_fitting_names_tensor_parallelism():
    def run(layout):
        raise PartitionMemoryError("a stage needs 90 GB", memory_needed=90e9, devices_needed=None)

    with pytest.raises(PartitionMemoryError, match="bound by tensor parallelism"):
        search_layouts([Layout(1, 2), Layout(2, 1)], run)
    assert "tensor parallelism" in TENSOR_PARALLEL_NOTE


def test_the_planner_folder_names_each_of_its_modules():
    import pipecompile.planner as folder

    from tests.support.folders import unlisted

    assert unlisted(folder) == []


def test_the_optimizer_step_is_priced_by_the_kernels_torch_runs_for_the_factory():
    """compile's optimizer factory read on a probe (layout.step_passes): torch's AdamW by
    default runs its foreach kernels, fused=True one kernel, Adam without weight decay
    skips its pass over the parameters, any other optimizer at AdamW's fused minimum."""
    import torch

    from pipecompile.passes.kernel_prices import ADAMW_PASSES
    from pipecompile.planner.layout import step_passes

    assert step_passes(lambda p: torch.optim.AdamW(p)) == (4, 2, 7)
    assert step_passes(lambda p: torch.optim.AdamW(p, weight_decay=0.0)) == (2, 2, 7)
    assert step_passes(lambda p: torch.optim.AdamW(p, fused=True)) == ADAMW_PASSES
    assert step_passes(lambda p: torch.optim.Adam(p)) == (2, 2, 7)
    assert step_passes(lambda p: torch.optim.SGD(p, lr=0.1)) == ADAMW_PASSES
    assert step_passes(None) == ADAMW_PASSES
    # bf16 parameters: AdamW's moments are bf16 (its kernels, as above); an optimizer keeping
    # fp32 master weights in its state is priced as Megatron-LM's mixed-precision step
    from pipecompile.passes.kernel_prices import mixed_precision_bytes, optimizer_seconds
    from tests.passes.test_annotate import MasterWeightsAdamW

    assert step_passes(lambda p: torch.optim.AdamW(p), torch.bfloat16) == (4, 2, 7)
    master = step_passes(MasterWeightsAdamW, torch.bfloat16)
    assert master == (1, 1, 3.0) and step_passes(MasterWeightsAdamW) == ADAMW_PASSES
    # 1e9 bf16 parameters, fp32 master and moments (12 bytes each), at 1 TB/s: 52 bytes each
    assert optimizer_seconds(1e12, 2e9, 2e9, 12e9, passes=master) == pytest.approx(
        mixed_precision_bytes(loss_scale=False) * 1e9 / 1e12) == pytest.approx(52e-3)


def test_a_given_tensor_degree_meets_one_rule():
    """The rule a given T meets, written once (layout_options and the search pass both call
    it): it divides the devices per node, and with D given, D x T divides the devices."""
    from pipecompile.planner.layout import check_tensor_degree

    for t in (1, 2, 4, 8):
        check_tensor_degree(t, 8, 64)
    check_tensor_degree(4, 8, 64, data_parallel=2)
    with pytest.raises(ConfigError, match=r"tensor_parallel=3 does not divide the 8 GPUs per "
                                          r"node.*use one of \[1, 2, 4, 8\]"):
        check_tensor_degree(3, 8, 64)
    with pytest.raises(ConfigError, match=r"tensor_parallel=16 does not divide the 8 GPUs"):
        check_tensor_degree(16, 8, 64)
    with pytest.raises(ConfigError, match=r"data_parallel=3 x tensor_parallel=4 does not "
                                          r"divide the 64 GPUs"):
        check_tensor_degree(4, 8, 64, data_parallel=3)
