"""Ops priced as a GPU runs them: matmul rooflines, fused attention (O(s) saved), bytes at
memory bandwidth; the kernels recorded while annotate runs a block on fake tensors."""

from __future__ import annotations

import pytest
import sympy
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.planner.hardware import accelerator_of
from pipecompile.passes.annotate import PricedBlockCost, symbolic_block_costs
from pipecompile.passes.kernels import FLASH_BACKWARD, HardwareRates, Kernels, is_causal_mask

RATES = HardwareRates(matmul=100e12, attention=50e12, memory=1e12, launch=1e-6)


def test_a_matmul_is_priced_by_the_slower_of_its_flops_and_its_bytes():
    f, b = sympy.Symbol("f"), sympy.Symbol("b")
    kernels = Kernels(matmuls=((f, b),), launches=1)
    compute_bound = kernels.times(0.0, RATES, lambda e: float(e.subs({f: 1e12, b: 1e9})))
    memory_bound = kernels.times(0.0, RATES, lambda e: float(e.subs({f: 1e9, b: 1e9})))
    assert compute_bound[0] == pytest.approx(1e12 / 100e12 + 1e-6)  # 10 ms > 1 ms of bytes
    assert memory_bound[0] == pytest.approx(1e9 / 1e12 + 1e-6)  # 1 ms of bytes > 10 us


def test_backward_runs_flash_backward_at_the_attention_rate_and_twice_the_memory():
    kernels = Kernels(matmuls=((sympy.Integer(10**12), sympy.Integer(0)),),
                      attention=sympy.Integer(10**11), attention_counted=sympy.Integer(2 * 10**11),
                      memory=sympy.Integer(10**9), launches=4)
    forward, backward = kernels.times(2e12 + FLASH_BACKWARD * 2e11, RATES, float)
    assert forward == pytest.approx(1e12 / 100e12 + 1e11 / 50e12 + 1e9 / 1e12 + 4e-6)
    assert backward == pytest.approx(2e12 / 100e12 + FLASH_BACKWARD * 1e11 / 50e12
                                     + 2e9 / 1e12 + 8e-6)


@pytest.fixture(scope="module")
def gpt_plan():
    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=32, layers=2, heads=4, seq=128)
    ids = torch.randint(0, 64, (4, 128))
    return pc.compile(model, (ids,), devices=[pc.preset("h100")] * 2, schedule="gpipe",
                      microbatches=1).plan


def test_attention_is_fused_on_a_gpu_preset_and_saves_no_score_matrix(gpt_plan):
    linear = gpt_plan.linear
    plain = symbolic_block_costs(linear)
    fused = symbolic_block_costs(linear, fused=True)
    layer = next(i for i, b in enumerate(linear.blocks) if b.name == "layers.0")
    cost = fused[layer]
    assert isinstance(cost, PricedBlockCost) and not isinstance(plain[layer], PricedBlockCost)
    sizes = gpt_plan.costs.sizes
    value = lambda e: float(sympy.sympify(e).subs(dict(sizes)))  # noqa: E731
    b, h, s, d = 4, 4, 128, 8
    # the counter's sdpa FLOPs (QK^T and PV, 4 b h s^2 d), halved for the causal mask
    assert value(cost.kernels.attention_counted) == 4 * b * h * s * s * d
    assert value(cost.kernels.attention) == 2 * b * h * s * s * d
    assert value(cost.activation_bytes) < 40 * b * s * 32 * 4  # O(s): (b, s, dim) tensors
    assert value(plain[layer].activation_bytes) > 0


class MaskedAttention(torch.nn.Module):
    """Attention with a causal mask built from two position ranges, as transformers builds it:
    on this CPU the math kernel saves the s x s probabilities."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(dim, 3 * dim), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (z.view(b, s, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=-1))
        positions = torch.arange(s, device=x.device)
        mask = positions[:, None] >= positions[None, :]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def test_a_range_built_mask_is_causal_and_fused_attention_drops_the_score_matrix():
    x = torch.randn(2, 64, 16)
    pipe = pc.compile(MaskedAttention(), (x,), devices=[pc.preset("a100")], schedule="gpipe",
                      microbatches=1, symbolic_sizes="all")  # the sequence length a symbol
    graph = pipe.plan.captured.module.graph
    attention = [n for n in graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(attention) == 1 and is_causal_mask(attention[0])
    assert not any(is_causal_mask(n) for n in graph.nodes if n.op == "call_function"
                   and n not in attention and "scaled_dot_product" in str(n.target))
    linear = pipe.plan.linear
    seq = next(k for k, v in pipe.plan.costs.sizes.items() if v == 64)
    plain = sympy.expand(sum(c.activation_bytes for c in symbolic_block_costs(linear)))
    fused = sympy.expand(sum(c.activation_bytes
                             for c in symbolic_block_costs(linear, fused=True)))
    # the CPU kernel keeps an s x s tensor (the mask, or the probabilities); fused: O(s)
    assert sympy.degree(plain, seq) == 2 and sympy.degree(fused, seq) == 1


def test_presets_price_attention_at_their_own_fraction_of_peak(gpt_plan):
    model = gpt_plan.device_model
    h100 = accelerator_of(pc.preset("h100"))
    assert h100 is not None and model.attention == pytest.approx(h100.attention * 66.9e12)  # fp32
    assert model.kernels is not None and model.kernels.matmul == pytest.approx(
        0.71 * 66.9e12)  # the measured GEMM's share of peak, at fp32
    assert model.kernels.chip is not None and model.kernels.dtype == "float32"


def test_each_kernel_is_recorded_with_its_shape(gpt_plan):
    """The GEMMs' shapes multiply back to the counted matmul FLOPs; attention is recorded as
    batch x heads, queries, keys, head dimension and its causal mask."""
    linear = gpt_plan.linear
    layer = next(i for i, b in enumerate(linear.blocks) if b.name == "layers.0")
    kernels = symbolic_block_costs(linear, fused=True)[layer].kernels
    sizes = gpt_plan.costs.sizes
    value = lambda e: float(sympy.sympify(e).subs(dict(sizes)))  # noqa: E731
    shaped = sum(2 * value(m) * value(n) * value(k) * value(b) * count
                 for m, n, k, b, _, count in kernels.gemms)
    assert shaped == pytest.approx(sum(value(f) for f, _ in kernels.matmuls))
    # every projection reads the 4 x 128 tokens of the micro-batch (m = 512 rows)
    assert {value(m) for m, *_ in kernels.gemms} == {512.0}
    ((heads, s_q, s_k, d, causal, count),) = kernels.flash
    assert (value(heads), value(s_q), value(s_k), value(d), causal, count) == (
        16.0, 128.0, 128.0, 8.0, True, 1)


def test_dropout_in_training_also_writes_its_one_byte_mask():
    """aten.dropout's CUDA kernel writes the output and a bool mask (read again by backward):
    bf16 in + out + mask = 5 bytes per element; in eval or at p = 0, in + out only."""
    import torch.fx as fx

    from pipecompile.passes.kernels import Recorder

    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.dropout.default, (x, 0.1, True))
    t = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    moved = []
    for args in ((t, 0.1, True), (t, 0.1, False), (t, 0.0, True)):
        recorder = Recorder(sym=lambda v: sympy.Integer(int(v)))
        recorder.record(node, args, {}, torch.empty_like(t), 0, False)
        moved += recorder.moves
    assert moved == [4 * 8 * 5, 4 * 8 * 4, 4 * 8 * 4]


def test_the_loss_over_a_vocabulary_and_a_cast_are_priced_by_the_kernels_torch_runs():
    """Cross-entropy over 32,000 fp32 logits per row: log-softmax reading each row three
    times, then NLL (kernel_prices.cross_entropy_bytes), forward and backward (`ruled`), not
    the op's inputs and outputs with twice that backward; a bf16 -> fp32 cast's backward is
    one cast back. A short softmax keeps the default (ruled by nothing)."""
    import torch.fx as fx

    from pipecompile.passes.kernel_prices import cross_entropy_bytes
    from pipecompile.passes.kernels import Recorder

    aten = torch.ops.aten
    graph = fx.Graph()
    x = graph.placeholder("x")
    loss = graph.call_function(aten.cross_entropy_loss.default, (x, x))
    cast = graph.call_function(aten.to.dtype, (x, torch.float32))
    soft = graph.call_function(aten._softmax.default, (x, -1, False))
    logits = torch.empty(8, 32000, dtype=torch.float32, device="meta")
    target = torch.empty(8, dtype=torch.long, device="meta")
    half = torch.empty(8, 32000, dtype=torch.bfloat16, device="meta")
    short = torch.empty(8, 128, dtype=torch.bfloat16, device="meta")
    recorder = Recorder(sym=lambda v: sympy.Integer(int(v)))
    recorder.record(loss, (logits, target), {}, torch.empty((), device="meta"), 0, False)
    recorder.record(cast, (half, torch.float32), {}, logits, 0, False)
    recorder.record(soft, (short, -1, False), {}, torch.empty_like(short), 0, False)
    forward = cross_entropy_bytes(8, 32000, 4)
    assert recorder.moves == [forward, 8 * 32000 * 6, 8 * 128 * 4]
    assert recorder.ruled == [(forward, cross_entropy_bytes(8, 32000, 4, backward=True)),
                              (8 * 32000 * 6, 8 * 32000 * 6)]
    kernels = recorder.kernels()
    assert kernels.loss == (forward,)  # the cross-entropy is the loss; the cast is not
    priced = kernels.parts(0.0, RATES, float)
    # backward: the ruled ops their own bytes, the short softmax twice its forward; the
    # cross-entropy's bytes named the loss, apart from the other memory-bound kernels
    assert priced[1].loss == pytest.approx(cross_entropy_bytes(8, 32000, 4, backward=True)
                                           / 1e12)
    assert priced[1].memory == pytest.approx((8 * 32000 * 6 + 2 * 8 * 128 * 4) / 1e12)
    assert priced[0].loss == pytest.approx(forward / 1e12)
    assert priced[0].memory == pytest.approx((8 * 32000 * 6 + 8 * 128 * 4) / 1e12)


def test_an_embedding_is_priced_by_the_rows_it_gathers_and_its_zero_filled_gradient():
    import torch.fx as fx

    from pipecompile.passes.kernel_prices import embedding_bytes
    from pipecompile.passes.kernels import Recorder

    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.embedding.default, (x, x))
    weight = torch.empty(1000, 64, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    recorder = Recorder(sym=lambda v: sympy.Integer(int(v)))
    recorder.record(node, (weight, ids), {}, torch.empty(4, 16, 64, device="meta",
                                                         dtype=torch.bfloat16), 0, False)
    forward = embedding_bytes(64, 64, 1000, 2)
    assert recorder.moves == [forward] and forward < 1000 * 64 * 2  # not the table
    assert recorder.ruled == [(forward, embedding_bytes(64, 64, 1000, 2, backward=True))]
