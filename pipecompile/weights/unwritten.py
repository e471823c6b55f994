"""Tensors `to_empty` allocated that nothing has written since, named before a step runs on them.

`to_empty` fills each tensor it allocates with a *poison* value that no initialiser and no
checkpoint writes (as torch's `fill_uninitialized_memory` does for `torch.empty` under
deterministic algorithms): NaN for floating and complex dtypes, the most negative value of a
signed integer dtype, the largest of an unsigned one. Whatever writes the tensor afterwards
(`load_weights`, `load_state_dict`, `init_weights`' function, a buffer recomputed by its
library, the user's own `copy_`, through `.data` or not) replaces it, so a tensor still holding
poison in any element was never (or only partly) written. A bool tensor has no value to spare:
it counts as written once its version counter moved.

    poison(t)                 fill `t` in place (a DTensor: its local shard)
    Unwritten()               name -> tensor, as to_empty allocated them
      .add(named)             remember these (their version after the poison)
      .left()                 the names whose tensor is still unwritten; forgets the others
    refuse(names, persistent, where)
                              the error naming them, what each is and what fills it
"""

from __future__ import annotations

from typing import Collection, Iterable

import torch

from ..errors import ConfigError

__all__ = ["Unwritten", "is_poisoned", "poison", "refuse"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _poison_value(dtype: torch.dtype) -> float | int | None:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def poison(tensor: torch.Tensor) -> None:
    """Fill `tensor` (just allocated, its contents undefined) with its dtype's poison value."""
    value = _poison_value(tensor.dtype)
    if value is not None:
        with torch.no_grad():
            _local(tensor).fill_(value)


def is_poisoned(tensor: torch.Tensor) -> bool:
    """True when any element of `tensor` still holds the poison value (a bool tensor: False)."""
    value = _poison_value(tensor.dtype)
    if value is None:
        return False
    local = _local(tensor).detach()
    if local.numel() == 0:
        return False
    hit = torch.isnan(local) if isinstance(value, float) else local == value
    return bool(hit.any().item())


class Unwritten:
    """The tensors of this process that `to_empty` allocated and poisoned, by name (a tied one
    under each name), until a check finds them written."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[torch.Tensor, int]] = {}

    def add(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Remember these tensors as just allocated (and poisoned)."""
        for name, tensor in named:
            self._held[name] = (tensor, tensor._version)

    def left(self) -> list[str]:
        """The names whose tensor still holds poison (a bool one: was not written in place
        since); the others are forgotten."""
        still = {}
        for name, (tensor, version) in self._held.items():
            if tensor.is_meta:  # never allocated here: check_materialised names it
                continue
            empty = (tensor._version == version if _poison_value(tensor.dtype) is None
                     else is_poisoned(tensor))
            if empty:
                still[name] = (tensor, version)
        self._held = still
        return list(still)


def refuse(names: Collection[str], persistent: Collection[str], where: str) -> ConfigError:
    """The error for tensors `names` never written: the non-persistent buffers among them (in no
    checkpoint, not recomputable here) and the others, each with what fills it."""
    buffers = [n for n in names if n not in persistent]
    rest = [n for n in names if n in persistent]
    parts = []
    if buffers:
        parts.append(
            f"non-persistent buffer(s) {_few(buffers)}: no checkpoint holds them and their "
            f"modules give no way to recompute them (pipecompile recomputes a transformers "
            f"model's buffers with the model's own _init_weights); build the model under "
            f"`with pipecompile.meta_parameters():` (parameters on meta, buffers real) "
            f"instead of `with torch.device('meta'):`, or write them with "
            f"pipe.init_weights(fn=...)")
    if rest:
        parts.append(
            f"{_few(rest)} were neither loaded nor initialised: fill them with "
            f"pipe.load_weights(path) (strict), pipe.init_weights() or pipe.load_state_dict()")
    return ConfigError(
        f"{where}: {len(names)} tensor(s) of this process hold uninitialised memory from "
        f"pipe.to_empty(): {'; '.join(parts)}; refusing to run on them")


def _few(names: Collection[str]) -> str:
    shown = sorted(names)
    return f"{shown[:4]}{f' and {len(shown) - 4} more' if len(shown) > 4 else ''}"
