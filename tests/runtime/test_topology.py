"""runtime/distributed without processes: a rank's place in the (replica x position) grid, the
stages it runs, and the forward-only schedule a validation pass or `pipe(x)` runs on the ranks.
(The reductions run on real gloo ranks in test_distributed.py.)"""

from __future__ import annotations

import pytest

from pipecompile.runtime.distributed import Topology, forward_only
from pipecompile.schedule.actions import Kind
from pipecompile.schedule.schedules import make_schedule


@pytest.mark.parametrize("rank, position, replica", [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)])
def test_ranks_fill_the_grid_pipeline_first(rank, position, replica):
    topology = Topology(rank, world_size=4, pipeline_size=2, data_parallel=2)
    assert (topology.position, topology.replica) == (position, replica)
    assert topology.rank_of(1 - position) == replica * 2 + 1 - position  # its pipeline peer
    assert topology.rank_of(position, replica=1 - replica) == (1 - replica) * 2 + position


@pytest.mark.parametrize("name, owned", [("1f1b", [(0,), (1,)]),
                                         ("interleaved-1f1b", [(0, 2), (1, 3)]),
                                         ("zb-v", [(0, 3), (1, 2)])])
def test_a_rank_runs_the_stages_its_position_holds(name, owned):
    schedule = make_schedule(name, 2, 4, virtual_stages=None if name == "1f1b" else 2)
    stages = [Topology(r, 4, 2, 2).own_stages(schedule) for r in range(4)]
    assert stages == owned + owned  # the second replica runs the same stages


def test_forward_only_keeps_the_first_microbatches_forwards_in_order():
    schedule = make_schedule("1f1b", 3, 6)
    forwards = forward_only(schedule, 2)
    assert forwards.num_microbatches == 2
    for row, kept in zip(schedule.actions, forwards.actions):
        expected = [a for a in row if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F)
                    and a.microbatch is not None and a.microbatch < 2]
        assert list(kept) == expected and expected


def test_tensor_parallel_ranks_are_consecutive_inside_the_grid():
    """P=2, D=2, T=2: rank = (replica * P + position) * T + index."""
    places = [(t.position, t.replica, t.tp_index)
              for t in (Topology(r, 8, 2, 2, tensor_parallel=2) for r in range(8))]
    assert places == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1),
                      (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    t = Topology(3, 8, 2, 2, tensor_parallel=2)  # position 1, replica 0, index 1
    assert t.rank_of(0) == 1  # its pipeline peer has the same tensor-parallel index
    assert t.rank_of(1, replica=1) == 7 and t.rank_of(0, 1, 0) == 4
