"""Pipeline x FSDP2: 2 pipeline stages x D data-parallel replicas, each stage sharded over them.

    torchrun --nproc-per-node 4 examples/train_fsdp.py --steps 5            # 2 stages x 2
    # two machines (or two launchers on one): 2 ranks each, c10d rendezvous
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 examples/train_fsdp.py               # and --node-rank 1

The recipe at scale: build on meta (nothing allocated), compile with `fsdp=True` (the compiler
shards each rank's stages over its "dp" group with torch's `fully_shard`), `to_empty()`, then
load or initialise; `pipe.parameters()` are DTensors, so the user's AdamW, `pipe.clip_grad_norm_`
(float32, over every rank) and torch.distributed.checkpoint work unchanged. Each replica trains
on its own slice of the global batch (`pipe.topology.replica`); `step` returns the global loss.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import pipecompile as pc
from pipecompile import zoo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (one per rank)")
    p.add_argument("--batch", type=int, default=8, help="global batch (split over replicas)")
    p.add_argument("--no-fsdp", action="store_true", help="replicate instead of sharding")
    p.add_argument("--double", action="store_true", help="float64 (for exact comparisons)")
    p.add_argument("--out", default=None, help="write rank 0's losses and norms as JSON")
    return p.parse_args(argv)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch of token ids and next-token targets, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (size, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]


def build() -> torch.nn.Module:
    with torch.device("meta"):
        return zoo.GPT(vocab=64, dim=32, layers=4, heads=2, seq=8)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = int(os.environ["WORLD_SIZE"])
    replicas = world // args.stages
    model = build().double() if args.double else build()
    x, _ = global_batch(0, args.batch)
    rank = int(os.environ["RANK"])
    replica = rank // args.stages
    mine = x.chunk(replicas)[replica]
    pipe = pc.compile(model, example_inputs=(mine,), devices=args.stages,
                      data_parallel=replicas, fsdp=not args.no_fsdp, loss_fn=zoo.lm_loss,
                      schedule="1f1b", microbatches=2)
    pipe.to_empty()
    torch.manual_seed(0)
    pipe.init_weights()  # per module, seeded by its name: the same weights however sharded
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(args.steps):
        x, y = global_batch(step, args.batch)
        losses.append(pipe.step(x.chunk(replicas)[replica], target=y.chunk(replicas)[replica]))
        norms.append(pipe.clip_grad_norm_(1.0))
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1} | loss {losses[-1].item():.10f} | grad norm "
                  f"{norms[-1].item():.6f}", flush=True)
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": [float(v) for v in losses],
                       "norms": [float(v) for v in norms]}, f)


if __name__ == "__main__":
    main()
