"""passes/opaque_causes.py: a custom autograd.Function (reversible residual layers: forward under
no_grad, backward recomputing the inputs) is kept as an opaque module running the Function with
its own backward, exact against the unsplit model; applied in the root, or with opaque=False, it
is refused naming the module. Writes through `.data` are found by module and line."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import Function

import pipecompile as pc
from pipecompile.capture.capture import capture
from pipecompile.capture.opaque_causes import data_kept, data_writes, watching_functions
from tests.support import capture_models
from tests.support.capture_models import ClampedNet, RevNet
from tests.support.reference import assert_grads_equal, reference_step

_APPLY_LINE = inspect.getsourcelines(capture_models.RevBlock.forward)[1] + 1
_FILE = capture_models.__file__
_WHY = (f"custom autograd.Function Reversible at {_FILE}:{_APPLY_LINE} (kept with its own "
        f"backward)")


def _revnet(**kwargs):
    torch.manual_seed(0)
    model = RevNet(**kwargs).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    return model, x, torch.randn(8, 2, dtype=torch.float64)


def test_the_module_applying_a_function_is_recorded_and_apply_restored():
    model, x, _ = _revnet(layers=2, in_root=True)
    torch_apply = Function.__dict__["apply"].__func__
    found: dict[str, str] = {}
    with watching_functions(model, found):
        assert Function.__dict__["apply"].__func__ is not torch_apply
        model(x)
    root_line = inspect.getsourcelines(RevNet.forward)[1] + 6
    assert found == {"blocks.0": _WHY, "blocks.1": _WHY, "": _WHY.replace(
        f":{_APPLY_LINE}", f":{root_line}")}
    assert Function.__dict__["apply"].__func__ is torch_apply  # torch's own again


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_reversible_layers_stay_opaque_and_train_exactly(schedule):
    model, x, y = _revnet()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule=schedule,
                      loss_fn=F.mse_loss)
    captured = pipe.program.captured
    calls = [n.target for n in captured.module.graph.nodes if n.op == "call_module"]
    assert calls == [f"blocks.{i}" for i in range(4)]
    assert f"opaque module 'blocks.3' (RevBlock): {_WHY}" in pipe.explain()
    loss = pipe.step(x, target=y)  # today's main: "element 0 of tensors does not require grad"
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, F.mse_loss, 2)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-12)) == len(ref_grads) == 20


def test_a_function_applied_in_the_root_or_with_opaque_false_is_refused_by_name():
    model, x, _ = _revnet(layers=2, in_root=True)
    with pytest.raises(pc.CaptureError, match=(
            r"torch.export cannot capture RevNet: module '<root>' \(RevNet\) custom "
            r"autograd.Function Reversible at .*capture_models.py:\d+ .*move that code into a "
            r"submodule")):
        pc.compile(model, (x,), devices=2, loss_fn=F.mse_loss)
    model, x, _ = _revnet(layers=2)
    with pytest.raises(pc.CaptureError, match=(
            r"module 'blocks.0' \(RevBlock\) custom autograd.Function Reversible at .*; "
            r"capture\(..., opaque=True\) keeps it opaque")):
        capture(model, (x,), opaque=False)


def test_data_writes_name_the_module_and_line_and_leave_the_weights_alone():
    torch.manual_seed(0)
    model = ClampedNet()
    with torch.no_grad():
        model.b.weight.mul_(10)  # well outside the clamp's range
    before = model.b.weight.detach().clone()
    line = inspect.getsourcelines(capture_models._ClampedLinear.forward)[1] + 2
    assert data_writes(model, (torch.randn(2, 4),), {}) == {"b": (
        f"uses the .data of 'b.weight' at {_FILE}:{line} (torch.export cannot capture writes "
        f"through .data)")}
    with data_kept(model):
        model(torch.randn(2, 4))
    assert torch.equal(model.b.weight, before)
    model(torch.randn(2, 4))  # outside: the model's own clamp
    assert model.b.weight.abs().max() <= 0.3


def test_reformer_reversible_encoder_is_kept_whole_and_trains_exactly():
    """transformers' Reformer runs all its layers through one `_ReversibleFunction` from the
    encoder's forward (which returns None for the outputs not asked for)."""
    from transformers import ReformerConfig, ReformerModelWithLMHead

    torch.manual_seed(0)
    cfg = ReformerConfig(vocab_size=32, hidden_size=16, num_attention_heads=2,
                         attention_head_size=8, attn_layers=["local", "local"],
                         feed_forward_size=32, axial_pos_embds=False, max_position_embeddings=16,
                         local_attn_chunk_length=4, is_decoder=True, use_cache=False,
                         hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
                         chunk_size_lm_head=0, pad_token_id=0)
    model = ReformerModelWithLMHead(cfg).double()
    reference = copy.deepcopy(model)
    ids, labels = torch.randint(1, 32, (4, 8)), torch.randint(1, 32, (4, 8))

    def loss_fn(out, y):
        return F.cross_entropy(out.logits.reshape(-1, 32), y.reshape(-1))

    pipe = pc.compile(model, (ids,), devices=2, microbatches=2, schedule="gpipe",
                      loss_fn=loss_fn, symbolic_sizes="batch")
    assert "opaque module 'reformer.encoder' (ReformerEncoder): custom autograd.Function " \
           "_ReversibleFunction at " in pipe.explain()
    loss = pipe.step(ids, target=labels)  # today's main: "element 0 of tensors does not ..."
    ref_loss, ref_grads = reference_step(reference, (ids,), {}, labels, loss_fn, 2)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-12)) == len(ref_grads)


class _Coefficients(nn.Module):
    """Gemma3n's AltUp in small: a method other than forward (called by its parent's forward)
    clamps the weight through `.data` in train mode."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) * 0.2)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.weight.data.clamp_(-0.3, 0.3)
        return x @ self.weight


class _PredictingLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.coefficients = _Coefficients(dim)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(self.coefficients.predict(x)))


def test_a_data_write_outside_forward_keeps_the_calling_module_opaque_and_trains_exactly():
    """The module whose method writes `.data` is never called (its forward hooks never run), so
    it cannot be kept opaque: the innermost module being called around it is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _PredictingLayer(4), _PredictingLayer(4),
                          nn.Linear(4, 2)).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    line = inspect.getsourcelines(_Coefficients.predict)[1] + 2
    found = data_writes(model, (x,), {})
    assert found == {f"{i}": (
        f"uses the .data of '{i}.coefficients.weight' at {__file__}:{line} (in "
        f"'{i}.coefficients', not through its forward) (torch.export cannot capture writes "
        f"through .data)") for i in (1, 2)}
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), (x,), {}, y, F.mse_loss, 2)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b",
                      loss_fn=F.mse_loss, symbolic_sizes="batch")
    assert sum("opaque module" in line for line in pipe.explain().splitlines()) == 2
    loss = pipe.step(x, target=y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert sorted(assert_grads_equal(pipe, ref_grads)) == sorted(ref_grads)
