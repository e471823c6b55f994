"""DeviceSpec: a device as the cost model sees it."""

from __future__ import annotations

import math

import pytest

from pipecompile.errors import ConfigError
from pipecompile.ir.devices import DeviceSpec


def test_latency_of_an_infinite_link_is_still_paid():
    assert DeviceSpec(latency=2e-6).send_time(1.0) == 2e-6
    assert math.isinf(DeviceSpec().bandwidth) and DeviceSpec().send_time(1.0) == 0.0


def test_an_absolute_device_gives_its_rate_by_dtype_and_a_relative_one_refuses():
    spec = DeviceSpec("cuda", flops=100e12, dtype_flops=(("bfloat16", 400e12),))
    assert spec.absolute and spec.rate("bfloat16") == 400e12 and spec.rate("float32") == 100e12
    with pytest.raises(ConfigError, match="no flops"):
        DeviceSpec().rate()
    with pytest.raises(ConfigError, match="speed must be > 0"):
        DeviceSpec(speed=0)
