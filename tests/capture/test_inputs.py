"""inputs.py: a call's inputs checked against the compiled signature, with errors that name the
input, the dimension and the captured size."""

from __future__ import annotations

import pytest
import torch

from pipecompile.capture.capture import capture
from pipecompile.errors import ConfigError
from pipecompile.capture.inputs import batch_parts, check_inputs, compiled_signature


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.register_buffer("table", torch.zeros(5, 3))  # fixes the sequence length at 5

    def forward(self, x, *, scale):
        return (self.proj(x) + self.table) * scale


@pytest.fixture(scope="module")
def captured():
    return capture(_Scaled(), (torch.randn(2, 5, 4),), {"scale": torch.ones(2, 1, 1)})


def test_the_signature_names_the_inputs(captured):
    assert compiled_signature(captured) == "(x, *, scale)"


def test_inputs_of_the_compiled_structure_pass(captured):
    # another batch size: the batch is symbolic
    check_inputs(captured, (torch.randn(7, 5, 4),), {"scale": torch.ones(7, 1, 1)},
                 where="pipe.step()")


@pytest.mark.parametrize("args,kwargs,message", [
    ((torch.randn(2, 5, 4),), {},
     "pipe.step() is missing the keyword input 'scale'; the model was compiled with inputs "
     "(x, *, scale): pass scale=..."),
    ((torch.randn(2, 5, 4),), {"scale": torch.ones(2, 1, 1), "bias": 1.0},
     "pipe.step() got the keyword input 'bias' that the model was not compiled with; it was "
     "compiled with inputs (x, *, scale)"),
    ((torch.randn(2, 5, 4), torch.randn(2)), {"scale": torch.ones(2, 1, 1)},
     "pipe.step() got 2 positional inputs but the model was compiled with 1: inputs "
     "(x, *, scale)"),
    ((torch.randn(2, 4),), {"scale": torch.ones(2, 1, 1)},
     "pipe.step(): input 'x' has 2 dimensions but the model was compiled with 3 (shape "),
    ((torch.randn(2, 6, 4),), {"scale": torch.ones(2, 1, 1)},
     "pipe.step(): input 'x' has size 6 in dimension 1, but the model was captured with that "
     "size fixed at 5"),
])
def test_each_mismatch_is_named(captured, args, kwargs, message):
    with pytest.raises(ConfigError) as info:
        check_inputs(captured, args, kwargs, where="pipe.step()")
    assert str(info.value).startswith(message), str(info.value)


def test_batch_parts_reads_both_fit_batch_forms():
    x, y = torch.randn(2, 4), torch.zeros(2)
    args, kwargs, target = batch_parts((x, y))
    assert args == (x,) and kwargs == {} and target is y
    args, kwargs, target = batch_parts(((x, x), {"mask": x}, y))
    assert args == (x, x) and kwargs == {"mask": x} and target is y
    with pytest.raises(ConfigError, match=r"\(args, target\) or \(args, kwargs, target\)"):
        batch_parts((x,))
