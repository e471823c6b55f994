"""Virtual stages share their device's memory: a placement whose stages each fit but overflow
their device together is placed again with each stage given its share (device_share.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipecompile.ir.devices import DeviceSpec
from pipecompile.passes.partition import PartitionProblem, partition
from pipecompile.planner.device_share import device_memory, fit_devices

# 4 equal blocks on 4 stages, two per device (interleaved: stage s on device s % 2); a block
# holds 10 bytes of state and 30 of activations per micro-batch, its stage's input 1 byte
PROBLEM = PartitionProblem(block_times=(1.0,) * 4, cut_bytes=(0.0, 1.0, 1.0, 1.0, 0.0),
                           static_bytes=(10.0,) * 4, activation_bytes=(30.0,) * 4,
                           devices=(DeviceSpec(memory=84.0),) * 4, inflight=(2, 2, 1, 1),
                           forward_times=(0.5,) * 4, recompute=(None,) * 4)
DEVICES = (0, 1, 0, 1)


def test_stages_that_overflow_their_device_together_recompute_until_it_fits():
    alone = partition(PROBLEM)
    # alone, no stage recomputes: stages 0 and 1 keep 2 micro-batches (10 + 2 x 30 = 70 and
    # 10 + 2 x 31 = 72 <= 84), 2 and 3 one (10 + 31 = 41); device 0 holds 111, device 1 113
    assert alone.recompute == (False,) * 4
    assert device_memory(PROBLEM, alone, DEVICES) == [pytest.approx(111.0), pytest.approx(113.0)]
    shared = fit_devices(PROBLEM, DEVICES, partition)
    # recomputing saves 30 on stages 0 and 1 (40 and 42 then), nothing on 2 and 3 (41 either
    # way): 0 and 1 recompute, the devices hold 81 and 83 <= 84
    assert shared.recompute == (True, True, False, False)
    assert device_memory(PROBLEM, shared, DEVICES) == [pytest.approx(81.0), pytest.approx(83.0)]


def test_a_placement_that_fits_or_one_stage_per_device_is_kept():
    roomy = replace(PROBLEM, devices=(DeviceSpec(memory=120.0),) * 4)
    assert fit_devices(roomy, DEVICES, partition) == partition(roomy)
    assert fit_devices(PROBLEM, (0, 1, 2, 3), partition) == partition(PROBLEM)
    assert fit_devices(PROBLEM, None, partition) == partition(PROBLEM)
    # 70: recomputing stages 0 and 1 leaves 81 and 83 on the devices; nothing more to force
    tight = replace(PROBLEM, devices=(DeviceSpec(memory=70.0),) * 4)
    found = fit_devices(tight, DEVICES, partition)
    assert found.recompute == (True, True, False, False)
    assert max(device_memory(tight, found, DEVICES)) > 70.0  # the caller sees the overflow


def test_a_device_holds_one_recomputed_micro_batch_at_a_time():
    every = partition(replace(PROBLEM, recompute=(True,) * 4))
    assert every.stage_memory == pytest.approx((40.0, 42.0, 41.0, 41.0))
    # each device runs one backward at a time: the 30 bytes of a recomputed micro-batch once
    assert device_memory(PROBLEM, every, DEVICES) == [pytest.approx(51.0), pytest.approx(53.0)]
