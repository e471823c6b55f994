"""Moving values between devices: the one helper every stage, transport and pass uses."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["local_tensor", "to_device"]


def to_device(value: Any, device: torch.device) -> Any:
    """`value` on `device`. A tensor already there (any CPU counts as the CPU) is returned
    itself; one elsewhere is copied with `.to`, which autograd sees (gradients flow back to the
    source); lists, tuples and dicts are mapped; any other value is returned unchanged. Copies
    to an accelerator do not block the host; copies to the CPU do (the values are read next)."""
    if isinstance(value, torch.Tensor):
        if value.device == device or value.device.type == device.type == "cpu":
            return value
        return value.to(device, non_blocking=device.type != "cpu")
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its shard, or its replica), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
