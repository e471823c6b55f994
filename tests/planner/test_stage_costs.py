"""stage_costs: block costs -> the simulator's per-stage costs, checked against hand sums."""

from __future__ import annotations

import pytest

from pipecompile.ir.records import StageTimes
from pipecompile.ir.devices import DeviceSpec
from pipecompile.schedule.schedules import make_schedule
from pipecompile.planner.stage_costs import (
    SPLIT_BACKWARD_RATIO,
    BlockTable,
    backward_ratio,
    inflight_for,
    partition_problem,
    placement_ratio,
    simulator_costs,
)

# four blocks: F, I, W per block; cut 0 carries nothing (the model's inputs), the others bytes
TABLE = BlockTable(forward=(1.0, 2.0, 3.0, 4.0), backward_input=(1.0, 1.0, 2.0, 2.0),
                   backward_weight=(1.0, 3.0, 2.0, 6.0), static_bytes=(0.0,) * 4,
                   activation_bytes=(0.0,) * 4, cut_bytes=(0.0, 100.0, 200.0, 300.0, 0.0))


def test_a_stage_costs_its_blocks_at_its_devices_speed():
    fast = DeviceSpec(speed=2.0, bandwidth=100.0)
    first, second = simulator_costs(TABLE, (0, 2, 4), (DeviceSpec(bandwidth=100.0), fast),
                                    recompute=(False, False), split_ratio=1.0)
    # the first stage receives no gradient-carrying input: its whole backward (6) is W
    assert (first.forward, first.backward, first.input_time, first.weight_time) == (3, 6, 0, 6)
    # the second: (3 + 4) / 2 forward, (2 + 2) / 2 input and (2 + 6) / 2 weight gradients
    assert (second.forward, second.backward, second.input_time, second.weight_time) == (
        3.5, 6.0, 2.0, 4.0)
    # messages over the sender's link: 200 bytes at 100 B/s; nothing crosses the ends
    assert (first.send_forward, first.send_backward) == (2.0, 0.0)
    assert (second.send_forward, second.send_backward) == (0.0, 2.0)


def test_a_recomputing_stage_runs_its_forward_again_in_b_and_in_i():
    plain, again = simulator_costs(TABLE, (0, 2, 4), (DeviceSpec(),) * 2, recompute=(False, True),
                                   split_ratio=1.0)
    assert again.backward == 12.0 + 7.0 and again.input_time == 4.0 + 7.0
    assert again.weight_time == 8.0 and plain.backward == 6.0


@pytest.mark.parametrize("measured_ratio", [0.13, 0.8, 1.0])
def test_a_split_backward_never_costs_less_than_the_fused_one(measured_ratio):
    """A probe on a loaded machine measured (I + W) / B = 0.13 (the one long B preempted more
    often than the short I and W): priced as such, zero-bubble schedules looked 7x cheaper in
    backward than they run. I and W run B's kernels: I + W is at least B."""
    assert backward_ratio(measured_ratio) == 1.0
    for cost in simulator_costs(TABLE, (0, 1, 3, 4), (DeviceSpec(),) * 3,
                                recompute=(False, True, False), split_ratio=measured_ratio):
        assert cost.input_time + cost.weight_time == pytest.approx(cost.backward)


def test_a_measured_ratio_above_one_and_the_default_price_i_and_w():
    assert backward_ratio(None) == SPLIT_BACKWARD_RATIO and backward_ratio(2.5) == 2.5
    first, second = simulator_costs(TABLE, (0, 2, 4), (DeviceSpec(),) * 2,
                                    recompute=(False, False), split_ratio=2.0)
    assert first.input_time + first.weight_time == 2.0 * first.backward == 12.0
    assert (second.input_time, second.weight_time) == (8.0, 16.0)


def test_measured_stage_times_are_used_as_they_are_unless_i_and_w_undercut_b():
    measured = {0: StageTimes(forward=1.0, backward=4.0, backward_input=0.5, backward_weight=4.5),
                1: StageTimes(forward=1.0, backward=4.0, backward_input=0.2, backward_weight=0.6)}
    kept, raised = simulator_costs(TABLE, (0, 2, 4), (DeviceSpec(speed=2.0),) * 2,
                                   recompute=(False, False), split_ratio=0.5, measured=measured)
    assert (kept.forward, kept.backward, kept.input_time, kept.weight_time) == (1, 4, 0.5, 4.5)
    # 0.8 s of I + W for a 4 s B is noise: scaled to B, in the measured proportion
    assert raised.input_time == pytest.approx(1.0) and raised.weight_time == pytest.approx(3.0)


def test_split_schedules_place_blocks_at_their_split_backwards_cost():
    assert placement_ratio(make_schedule("1f1b", 2, 4), 3.0) == 1.0
    assert placement_ratio(make_schedule("zb-h1", 2, 4), 3.0) == 3.0
    assert placement_ratio(make_schedule("zb-h1", 2, 4), 0.5) == 1.0
    problem = partition_problem(TABLE, (DeviceSpec(),) * 2, (2, 1), recompute=None, ratio=3.0)
    assert problem.block_times == (7.0, 14.0, 15.0, 28.0) and problem.forward_times is None
    free = partition_problem(TABLE, (DeviceSpec(),) * 2, (2, 1), recompute=(None, False))
    assert free.block_times == (3.0, 6.0, 7.0, 12.0) and free.forward_times == TABLE.forward


def test_inflight_for_another_stage_count_or_the_worst_case():
    assert inflight_for("1f1b", 4, microbatches=8, virtual_stages=1) == (4, 3, 2, 1)
    # interleaving needs the micro-batches to be a multiple of the devices: assume the worst
    assert inflight_for("interleaved-1f1b", 6, microbatches=4, virtual_stages=2) == (4,) * 6


@pytest.mark.parametrize("name,stages,m,v", [
    ("gpipe", 5, 7, 1), ("gpipe", 4, 1, 1), ("1f1b", 6, 12, 1), ("1f1b", 9, 3, 1),
    ("1f1b", 1, 5, 1), ("zb-h1", 4, 8, 1),
    ("interleaved-1f1b", 8, 8, 2), ("interleaved-1f1b", 12, 12, 3),
    ("zb-v", 8, 8, 2), ("interleaved-zb", 8, 8, 2)])
def test_inflight_for_reads_the_validated_schedules_counts(name, stages, m, v):
    """Read unvalidated and without messages (fast), the counts are the validated schedule's."""
    from pipecompile.schedule.schedules import make_schedule
    from pipecompile.schedule.simulate import inflight

    want = inflight(make_schedule(name, stages // v, m, virtual_stages=v))
    assert inflight_for(name, stages, microbatches=m, virtual_stages=v) == want


def test_inflight_for_a_stage_count_the_devices_cannot_hold_is_the_worst_case():
    assert inflight_for("interleaved-1f1b", 7, microbatches=4, virtual_stages=2) == (4,) * 7
