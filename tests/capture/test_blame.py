"""capture_errors.py: a failed capture names the submodule and the line whose code stopped it,
and gives only the hints that apply."""

from __future__ import annotations

import inspect

import torch

from pipecompile.capture.blame import capture_error, failing_submodule, first_line, opaque_reason
from pipecompile.errors import CaptureError
from tests.support.capture_models import returns_tuple


class _Picky(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # stands for a data-dependent branch export cannot follow
            raise RuntimeError("Could not guard on data-dependent expression u0 > 0\nmore")
        return x


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(3, 3)
        self.blocks = torch.nn.ModuleList([torch.nn.Identity(), _Picky()])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x.abs() + 1))


def _failure(model, x):
    try:
        model(x)
    except RuntimeError as exc:
        return exc
    raise AssertionError("the model was expected to fail")


_LINE = inspect.getsourcelines(_Picky.forward)[1] + 2  # the raise


def test_the_failing_submodule_and_line_are_found_on_the_stack():
    model = _Outer()
    exc = _failure(model, torch.ones(2, 3))
    assert failing_submodule(model, exc) == "blocks.1"
    assert first_line(exc) == "Could not guard on data-dependent expression u0 > 0"
    assert opaque_reason(model, exc) == (
        f"Could not guard on data-dependent expression u0 > 0 at {__file__}:{_LINE}")
    # a batch size that could not stay dynamic is not a submodule's fault
    assert failing_submodule(model, RuntimeError("Constraints violated (batch)")) is None
    assert first_line(ValueError()) == "ValueError"


def test_capture_error_names_module_file_and_line_with_the_data_dependent_hint():
    model = _Outer()
    exc = _failure(model, torch.ones(2, 3))
    exc.pipecompile_details = "torch's partial graph"
    error = capture_error(model, "torch.export", exc, "method='fx'", opaque={"blocks.0": 1})
    assert isinstance(error, CaptureError)
    text = str(error)
    assert text.startswith(
        f"torch.export could not capture _Outer in module 'blocks.1' (_Picky) at "
        f"{__file__}:{_LINE}: Could not guard on data-dependent expression u0 > 0. ")
    assert "torch.where or torch.cond" in text
    assert "try method='fx'" not in text  # the data-dependent hint replaces the alternative
    assert "already kept opaque: blocks.0" in text
    assert "verbose=True" in text and error.details == "torch's partial graph"
    assert "use_cache" not in text


def test_capture_error_without_a_site_suggests_the_alternative_and_the_cache_hint():
    class WithCache(torch.nn.Module):
        class config:  # a transformers-style config
            use_cache = True

        def forward(self, x):
            return x

    error = capture_error(WithCache(), "torch.fx", TypeError("unsupported call"), "method='export'")
    line = inspect.getsourcelines(WithCache.forward)[1]
    assert str(error) == (
        f"torch.fx could not capture WithCache (no frame of the model's code on torch's stack; "
        f"WithCache.forward is at {__file__}:{line}): unsupported call. try method='export'; "
        f"build the model with use_cache=False (a KV cache cannot be captured).")
    assert error.details == ""


# -- blame by frame: decorated forwards, one class for encoder and decoder ---------------------


class _Layer(torch.nn.Module):
    def __init__(self, check: bool):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.check = check

    @returns_tuple
    def forward(self, x):
        x = self.lin(x)
        if self.check and x.sum() > -1e9:
            raise RuntimeError("Could not guard on data-dependent expression u0 > 0")
        return x


class _Stack(torch.nn.Module):
    """One class for the encoder and the decoder (as T5Stack); only the encoder checks."""

    def __init__(self, check: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(False), _Layer(check)])

    @returns_tuple
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _EncoderDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = _Stack(check=True)
        self.decoder = _Stack(check=False)

    @returns_tuple
    def forward(self, x):
        return self.decoder(self.encoder(x))


_CHECK = inspect.getsourcelines(_Layer.forward)[1] + 4  # the raise (decorator line first)


def test_a_check_in_a_decorated_encoder_layer_is_blamed_on_that_layer():
    model = _EncoderDecoder()
    exc = _failure(model, torch.ones(2, 3))
    assert failing_submodule(model, exc) == "encoder.layers.1"
    assert opaque_reason(model, exc).endswith(f" at {__file__}:{_CHECK}")
    assert f"in module 'encoder.layers.1' (_Layer) at {__file__}:{_CHECK}:" in str(
        capture_error(model, "torch.export", exc, ""))


def test_a_check_in_a_decorated_root_forward_names_the_root_file_and_line():
    class Root(_EncoderDecoder):
        @returns_tuple
        def forward(self, x):
            y = self.decoder(x)
            if y.sum() > -1e9:
                raise RuntimeError("Could not guard on data-dependent expression u1 > 0")
            return y

    model = Root()
    model.decoder.layers[1].check = False
    exc = _failure(model, torch.ones(2, 3))
    line = inspect.getsourcelines(Root.forward)[1] + 4
    assert failing_submodule(model, exc) is None  # the root cannot be kept opaque
    text = str(capture_error(model, "torch.export", exc, "capture='fx'"))
    assert f"in module '<root>' (Root) at {__file__}:{line}: Could not guard" in text
    assert "move that code into a submodule" in text and "capture='fx'" not in text


def test_a_failure_in_the_models_own_loss_says_to_compute_it_in_loss_fn():
    """A loss the model computes from `labels=` (transformers' ForCTCLoss) that export cannot
    capture: the error says to compute it in loss_fn, not to make that code traceable."""
    def ForCTCLoss(logits):  # noqa: N802 - named as transformers names it
        raise RuntimeError("aten._ctc_loss.Tensor")

    class Model(torch.nn.Module):
        def forward(self, x):
            return ForCTCLoss(x)

    exc = _failure(Model(), torch.ones(2, 3))
    text = str(capture_error(Model(), "torch.export", exc, ""))
    line = inspect.getsourcelines(ForCTCLoss)[1] + 1
    assert f"the failing code is the model's own loss (ForCTCLoss at {__file__}:{line})" in text
    assert "loss_fn" in text and "make that code traceable" not in text
    other = str(capture_error(_Outer(), "torch.export", RuntimeError("untraceable"), ""))
    assert "make that code traceable" in other and "loss_fn" not in other
