"""Poison: what `to_empty` allocates is marked, and found until every element is written."""

from __future__ import annotations

import pytest
import torch

from pipecompile.weights.unwritten import Unwritten, is_poisoned, poison


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.complex64, torch.int64, torch.int8, torch.uint8])
def test_poison_is_found_until_every_element_is_written(dtype):
    t = torch.empty(3, dtype=dtype)
    poison(t)
    held = Unwritten()
    held.add([("t", t), ("alias", t)])
    assert is_poisoned(t) and held.left() == ["t", "alias"]
    t[:2] = torch.zeros(2).to(dtype)  # partly written: still refused
    assert held.left() == ["t", "alias"]
    t.data[2:] = torch.ones(1).to(dtype)  # through .data too
    assert not is_poisoned(t) and held.left() == [] and held.left() == []


def test_a_bool_tensor_counts_as_written_once_written_in_place():
    t = torch.empty(2, dtype=torch.bool)
    poison(t)  # no value to spare: its version counter tells
    held = Unwritten()
    held.add([("mask", t)])
    assert not is_poisoned(t) and held.left() == ["mask"]
    t.fill_(True)
    assert held.left() == []
