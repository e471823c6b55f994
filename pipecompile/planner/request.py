"""What the user asked of `pipecompile.compile`: one frozen `Request`, grouped, checked once.

    Request.of(devices=4, schedule="auto", loss_fn=f, ...)
      -> Request(capture=CaptureRequest(...), layout=LayoutRequest(devices=4, ...),
                 schedule=ScheduleRequest(schedule="auto", ...), training=..., costs=...)

    capture   how the model becomes a graph: method, symbolic_sizes, budget, verbose, rng,
              rng_seed
    layout    where it runs: devices, data_parallel, fsdp, mesh, memory_limit, bandwidth,
              split_points, granularity, tensor_parallel, sequence_parallel
    schedule  how a step runs: schedule, microbatches, virtual_stages, checkpoint, vertical_sync
    training  what a step computes and how long a wait may last: loss_fn, optimizer, timeout,
              compile_stages
    costs     how candidate plans are priced: profile, cache

A value given as "auto" stays "auto" (None: not given): the passes resolve it into a `Resolved`
record (resolved.py) and never rewrite the request. Every rule about one option's own value is
written here, once, in its section's `__post_init__` (a `ConfigError` naming the value and what
to pass); the rules between options, the example batch and the job's ranks are the resolver's
(options.py, layout_options.py).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from typing_extensions import TypedDict

from ..errors import ConfigError
from ..ir.compile_cache import CompileCache, default_cache
from ..ir.rng import RNG_MODES

if TYPE_CHECKING:
    from ..ir.devices import DeviceSpec
    from ..schedule.actions import Schedule
    from .cluster import Cluster

__all__ = ["Request", "CaptureRequest", "LayoutRequest", "ScheduleRequest", "TrainingRequest",
           "CostsRequest", "Options", "AUTO", "SYMBOLIC_SIZES"]

AUTO = "auto"  # the value that lets the search pass choose an option
SYMBOLIC_SIZES = ("auto", "all", "batch")  # compile(symbolic_sizes=...)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class CaptureRequest:
    """How the model is captured (capture/): `compile(capture=, symbolic_sizes=,
    capture_budget=, verbose=, rng=, rng_seed=)`."""

    method: str = "export"  # "export" (torch.export) or "fx" (symbolic_trace)
    # "auto": the batch symbolic, and every size of a batched input once a lazy pipeline meets
    # a size its plans fixed; "all": every size symbolic where the model allows (sequence
    # lengths too) from the start; "batch": the batch alone, always (other sizes fixed)
    symbolic_sizes: str = "auto"
    # seconds the torch.export attempt with every size symbolic may run (in a child process,
    # killed then) before capture gives up on it and keeps the batch alone symbolic
    budget: float = 120.0
    verbose: bool = False  # show torch's own output while capturing
    rng: str = "global"  # "per-microbatch": random streams from (seed, step, micro-batch, op)
    rng_seed: int = 0

    def __post_init__(self) -> None:
        if self.symbolic_sizes not in SYMBOLIC_SIZES:
            raise ConfigError(f"symbolic_sizes={self.symbolic_sizes!r} is not supported; use "
                              f"'auto' (the batch, then more sizes as calls change them), 'all' "
                              f"(every size of a batched input) or 'batch' (the batch alone)")
        if not _positive_number(self.budget):
            raise ConfigError(f"capture_budget must be a positive number of seconds (the "
                              f"torch.export attempt with every size symbolic gives up after "
                              f"it), got {self.budget!r}")
        if self.rng not in RNG_MODES:
            raise ConfigError(f"rng={self.rng!r} is not a random-stream mode; use one of "
                              f"{', '.join(RNG_MODES)}")


@dataclass(frozen=True)
class LayoutRequest:
    """Where the model runs: `compile(devices=, data_parallel=, tensor_parallel=,
    sequence_parallel=, vocab_parallel=, fsdp=, mesh=, memory_limit=, bandwidth=, split_points=,
    granularity=)`. `devices` and `data_parallel` None: not given."""

    devices: "int | Sequence[str | torch.device | DeviceSpec] | Cluster | None" = None
    data_parallel: int | str | None = None  # replicas, "auto" (searched) or None (not given)
    fsdp: bool | str = False  # True, False or "auto" (searched with the layout)
    mesh: Any = None  # the user's DeviceMesh with "dp" and "pp" dimensions (None: built)
    memory_limit: float | Sequence[float] | None = None  # bytes, one for all or per device
    bandwidth: float | None = None  # bytes/s between devices (None: measured or assumed)
    split_points: tuple[str, ...] | None = None  # module names: a cut right before each
    granularity: str | None = None  # the blocks' size (None: the coarsest that balances)
    # ranks that shard each layer of a stage (1: none; "auto": searched with the layout)
    tensor_parallel: int | str = 1
    # the tensor-parallel groups also split the tokens of their norms, dropout and residuals
    # (Korthikanti et al. 2022): True, False or "auto" (searched with the layout); planned and
    # priced for a cluster, not run
    sequence_parallel: bool | str = False
    # embeddings and the output layer split along the vocabulary over the T ranks: "auto" as
    # the cost model prices it (planner/tensor_costs.py), True or False as given
    vocab_parallel: bool | str = AUTO

    def __post_init__(self) -> None:
        if self.data_parallel not in (None, AUTO) and not _positive_int(self.data_parallel):
            raise ConfigError(f"data_parallel must be a positive int or 'auto', got "
                              f"{self.data_parallel!r}")
        if self.tensor_parallel != AUTO and not _positive_int(self.tensor_parallel):
            raise ConfigError(f"tensor_parallel must be a positive int or 'auto', got "
                              f"{self.tensor_parallel!r}")
        if self.fsdp not in (True, False, AUTO):
            raise ConfigError(f"fsdp must be True, False or 'auto', got {self.fsdp!r}")
        if not isinstance(self.sequence_parallel, bool) and self.sequence_parallel != AUTO:
            raise ConfigError(f"sequence_parallel must be True, False or 'auto', got "
                              f"{self.sequence_parallel!r}")
        if not isinstance(self.vocab_parallel, bool) and self.vocab_parallel != AUTO:
            raise ConfigError(f"vocab_parallel must be True, False or 'auto', got "
                              f"{self.vocab_parallel!r}")
        if self.sequence_parallel is True and self.tensor_parallel == 1:
            raise ConfigError("sequence_parallel=True splits the tokens over the ranks of a "
                              "tensor-parallel group, but tensor_parallel=1 has none; pass "
                              "tensor_parallel=T > 1 (or 'auto'), or sequence_parallel=False")
        if self.split_points is not None and not isinstance(self.split_points, tuple):
            object.__setattr__(self, "split_points", tuple(self.split_points))

    @property
    def searched(self) -> bool:
        """Whether the layout (P x D) is the search's: data_parallel="auto", or neither
        devices nor data_parallel given (under torchrun; elsewhere that is one device)."""
        return self.data_parallel == AUTO or (self.devices is None and self.data_parallel is None)


@dataclass(frozen=True)
class ScheduleRequest:
    """How a step runs: `compile(schedule=, microbatches=, virtual_stages=, checkpoint=,
    vertical_sync=)`; "auto" leaves a value to the search pass."""

    schedule: "str | Schedule" = AUTO  # "auto", a built-in name, or a written schedule
    microbatches: int | str = AUTO
    virtual_stages: int | str | None = AUTO  # None: as "auto"
    checkpoint: bool | str = AUTO  # recompute each stage's forward in backward
    vertical_sync: bool = False  # PipeDream: every stage uses one weight version per batch

    def __post_init__(self) -> None:
        if self.microbatches != AUTO and not _positive_int(self.microbatches):
            raise ConfigError(f"microbatches must be a positive int or 'auto', got "
                              f"{self.microbatches!r}")
        if self.virtual_stages not in (None, AUTO) and not _positive_int(self.virtual_stages):
            raise ConfigError(f"virtual_stages must be a positive int or 'auto', got "
                              f"{self.virtual_stages!r}")
        if self.checkpoint not in (True, False, AUTO):
            raise ConfigError(f"checkpoint must be True, False or 'auto', got "
                              f"{self.checkpoint!r}")


@dataclass(frozen=True)
class TrainingRequest:
    """What a step computes: `compile(loss_fn=, optimizer=, timeout=, compile_stages=)`."""

    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None
    timeout: float = 300.0  # seconds every blocking wait gives up after
    compile_stages: bool = False  # each stage graph through torch.compile

    def __post_init__(self) -> None:
        if not _positive_number(self.timeout):
            raise ConfigError(f"timeout must be a positive number of seconds (every blocking "
                              f"wait gives up after it), got {self.timeout!r}")


@dataclass(frozen=True)
class CostsRequest:
    """How plans are priced: `compile(profile=, cache=)`."""

    profile: bool = False  # time the blocks and stages on this machine
    # what compiling measures or derives, kept by content (None: nothing kept)
    cache: CompileCache | None = field(default=default_cache, compare=False, repr=False)


class Options(TypedDict, total=False):
    """compile's keyword options, with their types (see `pipecompile.compile`)."""

    devices: "int | Sequence[str | torch.device | DeviceSpec] | Cluster | None"
    microbatches: int | str
    schedule: "str | Schedule"
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    optimizer: Callable[[list], torch.optim.Optimizer] | None
    split_points: Sequence[str] | None
    capture: str
    symbolic_sizes: str
    capture_budget: float
    granularity: str | None
    virtual_stages: int | str | None
    profile: bool
    memory_limit: float | Sequence[float] | None
    bandwidth: float | None
    checkpoint: bool | str
    vertical_sync: bool
    data_parallel: int | str | None
    tensor_parallel: int | str
    sequence_parallel: bool | str
    vocab_parallel: bool | str
    timeout: float
    verbose: bool
    rng: str
    rng_seed: int
    compile_stages: bool
    fsdp: bool | str
    mesh: Any
    cache: CompileCache | None


# compile's keyword -> (section, field): the one table that groups the options
_WHERE: dict[str, tuple[str, str]] = {
    "capture": ("capture", "method"), "symbolic_sizes": ("capture", "symbolic_sizes"),
    "capture_budget": ("capture", "budget"), "verbose": ("capture", "verbose"),
    "rng": ("capture", "rng"), "rng_seed": ("capture", "rng_seed"),
    **{name: ("layout", name) for name in ("devices", "data_parallel", "tensor_parallel",
                                           "sequence_parallel", "vocab_parallel", "fsdp",
                                           "mesh",
                                           "memory_limit", "bandwidth", "split_points",
                                           "granularity")},
    **{name: ("schedule", name) for name in ("schedule", "microbatches", "virtual_stages",
                                             "checkpoint", "vertical_sync")},
    **{name: ("training", name) for name in ("loss_fn", "optimizer", "timeout",
                                             "compile_stages")},
    "profile": ("costs", "profile"), "cache": ("costs", "cache"),
}
_SECTIONS = {"capture": CaptureRequest, "layout": LayoutRequest, "schedule": ScheduleRequest,
             "training": TrainingRequest, "costs": CostsRequest}


@dataclass(frozen=True)
class Request:
    """compile's options as the user gave them, in five sections; never rewritten."""

    capture: CaptureRequest = CaptureRequest()
    layout: LayoutRequest = LayoutRequest()
    schedule: ScheduleRequest = ScheduleRequest()
    training: TrainingRequest = TrainingRequest()
    costs: CostsRequest = CostsRequest()

    @classmethod
    def of(cls, **options: Any) -> "Request":
        """The request of compile's keyword `options` (an unknown name is a `TypeError`
        naming the closest one; a bad value a `ConfigError`)."""
        grouped: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for name, value in options.items():
            if name not in _WHERE:
                close = difflib.get_close_matches(name, _WHERE, n=1)
                raise TypeError(f"compile() got an unexpected keyword argument {name!r}"
                                + (f"; did you mean {close[0]!r}?" if close else ""))
            section, key = _WHERE[name]
            grouped[section][key] = value
        return cls(**{name: _SECTIONS[name](**grouped[name]) for name in _SECTIONS})

    def keywords(self) -> dict[str, Any]:
        """compile's keyword options of this request, every one (defaults included)."""
        return {name: getattr(getattr(self, section), key)
                for name, (section, key) in _WHERE.items()}

    def __str__(self) -> str:
        """One line per section, only the values that differ from compile's defaults."""
        lines = []
        for name, section in _SECTIONS.items():
            value, default = getattr(self, name), section()
            given = [f"{f.name}={getattr(value, f.name)!r}" for f in fields(value)
                     if f.repr and getattr(value, f.name) != getattr(default, f.name)]
            lines.append(f"{name:9} {', '.join(given) if given else '(defaults)'}")
        return "\n".join(lines)
