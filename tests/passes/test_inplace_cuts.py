"""In-place ops next to cuts: a stage's received values tolerate any in-place use, exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.capture.capture import capture as capture_model
from pipecompile.errors import InPlaceError
from pipecompile.passes.linearize import linearize
from tests.support.capture_models import InplaceResNet, ViewWrite
from tests.support.reference import assert_grads_equal, reference_step


def _check_step(model, x, y, loss_fn, **options):
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), loss_fn=loss_fn, microbatches=2, **options)
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, loss_fn, 2)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert_grads_equal(pipe, ref_grads, rtol=1e-12)
    ref_state = reference.state_dict()
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, ref_state[key]), key
    return pipe


@pytest.mark.parametrize("granularity", ["layer", "layer+1", "op"])
@pytest.mark.parametrize("capture", ["export", "fx"])
def test_inplace_relu_after_residual_add_on_four_stages(granularity, capture):
    torch.manual_seed(0)
    model = InplaceResNet().double()
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    pipe = _check_step(model, x, y, F.cross_entropy, devices=["cpu"] * 4,
                       granularity=granularity, capture=capture)
    assert len(pipe.program.stages) == 4


def test_export_capture_makes_activation_inplace_ops_out_of_place():
    from pipecompile.capture.capture import capture

    model = InplaceResNet().double()
    captured = capture(model, (torch.randn(4, 3, 6, 6, dtype=torch.float64),))
    written = [n for n in captured.module.graph.nodes if n.op == "call_function"
               and n.target._schema.is_mutable and n.args[0].op != "get_attr"]
    assert written == [], [n.format_node() for n in written]
    assert any("in-place ops on activations made out-of-place" in s for s in captured.notes)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_write_into_view_of_received_value_is_exact(schedule):
    torch.manual_seed(0)
    model = ViewWrite().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe = _check_step(model, x, torch.randn(4, 6, dtype=torch.float64), F.mse_loss,
                       devices=["cpu"] * 2, split_points=["layers.1"], schedule=schedule)
    first = pipe.program.stages[1].module.graph
    assert any(n.target is torch.ops.aten.clone.default for n in first.nodes)


def test_write_seen_by_a_later_stage_is_refused_naming_op_and_value():
    model = ViewWrite(reuse=True).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(InPlaceError, match=r"in-place op 'mul_' \(stage 1\) writes to 'linear'.*stage 2 reads"):
        pc.compile(model, (x,), loss_fn=F.mse_loss, devices=["cpu"] * 3, microbatches=2,
                   split_points=["layers.1", "layers.2"])


class _SharedNorm(torch.nn.Module):
    """One BatchNorm used at two depths: its running statistics are updated by both uses."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(8)
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = torch.relu(self.b(self.norm(self.a(x))))
        return self.c(self.norm(h))


@pytest.mark.parametrize("capture", ["export", "fx"])
def test_state_updated_in_place_at_two_depths_stays_in_one_stage(capture):
    """One BatchNorm at two depths: its running statistics are updated at both uses, in the
    model's order only if no cut separates them. The blocks between its uses are one block;
    the pipeline trains exactly, statistics included, and no cut can fall in between."""
    torch.manual_seed(0)
    model = _SharedNorm().double()
    x = torch.randn(16, 8, dtype=torch.float64)
    linear = linearize(capture_model(copy.deepcopy(model), (x,), {}, method=capture))
    names = [b.name for b in linear.blocks]
    assert names[0].startswith("a") and names[-1].startswith("c") and len(names) == 3, names
    joined = set(linear.blocks[1].nodes)
    assert sum(1 for n in joined if "batch_norm" in n or n.startswith("norm")) >= 2, joined
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), loss_fn=F.mse_loss, devices=2, microbatches=2,
                      capture=capture, schedule="gpipe")
    loss = pipe.step(x, target=x)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, x, F.mse_loss, 2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert_grads_equal(pipe, ref_grads)
    want = reference.state_dict()
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=1e-12, atol=0, msg=name)
    with pytest.raises(pc.ConfigError, match="split point 'b' names no block"):
        pc.compile(copy.deepcopy(reference), (x,), loss_fn=F.mse_loss, devices=2,
                   split_points=["b"], capture=capture)


def _graph(fn, *args):
    return torch.export.export(fn, args).module()


class _TwoWrites(torch.nn.Module):
    def forward(self, x):
        a = x * 2
        a.relu_()  # on a fresh value: made out-of-place
        a.add_(1)
        v = x * 3
        view = v[:, :1]
        view.mul_(2)  # through a view: kept
        return a + v


def test_functionalize_rewrites_fresh_values_only_and_leaves_its_input_alone():
    from pipecompile.passes.inplace import functionalize, mutated_inputs

    gm = _graph(_TwoWrites(), torch.randn(3, 2))
    before = [n.format_node() for n in gm.graph.nodes]
    new, rewritten = functionalize(gm)
    assert [n.format_node() for n in gm.graph.nodes] == before  # a pass never mutates its input
    assert rewritten == ("relu_", "add_")
    targets = [n.target for n in new.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.relu.default in targets and torch.ops.aten.mul_.Tensor in targets
    x = torch.randn(3, 2)
    torch.testing.assert_close(new(x), _TwoWrites()(x.clone()), rtol=0, atol=0)
    assert mutated_inputs(new.graph) == {}


def test_mutated_inputs_sees_writes_through_views_of_placeholders():
    from pipecompile.passes.inplace import mutated_inputs

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    view = graph.call_function(torch.ops.aten.slice.Tensor, (x, 1, 0, 1))
    write = graph.call_function(torch.ops.aten.mul_.Tensor, (view, 2.0))
    graph.output((write,))
    assert mutated_inputs(graph) == {"x": write.name}
