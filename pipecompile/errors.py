"""Errors a user can act on.

Every error pipecompile raises for bad input is a `PipecompileError`; the subclasses also derive
from the built-in exception that fits (`ValueError`, `TypeError`, `RuntimeError`, `TimeoutError`)
so that generic handlers keep working. Messages name the value, what was expected and what to do.
"""

from __future__ import annotations

__all__ = [
    "PipecompileError",
    "CaptureError",
    "InPlaceError",
    "OpaqueModuleError",
    "PartitionError",
    "PartitionMemoryError",
    "ScheduleError",
    "ConfigError",
    "LossError",
    "StageExecutionError",
    "CheckpointError",
]


class PipecompileError(Exception):
    """Base class of every error pipecompile raises on purpose."""


class ConfigError(PipecompileError, ValueError):
    """An argument of `compile` (devices, microbatches, split points, ...) cannot be used."""


class CaptureError(PipecompileError, RuntimeError):
    """The model could not be captured as a graph (torch.export or torch.fx failed)."""


class InPlaceError(CaptureError):
    """An in-place op writes to a value that crosses a stage boundary and cannot be copied."""


class OpaqueModuleError(CaptureError):
    """A submodule kept as one opaque call cannot be run or differentiated as such."""


class PartitionError(PipecompileError, ValueError):
    """No placement of the blocks on the devices satisfies the constraints."""


class PartitionMemoryError(PartitionError):
    """No placement fits in memory; `memory_needed` and `devices_needed` say what would."""

    def __init__(self, message: str, *, memory_needed: float, devices_needed: int | None) -> None:
        super().__init__(message)
        self.memory_needed = memory_needed  # smallest per-device memory that fits (bytes)
        self.devices_needed = devices_needed  # fewest devices that fit, if known and any does


class ScheduleError(PipecompileError, ValueError):
    """A schedule is malformed: a missing action, an unmatched send, or a possible deadlock."""


class LossError(PipecompileError, ValueError):
    """The loss function returned something other than a scalar tensor."""


class StageExecutionError(PipecompileError, RuntimeError):
    """An action of a stage failed while a pipeline ran; names the stage and the action."""


class CheckpointError(PipecompileError, ValueError):
    """A weights checkpoint is missing, in no format pipecompile reads, or inconsistent."""
