"""Weight versions of one stage for the asynchronous schedules (PipeDream, 2BW).

The stage's parameters (the *live* weights) are what the optimizer updates, in place. A
*version* k is a snapshot of the live weights after k updates of this stage: separate tensors,
leaves of autograd, passed to the stage module with `torch.func.functional_call`. A micro-batch's
forward and backward both use the version its forward was given (weight stashing); nothing is
ever swapped in place under tensors autograd has saved (PipeDream's original bug with
PyTorch >= 1.5). The gradient of that version is applied to the live weights by the optimizer,
whose state therefore belongs to the newest weights.

Which version micro-batch j of a call uses (U = updates before the call, p stages, stage s):

    pipedream                 U + max(0, j - p + s + 1)       (1F1B order gives exactly this)
    pipedream, vertical sync  U + max(0, j - p + 1)           (the version stage 0 used)
    2bw                       max(0, U + j // m - 1)           (batch t uses W(t-1))

A version is dropped as soon as no in-flight micro-batch holds it and no later forward can need
it, so stage s keeps at most p - s versions under pipedream, and 2 under 2BW.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["VersionRule", "WeightVersions"]


@dataclass(frozen=True)
class VersionRule:
    """Which version micro-batch j of a call uses, given the updates U made before the call."""

    schedule: str  # "pipedream" or "2bw"
    stages: int
    stage: int
    microbatches: int
    vertical_sync: bool = False

    def __call__(self, updates_before: int, j: int) -> int:
        p, s, m = self.stages, self.stage, self.microbatches
        if self.schedule == "2bw":
            return max(0, updates_before + j // m - 1)
        behind = p - 1 if self.vertical_sync else p - s - 1
        return updates_before + max(0, j - behind)

    @property
    def loss_scale(self) -> float:
        """PipeDream updates with each micro-batch's own loss; 2BW with the batch mean."""
        return 1.0 / self.microbatches if self.schedule == "2bw" else 1.0


class WeightVersions:
    """The live weights of one stage, their stashed versions and the stage's optimizer."""

    def __init__(self, module: torch.nn.Module, rule: VersionRule,
                 optimizer: Callable[[list], torch.optim.Optimizer]):
        self.rule = rule
        self.live = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.optimizer = optimizer(list(self.live.values())) if self.live else None
        self.updates = 0
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.holders: dict[int, set[int]] = {}  # version -> micro-batches using it
        self.version_of: dict[int, int] = {}  # micro-batch -> version
        self.pending: dict[str, torch.Tensor] = {}  # gradient waiting for the next update
        self.call_base = 0  # updates made before the current call (or stream)
        self._next_j = 0  # the next micro-batch of the call this stage will forward
        self.peak_versions = 0

    def begin_call(self) -> None:
        """A call (or stream) starts: micro-batches count from 0 on top of the updates so far."""
        self.call_base = self.updates
        self._snapshot()
        self._prune(next_j=0)

    def acquire(self, j: int) -> dict[str, torch.Tensor]:
        """The version micro-batch j's forward uses (held until `release(j)`)."""
        k = self.rule(self.call_base, j)
        if k not in self.versions:
            raise RuntimeError(
                f"stage {self.rule.stage}: micro-batch {j} needs weight version {k} but only "
                f"{sorted(self.versions)} exist after {self.updates} updates (schedule order "
                f"does not match {self.rule.schedule})")
        self.holders.setdefault(k, set()).add(j)
        self.version_of[j] = k
        self._prune(next_j=j + 1)
        return self.versions[k]

    def accumulate(self, grads: dict[str, torch.Tensor | None]) -> None:
        for name, grad in grads.items():
            if grad is not None:
                held = self.pending.get(name)
                self.pending[name] = grad if held is None else held + grad

    def release(self, j: int) -> None:
        k = self.version_of.pop(j)
        self.holders[k].discard(j)
        self._prune(next_j=None)

    def update(self) -> None:
        """Apply the pending gradient to the live weights, then stash the new version."""
        for name, p in self.live.items():
            p.grad = self.pending.get(name)
        if self.optimizer is not None:
            self.optimizer.step()
        self.pending = {}
        self.updates += 1
        self._snapshot()
        self._prune(next_j=None)

    # -- internals -------------------------------------------------------------------------

    def _snapshot(self) -> None:
        if self.updates not in self.versions:
            self.versions[self.updates] = {
                n: p.detach().clone().requires_grad_(True) for n, p in self.live.items()}
            self.peak_versions = max(self.peak_versions, len(self.versions))

    def _prune(self, next_j: int | None) -> None:
        if next_j is not None:
            self._next_j = next_j
        floor = self.rule(self.call_base, self._next_j)
        for k in list(self.versions):
            if k < floor and not self.holders.get(k):
                del self.versions[k]
                self.holders.pop(k, None)
