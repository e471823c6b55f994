"""The devices a plan runs on, as the cost model sees them: the record every floor reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["DeviceSpec"]


@dataclass(frozen=True)
class DeviceSpec:
    """One device of the pipeline, as the cost model sees it.

    Relative (the default): block times are estimated or measured on this machine's first
    device and a stage's time is divided by `speed`. Absolute: `flops` (sustained FLOP/s in the
    model's compute dtype) with `memory`, link `bandwidth` and `latency` describe hardware that
    need not be on this machine; a compile whose devices are all absolute plans analytically
    and measures nothing (see `planner/hardware.py`, whose `preset` names real devices:
    `pipecompile.preset("h100")`). Then `speed` is derived: flops / the first device's flops.

        >>> DeviceSpec("cuda", memory=80e9, bandwidth=450e9, flops=495e12, latency=1e-5).absolute
        True
    """

    name: str = "cpu"  # the torch device a stage runs on ("cpu", "cuda", "cuda:3")
    speed: float = 1.0  # relative: a block's time on this device is block_time / speed
    memory: float = math.inf  # bytes available for this stage
    bandwidth: float = math.inf  # bytes/s of the link this device sends over
    flops: float | None = None  # sustained FLOP/s in the compute dtype (None: measured here)
    latency: float = 0.0  # seconds per message on the link, on top of bytes / bandwidth
    memory_bandwidth: float | None = None  # sustained bytes/s of device memory (absolute only)
    op_overhead: float | None = None  # seconds per graph op: launch, dispatch (absolute only)
    action_overhead: float | None = None  # seconds per pipeline action and message (absolute)
    hardware: str = ""  # what the device is, for reports ("NVIDIA H100 80GB SXM")
    dtype_flops: tuple[tuple[str, float], ...] = ()  # sustained FLOP/s by dtype ("bfloat16")

    def __post_init__(self) -> None:
        positive = [("speed", self.speed), ("bandwidth", self.bandwidth),
                    ("flops", self.flops), ("memory_bandwidth", self.memory_bandwidth),
                    *((f"dtype_flops[{d!r}]", v) for d, v in self.dtype_flops)]
        for field, value in positive:
            if value is not None and not value > 0:
                raise ConfigError(f"DeviceSpec {self.name!r}: {field} must be > 0, got {value}")
        for field, value in (("memory", self.memory), ("latency", self.latency),
                             ("op_overhead", self.op_overhead),
                             ("action_overhead", self.action_overhead)):
            if value is not None and not value >= 0:
                raise ConfigError(f"DeviceSpec {self.name!r}: {field} must be >= 0, got {value}")
        if self.flops is None and (self.dtype_flops or self.memory_bandwidth is not None
                                   or self.op_overhead is not None
                                   or self.action_overhead is not None):
            raise ConfigError(
                f"DeviceSpec {self.name!r}: dtype_flops, memory_bandwidth, op_overhead and "
                f"action_overhead describe an absolute device; give flops= too (sustained "
                f"FLOP/s), or leave them out to measure this machine")

    @property
    def absolute(self) -> bool:
        """Whether the spec gives its own FLOP rate (hardware that need not be here)."""
        return self.flops is not None

    def rate(self, dtype: str | None = None) -> float:
        """Sustained FLOP/s for `dtype` ("bfloat16", "float32", ...): its `dtype_flops` entry,
        else `flops`. Only for absolute specs."""
        if self.flops is None:
            raise ConfigError(f"DeviceSpec {self.name!r} has no flops: it is measured, not given")
        return dict(self.dtype_flops).get(dtype or "", self.flops)

    def send_time(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes` over this device's link (0 for no bytes)."""
        if nbytes <= 0:
            return 0.0
        return (0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth) + self.latency
