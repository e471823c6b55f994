"""What one kernel costs on a GPU, from the kernel's shape and published kernel measurements.

Pure functions of a kernel's shape and a `Chip` (the figures of one GPU); no torch, no model:

    matmul_seconds(chip, m, n, k, batch=1)     a GEMM (M x K) @ (K x N), `batch` of them
    attention_seconds(chip, heads, s_q, s_k, d, causal=, backward=)   FlashAttention-2
    memory_seconds(chip, nbytes)               a memory-bound kernel moving `nbytes`
    optimizer_seconds(chip, param_bytes, grad_bytes, state_bytes)     AdamW + clipping
    adam_passes(fused=, weight_decay=, decoupled=)   torch's Adam / AdamW step, by kernel
    mixed_precision_optimizer_seconds(bandwidth, parameters)   Adam over fp32 master weights
    softmax_bytes(rows, row, itemsize, backward=)      torch's CUDA softmax / log-softmax
    cross_entropy_bytes(rows, classes, itemsize, backward=)   torch's cross-entropy
    embedding_bytes(indices, width, table, itemsize, backward=)   torch's embedding

Matmul (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning Performance
docs): cuBLAS splits the output into tiles (256x128, 128x256, 128x128, 64x64 here), one tile
per SM at a time. A tile computes its whole tile even where the matrix ends (tile
quantisation) and the last wave of tiles may leave SMs idle (wave quantisation); too few tiles
to fill the SMs split K over them (split-K, slices of at least 256):

    waves    = ceil(batch * ceil(M / tm) * ceil(N / tn) * splits / SMs)
    compute  = waves * tm * tn * 2 ceil(K / splits) / (ceiling * peak / SMs)    the best tile
    seconds  = max(compute, (M K + K N + M N) batch bytes / bandwidth, launch)

`ceiling` is what a whole-wave GEMM reaches on the chip: on the A100 the best cuBLAS BF16
GEMM of Bekman's MAMF finder (267.9 of 312 TFLOP/s) times TYPICAL_OVER_BEST (0.887, measured
on the H200: not on an A100); on the H100 the median, over the 93
GEMMs of published runs' layers measured on an H200 (the same GH100 compute), of the tile
model's time at a ceiling of 1 over the measured time: 0.71 (the best shape there reached
0.806, MAMF's 792.1 of 989: the best shape is not the typical one; the rows spread -32 % to
+20 % around it). A small M (few tokens) makes the GEMM read its weight for little work: the
bytes term (a roofline) then dominates.

Attention (FlashAttention-2, Dao 2023, which torch's scaled_dot_product_attention runs on the
A100; on the H100 torch's default runs cuDNN's fused attention, priced by the same shape
model at its own efficiencies, measured): a
thread block owns 128 query rows and walks the key blocks of 128; each tile pays about one key
block of fixed work (loading Q, rescaling and writing O), so with n = s / 128 key blocks

    non-causal   efficiency = top * n / (n + 1)
    causal       efficiency = top * n / (n + 1 + 2)   (blocks on the diagonal run whole)

times the SM fill of its tiles (batch * heads * ceil(s / 128) over the SMs, as for matmuls) and
a head-dimension factor d (128 + a) / (128 (d + a)), a = 16 (the softmax's non-matmul work per
score at 1/16 of the tensor-core rate, FA2 section 3.1). `top` is the long-sequence efficiency
at head dimension 128: forward and backward separately.

Memory-bound kernels move their bytes at `memory_efficiency` of the HBM bandwidth: 0.62, what
eager PyTorch's memory-bound attention kernels sustained on the A100 in FlashAttention's
Figure 2 (Dao et al. 2022: standard attention, forward + backward, 40.3 GB of HBM reads and
writes in 41.7 ms, 0.97 TB/s of the 1.5 TB/s the paper gives for its A100 40GB), not a
STREAM copy's 0.9: training's memory-bound kernels are reductions (softmax, norms), multi-
output (dropout and its mask) and strided, not plain copies. Every kernel lasts at least
`launch` seconds (a small kernel costs its launch, not its bytes).

Softmax over a long row (torch's CUDA kernels, aten/src/ATen/native/cuda/SoftMax.cu,
`host_softmax` and `host_softmax_backward`): one thread block per row. A row of at most
1024 elements and 4096 bytes runs the warp-per-row kernel, and a row that fits a block's
shared memory (`SHARED_MEMORY_PER_BLOCK`, 48 KB: 12,256 fp32 elements) is cached there
(`cunn_SoftMaxForwardSmem`), so HBM sees it once; a longer row (the logits over a
vocabulary) is read from HBM twice, as measured on an H200 (torch 2.11: log_softmax over
4096 rows of 128,256 and 256,000 fp32 or bf16 logits moves two reads and one write at 0.62
of HBM bandwidth, the memory-bound rate; three reads, one per pass of the maximum, the sum
and the output, would be 0.83). Backward (`cunn_SoftMaxBackward` for rows over 1024
elements) sums the incoming gradient, then reads it again with the output to write the
result; measured, the second read costs no HBM traffic (cross-entropy's backward moved four
passes of the logits' size at that rate, zero-fill included), so the gradient is priced
once. Softmax (not log-softmax) first multiplies the gradient by the output in a kernel of
its own. Cross-entropy is log-softmax, then NLL; NLL's backward fills a gradient of the
logits' size with zeros before scattering into it (aten/src/ATen/native/cuda/Loss.cu /
LossNLL.cu).

An embedding (aten/src/ATen/native/Embedding.cpp: `weight.index_select(0, indices)`) reads
the rows it gathers, not its table. Its backward (`embedding_dense_backward_cuda`,
aten/src/ATen/native/cuda/Embedding.cu and EmbeddingBackwardKernel.cu) zero-fills a gradient
the size of the whole table (`at::zeros({num_weights, ...})`), sorts the indices, sums the
gathered rows' gradients per index in fp32 partial sums and writes them into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["Chip", "Attention", "CHIPS", "matmul_seconds", "matmul_efficiency",
           "attention_seconds", "attention_efficiency", "memory_seconds", "optimizer_seconds", "ADAMW_PASSES", "CLIP_PASSES",
           "TORCH_CLIP_PASSES", "TYPICAL_OVER_BEST",
           "adam_passes", "master_weights_passes",
           "mixed_precision_bytes", "mixed_precision_optimizer_seconds",
           "FLASH_BLOCK", "SOFTMAX_HEAD_DIM", "softmax_bytes", "cross_entropy_bytes",
           "embedding_bytes",
           "SHARED_MEMORY_PER_BLOCK", "MEMORY_EFFICIENCY"]

#: Sustained / peak HBM bandwidth of eager memory-bound kernels (module docstring): standard
#: attention's 40.3 GB in 41.7 ms on a 1.555 TB/s A100 40GB (FlashAttention, Dao et al. 2022,
#: Figure 2 left). Measured on the A100; the H100's is assumed the same until measured.
MEMORY_EFFICIENCY = 40.3e9 / 41.7e-3 / 1555e9
#: FlashAttention-2's query and key block (rows) at head dimension 128 on A100/H100.
FLASH_BLOCK = 128
#: The softmax's non-matmul work per score, in units of head dimension (module docstring).
SOFTMAX_HEAD_DIM = 16
#: AdamW moves per parameter: reads parameter, gradient and both moments, writes parameter and
#: both moments (torch.optim.AdamW, fused or foreach, at its minimum).
ADAMW_PASSES = (2, 1, 2)  # (parameter, gradient, optimizer state) bytes, each this many times
#: Clipping by the global norm: reads every gradient for the norm, reads and writes it to scale
#: (Megatron-LM's fused multi-tensor kernels, `mixed_precision_bytes`).
CLIP_PASSES = 3
#: torch's `clip_grad_norm_` (foreach) as measured on an H200: 847 and 1094 us over 100M fp32
#: gradients in 100 tensors, 6.3-8.2 passes at the memory-bound rate; `_foreach_norm` alone
#: sustains 0.21 of HBM bandwidth, `_foreach_mul_` 0.70 (bench/gpu.py, kernels section).
TORCH_CLIP_PASSES = 6
#: Shared memory a thread block gets without opting in (CUDA C++ Programming Guide, compute
#: capabilities 8.0 and 9.0: 48 KB), which torch's softmax asks for (`sharedMemPerBlock`).
SHARED_MEMORY_PER_BLOCK = 48 * 1024
#: torch's softmax kernel: 1024 threads per row, whose warps each keep one float for the
#: block's reductions (the shared memory the row cache cannot use).
_SOFTMAX_THREADS = 1024


@dataclass(frozen=True)
class Attention:
    """Long-sequence efficiency (fraction of the dense peak) of fused attention at head
    dimension 128: forward and backward (the backward runs 2.5x the forward's FLOPs)."""

    forward: float
    backward: float


@dataclass(frozen=True)
class Chip:
    """Kernel-level figures of one GPU: SMs, dense peaks by dtype, HBM bandwidth, the best
    GEMM efficiency (`ceiling`), fused attention's efficiencies, the fraction of HBM bandwidth
    memory-bound kernels sustain and the shortest a kernel lasts (`launch`)."""

    title: str
    sms: int
    peak_flops: tuple[tuple[str, float], ...]  # dense, by torch dtype name; first: default
    memory_bandwidth: float  # bytes/s, datasheet
    ceiling: float  # best cuBLAS GEMM / dense peak
    attention: Attention
    memory_efficiency: float = MEMORY_EFFICIENCY
    launch: float = 4e-6
    tiles: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (64, 64))

    def peak(self, dtype: str | None = None) -> float:
        """Dense peak FLOP/s in `dtype` (the first listed when not listed)."""
        return dict(self.peak_flops).get(dtype or "", self.peak_flops[0][1])

    @property
    def bandwidth(self) -> float:
        """Sustained bytes/s of a memory-bound kernel."""
        return self.memory_efficiency * self.memory_bandwidth

    def with_ceiling(self, ceiling: float) -> "Chip":
        """This chip whose best GEMM sustains `ceiling` of its peak (a preset's `efficiency=`);
        attention scales with it."""
        scale = ceiling / self.ceiling
        return replace(self, ceiling=ceiling, attention=Attention(
            min(1.0, self.attention.forward * scale), min(1.0, self.attention.backward * scale)))


def matmul_seconds(chip: Chip, m: float, n: float, k: float, *, batch: float = 1,
                   dtype: str | None = None, itemsize: int = 2) -> float:
    """Seconds of `batch` GEMMs (m x k) @ (k x n) in `dtype` (module docstring)."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    per_sm = chip.ceiling * chip.peak(dtype) / chip.sms
    compute = min(_tiled(chip.sms, m, n, k, batch, tm, tn) for tm, tn in chip.tiles) / per_sm
    moved = batch * (m * k + k * n + m * n) * itemsize / chip.bandwidth
    return max(compute, moved, chip.launch)


def _tiled(sms: int, m: float, n: float, k: float, batch: float, tm: int, tn: int) -> float:
    """FLOPs one SM runs for the GEMM in tiles of tm x tn: whole tiles, whole waves; where
    the tiles leave SMs idle, K is split over them (split-K, in slices of at least 256)."""
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    splits = max(1, min(sms // tiles if tiles < sms else 1, math.ceil(k / 256)))
    return math.ceil(tiles * splits / sms) * 2 * tm * tn * math.ceil(k / splits)


def matmul_efficiency(chip: Chip, m: float, n: float, k: float, *, batch: float = 1,
                      dtype: str | None = None, itemsize: int = 2) -> float:
    """Achieved FLOP/s of that GEMM over the dense peak."""
    seconds = matmul_seconds(chip, m, n, k, batch=batch, dtype=dtype, itemsize=itemsize)
    return 2 * m * n * k * batch / seconds / chip.peak(dtype) if seconds > 0 else 0.0


def attention_efficiency(chip: Chip, heads: float, s_q: float, s_k: float, head_dim: float, *,
                         causal: bool, backward: bool) -> float:
    """Fraction of the dense peak fused attention sustains (module docstring); `heads` is
    batch x heads."""
    top = chip.attention.backward if backward else chip.attention.forward
    blocks = max(1.0, s_k / FLASH_BLOCK)
    shape = blocks / (blocks + 1 + (2 if causal else 0))
    a = SOFTMAX_HEAD_DIM
    head = min(1.0, head_dim * (FLASH_BLOCK + a) / (FLASH_BLOCK * (head_dim + a)))
    tiles = heads * math.ceil(s_q / FLASH_BLOCK)
    fill = tiles / (math.ceil(tiles / chip.sms) * chip.sms)
    return top * shape * head * fill


def attention_seconds(chip: Chip, heads: float, s_q: float, s_k: float, head_dim: float, *,
                      causal: bool, backward: bool, dtype: str | None = None) -> float:
    """Seconds of FlashAttention over `heads` (batch x heads) of `s_q` queries and `s_k` keys:
    forward 4 s_q s_k d FLOPs per head (half of them with a causal mask), backward 2.5x."""
    if heads <= 0 or s_q <= 0 or s_k <= 0:
        return 0.0
    flops = 4 * heads * s_q * s_k * head_dim * (0.5 if causal else 1.0)
    flops *= 2.5 if backward else 1.0
    rate = attention_efficiency(chip, heads, s_q, s_k, head_dim, causal=causal,
                                backward=backward) * chip.peak(dtype)
    return max(flops / rate, chip.launch)


def memory_seconds(chip: Chip, nbytes: float) -> float:
    """Seconds of a memory-bound kernel reading and writing `nbytes` (at least a launch)."""
    return max(nbytes / chip.bandwidth, chip.launch) if nbytes > 0 else chip.launch


def adam_passes(*, fused: bool, weight_decay: float = 0.0,
                decoupled: bool = True) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer state) passes of torch.optim.Adam / AdamW's step: how
    many times each is read or written, the state being both moments (module torch.optim.adam).

    `fused=True` (`_fused_adam`: one kernel per tensor group) reads p, g, m, v and writes
    p, m, v: ADAMW_PASSES. Otherwise (torch's default for CUDA parameters, `foreach`:
    `_multi_tensor_adam`; the for-loop `_single_tensor_adam` runs the same kernels per tensor)
    each line below is a kernel over every element:

        p *= 1 - lr wd           (decoupled weight decay, AdamW)   read p, write p
        g = g + wd p             (coupled weight decay, Adam)      read g, p; write g
        m.lerp_(g, 1 - b1)                                          read m, g; write m
        v *= b2                                                     read v; write v
        v.addcmul_(g, g, 1 - b2)                                    read v, g; write v
        d = sqrt(v)                                                 read v; write d
        d /= sqrt(1 - b2^t)                                         read d; write d
        d += eps                                                    read d; write d
        p.addcdiv_(m, d, -lr / (1 - b1^t))                          read p, m, d; write p

    d is one moment's size: the state (m and v, two moments) is read or written 8 moment-
    sizes and d 6, 7 passes over the state's bytes; p twice (four times with decoupled weight
    decay, three with coupled), g twice (four with coupled). AdamW with weight decay: 20
    element accesses per parameter where the fused kernel makes 7 (amsgrad not priced)."""
    if fused:
        return ADAMW_PASSES
    param, grad = 2.0, 2.0
    if weight_decay:
        param, grad = (param + 2, grad) if decoupled else (param + 1, grad + 2)
    return (param, grad, 7.0)


def master_weights_passes(model_bytes: int = 2) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer state) passes of a step over fp32 master weights and
    fp32 moments of `model_bytes` parameters (the state: 12 bytes a parameter), priced as
    Megatron-LM's mixed-precision step without a loss scale (`mixed_precision_bytes`: 52 bytes
    a bf16 parameter): the parameter written once (the master copied back), the gradient read
    once (copied to fp32), the rest (the fp32 gradient written, clipped and read by Adam; Adam
    over the fp32 master and moments; the master read for the copy back: 42 bytes) over the
    state's 12, beside the 16-bit clipping `optimizer_seconds` adds (TORCH_CLIP_PASSES)."""
    total = mixed_precision_bytes(model_bytes=model_bytes, loss_scale=False)
    rest = total - (2 + TORCH_CLIP_PASSES) * model_bytes
    return (1.0, 1.0, rest / 12)


def optimizer_seconds(bandwidth: float, param_bytes: float, grad_bytes: float,
                      state_bytes: float, *, clip: bool = True,
                      passes: tuple[float, float, float] = ADAMW_PASSES) -> float:
    """Seconds of an optimizer step over these bytes at `bandwidth` (sustained bytes/s): the
    bytes it reads and writes (`passes` over parameters, gradients and state: AdamW's fused
    minimum, ADAMW_PASSES, unless given; `adam_passes`), plus torch's clipping by the global
    norm (TORCH_CLIP_PASSES over the gradients, measured) when `clip`, as Megatron-LM and
    torchtitan step by default."""
    p, g, s = passes
    moved = p * param_bytes + g * grad_bytes + s * state_bytes
    if clip:
        moved += TORCH_CLIP_PASSES * grad_bytes
    return moved / bandwidth


def mixed_precision_bytes(*, model_bytes: int = 2, loss_scale: bool = True,
                          clip: bool = True) -> float:
    """Bytes one parameter moves in a step of Megatron-LM's mixed-precision optimizer
    (`Float16OptimizerWithFloat16Params.step`, megatron/optimizer/optimizer.py): 16-bit model
    weights and gradients of `model_bytes`, fp32 master weights and fp32 Adam moments:

        gradients to fp32 (`main_grad.float()`)          read model_bytes, write 4
        unscale + inf check (fp16's loss scale)           read 4, write 4
        clip by the global norm: norm, then scale          read 4; read 4, write 4
        Adam (apex FusedAdam over fp32)                    read 4 x 4, write 3 x 4
        master weights back to the model's                 read 4, write model_bytes

    fp16 with clipping: 60 bytes per parameter; bf16 without a loss scale: 52."""
    moved = (model_bytes + 4) + 4 * 4 + 3 * 4 + (4 + model_bytes)
    if loss_scale:
        moved += 2 * 4
    if clip:
        moved += CLIP_PASSES * 4
    return float(moved)


def mixed_precision_optimizer_seconds(bandwidth: float, parameters: float, *,
                                      model_bytes: int = 2, loss_scale: bool = True,
                                      clip: bool = True) -> float:
    """Seconds of Megatron-LM's mixed-precision optimizer step over `parameters` at
    `bandwidth` (sustained bytes/s): `mixed_precision_bytes` per parameter, every kernel
    memory-bound (multi-tensor elementwise and reductions)."""
    return parameters * mixed_precision_bytes(model_bytes=model_bytes, loss_scale=loss_scale,
                                              clip=clip) / bandwidth


def _row_cached(row: float, itemsize: int) -> bool:
    """Whether torch's softmax reads a row of `row` elements from HBM once (module docstring):
    the warp-per-row kernel, or the row cached in shared memory."""
    if row <= 1024 and row * itemsize <= 4096:
        return True
    reduction = _SOFTMAX_THREADS // 32 * 4
    return row < (SHARED_MEMORY_PER_BLOCK - reduction) / itemsize


def softmax_bytes(rows: float, row: float, itemsize: int, out_itemsize: int | None = None, *,
                  backward: bool = False, log: bool = True) -> float:
    """HBM bytes torch's CUDA (log-)softmax over the last dimension moves: `rows` rows of `row`
    elements, input of `itemsize` bytes, output (and its gradient) of `out_itemsize` (module
    docstring). Forward: the input once (twice for a row shared memory cannot hold), the
    output once. Backward: the gradient and the output read once, the input's gradient
    written; softmax adds grad x output."""
    out = out_itemsize or itemsize
    n = rows * row
    if not backward:
        return n * ((1 if _row_cached(row, itemsize) else 2) * itemsize + out)
    moved = n * (out + out + itemsize)
    return moved if log else moved + 3 * n * out


def cross_entropy_bytes(rows: float, classes: float, itemsize: int, *,
                        backward: bool = False) -> float:
    """HBM bytes of torch's cross-entropy over `rows` rows of `classes` logits of `itemsize`
    bytes (class indices as targets, no label smoothing): log-softmax then NLL (module
    docstring); the targets are int64. Backward: NLL's gradient zero-filled at the logits'
    size and scattered into, then log-softmax's backward."""
    targets = rows * (8 + itemsize)  # read each target and its logit (or write its gradient)
    if not backward:
        return softmax_bytes(rows, classes, itemsize) + targets + itemsize
    return (rows * classes * itemsize + targets
            + softmax_bytes(rows, classes, itemsize, backward=True))


def embedding_bytes(indices: float, width: float, table: float, itemsize: int, *,
                    backward: bool = False) -> float:
    """HBM bytes of torch's embedding: `indices` int64 indices into a `table` x `width` weight
    of `itemsize` bytes (module docstring). Forward: the indices, the gathered rows read and
    written. Backward: the whole table's gradient zero-filled; the indices sorted (keys and
    positions read and written, 32 bytes each); each row's gradient read, summed in fp32
    partial sums (written and read) and written into the table's gradient."""
    rows = indices * width
    if not backward:
        return indices * 8 + 2 * rows * itemsize
    return table * width * itemsize + indices * 32 + rows * (2 * itemsize + 2 * 4)


TERA = 1e12
#: The median GEMM of published runs' layers over the best GEMM of a shape sweep, measured on
#: an H200 (the H100's compute): 0.71 against the MAMF finder's best on the H100, 792.1 /
#: 989.4 (0.801; the best of the 93 shapes measured there, 0.806). The Zero Bubble paper's
#: own A100 profile (its Table 6: weight-gradient GEMMs at 0.76-0.81 of peak against MAMF's
#: 0.859) is of the same order.
TYPICAL_OVER_BEST = 0.71 / (792.1 / 989.4)
CHIPS: dict[str, Chip] = {
    # NVIDIA A100 80GB SXM4: 108 SMs (A100 whitepaper); the GEMM ceiling is MAMF's best
    # (267.9 / 312, Bekman, ml-engineering, CUDA 12.1) times TYPICAL_OVER_BEST, the typical
    # layer GEMM over the best shape as measured on the H200 (not measured on an A100: an
    # assumption); FlashAttention-2 forward up to 73 % of peak (Dao 2023, abstract: 50-73 %,
    # 230 TFLOP/s), backward up to 63 % (section 4.1)
    "a100": Chip("NVIDIA A100 80GB SXM", 108,
                 (("bfloat16", 312 * TERA), ("float16", 312 * TERA), ("float32", 19.5 * TERA)),
                 2039e9, ceiling=267.9 / 312 * TYPICAL_OVER_BEST,
                 attention=Attention(0.73, 0.63)),
    # NVIDIA H100 80GB SXM5: 132 SMs (H100 whitepaper). Measured on an H200 (the same GH100
    # compute: 132 SMs, 989.4 TFLOP/s dense BF16, 700 W; torch 2.11, CUDA 13; bench/gpu.py's
    # kernels section, two runs): the 93 GEMMs of published runs' layers (hidden 3072-12288,
    # tensor-parallel widths 1-8, forward and both gradients) sit at a median 0.70-0.72 of the
    # tile model at a ceiling of 1 (the best shape reached 0.806, Bekman's MAMF 792.1 / 989:
    # the best, not the typical); torch's default attention there is cuDNN's (the profiler's
    # kernels), at 0.54 forward and 0.49 backward once the shape factors are divided out (the
    # median over sequences 2048-8192; FlashAttention-2 alone: 0.31 and 0.28 at sequence
    # 8192, as FA3's paper says of FA2 on the H100); an eager op lasts at least 6.9 us
    "h100": Chip("NVIDIA H100 80GB SXM", 132,
                 (("bfloat16", 989.4 * TERA), ("float16", 989.4 * TERA),
                  ("float32", 66.9 * TERA), ("float8_e4m3fn", 1978.9 * TERA)),
                 3350e9, ceiling=0.71, attention=Attention(0.54, 0.49), launch=7e-6),
}
# NVIDIA H200 SXM 141GB: the H100 SXM's GH100 (132 SMs, the same dense peaks, NVIDIA H200
# datasheet) with HBM3e at 4.8 TB/s; its kernels' efficiencies are the H100's
CHIPS["h200"] = replace(CHIPS["h100"], title="NVIDIA H200 141GB SXM", memory_bandwidth=4800e9)
