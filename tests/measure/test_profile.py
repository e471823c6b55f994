"""measure/profile.py: every block timed for real on one micro-batch (a block with 2**16 times
the FLOPs takes longer), the other costs kept, and the model's buffers and random state left as they
were; `record_values` gives every node's value on a real run."""

from __future__ import annotations

import torch
from torch import nn

from pipecompile.capture.capture import capture
from pipecompile.measure import profile
from pipecompile.passes.annotate import annotate
from pipecompile.passes.linearize import linearize


class _Uneven(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.big = nn.Sequential(nn.Linear(8, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 8))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.big(torch.tanh(self.norm(self.small(x)))))


def _linear():
    torch.manual_seed(0)
    model = _Uneven()
    x = torch.randn(64, 8)
    return model, x, linearize(capture(model, (x,)), granularity="layer")


def test_blocks_are_timed_and_the_model_is_left_as_it_was():
    _, x, linear = _linear()
    costs = annotate(linear, microbatch_size=16)
    gm = linear.captured.module
    buffers = {n: b.clone() for n, b in gm.named_buffers()}
    rng = torch.get_rng_state()
    measured = profile.profile_blocks(linear, costs, (x,), {}, microbatches=4, repeats=3)
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew from a forked generator
    for name, value in gm.named_buffers():  # batch norm's statistics did not move
        assert torch.equal(value, buffers[name]), name
    assert all(b.measured for b in measured.blocks)
    assert not any(b.measured for b in costs.blocks)  # the input table is not changed
    assert all(b.forward_time > 0 for b in measured.blocks)
    # what was not timed is kept: FLOPs, bytes, cut sizes
    assert [b.forward_flops for b in measured.blocks] == [b.forward_flops for b in costs.blocks]
    assert measured.cut_bytes == costs.cut_bytes
    names = [b.name for b in linear.blocks]
    small, big = names.index("small"), names.index("big.1")  # Linear(8, 8), Linear(2048, 2048)
    flops = measured.blocks[big].forward_flops / measured.blocks[small].forward_flops
    assert flops == 2**16
    # 2**16 times the FLOPs (~0.1 GFLOP): longer in forward and backward, whatever else runs on
    # the machine
    assert measured.blocks[big].forward_time > measured.blocks[small].forward_time
    assert measured.blocks[big].backward_time > measured.blocks[small].backward_time


def test_record_values_gives_every_node_value_of_a_real_run():
    model, x, linear = _linear()
    gm = linear.captured.module
    flat = linear.captured.flatten_inputs((x[:16],), {})
    buffers = {n: b.clone() for n, b in gm.named_buffers()}
    state = torch.get_rng_state()
    values = profile.record_values(gm, flat)
    assert set(values) == {n.name for n in gm.graph.nodes}
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(b, buffers[n]) for n, b in gm.named_buffers())
    # the same run as the graph's own (train mode: batch statistics, the same dropout mask)
    with torch.no_grad():
        direct = gm(*flat)[0]
    torch.set_rng_state(state)
    assert torch.equal(values["dropout"], direct)
    by_hand = torch.tanh(torch.nn.functional.batch_norm(
        model.small(x[:16]), None, None, model.norm.weight, model.norm.bias, training=True))
    torch.testing.assert_close(values["tanh"], by_hand)
    assert not values["tanh"].requires_grad  # recorded without autograd
    profile.sync_device()  # a no-op without CUDA
