"""passes/split points the captured graph's device literals (a position table made on the
embedding's device, also inside a `torch.no_grad()` region's body) at each stage's device: a
model left on one device and compiled for another made them on the device it was traced on."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from pipecompile.capture.capture import capture
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.pos = nn.Embedding(8, 6)
        self.head = nn.Linear(6, 10)

    def forward(self, ids):
        device = self.emb.weight.device
        positions = torch.arange(ids.shape[1], device=device)
        with torch.no_grad():
            scale = torch.full((6,), 2.0, device=device)
        h = (self.emb(ids) + self.pos(positions)) * scale
        return self.head(h)


def _device_literals(gm: fx.GraphModule) -> set[torch.device]:
    found: set[torch.device] = set()
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                fx.node.map_aggregate((node.args, node.kwargs), lambda v: found.add(v)
                                      if isinstance(v, torch.device) else None)
    return found


def _split(devices):
    torch.manual_seed(0)
    model = Positions().double()
    ids = torch.randint(0, 10, (4, 5))
    linear = linearize(capture(model, (ids,), {}))
    return model, ids, split(linear, (0, len(linear.blocks) - 1, len(linear.blocks)),
                             list(devices))


def test_literals_name_each_stage_device():
    """Traced on the CPU, split for meta (a device type a CPU machine has, standing in for a
    GPU): the first stage's position table and no-grad region make their tensors on meta."""
    for devices in (("meta", "cpu"), ("meta", "meta")):
        program = _split(devices)[2]
        for stage in program.stages:
            assert _device_literals(stage.module) <= {stage.device}, devices
        assert _device_literals(program.stages[0].module) == {torch.device("meta")}


def test_on_the_traced_device_the_stages_compute_the_model():
    model, ids, program = _split(("cpu", "cpu"))
    assert {d for s in program.stages for d in _device_literals(s.module)} == \
        {torch.device("cpu")}
    values = {"ids": ids}
    for stage in program.stages:
        out = stage.module(*(values[n] for n in stage.inputs))
        values.update(zip(stage.outputs, out))
    got = values[program.stages[-1].outputs[0]]
    torch.testing.assert_close(got, model(ids), rtol=0, atol=0)
