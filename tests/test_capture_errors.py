"""capture_errors.py: a failed capture names the submodule and the line whose code stopped it,
and gives only the hints that apply."""

from __future__ import annotations

import inspect

import torch

from pipecompile.capture_errors import (
    capture_error,
    failing_submodule,
    first_line,
    opaque_reason,
)
from pipecompile.errors import CaptureError


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

    error = capture_error(WithCache(), "torch.fx", TypeError("unsupported call"), "method='export'")
    assert str(error) == ("torch.fx could not capture WithCache: unsupported call. try "
                          "method='export'; build the model with use_cache=False (a KV cache "
                          "cannot be captured).")
    assert error.details == ""
