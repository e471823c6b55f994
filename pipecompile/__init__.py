"""pipecompile: pipeline-parallel training of PyTorch models as a compiler problem.

    pipe = pipecompile.compile(model, example_inputs=(x,), devices=4, loss_fn=...)
    print(pipe)                  # stage table
    loss = pipe.step(x, target=y)
"""

from .ir.compile_cache import CompileCache, default_cache
from .compiler import compile
from .errors import (
    CaptureError,
    CheckpointError,
    ConfigError,
    InPlaceError,
    LossError,
    OpaqueModuleError,
    PartitionError,
    PartitionMemoryError,
    PipecompileError,
    ScheduleError,
    StageExecutionError,
)
from .planner.hardware import preset
from .weights.materialize import meta_parameters
from .ir.devices import DeviceSpec
from .outputs.stage_check import StageCodeError
from .planner.cluster import Cluster, cluster
from .pipeline import Pipeline, load
from .outputs.memory_report import DeviceMemory, format_memory

__all__ = [
    "compile",
    "CompileCache",
    "default_cache",
    "load",
    "meta_parameters",
    "preset",
    "cluster",
    "Cluster",
    "Pipeline",
    "DeviceMemory",
    "format_memory",
    "DeviceSpec",
    "PipecompileError",
    "CaptureError",
    "CheckpointError",
    "ConfigError",
    "InPlaceError",
    "LossError",
    "OpaqueModuleError",
    "PartitionError",
    "PartitionMemoryError",
    "StageCodeError",
    "ScheduleError",
    "StageExecutionError",
]
__version__ = "0.1.0"
