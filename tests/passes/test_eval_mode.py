"""passes/eval_mode: a graph captured in training mode, rewritten, equals the model in eval()."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipecompile import zoo
from pipecompile.capture.capture import capture
from pipecompile.passes.eval_mode import eval_graph

aten = torch.ops.aten


class DropoutMLP(nn.Module):
    """Dropout as a module and as a function call."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        return self.fc2(F.dropout(h, p=0.3, training=self.training))


def _trained_cnn() -> zoo.ResidualCNN:
    """A ResidualCNN whose BatchNorm running statistics are not the initial 0/1."""
    torch.manual_seed(0)
    model = zoo.ResidualCNN(width=4, blocks=2, classes=3)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 6, 6) * 2 + 1)
    return model


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_batch_norm_reads_running_stats_and_buffers_stay():
    model = _trained_cnn()
    x = torch.randn(4, 3, 6, 6)
    captured = capture(model, (x,), {})
    before_code = captured.module.code
    before_state = {k: v.clone() for k, v in model.state_dict().items()}

    gm = eval_graph(captured.module)
    with torch.no_grad():
        got = gm(x)[0]
        got_again = gm(x)[0]
    model.eval()
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got, got_again)
    # no training-mode batch norm and no running-stat update is left in the new graph
    for node in gm.graph.nodes:
        if node.target == aten.batch_norm.default:
            assert node.args[5] is False
    assert aten.add_.Tensor not in _targets(gm)
    # the input is untouched; parameters and buffers are shared, and not updated
    assert captured.module.code == before_code
    assert aten.add_.Tensor in _targets(captured.module)
    assert gm.get_parameter("stem.0.weight") is captured.module.get_parameter("stem.0.weight")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before_state[key]), key


def test_dropout_becomes_identity_export_capture():
    torch.manual_seed(0)
    model = DropoutMLP()
    x = torch.randn(8, 6)
    captured = capture(model, (x,), {})
    assert aten.dropout.default in _targets(captured.module)

    gm = eval_graph(captured.module)
    assert aten.dropout.default not in _targets(gm)
    assert aten.dropout.default in _targets(captured.module)  # unchanged input
    model.eval()
    torch.testing.assert_close(gm(x)[0], model(x))


def test_fx_capture_leaf_modules_run_in_eval_mode_without_touching_the_model():
    torch.manual_seed(0)
    cnn = _trained_cnn()
    mlp = DropoutMLP()
    for model, x in ((cnn, torch.randn(4, 3, 6, 6)), (mlp, torch.randn(8, 6))):
        captured = capture(model, (x,), {}, method="fx")
        gm = eval_graph(captured.module)
        assert all(m.training for m in model.modules())  # the user's modules: still training
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            got = gm(x)[0]
        model.eval()
        with torch.no_grad():
            want = model(x)
        model.train()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for key, value in model.state_dict().items():
            assert torch.equal(value, state[key]), key


def test_eval_graph_of_a_stage_keeps_its_interface():
    import pipecompile as pc

    model = _trained_cnn()
    x = torch.randn(8, 3, 6, 6)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2)
    model.eval()
    env = {"x": x}
    for stage in pipe.program.stages:
        gm = eval_graph(stage.module)
        placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        assert placeholders == list(stage.inputs)
        with torch.no_grad():
            env.update(zip(stage.outputs, gm(*[env[n] for n in stage.inputs])))
    with torch.no_grad():
        torch.testing.assert_close(env[pipe.program.stages[-1].outputs[0]], model(x), rtol=1e-5,
                                   atol=1e-6)
