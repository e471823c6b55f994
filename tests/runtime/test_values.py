"""runtime/values.py: boundary values' shapes at given sizes and the bytes of every message
equal those of the real tensors the stages exchange on a micro-batch."""

from __future__ import annotations

import torch
from torch import nn

from pipecompile.capture.capture import capture
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime import values


class _Skip(nn.Module):
    """Three layers; the last reads both earlier activations and an int64 index (no gradient)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        a = torch.tanh(self.l1(x))
        index = a.argmax(-1)
        b = torch.tanh(self.l2(a))
        return self.l3(b + a) * index.unsqueeze(-1)


def _program():
    torch.manual_seed(0)
    x = torch.randn(8, 5, 4)  # batch 8, sequence 5: both symbolic
    linear = linearize(capture(_Skip(), (x,), sizes="all"), granularity="layer")
    return split(linear, (0, 1, 2, 3), ["cpu"] * 3), x


def _real_values(program, mb):
    """Every boundary value on one micro-batch, by running the stages."""
    real = {"x": mb}
    with torch.no_grad():
        for stage in program.stages:
            real.update(zip(stage.outputs, stage.module(*[real[n] for n in stage.inputs])))
    return real


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def test_message_bytes_are_the_bytes_of_the_real_tensors():
    program, x = _program()
    real = _real_values(program, x.chunk(4)[0])  # 4 micro-batches of 2
    sent = values.message_bytes(program, 2)
    links = {}
    for name, src in program.producer.items():
        for dst in program.consumers[name]:
            links.setdefault((src, dst), []).append(name)
    assert set(links) == {(0, 1), (1, 2)}
    want = {}
    for (src, dst), names in links.items():
        want[(src, dst, "F")] = sum(_nbytes(real[n]) for n in names)
        # gradients flow back only for floating-point values: not for the argmax index
        want[(dst, src, "B")] = sum(_nbytes(real[n]) for n in names if real[n].is_floating_point())
    assert sent == want
    # by hand: 2 samples x 5 positions; stage 1 sends tanh, linear_1 (float32, 6 wide) and the
    # index (int64)
    assert sent[(1, 2, "F")] == 2 * 5 * (6 * 4 + 6 * 4 + 8)
    assert sent[(2, 1, "B")] == 2 * 5 * (6 * 4 + 6 * 4)


def test_value_shape_evaluates_the_symbolic_shape_at_a_call_sizes():
    program, _ = _program()
    captured = program.captured
    call = torch.randn(3, 7, 4)  # another batch and sequence length
    sizes = captured.sizes_of([call])
    real = _real_values(program, call)
    for name in program.producer:
        assert values.value_shape(program, name, sizes) == tuple(real[name].shape), name
    assert values.value_shape(program, "argmax", captured.sizes_at(2)) == (2, 5)
