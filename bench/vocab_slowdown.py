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

Nothing here was fitted: the planner prices every kernel as docs/hardware.md says. The figure
this is a sanity check against (a published naive-layout slowdown of 2.75x from 32k to 256k at
sequence 2048) was quoted to us without its source, so it is printed beside the prediction,
not used.

    python bench/vocab_slowdown.py [--seq 2048] [--vocab 32000 256000]
"""

from __future__ import annotations

import argparse
import time

import _common as C

import torch

import pipecompile as pc

LAYERS, HIDDEN, HEADS, GPUS, M = 32, 3072, 24, 8, 128


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
    rows = []
    for seq in a.seq:
        base = None
        for vocab in a.vocab:
            start = time.perf_counter()
            p = predict(vocab, seq)
            base = base or p["step"]
            rows.append((str(seq), f"{vocab:,}", f"{p['step']:.2f}", f"{p['middle'] * 1e3:.1f}",
                         f"{p['last'] * 1e3:.1f}", f"{p['step'] / base:.2f}x",
                         f"{p['loss']:.2f}", f"{p['memory']:.2f}",
                         f"{time.perf_counter() - start:.0f}"))
    print(C.table(rows, ("seq", "vocab", "step s", "middle stage F+B ms/mb",
                         "last stage F+B ms/mb", "step / 32k", "loss s (busiest)",
                         "other memory-bound s", "plan s")))


if __name__ == "__main__":
    main()
