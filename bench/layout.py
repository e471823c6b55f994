"""The layout `data_parallel="auto"` chooses under torchrun, measured against every other.

    torchrun --nproc-per-node 4 bench/layout.py            # GPT d=128, 4 layers, 16 x 64 tokens
    torchrun --nproc-per-node 4 bench/layout.py --quick    # d=64, 16 x 32

Every rank compiles the model with `data_parallel="auto", fsdp="auto"` (the search's choice,
with this machine's measured costs), then every other layout of the ranks forced by hand
(`devices=P, data_parallel="auto", fsdp=...`: D = world / P), each with the schedule and
micro-batches its own search picks. Every rank passes the global batch. Rounds then alternate
over the pipelines (each round times `--steps` steps of each, between barriers), so that a
change of the machine's load falls on all of them alike. Rank 0 prints, per layout, the
predicted and the measured step (median over rounds) and the ratio of the chosen layout's
measured step to the best measured (the aim: within 10 %).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipecompile as pc  # noqa: E402
from pipecompile import zoo  # noqa: E402


def _setup(quick: bool):
    torch.manual_seed(0)
    dim, layers, seq, batch = (64, 4, 32, 16) if quick else (128, 4, 64, 16)
    model = zoo.GPT(vocab=256, dim=dim, layers=layers, heads=4, seq=seq)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (batch, seq), generator=g)
    y = torch.randint(0, 256, (batch, seq), generator=g)
    return model, x, y


def _compile(quick: bool, **options):
    model, x, _ = _setup(quick)
    return pc.compile(model, (x,), loss_fn=zoo.lm_loss, **options)


def _time(pipe, x, y, steps: int) -> float:
    """Seconds per step of `steps` steps, between barriers (every rank runs them)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        pipe.step(x, target=y)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per layout per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        sys.exit("run under torchrun: torchrun --nproc-per-node 4 bench/layout.py")
    torch.set_num_threads(1)
    start = time.perf_counter()
    chosen = _compile(args.quick, data_parallel="auto", fsdp="auto")
    compile_s = time.perf_counter() - start
    world = dist.get_world_size()
    rank = dist.get_rank()
    lay = chosen.layout
    pipes = {"chosen": chosen}
    for p in [p for p in range(1, world + 1) if world % p == 0]:
        for fsdp in ((False, True) if world // p > 1 else (False,)):
            if (p, world // p, fsdp) == (lay.pipeline, lay.data_parallel, lay.fsdp):
                continue
            pipes[f"{p} x {world // p}{' FSDP' if fsdp else ''}"] = _compile(
                args.quick, devices=p, data_parallel="auto", fsdp=fsdp)
    _, x, y = _setup(args.quick)
    for pipe in pipes.values():  # warm: first-step allocations, DDP reducers
        _time(pipe, x, y, 1)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for r in range(args.rounds):
        order = list(pipes) if r % 2 == 0 else list(reversed(pipes))
        for name in order:
            times[name].append(_time(pipes[name], x, y, args.steps))
    if rank != 0:
        dist.destroy_process_group()
        return
    measured = {name: statistics.median(t) for name, t in times.items()}
    best = min(measured, key=lambda n: measured[n])
    print(f"{world} ranks, {os.cpu_count()} CPU cores, torch {torch.__version__}; global "
          f"batch {tuple(x.shape)}; compile with data_parallel='auto' {compile_s:.1f} s")
    print(f"{'layout':<22} {'schedule':<18} {'predicted ms':>12} {'measured ms':>12} "
          f"{'spread':>8} {'vs best':>8}")
    for name, pipe in pipes.items():
        o = pipe.plan.resolved
        label = f"{pipe.layout.pipeline} x {pipe.layout.data_parallel}" + (
            " FSDP" if pipe.layout.fsdp else "") + (" (chosen)" if name == "chosen" else "")
        t = sorted(times[name])
        print(f"{label:<22} {o.schedule + f' m={o.microbatches}':<18} "
              f"{pipe.predicted.makespan * 1e3:>12.1f} {measured[name] * 1e3:>12.1f} "
              f"{(t[-1] - t[0]) / measured[name]:>7.0%} "
              f"{measured[name] / measured[best] - 1:>+8.1%}")
    ratio = measured["chosen"] / measured[best]
    print(f"chosen {lay.pipeline} x {lay.data_parallel}{' FSDP' if lay.fsdp else ''}: "
          f"measured/best measured = {ratio:.3f} (aim <= 1.10); {args.rounds} alternating "
          f"rounds of {args.steps} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
