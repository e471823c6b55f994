"""Predicted against published: torchtitan's FSDP2 Llama 3 runs on 64 A100 80GB, and the
pipeline-only 1F1B runs of the Zero Bubble paper on 8 A100 80GB, planned here.

Published (pytorch/torchtitan docs/performance.md, "Llama 3 performance numbers", FSDP2 only,
64 A100 80GB, local batch 1, sequence 8192, so a global batch of 64 sequences):

    8B,  selective layer activation checkpointing   2,904 tokens/s/GPU   56.8 % MFU
    70B, full activation checkpointing                331 tokens/s/GPU   51.7 % MFU

The prediction uses the planner's own pieces, nothing fitted to these numbers:
- per-block costs on `cluster("a100", nodes=8, per_node=8)` (passes/kernel_prices.py: each
  GEMM by tile and wave quantisation under the best cuBLAS rate, 0.859 of the A100's peak;
  FlashAttention-2 by sequence, mask and head dimension, forward and backward; other ops by
  their bytes at 0.9 of HBM bandwidth, at least 4 us per kernel), taken from a compile of the model with `data_parallel=64,
  fsdp=True` (one replica per GPU, no pipeline). The model is captured with 2 layers: every
  layer costs the same, so a layer's cost times the layer count is the model's;
- the collectives by the same alpha-beta model (planner/collectives.py) over the 8 x 8 group;
- torchtitan's runtime as it runs: FSDP2 per transformer block, `reshard_after_forward=True`
  (the forward's all-gather is repeated in backward), all-gathers in bf16 and reduce-scatters
  in fp32 (its MixedPrecisionPolicy), prefetched on a separate stream so that communication
  hides behind compute except the first block's gather and the last block's reduce; full AC
  runs every layer's forward again in backward, selective layer AC every second layer's;
  AdamW over fp32 shards at HBM bandwidth;
- MFU with torchtitan's and the issue's FLOP count: (6 N + 12 L h s) per token, A100 BF16
  dense peak 312 TFLOP/s.

Pipeline parallelism, no data or tensor parallelism (Qi, Wan, Huang and Lin, "Zero Bubble
Pipeline Parallelism", ICLR 2024, arXiv 2401.10241): Table 3 gives the GPT-3-like models
(Megatron-LM, fp16, sequence 1024), Table 4 the samples per GPU per second of Megatron-LM's
1F1B on 8 A100 SXM 80GB in one node (its "1F1B" row):

    1.5B: 22 layers, hidden 2304, 24 heads, micro-batch 6;  m = 24: 11.8,  m = 64: 13.6
    6.2B: 30 layers, hidden 4096, 32 heads, micro-batch 3;  m = 24: 3.50,  m = 64: 4.03

The model is transformers' GPT-2 at those sizes (learned positions, LayerNorm, GELU MLP of
4 x hidden, biases, dropout 0.1, embedding tied to the head as in the repository's
Megatron script of the time, vocabulary 32,000: the SentencePiece tokenizer's, which gives
the parameter counts the paper names, 1.48B and 6.18B), bfloat16 on meta, compiled for
`cluster("a100", nodes=1, per_node=8)` with `data_parallel=1, schedule="1f1b",
microbatches=m, checkpoint=False`: the plan's own placement (it puts one layer fewer on the
first and last stages, as the paper's runs do) and its predicted step, messages over NVLink.

Tensor-parallel runs (TP x PP x DP: Megatron-LM SC'21, BLOOM-176B, Llama 3 405B) are the last
section, in bench/_published_tp.py.

Each table ends with the mean absolute error of its rows, and the script with the mean over
all rows (every error is signed: + is a prediction faster than published).

    python bench/published.py
"""

from __future__ import annotations

import os
import sys
import time

import _common as C

import torch

sys.path.insert(0, os.path.join(C.ROOT, "examples"))

import factories  # noqa: E402
import _published_tp  # noqa: E402

import pipecompile as pc  # noqa: E402
from pipecompile.planner.collectives import Group, all_gather, reduce_scatter  # noqa: E402

SEQ, GPUS, PEAK = 8192, 64, 312e12
RUNS = [  # name, factory, layers, hidden, recomputed share of layers, published tok/s, MFU
    ("Llama 3 8B, selective layer AC", factories.llama3_8b, 32, 4096, 0.5, 2904, 0.568),
    ("Llama 3 70B, full AC", factories.llama3_70b, 80, 8192, 1.0, 331, 0.517),
]


def predict(factory, layers: int, hidden: int, recomputed: float) -> dict:
    """torchtitan's step on 64 A100s, from a 2-layer capture scaled to `layers`."""
    cluster = pc.cluster("a100", nodes=8, per_node=8)
    model, args, kwargs = factory(layers=2, batch=GPUS, seq=SEQ)
    full, _, _ = factory(layers=layers, batch=1, seq=16)
    n = sum(p.numel() for p in full.parameters())
    pipe = pc.compile(model, args, kwargs, devices=cluster, data_parallel=GPUS, fsdp=True,
                      schedule="gpipe", microbatches=1, checkpoint=False, memory_limit=1e15,
                      optimizer=lambda p: torch.optim.AdamW(p))
    blocks, names = pipe.plan.costs.blocks, [b.name for b in pipe.plan.linear.blocks]
    layer = [c for c, name in zip(blocks, names) if name.startswith("model.layers.")]
    other = [c for c, name in zip(blocks, names) if not name.startswith("model.layers.")]
    per_layer_f = sum(c.forward_time for c in layer) / 2
    per_layer = sum(c.forward_time + c.backward_time for c in layer) / 2
    compute = (layers * per_layer + sum(c.forward_time + c.backward_time for c in other)
               + recomputed * layers * per_layer_f)
    group, intra, inter = Group(8, 8), cluster.intra, cluster.inter
    gather = all_gather(2 * n, group, intra, inter)  # bf16, once in forward, again in backward
    reduce = reduce_scatter(4 * n, group, intra, inter)  # fp32 gradients
    comm = 2 * gather + reduce
    exposed = max(0.0, comm - compute) + (2 * gather + reduce) / layers
    optimizer = (4 * 2 + 4 + 8 * 2) * n / GPUS / cluster.device.memory_bandwidth
    step = compute + exposed + optimizer
    flops = (6 * n + 12 * layers * hidden * SEQ) * SEQ  # per GPU per step
    return dict(n=n, step=step, compute=compute, comm=comm, exposed=exposed,
                tokens=SEQ / step, mfu=flops / step / PEAK)


PIPELINE_RUNS = [  # name, layers, hidden, heads, micro-batch size, m, published samples/s/GPU
    ("Zero Bubble 1.5B, 1F1B, m=24", 22, 2304, 24, 6, 24, 11.8),
    ("Zero Bubble 1.5B, 1F1B, m=64", 22, 2304, 24, 6, 64, 13.6),
    ("Zero Bubble 6.2B, 1F1B, m=24", 30, 4096, 32, 3, 24, 3.50),
    ("Zero Bubble 6.2B, 1F1B, m=64", 30, 4096, 32, 3, 64, 4.03),
]
ZB_GPUS, ZB_SEQ, ZB_VOCAB = 8, 1024, 32000


def gpt(layers: int, hidden: int, heads: int, batch: int):
    """The Zero Bubble paper's GPT-3-like model as transformers' GPT-2, on meta, bfloat16."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=ZB_SEQ,
                        vocab_size=ZB_VOCAB, bos_token_id=0, eos_token_id=0, use_cache=False,
                        tie_word_embeddings=True)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    ids = torch.empty(batch, ZB_SEQ, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def predict_pipeline(layers: int, hidden: int, heads: int, size: int, m: int) -> dict:
    """Megatron-LM's 1F1B on 8 A100s in one node as pipecompile plans it (module docstring)."""
    model, args, kwargs = gpt(layers, hidden, heads, size * m)
    pipe = pc.compile(model, args, kwargs, devices=pc.cluster("a100", nodes=1, per_node=ZB_GPUS),
                      data_parallel=1, schedule="1f1b", microbatches=m, checkpoint=False,
                      optimizer=lambda p: torch.optim.AdamW(p))
    step = pipe.predicted.makespan
    layers_per_stage = [sum(b.name.startswith("transformer.h.") for b in blocks)
                        for blocks in _stage_blocks(pipe)]
    return dict(n=sum(p.numel() for p in model.parameters()), step=step,
                samples=size * m / step / ZB_GPUS, bubble=pipe.predicted.bubble_fraction,
                layers=layers_per_stage)


def _stage_blocks(pipe) -> list:
    linear = pipe.plan.linear.blocks
    return [[linear[b] for b in stage.blocks] for stage in pipe.program.stages]


def main() -> None:
    print(f"# predicted vs published; {C.machine()}, load {C.loadavg()}")
    print("\n## torchtitan, FSDP2 only, 64 A100 80GB (docs/performance.md)")
    rows = []
    for name, factory, layers, hidden, recomputed, tokens, mfu in RUNS:
        start = time.perf_counter()
        p = predict(factory, layers, hidden, recomputed)
        rows.append((name, f"{p['n'] / 1e9:.2f}B", f"{p['compute']:.2f}", f"{p['comm']:.2f}",
                     f"{p['exposed']:.3f}", f"{p['step']:.2f}", f"{p['tokens']:,.0f}",
                     f"{tokens:,}", f"{p['tokens'] / tokens - 1:+.1%}", f"{p['mfu']:.1%}",
                     f"{mfu:.1%}", f"{time.perf_counter() - start:.0f}"))
    print(C.table(rows, ("run", "params", "compute s", "FSDP comm s", "exposed s",
                         "step s", "tok/s/GPU pred.", "published", "error", "MFU pred.",
                         "published", "plan s")))
    errors = [float(r[8].rstrip("%")) for r in rows]
    print(f"mean absolute error {sum(map(abs, errors)) / len(errors):.1f} %")

    print("\n## Zero Bubble (Qi et al., ICLR 2024), Table 4 1F1B row: pipeline only, 8 A100 80GB")
    rows = []
    for name, layers, hidden, heads, size, m, published in PIPELINE_RUNS:
        start = time.perf_counter()
        p = predict_pipeline(layers, hidden, heads, size, m)
        rows.append((name, f"{p['n'] / 1e9:.2f}B", "/".join(map(str, p["layers"])),
                     f"{p['step']:.3f}", f"{p['bubble']:.1%}", f"{p['samples']:.2f}",
                     f"{published:.2f}", f"{p['samples'] / published - 1:+.1%}",
                     f"{time.perf_counter() - start:.0f}"))
    print(C.table(rows, ("run", "params", "layers per stage", "step s", "bubble",
                         "samples/s/GPU pred.", "published", "error", "plan s")))
    pipeline = [float(r[7].rstrip("%")) for r in rows]
    print(f"mean absolute error {sum(map(abs, pipeline)) / len(pipeline):.1f} %; over all "
          f"{len(errors) + len(pipeline)} rows "
          f"{sum(map(abs, errors + pipeline)) / (len(errors) + len(pipeline)):.1f} %")
    _published_tp.main()  # the tensor-parallel runs: their own table and mean absolute error


if __name__ == "__main__":
    main()
