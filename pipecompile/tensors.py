"""Moving values between devices: the one helper every stage, transport and pass uses."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_device"]


def to_device(value: Any, device: torch.device) -> Any:
    """`value` on `device`. A tensor already there (any CPU counts as the CPU) is returned
    itself, so a stage on the CPU shares the user's tensors; a `Parameter` elsewhere becomes a
    new `Parameter` (a leaf of its own) on `device`; lists, tuples and dicts are mapped; any
    other value is returned unchanged. Copies to an accelerator do not block the host."""
    if isinstance(value, torch.Tensor):
        if value.device == device or value.device.type == device.type == "cpu":
            return value
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(value.detach().to(device), requires_grad=value.requires_grad)
        return value.to(device, non_blocking=device.type != "cpu")
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
