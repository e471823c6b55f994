"""The calling thread's grad mode and autocast state, put back after a stage's compute.

torch's `wrap_with_set_grad_enabled` higher-order op (what `torch.export` makes of a
`torch.no_grad()` region inside a model, such as a rotary embedding decorated with
`@torch.no_grad()`) sets the grad mode, runs its body and sets the mode back without a
`finally`: when an op in the body raises, the thread stays in no-grad mode. A failing step
then left the caller's thread (one device row runs there) or a device thread unable to train:
every later backward, even a plain model's `loss.backward()`, failed with "element 0 of
tensors does not require grad". `kept_thread_state` saves the grad mode and the autocast
state of the device types in play and restores whatever differs when the body ends, normally
or by an exception.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

__all__ = ["kept_thread_state"]

# device types whose autocast state is saved besides the rows' own ("cpu" always exists)
_ALWAYS = ("cpu",)


def _autocast_state(device_types: Iterable[str]) -> list[tuple[str, bool, torch.dtype]]:
    state = []
    for device_type in dict.fromkeys((*_ALWAYS, *device_types)):
        try:
            state.append((device_type, torch.is_autocast_enabled(device_type),
                          torch.get_autocast_dtype(device_type)))
        except RuntimeError:  # a device type without autocast (meta): nothing to keep
            continue
    return state


@contextlib.contextmanager
def kept_thread_state(device_types: Iterable[str] = ()) -> Iterator[None]:
    """Run the body; afterwards (also after an exception) this thread's grad mode, autocast
    cache flag and the autocast enabled/dtype of `device_types` (and the CPU) are what they
    were before it."""
    grad = torch.is_grad_enabled()
    cache = torch.is_autocast_cache_enabled()
    autocast = _autocast_state(device_types)
    try:
        yield
    finally:
        if torch.is_grad_enabled() != grad:
            torch.set_grad_enabled(grad)
        if torch.is_autocast_cache_enabled() != cache:
            torch.set_autocast_cache_enabled(cache)
        for device_type, enabled, dtype in autocast:
            if torch.is_autocast_enabled(device_type) != enabled:
                torch.set_autocast_enabled(device_type, enabled)
            if torch.get_autocast_dtype(device_type) != dtype:
                torch.set_autocast_dtype(device_type, dtype)
