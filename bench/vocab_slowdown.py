"""A sanity check in the shape of a held-back table: how the predicted step of a pipeline whose
last stage holds the output layer grows with the vocabulary.

GPT of 3B parameters (32 layers, hidden 3072, 24 heads; transformers' GPT-2 layers, untied
output layer), bfloat16 on meta, pipeline-parallel on 8 A100 80GB in one node
(`cluster("a100", nodes=1, per_node=8)`), 1F1B, 128 micro-batches of one sequence, no
recomputation. The naive layout: 4 layers per stage, the embedding on the first stage and the
output layer with the loss on the last (`split_points` every 4 layers). Printed per sequence
length and vocabulary: the predicted step, the last stage's forward + backward per micro-batch
against a middle stage's, the step's growth from the 32k vocabulary, and what `explain()`
names the loss over the vocabulary on the busiest device (planner/breakdown.py: softmax /
cross-entropy over rows longer than shared memory, per step).

Nothing here was fitted: the planner prices every kernel as docs/hardware.md says. What it is
checked against (printed beside the prediction, never used by it): the run this shape is
from, Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism" (arXiv
2411.05288), Megatron-LM on 8 A100 80GB, fp16, its "baseline" (4 layers a stage, the output
layer and loss on the last), as its repository publishes it (sail-sg/VocabularyParallelism
at 6191c3b):

- `artifact/exp_one_host.csv`, the experiment table the artifact runs from: per stage the
  forward and backward of one micro-batch (microseconds; columns 26-27, unlabelled, read as
  such because the layer-redistribution rows' stages scale with their layer counts) and the
  achieved TFLOP/s per GPU (column 33; the step is the paper's FLOPs over it, and the table's
  bubble rate, column 34, agrees with the per-stage times);
- `artifact/example-results/full-exp.txt`, the artifact's expected MFU of a rerun (one
  timing, iteration 10): 47.52 % at 32k and 17.29 % at 256k, sequence 2048: the 2.75x quoted
  to us (an MFU ratio; as a step ratio, 3.21x).

MFU as the paper counts it (`artifact/show_result_full_exp.py`): 3 (2bshV + L (8bsh^2 +
4bs^2h + 4bsh f)) FLOPs a step, over 8 GPUs at 312 TFLOP/s. The model here is transformers'
GPT-2 in bf16 with torch's AdamW, not Megatron's fused fp16 GPT with fp32 master weights.

    python bench/vocab_slowdown.py [--seq 2048 4096] [--vocab 32000 256000]
"""

from __future__ import annotations

import argparse
import time

import _common as C

import torch

import pipecompile as pc

LAYERS, HIDDEN, HEADS, GPUS, M = 32, 3072, 24, 8, 128
FFN, A100_PEAK = 4 * HIDDEN, 312e12

#: (seq, vocab) -> the paper's baseline as its repository publishes it (module docstring):
#: (middle stage F+B ms, last stage F+B ms, TFLOP/s per GPU) from exp_one_host.csv (the
#: middle: the median of stages 1-6), and the rerun's MFU from full-exp.txt
PUBLISHED = {(2048, 32000): (31.9, 40.6, 147.72, 0.4752),
             (2048, 64000): (31.8, 47.6, 129.54, 0.4082),
             (2048, 128000): (31.6, 61.8, 105.94, 0.3370),
             (2048, 256000): (31.3, 89.2, 80.72, 0.1729),
             (4096, 32000): (70.2, 88.1, 150.55, 0.5282),
             (4096, 64000): (69.5, 101.7, 133.97, 0.4578),
             (4096, 128000): (68.8, 128.1, 111.99, 0.3713),
             (4096, 256000): (69.0, 183.4, 85.60, 0.2763)}


def flops(vocab: int, seq: int) -> float:
    """A step's FLOPs as the paper counts them (show_result_full_exp.py `calculate_mfu`)."""
    b, s, h = M, seq, HIDDEN
    return 3 * (2 * b * s * h * vocab
                + LAYERS * (8 * b * s * h * h + 4 * b * s * s * h + 4 * b * s * h * FFN))


def mfu(step: float, vocab: int, seq: int) -> float:
    """MFU of a step of `step` seconds as the paper counts it: its FLOPs over 8 A100 peaks."""
    return flops(vocab, seq) / GPUS / A100_PEAK / step


def gpt(vocab: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, n_positions=seq,
                        vocab_size=vocab, bos_token_id=0, eos_token_id=0, use_cache=False,
                        tie_word_embeddings=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    ids = torch.empty(M, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def predict(vocab: int, seq: int) -> dict:
    model, args, kwargs = gpt(vocab, seq)
    per = LAYERS // GPUS
    pipe = pc.compile(model, args, kwargs, devices=pc.cluster("a100", nodes=1, per_node=GPUS),
                      data_parallel=1, schedule="1f1b", microbatches=M, checkpoint=False,
                      split_points=[f"transformer.h.{per * i}" for i in range(1, GPUS)],
                      optimizer=lambda p: torch.optim.AdamW(p))
    from pipecompile.planner.breakdown import step_breakdown

    costs, parts = pipe.plan.stage_costs, step_breakdown(pipe.plan)
    return dict(step=pipe.predicted.makespan, last=costs[-1].forward + costs[-1].backward,
                middle=costs[1].forward + costs[1].backward,
                loss=parts.loss if parts is not None else 0.0,
                memory=parts.memory if parts is not None else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[2048])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 256000])
    a = parser.parse_args()
    print(f"# naive layout vs vocabulary; {C.machine()}, load {C.loadavg()}")
    rows, against = [], []
    for seq in a.seq:
        base = None
        for vocab in a.vocab:
            start = time.perf_counter()
            p = predict(vocab, seq)
            base = base or (p["step"], vocab)
            rows.append((str(seq), f"{vocab:,}", f"{p['step']:.2f}", f"{p['middle'] * 1e3:.1f}",
                         f"{p['last'] * 1e3:.1f}", f"{p['step'] / base[0]:.2f}x",
                         f"{p['loss']:.2f}", f"{p['memory']:.2f}",
                         f"{time.perf_counter() - start:.0f}"))
            pub, pub0 = PUBLISHED.get((seq, vocab)), PUBLISHED.get((seq, base[1]))
            if pub is None or pub0 is None:
                continue
            step = flops(vocab, seq) / GPUS / (pub[2] * 1e12)
            step0 = flops(base[1], seq) / GPUS / (pub0[2] * 1e12)
            m, m0 = mfu(p["step"], vocab, seq), mfu(base[0], base[1], seq)
            against.append((str(seq), f"{vocab:,}", f"{p['middle'] * 1e3:.1f} / {pub[0]:.1f}",
                            f"{p['last'] * 1e3:.1f} / {pub[1]:.1f}",
                            f"{p['step']:.2f} / {step:.2f}",
                            f"{p['step'] / base[0]:.2f}x / {step / step0:.2f}x",
                            f"{m:.1%} / {pub[2] * 1e12 / A100_PEAK:.1%} / {pub[3]:.1%}",
                            f"{m0 / m:.2f}x / {pub0[2] / pub[2]:.2f}x / {pub0[3] / pub[3]:.2f}x"))
    print(C.table(rows, ("seq", "vocab", "step s", "middle stage F+B ms/mb",
                         "last stage F+B ms/mb", "step / 32k", "loss s (busiest)",
                         "other memory-bound s", "plan s")))
    if against:
        print("\n# predicted / published (Yeung et al. 2024, sail-sg/VocabularyParallelism "
              "artifact: the table's per-stage times and TFLOP/s; MFU also the rerun's)")
        print(C.table(against, ("seq", "vocab", "middle F+B ms", "last F+B ms", "step s",
                                "step / first vocab", "MFU pred. / table / rerun",
                                "MFU drop pred. / table / rerun")))


if __name__ == "__main__":
    main()
