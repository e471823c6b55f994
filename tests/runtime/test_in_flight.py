"""runtime/in_flight: micro-batch 0's forward begins a step: a new step count, fresh memory
counts, and the gradient hooks told."""

from __future__ import annotations

import torch

from pipecompile.runtime.in_flight import InFlight, NoSync, Saved


class _Hooks:
    def __init__(self):
        self.began = 0

    def begin_step(self) -> None:
        self.began += 1


def test_begin_step_counts_steps_resets_activations_and_tells_the_hooks():
    held, hooks = InFlight(), _Hooks()
    module = torch.nn.Linear(2, 2)
    held.activations.hold(0, [torch.ones(16)])
    assert held.activations.held
    held.begin_step({"x": torch.ones(2)}, module, hooks)
    held.begin_step({"x": torch.ones(2)}, module, hooks)
    assert (held.steps, hooks.began) == (2, 2)
    assert not held.activations.held


def test_no_sync_does_nothing_and_saved_defaults_hold_no_work():
    sync = NoSync()
    assert (sync.begin_step(), sync.summed(True), sync.before_backward()) == (None, None, None)
    saved = Saved({}, {"y": 1})
    assert (saved.inputs, saved.store, saved.weight_work, saved.weights) == (None,) * 4
