"""module_state: the Pipeline as the model's nn.Module. Before a plan the model's own tensors,
after it this process's stage copies, under the model's names (a tied weight under both);
`load_state` copies into every copy and refuses what would break that; meta tensors are found."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile import module_state


class Tied(nn.Module):
    """`first.weight` is `last.weight`, and a buffer: what the names must keep."""

    def __init__(self):
        super().__init__()
        self.first, self.mid, self.last = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.last.weight = self.first.weight
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x))))) + self.offset


def _pipe(model):
    x = torch.randn(4, 4, dtype=torch.float64)
    return pc.compile(model, (x,), devices=3, schedule="gpipe", microbatches=2,
                      loss_fn=lambda out, y: ((out - y) ** 2).mean())


def test_before_a_plan_the_names_are_over_the_models_own_tensors():
    model = Tied().double()
    root = nn.Module()
    module_state.mirror_model(root, model)
    assert list(root.state_dict(keep_vars=True)) == list(model.state_dict(keep_vars=True))
    assert all(t is model.state_dict(keep_vars=True)[n]
               for n, t in root.state_dict(keep_vars=True).items())


def test_after_adopting_a_plan_a_tied_weight_is_one_tensor_under_both_names():
    model = Tied().double()
    pipe = _pipe(model)
    own = dict(module_state.own_state(pipe))
    assert set(own) == set(model.state_dict())  # every name, the tied one twice
    assert own["first.weight"] is own["last.weight"]
    stage_tensors = {id(t) for s in pipe.program.stages for t in s.module.parameters()}
    assert all(id(p) in stage_tensors for p in pipe.parameters())


def test_load_state_copies_into_every_copy_and_reports_bad_keys():
    model = Tied().double()
    pipe = _pipe(model)
    state = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    result = module_state.load_state(pipe, pipe.program, state, strict=True, assign=False)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for name, copies in pipe.program.tensors.items():
        for _, tensor in copies:  # every stage's copy, a tied weight's on each device
            assert torch.equal(tensor, state[name]), name
    with pytest.raises(pc.ConfigError, match=r"missing keys \['first.bias'\]"):
        module_state.load_state(pipe, pipe.program,
                                {k: v for k, v in state.items() if k != "first.bias"},
                                strict=True, assign=False)
    with pytest.raises(pc.ConfigError, match="assign=True"):
        module_state.load_state(pipe, pipe.program, state, strict=False, assign=True)


def test_a_meta_tensor_left_is_named_before_anything_runs():
    with torch.device("meta"):
        model = Tied().double()
    pipe = _pipe(model)
    with pytest.raises(pc.ConfigError, match="meta"):
        module_state.check_runnable(pipe, pipe.plan, "pipe.step()")
    pipe.to_empty()
    # allocated but written by nothing: uninitialised memory is refused, each tensor named
    with pytest.raises(pc.ConfigError, match=r"pipe.step\(\): 7 tensor.*'first.bias'.*"
                                             r"neither loaded nor initialised"):
        module_state.check_runnable(pipe, pipe.plan, "pipe.step()")
    state = Tied().double().state_dict()
    pipe.load_state_dict({k: v for k, v in state.items() if k != "offset"}, strict=False)
    with pytest.raises(pc.ConfigError, match=r"1 tensor.*\['offset'\]"):
        module_state.check_runnable(pipe, pipe.plan, "pipe.step()")
    pipe.load_state_dict(state)
    module_state.check_runnable(pipe, pipe.plan, "pipe.step()")  # written: nothing raised


class Scratch(nn.Module):
    """A non-persistent buffer (in no checkpoint) that no library recomputes; moved to the
    input's device as transformers' rotary embeddings do (a meta_parameters() model is
    captured on meta inputs)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale.to(x.device)


def test_a_non_persistent_buffer_built_on_meta_is_refused_with_the_fix():
    with torch.device("meta"):
        model = Scratch().double()
    pipe = _pipe(model)
    pipe.to_empty()
    pipe.load_state_dict(Scratch().double().state_dict())  # every persistent key
    with pytest.raises(pc.ConfigError, match=r"non-persistent buffer\(s\) \['scale'\].*"
                                             r"meta_parameters\(\)"):
        module_state.check_runnable(pipe, pipe.plan, "pipe.step()")
    with pc.meta_parameters():  # the fix: parameters on meta, buffers real
        model = Scratch().double()
    pipe = _pipe(model)
    pipe.to_empty()
    pipe.load_state_dict(Scratch().double().state_dict())
    module_state.check_runnable(pipe, pipe.plan, "pipe.step()")
    assert torch.equal(pipe.scale, torch.full((4,), 2.0, dtype=torch.float64))
