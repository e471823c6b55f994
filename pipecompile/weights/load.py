"""Load this process's tensors from a checkpoint on disk, strictly, as `from_pretrained` would.

    load_weights(module, own, path, model_keys, ties, strict=True, model=None)
        -> _IncompatibleKeys(missing, unexpected)

Every key of `module`'s state dict (a Pipeline: this process's tensors under the model's keys)
is made by a recipe (hf_keys.py): the checkpoint's tensor of that key, or, for a
transformers model, what its model type's conversion makes from the saved keys (a Mixtral's
fused experts from the N per-expert tensors). Only the recipes of this process's keys are read,
and only their source tensors (read.py opens only the files holding them), a few at a time.
A tensor this rank holds a slice of (a DTensor under tensor_parallel=T, `Shard` or a fused
projection's `_StridedShard`; under fsdp=True also over "dp", TP x FSDP: 1/(T D) of it) read
from a plain key is read as that slice only (shard_slices.py `blocks_of`: safetensors
`get_slice`, DCP chunks); one made by a conversion is read whole and cut (`copy_into`).

    checkpoint --keys--> recipes --this process's keys--> read sources --convert--> copy in

Strict (the default, as `load_state_dict`): a key this process holds that the checkpoint cannot
fill is a `CheckpointError` naming it; `strict=False` returns it among the missing keys (its
tensor keeps the poison `to_empty` put there, and the step refuses to run on it until something
writes it). Unexpected keys (the checkpoint's keys that fill no key of the model) are returned,
never an error: checkpoints often hold more than the model (from_pretrained ignores them too).
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, Sequence, cast

import torch
from torch.nn.modules.module import _IncompatibleKeys

from ..errors import CheckpointError
from .hf_keys import Recipe, convert, recipes
from .materialize import copy_into
from .read import checkpoint_keys, read_tensors
from .shard_slices import Block, blocks_of, read_slices, slice_bytes

__all__ = ["load_weights"]

_CHUNK_BYTES = 64 << 20  # checkpoint bytes read before they are copied in and freed


def load_weights(module: torch.nn.Module, own: Mapping[str, torch.Tensor],
                 path: str | os.PathLike, model_keys: Sequence[str],
                 ties: Iterable[Sequence[str]], *, strict: bool = True,
                 model: torch.nn.Module | None = None) -> _IncompatibleKeys:
    """Load `module`'s tensors (`own`: each of its tensors by every name) from the checkpoint at
    `path`, reading only the tensors they are made from. `model_keys`: all the model's state
    dict keys; `model`: the model (transformers: its conversion mapping applies).

    A tied weight stored once (transformers keeps `embed_tokens.weight`, not `lm_head.weight`)
    loads into every name of its group; dtypes convert to the tensor's; a shape that differs
    raises `CheckpointError`. Without state-dict hooks each tensor is copied in place; a model
    whose hooks rename keys is loaded through its own `load_state_dict` hooks."""
    wanted = module.state_dict(keep_vars=True)  # through the model's hooks: its own keys
    stored = checkpoint_keys(path)
    plan = recipes(model, model_keys, stored)
    feeds: dict[str, tuple[Recipe, str]] = {k: (plan.by_target[k], k) for k in wanted
                                            if k in plan.by_target}
    for names in ties:
        found = next((n for n in names if n in plan.by_target), None)
        for name in names:
            if found is not None and name in wanted:
                feeds.setdefault(name, (plan.by_target[found], found))
    for key, (recipe, _) in feeds.items():
        if recipe.converter is None:  # checked from the headers, before reading
            _check_shape(path, recipe.sources[0], tuple(stored[recipe.sources[0]][0]),
                         key, wanted[key])
    missing = sorted(set(wanted) - set(feeds))
    if strict and missing:
        raise CheckpointError(
            f"load_weights: {os.fspath(path)} lacks {len(missing)} key(s) this process needs: "
            f"{missing[:6]}{' ...' if len(missing) > 6 else ''}"
            f"{_unused_hint(plan.unexpected)}; pass strict=False to load what it holds (the "
            f"rest must then be written, e.g. by pipe.load_state_dict, before a step runs)")
    if all(own.get(k) is t for k, t in wanted.items()):
        sliced = {k: b for k, (recipe, _) in feeds.items() if recipe.converter is None
                  and (b := blocks_of(wanted[k])) is not None}
        for key, local in _sliced(path, feeds, sliced, stored):
            with torch.no_grad():
                cast(Any, wanted[key]).to_local().copy_(local)
        rest = {k: f for k, f in feeds.items() if k not in sliced}
        for key, made in _made(path, rest, stored, wanted, model):
            with torch.no_grad():
                copy_into(own[key], made)
    else:  # keys renamed by the model's hooks: its load_state_dict hooks put them back
        module.load_state_dict(dict(_made(path, feeds, stored, wanted, model)), strict=False)
    return _IncompatibleKeys(missing, list(plan.unexpected))


def _sliced(path: str | os.PathLike, feeds: Mapping[str, tuple[Recipe, str]],
            sliced: Mapping[str, list[Block]],
            stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
            ) -> Iterable[tuple[str, torch.Tensor]]:
    """(key, this rank's slice) for every sharded key (shard_slices.py: only its blocks are
    read), at most `_CHUNK_BYTES` of slices at a time."""
    batch: dict[str, list[Block]] = {}
    size = 0
    todo = list(sliced.items())
    for i, (key, blocks) in enumerate(todo):
        source = feeds[key][0].sources[0]
        batch[key] = blocks
        size += slice_bytes(blocks, *stored[source])
        if size < _CHUNK_BYTES and i < len(todo) - 1:
            continue
        read = read_slices(path, {feeds[k][0].sources[0]: r for k, r in batch.items()})
        for done in batch:
            yield done, read[feeds[done][0].sources[0]]
        batch, size = {}, 0


def _made(path: str | os.PathLike, feeds: Mapping[str, tuple[Recipe, str]],
          stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
          wanted: Mapping[str, torch.Tensor],
          model: torch.nn.Module | None) -> Iterable[tuple[str, torch.Tensor]]:
    """(key, its tensor) for every key of `feeds`: the recipes' sources read a few at a time
    (at most `_CHUNK_BYTES` ahead), each recipe converted once and fed to all its keys."""
    by_recipe: dict[Recipe, list[tuple[str, str]]] = {}
    for key, (recipe, made) in feeds.items():
        by_recipe.setdefault(recipe, []).append((key, made))
    batch: list[Recipe] = []
    size = 0
    todo = list(by_recipe)
    for i, recipe in enumerate(todo):
        batch.append(recipe)
        for source in recipe.sources:
            shape, dtype = stored[source]
            size += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if size < _CHUNK_BYTES and i < len(todo) - 1:
            continue
        read = read_tensors(path, {s for r in batch for s in r.sources})
        for done in batch:
            keys = by_recipe[done]
            if done.converter is not None:  # as from_pretrained: sources in the model's dtype
                dtype = wanted[keys[0][0]].dtype
                tensors = {s: read[s].to(dtype) for s in done.sources}
            else:
                tensors = {done.sources[0]: read[done.sources[0]]}
            out = convert(done, tensors, model)
            for key, made in keys:
                if done.converter is not None and out[made].shape != wanted[key].shape:
                    raise CheckpointError(
                        f"{os.fspath(path)}: transformers' conversion ({done!r}) made "
                        f"{made!r} of shape {list(out[made].shape)} from "
                        f"{len(done.sources)} checkpoint tensors, but the model's {key!r} "
                        f"has shape {list(wanted[key].shape)}: a source is missing from the "
                        f"checkpoint, or it is of another configuration")
                yield key, out[made]
        batch, size = [], 0


def _check_shape(path: str | os.PathLike, source: str, have: tuple[int, ...], key: str,
                 target: torch.Tensor) -> None:
    if have != tuple(target.shape):
        raise CheckpointError(
            f"{os.fspath(path)}: {source!r} has shape {list(have)} in the checkpoint but the "
            f"model's {key!r} has shape {list(target.shape)}; is this the checkpoint of this "
            f"model (and its configuration)?")


def _unused_hint(unexpected: Sequence[str]) -> str:
    if not unexpected:
        return ""
    return (f" (it holds {len(unexpected)} key(s) that fill no key of the model, e.g. "
            f"{list(unexpected[:3])}: a transformers checkpoint loads converted only with the "
            f"model itself, built from its transformers class)")
