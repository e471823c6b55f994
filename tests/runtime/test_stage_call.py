"""runtime/stage_call: how a stage's module is called: by input name, through the graph's
direct forward, with a weight version, or with deferred linears; and the keys found once."""

from __future__ import annotations

import torch
from torch import nn

from pipecompile.runtime.stage_call import StageCall
from pipecompile.runtime.weight_store import WeightGradStore


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, h, x):
        return (torch.tanh(self.fc(h)) * x,)


def _graph() -> tuple[torch.fx.GraphModule, dict]:
    torch.manual_seed(0)
    inputs = {"h": torch.randn(2, 4, dtype=torch.float64),
              "x": torch.randn(2, 3, dtype=torch.float64)}
    module = _Stage().double()
    return torch.export.export(module, (inputs["h"], inputs["x"])).module(), inputs


def _call(module) -> StageCall:
    return StageCall(0, module, ("h", "x"), ("y",), frozenset({"h"}))


def test_direct_plain_and_versioned_runs_equal_the_module():
    gm, inputs = _graph()
    call = _call(gm)
    want = gm(inputs["h"], inputs["x"])[0]
    assert torch.equal(call.run(inputs, step=1)[0], want)  # direct calls
    assert torch.equal(call.run(inputs, direct=False)[0], want)
    zeros = {n: torch.zeros_like(p) for n, p in gm.named_parameters()}
    assert torch.equal(call.run(inputs, zeros)[0], torch.zeros(2, 3, dtype=torch.float64))
    assert call.named((want,)) == {"y": want}


def test_leaves_are_the_floating_received_inputs_that_need_gradients():
    gm, inputs = _graph()
    call = StageCall(0, gm, ("h", "x", "i"), ("y",), frozenset({"h", "i"}))
    leaves = call.leaves({**inputs, "i": torch.arange(3)})
    assert list(leaves) == ["h"]  # x is not a gradient input, i is not floating
    assert leaves["h"].requires_grad and leaves["h"].grad_fn is None
    assert torch.equal(leaves["h"], inputs["h"])


def test_deferred_linears_only_for_a_graph_and_the_graph_found_once():
    gm, inputs = _graph()
    call = _call(gm)
    module, store = call.deferred()
    assert module is not gm and isinstance(store, WeightGradStore)
    again, other = call.deferred()
    assert again is module and other is not store  # the graph once, a store per forward
    plain = _call(_Stage().double())
    assert plain.deferred()[1] is None  # no graph: nothing deferred


def test_the_layout_key_is_the_same_for_same_layouts_and_differs_by_shape():
    gm, inputs = _graph()
    call = _call(gm)
    key = call.layout(gm, inputs, None, 1)
    assert key == call.layout(gm, {n: v.clone() for n, v in inputs.items()}, None, 1)
    wider = {"h": torch.randn(3, 4, dtype=torch.float64), "x": torch.randn(3, 3).double()}
    assert key != call.layout(gm, wider, None, 1)
    assert not call.seeded(gm)
    state = call.state(None)
    assert len(state) == 2 and call.state(None) is state  # weight and bias storages, once
