"""Capture's fallbacks blame the module whose code failed: a data-dependent check in a BART
encoder layer keeps exactly those layers opaque (not the decoder, not nothing), an in-place
write through `.data` keeps its module opaque, and both train exactly; an export failure with
no way out names the forward's file and line and suggests no capture method that fails too."""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.capture.capture import capture
from tests.support import capture_models
from tests.support.capture_models import ClampedNet
from tests.support.reference import assert_grads_equal, reference_step

VOCAB = 64


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration
    from transformers.models.bart.modeling_bart import BartEncoderLayer

    class CheckedEncoderLayer(BartEncoderLayer):
        def forward(self, hidden_states, *args, **kwargs):
            if not torch.isfinite(hidden_states).all():
                raise ValueError("the encoder's hidden states are not finite")
            return super().forward(hidden_states, *args, **kwargs)

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=1,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                     decoder_ffn_dim=32, max_position_embeddings=32, use_cache=False,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = BartForConditionalGeneration(cfg).double()
    for layer in model.model.encoder.layers:
        layer.__class__ = CheckedEncoderLayer
    line = inspect.getsourcelines(CheckedEncoderLayer.forward)[1] + 1
    return model, line


def _bart_loss(out, labels):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


def test_a_check_in_bart_encoder_layers_keeps_those_layers_opaque_and_trains_exactly():
    model, line = _bart()
    reference = copy.deepcopy(model)
    ids, dec, labels = (torch.randint(3, VOCAB, (4, n)) for n in (8, 6, 6))
    pipe = pc.compile(model, (ids,), {"decoder_input_ids": dec}, devices=2, microbatches=2,
                      schedule="gpipe", loss_fn=_bart_loss, symbolic_sizes="batch")
    opaque = [n for n in pipe.program.captured.notes if n.startswith("opaque module")]
    assert opaque == [
        f"opaque module 'model.encoder.layers.{i}' (CheckedEncoderLayer): Could not guard on "
        f"data-dependent expression Eq(u0, 1) at {__file__}:{line}" for i in range(2)]
    loss = pipe.step(ids, decoder_input_ids=dec, target=labels)
    ref_loss, ref_grads = reference_step(reference, (ids,), {"decoder_input_ids": dec}, labels,
                                         _bart_loss, 2)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-12)) == len(ref_grads)


def test_an_inplace_write_through_data_keeps_its_module_opaque_and_trains_exactly():
    torch.manual_seed(0)
    model = ClampedNet().double()
    with torch.no_grad():
        model.b.weight.mul_(4)  # the clamp changes it
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b",
                      loss_fn=F.mse_loss)
    line = inspect.getsourcelines(capture_models._ClampedLinear.forward)[1] + 2
    assert (f"opaque module 'b' (_ClampedLinear): uses the .data of 'b.weight' at "
            f"{capture_models.__file__}:{line}") in pipe.explain()
    assert model.b.weight.abs().max() > 0.3  # compiling wrote nothing
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, F.mse_loss, 2)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-12)) == len(ref_grads) == 6
    assert torch.equal(model.b.weight, reference.b.weight)  # clamped by both, alike


class _Box:
    def __init__(self, t):
        self.t = t


class _Boxed(torch.nn.Module):
    """Returns an object neither torch.export nor torch.fx can capture."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return _Box(self.lin(x))


def test_an_export_failure_outside_the_model_names_its_forward_and_no_failing_method():
    line = inspect.getsourcelines(_Boxed.forward)[1]
    try:
        capture(_Boxed(), (torch.randn(4, 3),))
    except pc.CaptureError as error:
        text = str(error)
    else:
        raise AssertionError("capture was expected to fail")
    assert text.startswith(
        f"torch.export could not capture _Boxed (no frame of the model's code on torch's stack; "
        f"_Boxed.forward is at {__file__}:{line}): Found <class ")
    assert "capture='fx'" not in text  # torch.fx cannot capture it either
