"""passes/flops: the CPU's fused attention counted as torch counts the GPU's."""

from __future__ import annotations

import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from pipecompile.capture.capture import capture
from pipecompile.passes.annotate import symbolic_block_costs
from pipecompile.passes.flops import flop_counter
from pipecompile.passes.linearize import linearize


def test_cpu_attention_forward_and_backward_are_counted():
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    with flop_counter() as counter:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    forward = 4 * 2 * 4 * 16 * 16 * 8  # QK^T and PV: 2 x (2 b h s s d), as torch counts fused ones
    assert plain.get_total_flops() == 0  # why this module exists (torch 2.13)
    assert counter.get_total_flops() == forward + 2.5 * forward


class Attention(nn.Module):
    def forward(self, x):  # x: [batch, heads 2, seq 16, dim 8]
        return F.scaled_dot_product_attention(x, x, x).relu()


def test_a_block_costed_on_the_cpu_counts_its_attention_in_the_batch():
    captured = capture(Attention(), (torch.randn(4, 2, 16, 8),), {})
    linear = linearize(captured)
    b = captured.batch_symbol
    costs = symbolic_block_costs(linear)
    flops = sum((c.forward_flops for c in costs), sympy.Integer(0))
    assert sympy.expand(flops - 4 * b * 2 * 16 * 16 * 8) == 0
