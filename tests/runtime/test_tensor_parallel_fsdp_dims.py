"""runtime/tensor_parallel with FSDP, without processes: the dim FSDP shards each tensor-
parallel parameter along, and the part reader a fused parameter held whole goes through
(forward: this rank's parts; backward: its parts' gradient in place, summed over the group).
The whole runs on gloo ranks in tests/distributed/test_tensor_parallel_fsdp.py."""

from __future__ import annotations

import torch

from pipecompile.ir.shard_plan import Placement
from pipecompile.runtime import tensor_parallel
from pipecompile.runtime.tensor_parallel import fsdp_dim, fsdp_placement, part_reader


def test_fsdp_shards_along_dim_0_except_a_fused_projections_split_dim():
    column, row = Placement(0, (8,), "column"), Placement(1, (8,), "row")
    qkv, conv1d = Placement(0, (4, 4, 4), "column"), Placement(1, (4, 4, 4), "column")
    assert fsdp_dim((8, 4), None, 2) == 0  # whole over "tp"
    assert fsdp_dim((8, 4), column, 2) == 0 and fsdp_dim((4, 8), row, 2) == 0
    assert fsdp_dim((12, 4), qkv, 2) == 1  # Linear's fused weight: along its input dim
    assert fsdp_dim((4, 12), conv1d, 2) == 0  # GPT-2's Conv1D [h, 3h]: along its rows
    assert fsdp_dim((12, 3), qkv, 2) is None  # no other dim 2 divides
    assert fsdp_dim((12,), qkv, 2) is None  # a fused bias: stays whole over "tp"


def test_the_placement_fn_reads_the_tensor_parallel_placement():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    class Fake(torch.nn.Parameter):
        placements: tuple

    def param(shape, placement):
        p = Fake(torch.zeros(shape))
        p.placements = (placement,)
        return p

    shard = fsdp_placement(2)
    assert shard(param((12, 4), _StridedShard(0, split_factor=3))) == Shard(1)
    assert shard(param((4, 12), _StridedShard(1, split_factor=3))) == Shard(0)
    assert shard(param((8, 4), Shard(0))) == Shard(0)
    assert shard(param((8,), Replicate())) == Shard(0)


def test_a_fused_part_reads_its_parts_and_puts_the_gradient_back(monkeypatch):
    """Rank 1 of 2, qkv bias [3 x 4]: forward q_1, k_1, v_1; backward their gradient at their
    places, zeros elsewhere, then summed over the group (here: the sum is the rank's own)."""
    reduced = []
    monkeypatch.setattr(tensor_parallel.dist, "all_reduce",
                        lambda t, group=None: reduced.append(t.clone()))
    whole = torch.arange(12.0, dtype=torch.float64, requires_grad=True)
    part = part_reader(Placement(0, (4, 4, 4), "column bias"), None, 2, 1)
    got = part(whole)
    assert got.tolist() == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    got.backward(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.float64))
    assert whole.grad.tolist() == [0, 0, 1, 2, 0, 0, 3, 4, 0, 0, 5, 6]
    assert len(reduced) == 1  # one all-reduce of the whole gradient
