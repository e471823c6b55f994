"""Read named tensors out of a checkpoint on disk, touching only what was asked for.

A *checkpoint* here is a flat map from a parameter or buffer name ("model.norm.weight") to a tensor,
stored in one of three layouts:

    "safetensors"  model.safetensors                  the path is the file itself

    "shards"       ckpt/                               transformers `save_pretrained` output
                     model.safetensors.index.json      {"metadata": ..., "weight_map": {key: file}}
                     model-00001-of-00003.safetensors
                     model-00002-of-00003.safetensors  ...
                   (or a directory holding only model.safetensors and no index)

    "dcp"          ckpt/                               `torch.distributed.checkpoint.save` output
                     .metadata                         key -> size, dtype, where the bytes are
                     __0_0.distcp ...

    checkpoint_keys(path)          -> {key: (shape, dtype)}   headers, index or metadata only
    read_tensors(path, keys)       -> {key: tensor}           only the requested keys that exist

Why so careful: each pipeline stage holds a slice of the model, so each process reads only the
files holding its own keys and only those tensors (safetensors `safe_open` + `get_tensor`, never a
whole-file load). DCP checkpoints are read with `no_dist=True`, so a stage reads on its own without
collectives, whether or not a process group is initialised. Tensors keep the dtype they were saved
with; converting them is the caller's job. Non-tensor DCP entries (e.g. a saved step counter) are
not tensors and are left out of both results.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal, Union

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from .dcp_metadata import SafeReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError
from ..ir.progress import Progress

__all__ = ["CheckpointFormat", "checkpoint_format", "checkpoint_keys", "read_tensors"]

log = logging.getLogger(__name__)

CheckpointFormat = Literal["safetensors", "shards", "dcp"]
PathLike = Union[str, "os.PathLike[str]"]
KeyInfo = tuple[tuple[int, ...], torch.dtype]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_DCP_METADATA = ".metadata"
_ACCEPTED = (
    "expected one of: (1) a .safetensors file; (2) a directory of transformers shards with "
    f"{_INDEX} (or holding a single {_SINGLE}); (3) a torch.distributed.checkpoint directory "
    f"with a {_DCP_METADATA} file")

# safetensors header dtype names (the format's spec) -> torch dtypes.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def checkpoint_format(path: PathLike) -> CheckpointFormat:
    """Which of the three layouts `path` is; `CheckpointError` if it is none of them."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist; {_ACCEPTED}")
    if p.is_file() and p.suffix == ".safetensors":
        return "safetensors"
    if p.is_dir():
        if (p / _INDEX).is_file():
            return "shards"
        if (p / _DCP_METADATA).is_file():
            return "dcp"
        found = sorted(f.name for f in p.glob("*.safetensors"))
        if found == [_SINGLE]:
            return "shards"
        if found:
            raise CheckpointError(
                f"checkpoint directory {str(p)!r} holds {len(found)} .safetensors files "
                f"({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}) but no {_INDEX} "
                f"saying which file holds which key; add the index (transformers' "
                f"save_pretrained writes one) or pass one .safetensors file; {_ACCEPTED}")
    raise CheckpointError(f"{str(p)!r} is not a checkpoint pipecompile can read; {_ACCEPTED}")


def checkpoint_keys(path: PathLike) -> dict[str, KeyInfo]:
    """Every tensor key in the checkpoint with its shape and dtype, without reading tensor data.

    safetensors files are read through their headers (`safe_open` + `get_slice`), a DCP checkpoint
    through its `.metadata` file.
    """
    if checkpoint_format(path) == "dcp":
        return {key: (tuple(md.size), md.properties.dtype)
                for key, md in _dcp_tensor_metadata(Path(path)).items()}
    keys: dict[str, KeyInfo] = {}
    for file, listed in _files_by_key(Path(path)).items():
        with _open(file) as f:
            for key in _keys_in(f, file, listed):
                view = f.get_slice(key)
                keys[key] = (tuple(view.get_shape()), _dtype(view.get_dtype(), key, file))
    return keys


def read_tensors(path: PathLike, keys: Iterable[str], *,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The requested keys that the checkpoint holds, as tensors on `device` in their saved dtype.

    Keys the checkpoint lacks are absent from the result (the caller decides whether that is an
    error: a tied `lm_head.weight`, for instance, is often not saved). Only the files holding
    requested keys are opened and only the requested tensors are read.
    """
    wanted = set(keys)
    if checkpoint_format(path) == "dcp":
        return _read_dcp(Path(path), wanted, torch.device(device))
    out: dict[str, torch.Tensor] = {}
    files = _files_by_key(Path(path), only=wanted)
    progress = Progress(log, f"reading {path}", len(files), unit="shards")
    for file, listed in files.items():
        with _open(file, device=str(device)) as f:
            for key in _keys_in(f, file, listed, only=wanted):
                out[key] = f.get_tensor(key)
        progress.advance(note=f"{len(out)} tensors")
    progress.done(note=f"{len(out)} tensors")
    return out


def _files_by_key(path: Path, *,
                  only: set[str] | None = None) -> Mapping[Path, list[str] | None]:
    """Which keys each safetensors file holds, from the index; restricted to `only` if given.

    Without an index (a single file) its keys are known only from its header, so the list is
    None and `_keys_in` reads them there.
    """
    if path.is_file():
        return {path: None}
    index = path / _INDEX
    if not index.is_file():
        return {path / _SINGLE: None}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{str(index)!r} is not a transformers shard index ({exc}); it must be JSON with a "
            f"'weight_map' object mapping each key to its .safetensors file") from exc
    files: dict[Path, list[str]] = {}
    for key, name in weight_map.items():
        if only is not None and key not in only:
            continue
        file = path / str(name)
        if file not in files and not file.is_file():
            raise CheckpointError(
                f"{str(index)!r} maps key {key!r} to {str(name)!r}, which is not in {str(path)!r}; "
                f"copy the missing shard there or re-save the checkpoint")
        files.setdefault(file, []).append(key)
    return files


def _open(file: Path, *, device: str = "cpu") -> safe_open:
    """`safe_open` that turns a corrupt or unreadable file into a `CheckpointError`."""
    try:
        return safe_open(str(file), "pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"cannot open {str(file)!r} as a safetensors file ({exc}); check that it was fully "
            f"written and is not a .bin/.pt file") from exc


def _keys_in(f: safe_open, file: Path, listed: list[str] | None, *,
             only: set[str] | None = None) -> list[str]:
    """The keys to take from an open file: those the index `listed` for it (checked against its
    header), or, with no index, those in its header that are in `only` (all if `only` is None)."""
    held = list(f.keys())
    if listed is None:
        return [key for key in held if only is None or key in only]
    missing = sorted(set(listed) - set(held))
    if missing:
        raise CheckpointError(
            f"the shard index says {str(file)!r} holds {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, but its header does not; the index and the "
            f"shards come from different saves: re-save the checkpoint")
    return listed


def _dtype(name: str, key: str, file: Path) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(
            f"{key!r} in {str(file)!r} has safetensors dtype {name}, which pipecompile cannot "
            f"map to a torch dtype; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _dcp_tensor_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """The tensor entries of a DCP checkpoint's `.metadata` (global size and dtype of each key)."""
    try:
        metadata = SafeReader(str(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:  # unpickling errors come in many types
        raise CheckpointError(
            f"cannot read {str(path / _DCP_METADATA)!r} as torch.distributed.checkpoint "
            f"metadata ({type(exc).__name__}: {exc}); check that the save finished") from exc
    return {key: md for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def _read_dcp(path: Path, wanted: set[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Load only the wanted tensors: DCP fills a state dict of empty tensors in place.

    `no_dist=True` keeps every process reading on its own (no collectives, so stages may call
    this at different times or not at all); every key asked of `dcp.load` is in the checkpoint,
    so the default planner needs no `allow_partial_load`.
    """
    state: dict[str, torch.Tensor] = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype, device=device)
        for key, md in _dcp_tensor_metadata(path).items() if key in wanted}
    if not state:
        return {}
    with warnings.catch_warnings():
        # dcp.load warns that it "assumes the intent is to load in a single process": it is.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=True)
    return state
