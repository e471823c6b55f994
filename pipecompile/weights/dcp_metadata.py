"""A torch.distributed.checkpoint directory's `.metadata` read without running code.

DCP writes its metadata (every key's global size, dtype and chunks) with `pickle`, and its
`FileSystemReader.read_metadata` reads it with `pickle.load`: a file that names any importable
callable runs it on load. `SafeReader` reads it with an unpickler that builds only what DCP's
metadata is made of (pickle's "restricting globals"): DCP's metadata records, `torch.Size`,
dtypes, layouts and memory formats, paths; anything else is a `CheckpointError` naming it. The
tensor files DCP reads next hold raw bytes, read without pickle.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CheckpointError

__all__ = ["SafeReader", "load_metadata"]

_MODULES = {"torch.distributed.checkpoint.metadata"}  # DCP's records and enums, every name
_NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
          ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
          ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
          ("pathlib", "PureWindowsPath"), ("builtins", "set"), ("builtins", "frozenset")}
_TORCH_KINDS = (torch.dtype, torch.layout, torch.memory_format)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module in _MODULES or (module, name) in _NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_KINDS):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where} names {module}.{name}, which is not part of torch.distributed."
            f"checkpoint metadata; it is not loaded (it would run code). Re-save the "
            f"checkpoint with torch.distributed.checkpoint.save, or convert it to safetensors")


def load_metadata(path: str | os.PathLike) -> Metadata:
    """The `Metadata` pickled in the file `path` (a DCP `.metadata`), built without running
    code."""
    with open(path, "rb") as stream:
        found = _Unpickler(stream, str(path)).load()
    if not isinstance(found, Metadata):
        raise CheckpointError(f"{path} holds a {type(found).__name__}, not torch.distributed."
                              f"checkpoint Metadata")
    return found


class SafeReader(dcp.FileSystemReader):
    """`FileSystemReader` whose metadata is read by `load_metadata` (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = load_metadata(path)
        storage = metadata.storage_meta
        if storage is None:
            storage = metadata.storage_meta = StorageMeta()
        storage.load_id = self.load_id
        return metadata
