"""graph_code: a GraphModule written as Python source and rebuilt from it."""

from __future__ import annotations

import torch

from pipecompile.capture.capture import capture
from pipecompile.outputs.graph_code import build_module, module_source


class NoGradPositions(torch.nn.Module):
    """A no-grad region (an inner graph module under torch.export) and an arange of constants."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        with torch.no_grad():
            positions = torch.arange(4, dtype=x.dtype) * self.scale
        return self.fc(x + positions)


def _state(gm):
    return dict(list(gm.named_parameters(remove_duplicate=False))
                + list(gm.named_buffers(remove_duplicate=False)))


def test_round_trip_keeps_ops_names_and_inner_modules():
    torch.manual_seed(0)
    model = NoGradPositions()
    x = torch.randn(3, 4)
    gm = capture(model, (x,), {}).module
    source = module_source(gm, class_name="Stage0", doc="a test stage")
    assert source.startswith('"""a test stage"""')
    assert "class Stage0(torch.nn.Module):" in source
    inner = [p for p, m in gm.named_modules() if p and isinstance(m, torch.fx.GraphModule)]
    assert inner, "torch.export should have made the no-grad region an inner graph module"
    assert f"SUBMODULES = {{{inner[0]!r}: 'Stage0_{inner[0]}'}}" in source

    rebuilt = build_module(source, "Stage0", _state(gm))
    def names(g):
        return [n.name for n in g.graph.nodes if n.op != "placeholder"]

    assert names(rebuilt) == names(gm)
    assert [n.target for n in rebuilt.graph.nodes if n.op == "call_function"] == [
        n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert rebuilt.code == gm.code
    assert not any(name.startswith("_tensor_constant") for name, _ in rebuilt.named_buffers())
    torch.testing.assert_close(rebuilt(x)[0], model(x))
    # parameters are the given tensors, not copies
    assert rebuilt.get_parameter("fc.weight") is model.fc.weight
