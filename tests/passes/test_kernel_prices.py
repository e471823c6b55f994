"""Kernels priced by their shape on a chip, against values worked out by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import sympy

from pipecompile.passes.kernel_prices import (
    CHIPS,
    Attention,
    Chip,
    ADAMW_PASSES,
    adam_passes,
    master_weights_passes,
    attention_efficiency,
    attention_seconds,
    cross_entropy_bytes,
    embedding_bytes,
    matmul_efficiency,
    matmul_seconds,
    memory_seconds,
    mixed_precision_bytes,
    mixed_precision_optimizer_seconds,
    optimizer_seconds,
    softmax_bytes,
    TORCH_CLIP_PASSES,
    TYPICAL_OVER_BEST,
)
from pipecompile.passes.kernels import HardwareRates, Kernels

# 100 SMs of 1 TFLOP/s each at ceiling 1, 1 TB/s at 100 %, one 128 x 128 tile, 1 us launch
TOY = Chip("toy", 100, (("bfloat16", 100e12),), 1e12, ceiling=1.0,
           attention=Attention(0.5, 0.4), memory_efficiency=1.0, launch=1e-6,
           tiles=((128, 128),))


def test_a_gemm_of_whole_waves_runs_at_the_ceiling():
    # 1280 x 1280 outputs = 100 tiles = one wave; 2 * 128 * 128 * 4096 FLOPs per SM at 1e12
    seconds = matmul_seconds(TOY, 1280, 1280, 4096)
    assert seconds == pytest.approx(2 * 128 * 128 * 4096 / 1e12)
    assert matmul_efficiency(TOY, 1280, 1280, 4096) == pytest.approx(1.0)


def test_tile_and_wave_quantisation_waste_what_they_round_up():
    # 1281 rows need 11 row tiles: 110 tiles = 2 waves for 1281/1280 of one wave's work
    assert matmul_seconds(TOY, 1281, 1280, 4096) == pytest.approx(2 * 2 * 128 * 128 * 4096 / 1e12)
    assert matmul_efficiency(TOY, 1281, 1280, 4096) == pytest.approx(1281 / 2560)
    # the best tile is taken: a 256 x 128 tile would need 5 x 10 = 50 tiles, one wave
    both = replace(TOY, tiles=((128, 128), (256, 128)))
    assert matmul_seconds(both, 1280, 1280, 4096) == pytest.approx(2 * 128 * 128 * 4096 / 1e12)


def test_a_few_rows_make_a_gemm_memory_bound():
    # m = 8: the 4096 x 4096 weight (32 MiB in bf16) dominates: bytes / bandwidth; in
    # 128 x 128 tiles 32 tiles split K 3 ways over the 100 SMs, 44.7 us of padded rows
    small = replace(TOY, tiles=((128, 128), (64, 64)))
    assert matmul_seconds(TOY, 8, 4096, 4096) == pytest.approx(
        2 * 128 * 128 * math.ceil(4096 / 3) / 1e12)
    seconds = matmul_seconds(small, 8, 4096, 4096)  # 64 tiles of 64 x 64: 33.6 us of FLOPs
    assert seconds == pytest.approx((8 * 4096 + 4096 * 4096 + 8 * 4096) * 2 / 1e12)
    assert matmul_efficiency(small, 8, 4096, 4096) == pytest.approx(
        2 * 8 * 4096 * 4096 / seconds / 100e12)  # 8 % of peak


def test_a_tiny_kernel_costs_its_launch():
    assert matmul_seconds(TOY, 16, 16, 16) == 1e-6
    assert memory_seconds(TOY, 1000) == 1e-6
    assert memory_seconds(TOY, 1e9) == pytest.approx(1e-3)


def test_attention_efficiency_by_sequence_causal_mask_head_dimension_and_fill():
    # 200 heads x 16 query tiles (s = 2048) fill 100 SMs in 32 whole waves; n = 16 key blocks
    non_causal = attention_efficiency(TOY, 200, 2048, 2048, 128, causal=False, backward=False)
    assert non_causal == pytest.approx(0.5 * 16 / 17)
    causal = attention_efficiency(TOY, 200, 2048, 2048, 128, causal=True, backward=False)
    assert causal == pytest.approx(0.5 * 16 / 19)
    backward = attention_efficiency(TOY, 200, 2048, 2048, 128, causal=False, backward=True)
    assert backward == pytest.approx(0.4 * 16 / 17)
    # head dimension 64: 64 (128 + 16) / (128 (64 + 16)) = 0.9 of the head-128 rate
    small = attention_efficiency(TOY, 200, 2048, 2048, 64, causal=False, backward=False)
    assert small == pytest.approx(0.9 * non_causal)
    # 10 heads x 16 tiles = 160 tiles: 2 waves of 100 SMs, 0.8 filled
    few = attention_efficiency(TOY, 10, 2048, 2048, 128, causal=False, backward=False)
    assert few == pytest.approx(0.8 * non_causal)
    seconds = attention_seconds(TOY, 200, 2048, 2048, 128, causal=True, backward=True)
    flops = 4 * 200 * 2048 * 2048 * 128 / 2 * 2.5
    assert seconds == pytest.approx(flops / (0.4 * 16 / 19 * 100e12))


def test_the_optimizer_step_and_clipping_move_their_bytes():
    # AdamW: 2 x parameters + gradients + 2 x state; torch's clipping: 6 x gradients (measured)
    assert optimizer_seconds(1e12, 2e9, 2e9, 4e9, clip=False) == pytest.approx(14e-3)
    assert optimizer_seconds(1e12, 2e9, 2e9, 4e9) == pytest.approx(26e-3)


def test_torchs_adam_step_is_priced_by_the_kernels_it_runs():
    """torch.optim.AdamW's foreach (default) step: p read and written twice (the decoupled
    weight decay, then addcdiv), g read twice (lerp, addcmul), the two moments 8 times and the
    denominator 6 (sqrt, divide, add eps, read by addcdiv): 20 accesses of the parameter's
    size where the fused kernel makes 7 (adam_passes' docstring)."""
    assert adam_passes(fused=True, weight_decay=0.01) == ADAMW_PASSES == (2, 1, 2)
    foreach = adam_passes(fused=False, weight_decay=0.01, decoupled=True)
    assert foreach == (4, 2, 7)
    assert foreach[0] + foreach[1] + 2 * foreach[2] == 20  # state = two moments
    assert adam_passes(fused=False) == (2, 2, 7)  # Adam without weight decay
    assert adam_passes(fused=False, weight_decay=0.1, decoupled=False) == (3, 4, 7)
    # a bf16 AdamW over 1e9 parameters at 1 TB/s, with torch's clipping: (20 + 6) x 2 bytes
    assert optimizer_seconds(1e12, 2e9, 2e9, 4e9, passes=foreach) == pytest.approx(52e-3)


def test_master_weights_are_priced_as_megatrons_mixed_precision_step():
    """fp32 master weights and moments (12 bytes of state) of bf16 parameters: the parameter
    written once, the gradient read once, 36 bytes over the state, 12 of torch's 16-bit
    clipping: 52 bytes a parameter, mixed_precision_bytes without a loss scale."""
    passes = master_weights_passes(2)
    assert passes == (1, 1, 3.0)
    assert 2 * passes[0] + 2 * passes[1] + 12 * passes[2] + TORCH_CLIP_PASSES * 2 == 52
    assert mixed_precision_bytes(model_bytes=2, loss_scale=False) == 52


def test_megatrons_mixed_precision_optimizer_moves_its_bytes_per_parameter():
    # fp16: grads to fp32 (2 + 4), unscale (4 + 4), norm + scale (3 x 4), Adam (7 x 4),
    # master weights back (4 + 2)
    assert mixed_precision_bytes() == 6 + 8 + 12 + 28 + 6 == 60
    assert mixed_precision_bytes(loss_scale=False) == 52  # bf16: no loss scale
    assert mixed_precision_bytes(loss_scale=False, clip=False) == 40
    assert mixed_precision_bytes(model_bytes=4, loss_scale=False, clip=False) == 44
    # a 1e9-parameter stage at 1 TB/s: 60 ms; a bf16 fused AdamW with torch's clipping: 26 ms
    assert mixed_precision_optimizer_seconds(1e12, 1e9) == pytest.approx(60e-3)
    assert optimizer_seconds(1e12, 2e9, 2e9, 4e9) == pytest.approx(26e-3)


def test_the_presets_constants():
    a100, h100 = CHIPS["a100"], CHIPS["h100"]
    assert (a100.sms, h100.sms) == (108, 132)
    # MAMF's best cuBLAS BF16 GEMM times the typical-over-best ratio measured on the H200
    assert a100.ceiling * 312e12 == pytest.approx(267.9e12 * TYPICAL_OVER_BEST)
    assert TYPICAL_OVER_BEST == pytest.approx(0.71 / 0.8006, rel=1e-3)
    assert h100.ceiling == 0.71  # measured: the median GEMM of published layers on an H200
    assert CHIPS["h200"].ceiling == h100.ceiling and CHIPS["h200"].sms == 132
    assert a100.bandwidth == pytest.approx(0.6215 * 2039e9, rel=1e-3)  # 0.97 of 1.555 TB/s
    # a GPT-3 1.5B MLP GEMM (6144 tokens x 2304 -> 9216) on the A100: 1296 tiles of 128 x 128
    # (48 x 27 of 256 x 128) in 12 whole waves: the ceiling
    assert matmul_efficiency(a100, 6144, 9216, 2304) == pytest.approx(a100.ceiling)


def test_kernels_by_shape_split_forward_and_backward_by_kind():
    m, n, k = sympy.symbols("m n k")
    kernels = Kernels(launches=3, gemms=((m, n, k, sympy.Integer(1), 2, 1),),
                      flash=((sympy.Integer(200), sympy.Integer(2048), sympy.Integer(2048),
                              sympy.Integer(128), True, 1),),
                      moves=((sympy.Integer(10**9), 2),))
    sizes = {m: 1280, n: 1280, k: 4096}
    value = lambda e: float(sympy.sympify(e).subs(sizes))  # noqa: E731
    rates = HardwareRates(1.0, 1.0, 1.0, chip=TOY, dtype="bfloat16")
    gemm = 2 * 1280 * 1280 * 4096
    forward, backward = kernels.parts(2 * gemm + 2.5 * 0, rates, value)
    assert forward.matmul == pytest.approx(gemm / 100e12)
    assert forward.attention == pytest.approx(
        attention_seconds(TOY, 200, 2048, 2048, 128, causal=True, backward=False))
    assert forward.memory == pytest.approx(2 * 1e-3) and forward.launch == 0.0
    # backward: dX (1280 x 4096, inner 1280) and dW (4096 x 1280, inner 1280): 320 tiles
    # each, 4 waves of 100 SMs (0.8 of the ceiling)
    assert backward.matmul == pytest.approx(2 * 4 * 2 * 128 * 128 * 1280 / 1e12)
    assert backward.memory == pytest.approx(4 * 1e-3)
    assert kernels.times(2 * gemm, rates, value) == (pytest.approx(forward.total),
                                                     pytest.approx(backward.total))
    # frozen weights: autograd runs half the backward GEMMs
    assert kernels.parts(gemm, rates, value)[1].matmul == pytest.approx(backward.matmul / 2)
    assert math.isclose(forward.total, forward.matmul + forward.attention + forward.memory)


def test_softmax_over_a_row_longer_than_shared_memory_reads_it_twice():
    """torch's SoftMax.cu as measured on an H200: a row of 32,000 fp32 (125 KB > 48 KB of
    shared memory) is read twice and written once; a 1024-element bf16 row (the warp kernel)
    and a 4096-element bf16 row (cached in shared memory) are read once. Backward reads the
    gradient and the output once, then writes; softmax (not log) first writes grad x output."""
    assert softmax_bytes(10, 32000, 4) == 10 * 32000 * (2 * 4 + 4)
    assert softmax_bytes(10, 1024, 2) == 10 * 1024 * (2 + 2)
    assert softmax_bytes(10, 4096, 2) == 10 * 4096 * (2 + 2)
    assert softmax_bytes(10, 32000, 4, backward=True) == 10 * 32000 * (4 + 4 + 4)
    assert softmax_bytes(10, 32000, 4, backward=True, log=False) == 10 * 32000 * (12 + 12)
    assert softmax_bytes(10, 1024, 2, backward=True) == 10 * 1024 * (2 + 2 + 2)
    assert softmax_bytes(10, 32000, 2, 4) == 10 * 32000 * (2 * 2 + 4)  # bf16 in, fp32 out


def test_cross_entropy_is_log_softmax_then_nll_whose_backward_zero_fills_the_logits():
    rows, classes = 2048, 256000
    logits = rows * classes
    targets = rows * (8 + 4)
    assert cross_entropy_bytes(rows, classes, 4) == 12 * logits + targets + 4
    # zero-filled gradient (4) + log-softmax's backward (gradient, output, written: 12)
    assert cross_entropy_bytes(rows, classes, 4, backward=True) == 16 * logits + targets


def test_an_embedding_reads_its_rows_and_its_backward_zero_fills_the_table():
    n, width, table = 2048, 3072, 256000
    assert embedding_bytes(n, width, table, 2) == n * 8 + 2 * n * width * 2
    assert embedding_bytes(n, width, table, 2, backward=True) == (
        table * width * 2 + n * 32 + n * width * (2 * 2 + 2 * 4))


def _output_layer_and_loss(chip: Chip, tokens: int, hidden: int, vocab: int) -> tuple[float, float]:
    """Forward and backward seconds of an untied output layer, the cast of its bf16 logits to
    fp32 and torch's cross-entropy, as the kernel model prices transformers' causal LM loss."""
    logits = tokens * vocab
    cast = memory_seconds(chip, logits * 6)  # read bf16, write fp32; backward: one cast back
    forward = (matmul_seconds(chip, tokens, vocab, hidden) + cast
               + memory_seconds(chip, cross_entropy_bytes(tokens, vocab, 4)))
    backward = (matmul_seconds(chip, tokens, hidden, vocab)  # dX = dY W
                + matmul_seconds(chip, hidden, vocab, tokens)  # dW = X^T dY
                + cast + memory_seconds(chip, cross_entropy_bytes(tokens, vocab, 4,
                                                                  backward=True)))
    return forward, backward


@pytest.mark.parametrize("tokens, measured", [(2048, 56.6e-3), (4096, 111.3e-3)])
def test_a_large_vocabulary_output_layer_and_loss_on_the_a100_is_priced_as_measured(
        tokens, measured):
    """Yeung et al. 2024 (arXiv 2411.05288; sail-sg/VocabularyParallelism at 6191c3b,
    artifact/exp_one_host.csv, the layer-redistribution rows): on an A100 the last stage of
    Megatron-LM's GPT (hidden 3072, vocabulary 256,000, fp16) holding no layer, only the final
    norm, the output layer and the loss, ran forward + backward of one sequence of 2048
    tokens in 26.0 + 30.5 ms, of 4096 in 52.7 + 58.6 ms. The kernels differ (Megatron's loss
    does most of its work forward, torch's recomputes the softmax backward), so the sum is
    held: within 10 %."""
    forward, backward = _output_layer_and_loss(CHIPS["a100"], tokens, 3072, 256000)
    assert forward + backward == pytest.approx(measured, rel=0.10)


def test_the_unfused_torch_loss_over_256k_logits_is_not_priced_faster_than_measured():
    """Apple's ml-cross-entropy README (benchmark/__main__.py `baseline`, A100 SXM4, PyTorch
    2.4.1): `F.cross_entropy((e @ c.T` soft-capped `).float(), t)` over 8,192 tokens of Gemma 2
    (hidden 2304, vocabulary 256,000) ran forward in 81.9 ms. Priced: the GEMM, the soft cap's
    three bf16 elementwise kernels (divide, tanh, multiply: a read and a write each), the cast
    and the cross-entropy: at most 15 % slower than measured, never faster."""
    chip, tokens, vocab = CHIPS["a100"], 8192, 256000
    forward, _ = _output_layer_and_loss(chip, tokens, 2304, vocab)
    forward += 3 * memory_seconds(chip, tokens * vocab * 4)
    assert 81.9e-3 <= forward <= 1.15 * 81.9e-3
