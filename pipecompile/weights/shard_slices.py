"""This rank's slice of a sharded tensor (a DTensor), read from a checkpoint alone, and shown to
torch.distributed.checkpoint as the pieces it is made of.

    runs_of(tensor)              -> Runs | None   the global indices along one dim this rank
                                                   holds, as contiguous runs in local order
    blocks_of(tensor)            -> [(offsets, sizes, local starts)] | None  this rank's
                                                   blocks over every mesh dimension
    read_slices(path, slices)    -> {key: local}  only those runs or blocks of each tensor
    as_pieces(tensor)            a DTensor whose DCP chunks are its blocks (a fused projection,
                                 with FSDP too)
    pieces_after_optimizer_steps()  the same for an optimizer's state of such a parameter

A tensor split along dim d (`Shard(d)`) holds one run of d: rank r of T holds rows
[r N/T, (r+1) N/T). A fused projection (GPT-2's `c_attn`: q, k and v in one weight,
`_StridedShard(d, split_factor=k)`) holds k runs: of each part its r-th 1/T. The runs are
computed by the placement's own split (`_split_tensor` of an index vector), so they are what
`full_tensor()` gathers, for any placement torch defines on one mesh dimension.

Under TP x FSDP a tensor is split by two mesh dimensions ("dp" and "tp"), on two dims (a
fused projection: rows over "dp", parts over "tp") or on one (FSDP's `_StridedShard(0)` of
TP's `Shard(0)`): its blocks are the product of each dim's runs, each dim's runs cut by the
placements on it as torch cuts them, so a rank reads 1/(T D) of the tensor.

Reading: a safetensors file (or transformers shards) reads each run (block) with
`safe_open(...).get_slice(key)[...]`, so only those bytes are copied out of the file; a DCP
checkpoint reads each run as a chunk (DCP reads every saved chunk the run overlaps: a
checkpoint saved by the same T ranks reads this rank's chunks only, one saved unsplit reads
the whole tensor).

DCP: its planner takes one chunk per DTensor from `compute_local_shape_and_global_offset`,
which for a `_StridedShard` on one mesh dimension gives chunks that overlap ("overlapping
chunks"). `as_pieces` gives the DTensor the checkpoint protocol DCP asks every value for
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`): one chunk per run,
at its global offset, so a fused projection saves and loads exactly, resharded to any T (one
process included) under its own key.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, cast

import torch

__all__ = ["Block", "Runs", "runs_of", "blocks_of", "read_slices", "as_pieces", "slice_bytes",
           "pieces_after_optimizer_steps"]


Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # offsets, sizes, local starts


@dataclass(frozen=True)
class Runs:
    """Global indices [start, stop) along `dim` that this rank holds, in its local order."""
    dim: int
    runs: tuple[tuple[int, int], ...]

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        size = sum(b - a for a, b in self.runs)
        return tuple(size if d == self.dim else n for d, n in enumerate(shape))

    def chunks(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...],
                                                          int]]:
        """(global offsets, sizes, local start along dim) of each run."""
        out, local = [], 0
        for a, b in self.runs:
            offsets = tuple(a if d == self.dim else 0 for d in range(len(shape)))
            sizes = tuple(b - a if d == self.dim else n for d, n in enumerate(shape))
            out.append((offsets, sizes, local))
            local += b - a
        return out


def runs_of(tensor: torch.Tensor) -> Runs | None:
    """This rank's runs of a DTensor split along one dim by one mesh dimension (`Shard`,
    `_StridedShard`); None for a plain tensor, a replicated one, or any other layout (read
    whole, then cut: weights/materialize.py `copy_into`)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return None
    split = [(i, p) for i, p in enumerate(tensor.placements) if not isinstance(p, Replicate)]
    if len(split) != 1 or not isinstance(split[0][1], (Shard, _StridedShard)):
        return None
    mesh_dim, placement = split[0][0], cast(Any, split[0][1])
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    dim = placement.dim
    index = torch.arange(tensor.shape[dim]).view(
        [n if d == dim else 1 for d, n in enumerate(tensor.shape)])
    pieces, _ = placement._split_tensor(index, tensor.device_mesh.size(mesh_dim),
                                        with_padding=False, contiguous=False)
    found = Runs(dim, tuple(_runs(pieces[coordinate[mesh_dim]].flatten().tolist())))
    if found.local_shape(tuple(tensor.shape)) != tuple(tensor.to_local().shape):
        return None  # padded or otherwise unlike the split: read whole
    return found


def slice_bytes(runs: Runs | Sequence[Block], shape: tuple[int, ...], dtype: torch.dtype
                ) -> int:
    """Bytes of this rank's slice (its runs or blocks) of a tensor of `shape` and `dtype`."""
    count = sum(math.prod(sizes) for _, sizes, _ in _blocks(runs, shape))
    return count * torch.empty((), dtype=dtype).element_size()


def read_slices(path: str | os.PathLike, wanted: Mapping[str, Runs | Sequence[Block]]
                ) -> dict[str, torch.Tensor]:
    """Each key's slice (its runs, or its blocks from `blocks_of`: its local tensor, in the
    saved dtype) read from the checkpoint at `path`: safetensors by `get_slice`, block by
    block; DCP by chunks; keys it lacks are left out."""
    from .read import _files_by_key, _keys_in, _open, checkpoint_format

    if not wanted:
        return {}
    if checkpoint_format(path) == "dcp":
        return _read_dcp_slices(Path(path), wanted)
    out: dict[str, torch.Tensor] = {}
    for file, listed in _files_by_key(Path(path), only=set(wanted)).items():
        with _open(file) as f:
            for key in _keys_in(f, file, listed, only=set(wanted)):
                view = f.get_slice(key)
                blocks = _blocks(wanted[key], tuple(view.get_shape()))
                parts = [view[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
                         for offsets, sizes, _ in blocks]
                if len(parts) == 1:
                    out[key] = parts[0]
                    continue
                local = torch.empty(_local_shape(blocks), dtype=parts[0].dtype)
                for (_, sizes, starts), part in zip(blocks, parts):
                    _narrow(local, starts, sizes).copy_(part)
                out[key] = local
    return out


def _blocks(wanted: Runs | Sequence[Block], shape: tuple[int, ...]) -> list[Block]:
    """Runs along one dim as blocks of a tensor of `shape`; blocks as they are."""
    if not isinstance(wanted, Runs):
        return list(wanted)
    return [(offsets, sizes, tuple(start if d == wanted.dim else 0 for d in range(len(shape))))
            for offsets, sizes, start in wanted.chunks(shape)]


def _local_shape(blocks: Sequence[Block]) -> tuple[int, ...]:
    """The local tensor's shape: the blocks cover it."""
    return tuple(max(starts[d] + sizes[d] for _, sizes, starts in blocks)
                 for d in range(len(blocks[0][1])))


def _narrow(local: torch.Tensor, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for d, (start, size) in enumerate(zip(starts, sizes)):
        local = local.narrow(d, start, size)
    return local


def _read_dcp_slices(path: Path, wanted: Mapping[str, Runs | Sequence[Block]]
                     ) -> dict[str, torch.Tensor]:
    """DCP reads each block as a chunk into its place in the local tensor (`no_dist`: this
    process alone, no collectives)."""
    import torch.distributed.checkpoint as dcp

    from .dcp_metadata import SafeReader
    from .read import _dcp_tensor_metadata

    metadata = _dcp_tensor_metadata(path)
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    for key, slice_ in wanted.items():
        md = metadata.get(key)
        if md is None:
            continue
        blocks = _blocks(slice_, tuple(md.size))
        local = torch.empty(_local_shape(blocks), dtype=md.properties.dtype)
        out[key] = local
        pieces[key] = [(offsets, _narrow(local, starts, sizes))
                       for offsets, sizes, starts in blocks]
    if out:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(out, storage_reader=SafeReader(str(path)), no_dist=True,
                     planner=_PiecesPlanner(pieces))
    return out


def _pieces_planner() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class PiecesPlanner(DefaultLoadPlanner):
        """Reads each key as the chunks given (global offsets -> a view of the local tensor)."""

        def __init__(self, pieces: Mapping[str, list[tuple[tuple[int, ...], torch.Tensor]]]
                     ) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.pieces = pieces

        def create_local_plan(self) -> Any:
            items = []
            for key, parts in self.pieces.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape)
                          for o, v in parts]
                assert self.metadata is not None
                items += create_read_items_for_chunk_list(
                    key, cast(Any, self.metadata.state_dict_metadata[key]), chunks)
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return next(v for o, v in self.pieces[index.fqn] if tuple(o) == tuple(index.offset))

    return PiecesPlanner


def _PiecesPlanner(pieces: Mapping[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> Any:
    return _pieces_planner()(pieces)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs [start, stop) of `indices`, in their order."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def blocks_of(tensor: torch.Tensor) -> list[Block] | None:
    """This rank's local tensor as blocks of the global one: (global offsets, sizes, local
    starts) of each, for a DTensor split by `Shard`/`_StridedShard` over any of its mesh
    dimensions (TP's fused `_StridedShard(1)` with FSDP's `Shard(0)`; TP's `Shard(0)` with
    FSDP's `_StridedShard(0)` on the same dim too): the product of each dim's runs. None for a
    plain tensor, a replicated one, or any other layout (a `Partial`, padding)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor) or tensor.device_mesh.get_coordinate() is None:
        return None
    if all(isinstance(p, Replicate) for p in tensor.placements):
        return None
    shape = tuple(tensor.shape)
    runs = []
    for dim, n in enumerate(shape):
        indices = _indices_along(tensor, dim)
        if indices is None:
            return None
        runs.append(_runs(indices))
    if tuple(sum(b - a for a, b in r) for r in runs) != tuple(tensor.to_local().shape):
        return None  # padded or otherwise unlike the split
    blocks: list[Block] = [((), (), ())]
    for dim_runs in runs:
        grown = []
        for offsets, sizes, starts in blocks:
            local = 0
            for a, b in dim_runs:
                grown.append(((*offsets, a), (*sizes, b - a), (*starts, local)))
                local += b - a
        blocks = grown
    return blocks


def _indices_along(tensor: Any, dim: int) -> list[int] | None:
    """The global indices along `dim` this rank holds, in local order: an index vector cut by
    the placements on `dim` (the others replicated) as torch cuts a tensor
    (`distribute_tensor` with `src_data_rank=None`: each rank its own piece, no
    communication), so several mesh dimensions on one dim compose as `full_tensor()` undoes
    them; None for a placement that is no split (a `Partial`)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    n = tensor.shape[dim]
    if any(not isinstance(p, (Replicate, Shard, _StridedShard)) for p in tensor.placements):
        return None
    on_dim = [p if not isinstance(p, Replicate) and p.dim == dim else Replicate()
              for p in tensor.placements]
    if all(isinstance(p, Replicate) for p in on_dim):
        return list(range(n))
    index = torch.arange(n).view([n if d == dim else 1 for d in range(tensor.ndim)])
    mine = distribute_tensor(index, tensor.device_mesh, on_dim, src_data_rank=None)
    return cast(Any, mine).to_local().flatten().tolist()


def as_pieces(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a DTensor of more than one block, else returned as it is) shown to DCP as its
    blocks (`blocks_of`): one chunk each at its global offset, read and written through views
    of the local tensor. The value is the same object, still a DTensor."""
    chunks = blocks_of(tensor)
    if chunks is None or len(chunks) == 1:
        return tensor
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    shape = tuple(tensor.shape)
    local = cast(Any, tensor).to_local()

    def create_chunk_list() -> list[Any]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                for o, s, _ in chunks]

    def create_write_items(fqn: str, obj: Any) -> list[Any]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(o),
                                                         sizes=torch.Size(s)),
                              properties=TensorProperties.create_from_tensor(local),
                              size=torch.Size(shape)))
                for o, s, _ in chunks]

    def get_tensor_shard(index: Any) -> torch.Tensor:
        for o, s, starts in chunks:
            if index.offset is not None and tuple(index.offset) == o:
                return _narrow(local, starts, s)
        raise ValueError(f"{index.fqn}: no piece at offset {index.offset}")

    tensor.__dict__["__create_chunk_list__"] = create_chunk_list
    tensor.__dict__["__create_write_items__"] = create_write_items
    tensor.__dict__["__get_tensor_shard__"] = get_tensor_shard
    return tensor


_HOOKED = False


def pieces_after_optimizer_steps() -> None:
    """After every optimizer step (torch's global step hook, registered once per process),
    show each state tensor of a fused projection (AdamW's moments: DTensors placed as their
    parameter) to DCP as its pieces, so `get_state_dict(pipe, opt)` saves and loads with
    `dcp.save`/`dcp.load`. A tensor already shown is skipped; any other is left alone."""
    global _HOOKED
    if _HOOKED:
        return
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def show(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for param, values in optimizer.state.items():
            if not isinstance(param, DTensor) or not any(
                    type(p).__name__ == "_StridedShard" for p in param.placements):
                continue
            for value in values.values():
                if isinstance(value, DTensor) and "__create_chunk_list__" not in value.__dict__:
                    as_pieces(value)

    register_optimizer_step_post_hook(show)
    _HOOKED = True
