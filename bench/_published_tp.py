"""Predicted against published: runs that shard every layer with tensor parallelism (TP x PP x
DP), planned here with the run's own layout (`bench/published.py` prints this section).

Published runs (the numbers transcribed from the papers). Checked against public copies of
the tables, not the PDFs themselves: BLOOM's "about 150 TFLOPs" on BigScience's 176B model
page (bigscience.notion.site); Megatron's layers, hidden sizes and heads of 39.1B, 145.6B and
310.1B in AWS's Megatron-LM training recipes (awsome-distributed-training), and the 145.6B row
(TP 8, PP 8, 1536 GPUs, 148 TFLOP/s, 47 % of peak) in a transcription of Table 1; Llama 3's
43 % MFU at 8,192 GPUs (41 % at 16,384) in secondary summaries of the paper. The 39.1B and
310.1B throughputs (138, 155 TFLOP/s) were found in no copy here: check them against the PDF.

- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21, arXiv 2104.04473, **Table 1** (GPT models, sequence 2048, vocabulary
  51,200, A100 80GB on Selene: DGX A100 nodes, 8 GPUs on NVLink, 8 HDR InfiniBand NICs):
      39.1B   48 layers, h 8192,  64 heads, TP 8, PP 2,   512 GPUs, batch 1536: 138 TFLOP/s/GPU
      145.6B  80 layers, h 12288, 96 heads, TP 8, PP 8,  1536 GPUs, batch 2304: 148 TFLOP/s/GPU
      310.1B  96 layers, h 16384, 128 heads, TP 8, PP 16, 1920 GPUs, batch 2160: 155 TFLOP/s/GPU
  The paper's FLOP count (its equation 3) includes full activation recomputation, which
  these runs used: F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) per step, so the published
  step is F / (GPUs x TFLOP/s). Planned: `schedule="1f1b"` (PipeDream-Flush), micro-batch 1
  (m = batch / DP), `checkpoint=True`, the model as transformers' GPT-2 at that shape with
  the kernels Megatron-LM runs (these runs predate FlashAttention): the s x s scores between
  two batched GEMMs through one fused scale-mask-softmax kernel (`megatron_attention`; SC'21
  section 4.2, Megatron-LM's `FusedScaleMaskSoftmax` / `scaled_upper_triang_masked_softmax`),
  and GeLU as one kernel (Megatron's TorchScript `bias_gelu`, megatron/model/fused_bias_gelu.py:
  the bias add and the tanh GeLU in one kernel, one more for its backward; here the bias is
  in the GEMM and torch's tanh GeLU is the kernel). Not modelled: Megatron's fused bias +
  dropout + residual add (one kernel: reads x and the residual, writes the sum and the mask),
  run here as dropout then add (two: one more read and one more write of b s h, twice per
  layer). `--eager` plans transformers' eager GPT-2 instead (its tanh GeLU as eight
  elementwise kernels, scale, mask add and softmax as three: the bench before 2026-11-28).
- BigScience, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model", arXiv
  2211.05100, section 3.4 (and the BigScience 176B model page): 70 layers, h 14336, 112 heads,
  sequence 2048, vocabulary 250,880, TP 4 x PP 12 x DP 8 on 384 A100 80GB (48 nodes of 8 on
  Jean Zay: 4 NVLink links per GPU, 4 x 100 Gb/s Omni-Path per node, so 6.25 GB/s per GPU
  between nodes), global batch 2048, micro-batch 2, about 150 TFLOP/s per GPU. Megatron-
  DeepSpeed reports TFLOP/s by the same formula with recomputation (its
  `checkpoint_activations_factor` 4), which the run used; the step is F / (384 x 150e12).
  Planned as GPT-2 at that shape, eager attention as above (learned positions instead of
  ALiBi: the same matmuls),
  1F1B (DeepSpeed's pipeline schedule), m = 256 / 2 = 128, recomputation; ZeRO-1's sharded
  optimizer step is priced as a replicated one.
- Llama Team, "The Llama 3 Herd of Models", arXiv 2407.21783, **Table 4**, the 8,192-GPU row:
  405B (126 layers, h 16384, 128 heads, 8 KV heads, MLP 53248, vocabulary 128,256), TP 8 x
  CP 1 x PP 16 x DP 64 on H100 80GB, sequence 8192, batch 32 sequences per DP group (16M
  tokens), 430 TFLOP/s per GPU, 43 % BF16 MFU. MFU counts the model's FLOPs without
  recomputation; with the issue's (torchtitan's) count, (6 N + 12 L h s) per token, the
  published step is tokens x that / (8192 x 0.43 x 989.4e12). Planned: interleaved 1F1B
  (Meta's schedule is an interleaved one), virtual stages "auto", micro-batch 1 (m = 32),
  recomputation "auto" (Meta recomputes selectively), on `cluster("h100")` (NVLink inside a
  node, 400 Gb/s per GPU between: Meta's RoCE is priced as InfiniBand).

Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198: the tensor-parallel group
also splits the tokens of its norms, dropout and residuals) as each source ran it: the SC'21
Table 1 runs did not have it (it came in 2022), BLOOM's Megatron-DeepSpeed run did not
either (`sequence_parallel=False`); Llama 3 405B ran its tensor parallelism with it
(`sequence_parallel=True`; the paper's tensor parallelism cites Korthikanti et al.: check
against the PDF). `--no-sp` plans every row without it (the comparison).

Each prediction is `pipe.predicted.makespan` of `compile(model_on_meta, global_batch,
devices=cluster, data_parallel=DP, tensor_parallel=TP, ...)`: the layout's P follows (P =
GPUs / (DP x TP)), each rank's share of a layer priced by planner/tensor_costs.py, nothing
fitted to these rows. `memory_limit` is lifted (the published runs fit by construction; the
plan's memory is printed, not checked). Error = published step / predicted step - 1 (+: the
prediction is faster than published).

    python bench/_published_tp.py            # every row (python bench/published.py: all)
    python bench/_published_tp.py BLOOM      # the rows whose name contains BLOOM
    python bench/_published_tp.py Llama --no-sp   # without sequence parallelism
    python bench/_published_tp.py 39.1B --eager   # transformers' eager GPT-2 kernels
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import _common as C

import torch

sys.path.insert(0, os.path.join(C.ROOT, "examples"))

import factories  # noqa: E402

import pipecompile as pc  # noqa: E402
from pipecompile.planner.cluster import Link  # noqa: E402

A100_PEAK, H100_PEAK = 312e12, 989.4e12

# name, model (layers, hidden, heads, vocab, seq), GPUs, TP, PP, DP, batch, micro-batch,
# published TFLOP/s per GPU (with recomputation: Megatron's count) or None, published MFU
MEGATRON = [
    ("Megatron-LM 39.1B (SC'21 T1)", (48, 8192, 64, 51200, 2048), 512, 8, 2, 32, 1536, 1, 138e12),
    ("Megatron-LM 145.6B (SC'21 T1)", (80, 12288, 96, 51200, 2048), 1536, 8, 8, 24, 2304, 1,
     148e12),
    ("Megatron-LM 310.1B (SC'21 T1)", (96, 16384, 128, 51200, 2048), 1920, 8, 16, 15, 2160, 1,
     155e12),
    ("BLOOM-176B (2211.05100)", (70, 14336, 112, 250880, 2048), 384, 4, 12, 8, 2048, 2, 150e12),
]
LLAMA = ("Llama 3 405B (2407.21783 T4)", 8192, 8, 16, 64, 2048, 8192, 0.43)


def megatron_flops(layers: int, hidden: int, vocab: int, seq: int, batch: int) -> float:
    """Narayanan et al.'s FLOPs per step, recomputation included (their equation 3)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden)
                                                      + vocab / (16 * layers * hidden))


def megatron_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """Attention as Megatron-LM runs it without FlashAttention (Narayanan et al. SC'21, section
    4.2: scale, mask and softmax fused in one custom kernel, implicit causal mask): QK^T as one
    batched GEMM, one softmax kernel over the s x s scores (reads them, writes the
    probabilities; the scale and the causal mask are applied inside it, so they are no ops of
    their own here), dropout, the batched GEMM by V. For pricing on meta tensors only: the
    mask is not applied, so its values are not attention's."""
    del attention_mask, scaling, kwargs  # inside Megatron's fused softmax kernel
    probs = torch.softmax(torch.matmul(query, key.transpose(-1, -2)), dim=-1)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2), None


def _gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int, batch: int):
    """GPT-2 at the run's shape with the kernels Megatron-LM fuses (SC'21 section 4.2): GeLU
    as one kernel (torch's tanh GeLU for the fused bias + GeLU, the bias in the GEMM) and the
    fused scale-mask-softmax (`megatron_attention`); `--eager` keeps transformers' eager GPT-2
    (its tanh GeLU as eight elementwise kernels, scale, mask add and softmax as three)."""
    from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel

    eager = "--eager" in sys.argv
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq,
                        vocab_size=vocab, bos_token_id=0, eos_token_id=0, use_cache=False,
                        tie_word_embeddings=True,
                        activation_function="gelu_new" if eager else "gelu_pytorch_tanh")
    AttentionInterface.register("megatron", megatron_attention)
    # these runs predate FlashAttention: s x s scores between two batched GEMMs
    config._attn_implementation = "eager" if eager else "megatron"
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def _bloom_cluster():
    """Jean Zay as BLOOM ran on it: 48 nodes of 8 A100s, Omni-Path between nodes (4 x 100
    Gb/s per node: 6.25 GB/s per GPU, at the presets' 0.8 sustained)."""
    base = pc.cluster("a100", nodes=48, per_node=8)
    return dataclasses.replace(base, inter=Link("omni-path", 0.8 * 4 * 100e9 / 8 / 8, 20e-6))


def _plan(model, args, kwargs, devices, dp, tp, schedule, m, **extra):
    start = time.perf_counter()
    if "--no-sp" in sys.argv:
        extra["sequence_parallel"] = False
    pipe = pc.compile(model, args, kwargs, devices=devices, data_parallel=dp,
                      tensor_parallel=tp, schedule=schedule, microbatches=m,
                      memory_limit=1e15, optimizer=lambda p: torch.optim.AdamW(p), **extra)
    return pipe, time.perf_counter() - start


def rows(only: str = "") -> list[tuple]:
    """One row per published run (those whose name contains `only`): layout, published and
    predicted step, signed error."""
    out = []
    for name, (layers, h, heads, vocab, seq), gpus, tp, pp, dp, batch, micro, tflops in MEGATRON:
        if only not in name:
            continue
        model, args, kwargs = _gpt(layers, h, heads, vocab, seq, batch)
        devices = (_bloom_cluster() if "BLOOM" in name
                   else pc.cluster("a100", nodes=gpus // 8, per_node=8))
        pipe, seconds = _plan(model, args, kwargs, devices, dp, tp, "1f1b",
                              batch // dp // micro, checkpoint=True, sequence_parallel=False)
        published = megatron_flops(layers, h, vocab, seq, batch) / (gpus * tflops)
        out.append(_row(name, pipe, published, f"{tflops / 1e12:.0f} TFLOP/s (w/ recompute)",
                        seconds, (pp, dp, tp)))
    name, gpus, tp, pp, dp, batch, seq, mfu = LLAMA
    if only not in name:
        return out
    layers, hidden = 126, 16384
    model, args, kwargs = factories._llama3_on_meta(layers, hidden=hidden, mlp=53248, heads=128,
                                                    batch=batch, seq=seq)
    n = sum(p.numel() for p in model.parameters())
    pipe, seconds = _plan(model, args, kwargs, pc.cluster("h100", nodes=gpus // 8, per_node=8),
                          dp, tp, "interleaved-1f1b", batch // dp, virtual_stages="auto",
                          checkpoint="auto", sequence_parallel=True)
    published = (6 * n + 12 * layers * hidden * seq) * batch * seq / (gpus * mfu * H100_PEAK)
    out.append(_row(name, pipe, published, f"{mfu:.0%} MFU (no recompute)", seconds,
                    (pp, dp, tp)))
    return out


LAST = None  # the last row's pipeline (bench/tp_breakdown.py reads it)


def _row(name, pipe, published, source, seconds, asked) -> tuple:
    global LAST
    LAST = pipe
    lay = pipe.layout
    assert (lay.pipeline, lay.data_parallel, lay.tensor_parallel) == asked, (lay, asked)
    o = pipe.plan.resolved
    recompute = sum(o.stage_checkpoint(s) for s in range(o.num_stages))
    step = pipe.predicted.makespan
    return (name, f"PP{lay.pipeline} x DP{lay.data_parallel} x TP{lay.tensor_parallel}"
            + ("+SP" if lay.sequence_parallel else ""),
            f"{o.schedule} m={o.microbatches} v={o.virtual_stages} rc {recompute}/{o.num_stages}",
            source, f"{published:.2f}", f"{step:.2f}", f"{published / step - 1:+.1%}",
            f"{seconds:.0f}")


def main(only: str = "") -> list[float]:
    """Print the table; return the signed errors (%)."""
    print("\n## Tensor-parallel runs (TP x PP x DP), planned with the run's own layout")
    table = rows(only)
    print(C.table(table, ("run", "layout", "plan", "published", "step s published",
                          "step s predicted", "error", "plan s")))
    errors = [float(r[6].rstrip("%")) for r in table]
    print(f"mean absolute error {sum(map(abs, errors)) / len(errors):.1f} %")
    return errors


if __name__ == "__main__":
    print(f"# predicted vs published (tensor parallel); {C.machine()}, load {C.loadavg()}")
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(names[0] if names else "")
