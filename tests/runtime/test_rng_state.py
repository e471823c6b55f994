"""runtime/rng_state: a captured random state replays the same draws and leaves the generator
as it found it."""

from __future__ import annotations

import torch

from pipecompile.runtime.rng_state import RngState


def test_restored_replays_the_draws_made_after_capture():
    torch.manual_seed(7)
    state = RngState.capture([torch.zeros(2)])
    first = torch.rand(4)
    torch.rand(4)  # the generator moves on
    with state.restored():
        replay = torch.rand(4)
    assert torch.equal(replay, first)


def test_restored_puts_the_generator_back_as_it_found_it():
    torch.manual_seed(7)
    state = RngState.capture([])
    torch.rand(8)
    expected_next = torch.rand(4)
    torch.manual_seed(7)
    torch.rand(8)
    with state.restored():
        torch.rand(100)  # the body's draws do not move the generator outside
    assert torch.equal(torch.rand(4), expected_next)


def test_cpu_and_meta_tensors_capture_only_the_cpu_generator():
    state = RngState.capture([torch.zeros(1), torch.empty(2, device="meta"), 3.0])
    assert state.device_type is None and state.devices == ()
    assert torch.equal(state.cpu, torch.random.get_rng_state())
