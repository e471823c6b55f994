"""capture: export with a dynamic batch, the static fallback, and the fx front end."""

from __future__ import annotations

import copy

import pytest
import sympy
import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile import zoo
from pipecompile.capture.capture import capture
from pipecompile.capture.graph import flat_graph, output_names
from tests.support.models import CASES
from tests.support.reference import assert_grads_equal, reference_step


def test_export_marks_batch_dynamic_and_keeps_structure():
    case = CASES["keyword_tuple"]()
    captured = capture(case.model, case.args, case.kwargs)
    assert captured.method == "export" and captured.dynamic_batch
    assert captured.input_names == ("x", "scale")
    assert isinstance(captured.batch_symbol, sympy.Symbol)
    assert captured.values["x"].shape[0] == captured.batch_symbol
    assert captured.example_sizes[captured.batch_symbol] == 8
    flat = captured.flatten_inputs(case.args, case.kwargs)
    out = captured.unflatten_outputs(list(captured.module(*flat)))
    want = case.model(*case.args, **case.kwargs)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out[0], want[0])


class HardCodedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x).reshape(4, 4))  # assumes a batch of exactly 4


def test_static_fallback_captures_at_microbatch_size_and_trains_exactly():
    torch.manual_seed(0)
    model = HardCodedBatch().double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 4, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=loss_fn)
    captured = pipe.program.captured
    assert not captured.dynamic_batch and captured.captured_batch_size == 4
    assert any("static" in note for note in captured.notes)
    loss = pipe.step(x, target=y)
    ref_loss, grads = reference_step(reference, (x,), {}, y, loss_fn, 2)
    assert torch.allclose(loss, ref_loss, rtol=1e-12)
    assert_grads_equal(pipe, grads)
    with torch.no_grad():  # a full batch is run in chunks of the captured size
        torch.testing.assert_close(pipe(x), torch.cat([reference(x[:4]), reference(x[4:])]))


def test_fx_capture_matches_unsplit_model():
    torch.manual_seed(0)
    model = zoo.ResidualCNN(width=4, blocks=3, classes=3).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    loss_fn = nn.functional.cross_entropy
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=loss_fn, capture="fx")
    assert pipe.program.captured.method == "fx"
    assert pipe.program.captured.dynamic_batch
    loss = pipe.step(x, target=y)
    ref_loss, grads = reference_step(reference, (x,), {}, y, loss_fn, 2)
    assert torch.allclose(loss, ref_loss, rtol=1e-12)
    assert_grads_equal(pipe, grads)
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, reference.state_dict()[key]), key


def test_transformers_models_capture_with_dynamic_batch():
    for name in ("gpt2", "bert", "llama", "t5", "vit"):
        case = CASES[name]()
        captured = capture(case.model, case.args, case.kwargs)
        assert captured.dynamic_batch, name
        assert captured.output_names, name


def test_a_function_is_refused_with_what_was_passed_and_how_to_wrap_it():
    def double(x):
        return x * 2

    x = torch.randn(4, 3)
    for example in ((x,), ()):  # planned now, and lazily at the first step
        with pytest.raises(pc.ConfigError, match=r"got the function '.*double'; wrap it in a "
                                                 r"module whose forward calls it"):
            pc.compile(double, example, devices=2)
    with pytest.raises(pc.ConfigError, match=r"got int 3; pass the model \(an nn.Module\)"):
        pc.compile(3, (x,), devices=2)
    with pytest.raises(pc.ConfigError, match="capture_budget must be a positive number"):
        pc.compile(nn.Linear(3, 3), (x,), devices=2, capture_budget=0)


def test_flat_graph_returns_the_outputs_as_one_flat_tuple_in_order():
    class Nested(nn.Module):
        def forward(self, x):
            return {"a": x + 1, "b": (x * 2, x - 1)}

    traced = torch.fx.symbolic_trace(Nested())
    graph = flat_graph(traced.graph, drop_guards=True)
    out = torch.fx.GraphModule(traced, graph)(torch.ones(2))
    assert isinstance(out, tuple) and [t.tolist() for t in out] == [[2, 2], [2, 2], [0, 0]]
    assert output_names(graph) == ("add", "mul", "sub")


def test_the_capture_folder_names_each_of_its_modules():
    import pipecompile.capture as folder

    from tests.support.folders import unlisted

    assert unlisted(folder) == []
