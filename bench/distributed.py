"""2 pipeline ranks over gloo vs 1 process, on a balanced GPT (m = 8, 1F1B), same micro-batches.

Spawns the ranks itself (torch.multiprocessing, gloo on loopback); each rank uses one intra-op
thread, as does the single process. Prints median step times, their ratio, and per rank how much
of the step was spent waiting for messages (receives and the send completions at the end),
how many messages and bytes it sent.

    python bench/distributed.py            # 8 layers, d=128, batch 16x64 (the model of the earlier peer comparison)
    python bench/distributed.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipecompile as pc  # noqa: E402
from pipecompile import zoo  # noqa: E402


def _setup(quick: bool):
    torch.manual_seed(0)
    dim, layers, seq, batch = (64, 4, 32, 16) if quick else (128, 8, 64, 16)
    model = zoo.GPT(vocab=512, dim=dim, layers=layers, heads=4, seq=seq)
    x = torch.randint(0, 512, (batch, seq))
    y = torch.randint(0, 512, (batch, seq))
    return model, x, y


def _rank(rank, world, port, quick, steps, schedule, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, x, y = _setup(quick)
    pipe = pc.compile(model, (x,), devices=world, microbatches=8, schedule=schedule,
                      loss_fn=zoo.lm_loss)
    times, waits = [], []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, target=y)
        if i:
            times.append(time.perf_counter() - t0)
            waits.append(pipe.communication["wait_seconds"])
    busy = sum(e.end - e.start for e in pipe.timeline().events)
    queue.put((rank, statistics.median(times), statistics.median(waits), busy,
               pipe.communication["messages"], pipe.communication["bytes"]))
    dist.destroy_process_group()


def _single(quick, steps) -> float:
    torch.set_num_threads(1)
    model, x, y = _setup(quick)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        model.zero_grad()
        for xc, yc in zip(x.chunk(8), y.chunk(8)):
            (zoo.lm_loss(model(xc), yc) / 8).backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--schedule", default="1f1b")
    opts = parser.parse_args()
    steps = 3 if opts.quick else 10
    from tests.distributed.ranks import free_port  # noqa: PLC0415 - the repository's helper

    single = _single(opts.quick, steps)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, opts.quick, steps, opts.schedule, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    step = max(r[1] for r in results)
    print(f"model {'quick' if opts.quick else 'GPT d=128 L=8 16x64'}, m=8, {opts.schedule}, "
          f"torch {torch.__version__}, 1 intra-op thread per process")
    print(f"1 process, same micro-batches: {single * 1e3:7.1f} ms/step")
    print(f"2 ranks (gloo):                {step * 1e3:7.1f} ms/step   speed-up {single / step:.2f}x")
    for rank, t, wait, busy, messages, nbytes in results:
        print(f"  rank {rank}: step {t * 1e3:6.1f} ms, compute {busy * 1e3:6.1f} ms, waiting for "
              f"messages {wait * 1e3:6.1f} ms ({wait / t:.0%}), sent {messages} messages, "
              f"{nbytes / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
