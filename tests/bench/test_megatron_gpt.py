"""bench/_megatron_gpt.py: the Zero Bubble paper's GPT as Megatron-LM's kernels ran it (no
FlashAttention: the b x heads x s x s scores go through HBM), as the kernel model records it."""

from __future__ import annotations

import sys
from pathlib import Path

import sympy

import pipecompile as pc
from pipecompile.passes.annotate import PricedBlockCost

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _megatron_gpt import megatron_gpt  # noqa: E402


def test_megatron_attention_moves_the_score_matrix_and_gelu_is_one_kernel():
    b, heads, s, hidden = 2, 4, 64, 32
    model, args, kwargs = megatron_gpt(2, hidden, heads, b, seq=s, vocab=128)
    plan = pc.compile(model, args, kwargs, devices=[pc.preset("a100")] * 2, schedule="gpipe",
                      microbatches=1).plan
    sizes = plan.costs.sizes
    value = lambda e: float(sympy.sympify(e).subs(dict(sizes)))  # noqa: E731
    costs = plan.costs.symbolic
    assert all(isinstance(c, PricedBlockCost) for c in costs)
    gemms = [g for c in costs for g in c.kernels.gemms]
    moves = [(value(nbytes), n) for c in costs for nbytes, n in c.kernels.moves]
    assert not any(c.kernels.flash for c in costs)  # no FlashAttention: unfused
    scores = b * heads * s * s
    # per layer, the two batched GEMMs over the scores: QK^T (s x s out, inner d), PV (inner s)
    batched: dict[tuple[float, ...], int] = {}
    for m, n, k, bt, _, count in gemms:
        if value(bt) > 1:
            shape = (value(m), value(n), value(k), value(bt))
            batched[shape] = batched.get(shape, 0) + count
    d = hidden // heads
    assert batched == {(s, s, d, b * heads): 2, (s, d, s, b * heads): 2}
    # softmax: bf16 scores in, probabilities out; dropout: in, out and its one-byte mask
    assert sum(n for nbytes, n in moves if nbytes == 2 * 2 * scores) == 2
    assert sum(n for nbytes, n in moves if nbytes == 5 * scores) == 2
    # one GELU kernel per layer over the (b s, 4 hidden) activations, bf16 in and out
    assert sum(n for nbytes, n in moves if nbytes == 2 * 2 * b * s * 4 * hidden) == 2
