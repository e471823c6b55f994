"""This rank's slice of a sharded tensor (a DTensor), read from a checkpoint alone, and shown to
torch.distributed.checkpoint as the pieces it is made of.

    runs_of(tensor)              -> Runs | None   the global indices along one dim this rank
                                                   holds, as contiguous runs in local order
    read_slices(path, runs)      -> {key: local}  only those rows/columns of each tensor
    blocks_of(tensor)            -> [(offsets, sizes, local starts)] | None  this rank's
                                                   blocks over every mesh dimension
    as_pieces(tensor)            a DTensor whose DCP chunks are its blocks (a fused projection,
                                 with FSDP too)
    pieces_after_optimizer_steps()  the same for an optimizer's state of such a parameter

A tensor split along dim d (`Shard(d)`) holds one run of d: rank r of T holds rows
[r N/T, (r+1) N/T). A fused projection (GPT-2's `c_attn`: q, k and v in one weight,
`_StridedShard(d, split_factor=k)`) holds k runs: of each part its r-th 1/T. The runs are
computed by the placement's own split (`_split_tensor` of an index vector), so they are what
`full_tensor()` gathers, for any placement torch defines on one mesh dimension.

Reading: a safetensors file (or transformers shards) reads each run with
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

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, cast

import torch

__all__ = ["Runs", "runs_of", "blocks_of", "read_slices", "as_pieces", "slice_bytes",
           "pieces_after_optimizer_steps"]


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


def slice_bytes(runs: Runs, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of this rank's slice of a tensor of `shape` and `dtype`."""
    count = 1
    for n in runs.local_shape(shape):
        count *= n
    return count * torch.empty((), dtype=dtype).element_size()


def read_slices(path: str | os.PathLike, wanted: Mapping[str, Runs]) -> dict[str, torch.Tensor]:
    """Each key's runs (its local tensor, in the saved dtype) read from the checkpoint at
    `path`: safetensors by `get_slice`, DCP by chunks; keys it lacks are left out."""
    from .read import _files_by_key, _keys_in, _open, checkpoint_format

    if not wanted:
        return {}
    if checkpoint_format(path) == "dcp":
        return _read_dcp_slices(Path(path), wanted)
    out: dict[str, torch.Tensor] = {}
    for file, listed in _files_by_key(Path(path), only=set(wanted)).items():
        with _open(file) as f:
            for key in _keys_in(f, file, listed, only=set(wanted)):
                view, runs = f.get_slice(key), wanted[key]
                rank = len(view.get_shape())
                parts = []
                for a, b in runs.runs:
                    index = tuple(slice(a, b) if d == runs.dim else slice(None)
                                  for d in range(rank))
                    parts.append(view[index])
                out[key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=runs.dim)
    return out


def _read_dcp_slices(path: Path, wanted: Mapping[str, Runs]) -> dict[str, torch.Tensor]:
    """DCP reads each run as a chunk into its place in the local tensor (`no_dist`: this
    process alone, no collectives)."""
    import torch.distributed.checkpoint as dcp

    from .dcp_metadata import SafeReader
    from .read import _dcp_tensor_metadata

    metadata = _dcp_tensor_metadata(path)
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    for key, runs in wanted.items():
        md = metadata.get(key)
        if md is None:
            continue
        shape = tuple(md.size)
        local = torch.empty(runs.local_shape(shape), dtype=md.properties.dtype)
        out[key] = local
        pieces[key] = [(offsets, local.narrow(runs.dim, start, sizes[runs.dim]))
                       for offsets, sizes, start in runs.chunks(shape)]
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


Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # offsets, sizes, local starts


def blocks_of(tensor: torch.Tensor) -> list[Block] | None:
    """This rank's local tensor as blocks of the global one: (global offsets, sizes, local
    starts) of each, for a DTensor whose mesh dimensions split distinct tensor dims (`Shard`,
    `_StridedShard`; TP's fused `_StridedShard(1)` with FSDP's `Shard(0)` too): the product of
    each dim's runs. None for a plain tensor, or two mesh dimensions on one tensor dim (torch's
    own chunk is right there)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return None
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    shape = tuple(tensor.shape)
    per_dim: dict[int, list[tuple[int, int]]] = {}
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)) or placement.dim in per_dim:
            return None
        dim = placement.dim
        index = torch.arange(shape[dim]).view([n if d == dim else 1 for d, n in enumerate(shape)])
        pieces, _ = cast(Any, placement)._split_tensor(
            index, tensor.device_mesh.size(mesh_dim), with_padding=False, contiguous=False)
        per_dim[dim] = _runs(pieces[coordinate[mesh_dim]].flatten().tolist())
    runs = [per_dim.get(d, [(0, n)]) for d, n in enumerate(shape)]
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
                view = local
                for d, (start, size) in enumerate(zip(starts, s)):
                    view = view.narrow(d, start, size)
                return view
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
