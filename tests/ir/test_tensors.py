"""tensors.to_device: one helper for stages, transports and calibration."""

from __future__ import annotations

import torch

from pipecompile.ir.tensors import to_device


def test_a_tensor_already_on_the_cpu_is_shared_not_copied():
    x = torch.randn(3, requires_grad=True)
    assert to_device(x, torch.device("cpu")) is x


def test_containers_are_mapped_and_other_values_pass_through():
    x, y = torch.ones(2), torch.zeros(2)
    moved = to_device({"a": [x, (y, 3)], "b": "text"}, torch.device("cpu"))
    assert moved["a"][0] is x and moved["a"][1][0] is y and moved["a"][1][1] == 3
    assert isinstance(moved["a"][1], tuple) and moved["b"] == "text"
    assert to_device(None, torch.device("cpu")) is None
