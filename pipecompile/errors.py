"""Errors a user can act on.

Every error pipecompile raises for bad input is a `PipecompileError`; the subclasses also derive
from the built-in exception that fits (`ValueError`, `TypeError`, `RuntimeError`, `TimeoutError`)
so that generic handlers keep working. Messages name the value, what was expected and what to do.
"""

from __future__ import annotations

import importlib
from types import ModuleType

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
    "MissingDependencyError",
    "require",
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


class MissingDependencyError(PipecompileError, ModuleNotFoundError):
    """An optional package a feature needs is not installed; names the extra that installs it."""


# Optional packages: a feature that needs one imports it with `require`; the extra of
# pyproject.toml's [project.optional-dependencies] that installs each:
#   plot: matplotlib (plot_timeline, draw); onnx: onnx, onnxscript (export_onnx), onnxruntime
#   (outputs.onnx_run), jsonschema (the manifest's schema); tensorboard (the metrics example)
_EXTRAS = {"matplotlib": "plot", "onnx": "onnx", "onnxscript": "onnx", "onnx_ir": "onnx",
           "onnxruntime": "onnx", "jsonschema": "onnx", "tensorboard": "tensorboard"}


def require(module: str, *, purpose: str) -> ModuleType:
    """`import module`, or a `MissingDependencyError` saying which extra installs it and what
    needs it (`purpose`, e.g. "drawing the timeline")."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.split(".")[0]
        if error.name is not None and error.name.split(".")[0] != top:
            raise  # the package is there but one of its own imports failed: torch's message
        extra = _EXTRAS.get(top)
        fix = f"pip install 'pipecompile[{extra}]'" if extra else f"pip install {top}"
        raise MissingDependencyError(
            f"{purpose} needs the package {top!r}, which is not installed: {fix}",
            name=top) from error
