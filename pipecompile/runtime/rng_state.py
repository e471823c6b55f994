"""The random state a recomputed (checkpointed) forward started from, to replay its masks.

    RngState.capture(tensors)    the CPU generator's state and that of each accelerator the
                                 tensors live on (dropout on a CUDA tensor draws from the CUDA
                                 generator, not the CPU one)
    with state.restored(): ...   the body runs from that state; afterwards the state is what it
                                 was before (as torch.utils.checkpoint does)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from ..ir.rng import generator_lock

__all__ = ["RngState"]


@dataclass(frozen=True)
class RngState:
    """The random state a checkpointed forward started from: the CPU generator's and, per
    accelerator device the stage touches, that device's generator."""

    cpu: torch.Tensor
    device_type: str | None  # "cuda" (or another accelerator), None for a CPU-only stage
    devices: tuple[tuple[int, torch.Tensor], ...]  # (device index, its generator state)

    @classmethod
    def capture(cls, values: Iterable[Any]) -> "RngState":
        """The current random state of the CPU and of the devices `values`' tensors are on."""
        found = {(v.device.type, v.get_device()) for v in values
                 if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")}
        types = {kind for kind, _ in found}
        if len(types) > 1:
            raise RuntimeError(f"a stage's tensors are on several device types {sorted(types)}; "
                               f"checkpointing restores the random state of one")
        device_type = types.pop() if types else None
        states: tuple[tuple[int, Any], ...] = ()
        with generator_lock:  # not in the middle of another thread's seeded draw
            if device_type is not None:
                module = torch.get_device_module(device_type)
                states = tuple((i, module.get_rng_state(i)) for i in sorted(i for _, i in found))
            return cls(torch.random.get_rng_state(), device_type, states)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body from this random state; afterwards the state is what it was before.

        Setting and putting back the state hold `generator_lock`, so they never fall between
        another device thread's seed and draw (rng="per-microbatch"); the body does not, so
        stages recompute in parallel."""
        indices = [i for i, _ in self.devices]
        state = contextlib.ExitStack()
        with generator_lock:
            # device_type matters only when indices is non-empty; "cuda" keeps a CPU-only stage
            # from asking an absent accelerator for anything.
            state.enter_context(torch.random.fork_rng(devices=indices,
                                                      device_type=self.device_type or "cuda"))
            torch.random.set_rng_state(self.cpu)
            if self.device_type is not None:
                module = torch.get_device_module(self.device_type)
                for index, saved in self.devices:
                    module.set_rng_state(saved, index)
        try:
            yield
        finally:
            with generator_lock:
                state.close()
