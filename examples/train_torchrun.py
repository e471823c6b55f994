"""Train a small GPT with one pipeline stage per rank under torchrun.

    torchrun --nproc-per-node 4 examples/train_torchrun.py                     # 4-stage pipeline
    torchrun --nproc-per-node 4 examples/train_torchrun.py --data-parallel 2   # 2 stages x 2 replicas

Every rank runs this same script: `pc.compile` sees torchrun's environment, initialises the
process group (gloo on CPU, NCCL on GPUs), builds the same plan on every rank (checked), and
keeps only the rank's own stages. Each data-parallel replica trains on its own shard.
"""

import argparse
import os

import torch

import pipecompile as pc
from pipecompile import zoo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b")
    opts = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    stages = max(1, world // opts.data_parallel)

    torch.manual_seed(0)  # the same initial weights on every rank
    vocab, seq, batch = 128, 32, 16
    model = zoo.GPT(vocab=vocab, dim=64, layers=8, heads=4, seq=seq)
    example = torch.randint(0, vocab, (batch, seq))
    pipe = pc.compile(model, (example,), devices=stages, data_parallel=opts.data_parallel,
                      microbatches=8, schedule=opts.schedule, loss_fn=zoo.lm_loss,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3))
    rank = int(os.environ.get("RANK", 0))
    replica = pipe.topology.replica if pipe.topology else 0
    if rank == 0:
        print(pipe)
    data = torch.Generator().manual_seed(1000 + replica)  # each replica its own shard
    for step in range(opts.steps):
        start = torch.randint(0, vocab, (batch, 1), generator=data)
        tokens = (start + torch.arange(seq + 1)) % vocab  # next token = previous + 1
        loss = pipe.step(tokens[:, :-1], target=tokens[:, 1:])
        if rank == 0 and (step % 5 == 0 or step == opts.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
