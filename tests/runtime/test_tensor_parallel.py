"""runtime/tensor_parallel without processes: each rank's slice of a parameter (a fused
projection sliced part by part) and the DTensor placement that describes it. The collectives
run on gloo ranks in tests/distributed/test_tensor_parallel_exact.py."""

from __future__ import annotations

import torch

from pipecompile.ir.shard_plan import Placement
from pipecompile.runtime.tensor_parallel import local_slice, placement_of


def test_a_plain_split_is_the_ranks_contiguous_block():
    w = torch.arange(24.0).reshape(6, 4)
    p = Placement(1, (4,), "row")
    assert torch.equal(local_slice(w, p, 2, 1), w[:, 2:])
    assert torch.equal(torch.cat([local_slice(w, p, 2, r) for r in range(2)], 1), w)


def test_a_fused_projection_is_sliced_part_by_part():
    """qkv [3h, h]: rank r holds q_r, k_r, v_r (its heads of each), not a third of the rows."""
    h, T = 4, 2
    w = torch.arange(3 * h * h, dtype=torch.float64).reshape(3 * h, h)
    p = Placement(0, (h, h, h), "column")
    q, k, v = w.split(h)
    for r in range(T):
        rows = slice(r * h // T, (r + 1) * h // T)
        assert torch.equal(local_slice(w, p, T, r), torch.cat([q[rows], k[rows], v[rows]]))


def test_placements_name_the_split():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert placement_of(None) == Replicate()
    assert placement_of(Placement(1, (8,), "row")) == Shard(1)
    fused = placement_of(Placement(0, (4, 4, 4), "column"))
    assert isinstance(fused, _StridedShard) and fused.dim == 0 and fused.split_factor == 3


def test_the_vocabulary_lookups_of_the_ranks_sum_to_the_whole_lookup():
    """An embedding split along its rows: each rank looks up the indices it holds (zeros
    elsewhere); their sum is the whole lookup, and each rank's table gradient is its rows'
    slice of the whole one, padding_idx's row getting none."""
    from pipecompile.runtime.tensor_parallel import vocab_lookup

    T, V = 4, 12
    table = torch.randn(V, 3, dtype=torch.float64)
    ids = torch.tensor([[0, 5, 11, 3], [7, 5, 2, 9]])
    want_table = table.clone().requires_grad_()
    want = torch.nn.functional.embedding(ids, want_table, padding_idx=5)
    want.pow(2).sum().backward()
    parts = [table.chunk(T)[r].clone().requires_grad_() for r in range(T)]
    got = sum(vocab_lookup(r)(parts[r], ids, 5) for r in range(T))
    assert torch.equal(got, want)
    got.pow(2).sum().backward()
    assert torch.equal(torch.cat([p.grad for p in parts]), want_table.grad)
    assert not want_table.grad[5].any()
