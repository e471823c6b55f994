"""weights/shard_slices.py in one process: which runs a rank of a DTensor holds (a fake
2-rank process group: this process is rank 1), and reading only those runs out of a
safetensors file and a DCP checkpoint. The real 2-rank job (meta models, load_weights, DCP
save of a fused projection) is tests/distributed/test_tensor_parallel_weights.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from pipecompile.weights.shard_slices import Runs, read_slices, runs_of, slice_bytes

W = torch.arange(4 * 6, dtype=torch.float64).reshape(4, 6)


@pytest.fixture
def rank1_of_2():
    """A fake process group (no communication): this process is rank 1 of 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_runs_follow_the_placement(rank1_of_2):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = rank1_of_2

    def of(placement, local):
        return runs_of(DTensor.from_local(local, mesh, [placement], run_check=False,
                                          shape=W.shape, stride=W.stride()))

    assert of(Shard(0), W[2:]) == Runs(0, ((2, 4),))
    assert of(Shard(1), W[:, 3:]) == Runs(1, ((3, 6),))
    # q, k, v of two columns each: rank 1 holds the second column of each
    assert of(_StridedShard(1, split_factor=3), W[:, [1, 3, 5]]) == Runs(1, ((1, 2), (3, 4),
                                                                             (5, 6)))
    assert of(Replicate(), W) is None
    assert runs_of(W) is None


def test_a_slice_is_read_run_by_run(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": W, "b": W[0].clone()}, str(path))
    runs = Runs(1, ((1, 2), (3, 4), (5, 6)))
    got = read_slices(str(path), {"w": runs, "missing": runs})
    assert set(got) == {"w"}
    assert torch.equal(got["w"], W[:, [1, 3, 5]])
    assert slice_bytes(runs, (4, 6), torch.float64) == 4 * 3 * 8
    assert torch.equal(read_slices(str(path), {"w": Runs(0, ((2, 4),))})["w"], W[2:])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_slice_is_read_as_chunks(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": W}, checkpoint_id=str(tmp_path), no_dist=True)
    got = read_slices(str(tmp_path), {"w": Runs(1, ((0, 1), (2, 3), (4, 5)))})
    assert torch.equal(got["w"], W[:, [0, 2, 4]])


@contextlib.contextmanager
def _dp_tp_mesh(rank: int, whole: torch.Tensor):
    """Rank `rank` of a fake (dp, tp) = 2 x 2 mesh (no communication); yields `of(placements,
    local)`: the blocks this rank holds of `whole` as a DTensor of those placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pipecompile.weights.shard_slices import blocks_of

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        yield lambda placements, local: blocks_of(DTensor.from_local(
            local, mesh, placements, run_check=False, shape=whole.shape, stride=whole.stride()))
    finally:
        dist.destroy_process_group()


def test_blocks_over_two_mesh_dims_are_the_product_of_each_dims_runs():
    """FSDP's Shard(0) over "dp" with TP's fused _StridedShard(1) over "tp" (rank 3 of a fake
    2 x 2 mesh: second rows, second column of each part): 3 blocks at their global offsets,
    local starts along the local tensor; two mesh dims on one tensor dim (FSDP's
    _StridedShard(0) of TP's Shard(0)) compose as torch composes them; replicated: None."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from pipecompile.weights.shard_slices import blocks_of

    with _dp_tp_mesh(rank=3, whole=W) as of:
        fused = [Shard(0), _StridedShard(1, split_factor=3)]
        assert of(fused, W[2:, [1, 3, 5]]) == [((2, 1), (2, 1), (0, 0)), ((2, 3), (2, 1), (0, 1)),
                                               ((2, 5), (2, 1), (0, 2))]
        assert of([Replicate(), Shard(1)], W[:, 3:]) == [((0, 3), (4, 3), (0, 0))]
        assert of([Shard(0), Shard(0)], W[3:]) == [((3, 0), (1, 6), (0, 0))]
        assert of([_StridedShard(0, split_factor=2), Shard(0)], W[3:]) == [
            ((3, 0), (1, 6), (0, 0))]
        assert of([Replicate(), Replicate()], W) is None
        assert blocks_of(W) is None


def test_strided_dp_over_tp_rows_is_cut_as_torch_cuts_it():
    """Rank 1 of a fake (dp, tp) = 2 x 2 mesh (dp 0, tp 1), 8 rows: TP's Shard(0) gives it rows
    4-7 and FSDP's _StridedShard(0) over dp the first half of those (rows 4, 5), where two plain
    Shard(0) give rows 2, 3."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    rows = torch.arange(8 * 3, dtype=torch.float64).reshape(8, 3)
    with _dp_tp_mesh(rank=1, whole=rows) as of:
        assert of([_StridedShard(0, split_factor=2), Shard(0)], rows[4:6]) == [
            ((4, 0), (2, 3), (0, 0))]
        assert of([Shard(0), Shard(0)], rows[2:4]) == [((2, 0), (2, 3), (0, 0))]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_blocks_are_read_block_by_block_into_the_local_tensor(tmp_path):
    """The fused projection's blocks under TP x FSDP (rows 2-3, the second column of each
    part): safetensors and DCP give the same local tensor; its bytes are those blocks'."""
    import torch.distributed.checkpoint as dcp

    blocks = [((2, 1), (2, 1), (0, 0)), ((2, 3), (2, 1), (0, 1)), ((2, 5), (2, 1), (0, 2))]
    path = tmp_path / "w.safetensors"
    save_file({"w": W}, str(path))
    dcp.save({"w": W}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    want = W[2:, [1, 3, 5]]
    assert torch.equal(read_slices(str(path), {"w": blocks})["w"], want)
    assert torch.equal(read_slices(str(tmp_path / "dcp"), {"w": blocks})["w"], want)
    assert slice_bytes(blocks, (4, 6), torch.float64) == 2 * 3 * 8
