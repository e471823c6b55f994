"""ranks.py: in one process every agreement is the identity; on 2 gloo ranks the measurements a
plan depends on are rank 0's, stage times are gathered from every rank, and different plans are
an error on every rank."""

from __future__ import annotations

import pytest
import torch

from pipecompile.capture.capture import capture
from pipecompile.ir.records import StageTimes
from pipecompile.passes.annotate import annotate, with_measured_times
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.measure.ranks import Ranks
from pipecompile.runtime.distributed import Topology
from pipecompile.schedule.schedules import make_schedule
from tests.distributed.ranks import run_ranks


def _linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    return linearize(capture(model, (torch.randn(8, 4),), method="fx"), granularity="layer")


def test_one_process_agrees_with_itself():
    ranks = Ranks()
    assert not ranks.distributed
    schedule = make_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)
    assert ranks.own_stages(schedule) == (0, 1, 2, 3)
    assert ranks.rate(3e9) == 3e9
    probe = object()
    assert ranks.shared(probe) is probe
    linear = _linear()
    costs = annotate(linear, microbatch_size=4)
    assert ranks.block_times(costs) is costs
    measured = {0: StageTimes(1.0, 2.0, 1.0, 1.0)}
    assert ranks.stage_times(measured) == measured and ranks.stage_times(measured) is not measured
    program = split(linear, (0, 1, linear.num_blocks), ["cpu", "cpu"])
    assert ranks.check(program, make_schedule("gpipe", 2, 2)) is None


def _agree(rank):
    ranks = Ranks(Topology(rank, 2, 2, 1))
    linear = _linear()
    costs = annotate(linear, microbatch_size=4)
    # each rank "measured" its own block times: rank r's are r + 1 seconds per part
    times = {i: (rank + 1.0, rank + 1.0, rank + 1.0) for i in range(linear.num_blocks)}
    mine = with_measured_times(costs, times)
    result = {
        "own": ranks.own_stages(make_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)),
        "rate": ranks.rate(1e9 * (rank + 1)),
        "shared": ranks.shared({"rank": rank}),
        "blocks": [(b.forward_time, b.backward_input_time, b.backward_weight_time, b.measured)
                   for b in ranks.block_times(mine).blocks],
        # each rank times only its own stage
        "stages": ranks.stage_times({rank: StageTimes(rank + 1.0, 0.0, 0.0, 0.0)}),
    }
    program = split(linear, (0, 1, linear.num_blocks), ["cpu", "cpu"])
    result["same"] = ranks.check(program, make_schedule("gpipe", 2, 2))
    # rank 1 plans another schedule: both ranks learn it
    try:
        ranks.check(program, make_schedule("gpipe" if rank == 0 else "1f1b", 2, 2))
        result["differ"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["differ"] = f"{type(exc).__name__}: {exc}"
    return result


@pytest.mark.slow
def test_rank_zeros_measurements_and_one_plan_on_two_gloo_ranks():
    results = run_ranks(_agree, 2)
    blocks = len(_linear().blocks)
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        assert r["own"] == ((0, 2), (1, 3))[rank]
        assert r["rate"] == 1e9 and r["shared"] == {"rank": 0}  # rank 0's, on both
        assert r["blocks"] == [(1.0, 1.0, 1.0, True)] * blocks
        assert r["stages"] == {0: StageTimes(1.0, 0.0, 0.0, 0.0),
                               1: StageTimes(2.0, 0.0, 0.0, 0.0)}
        assert r["same"] == (f"same plan on all 2 ranks; this is rank {rank} (position {rank}, "
                             f"replica 0)")
        assert r["differ"].startswith("ConfigError: the ranks compiled different pipeline "
                                      "plans (ranks [0]: plan ")
