"""Tensor parallelism on gloo: a GPT step on 2 tensor-parallel ranks (tensor_parallel=2, one
pipeline stage) against the same model unsplit in one process, same micro-batches (float32,
GPipe, m = 2), and the all-reduce traffic of a TP step counted as it runs.

Spawns the ranks itself (torch.multiprocessing, gloo on loopback), one intra-op thread each, as
the single process. Prints median step times, their ratio, and per step the all-reduces and
their bytes (every `torch.distributed.all_reduce` during the step, counted by wrapping it: the
per-layer pairs, plus the loss's 16-byte mean) against Megatron's count: per layer and
micro-batch 2 forward (attention, MLP) and 2 backward (their column inputs), each of
(micro-batch x sequence x width) floats.

    python bench/tp_overhead.py            # 4 layers, d=256, 4 heads, batch 8 x 64
    python bench/tp_overhead.py --quick
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

import _common as C  # noqa: E402

import pipecompile as pc  # noqa: E402
from pipecompile import zoo  # noqa: E402

M = 2  # micro-batches


def _sizes(quick: bool) -> dict:
    return dict(dim=128, layers=2, seq=32, batch=8) if quick else dict(dim=256, layers=4,
                                                                         seq=64, batch=8)


def _setup(quick: bool):
    s = _sizes(quick)
    torch.manual_seed(0)
    model = zoo.GPT(vocab=512, dim=s["dim"], layers=s["layers"], heads=4, seq=s["seq"])
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (s["batch"], s["seq"]), generator=g)
    y = torch.randint(0, 512, (s["batch"], s["seq"]), generator=g)
    return model, x, y


def _timed(pipe, x, y, steps: int) -> list[float]:
    times = []
    for i in range(steps + 1):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, target=y)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def _rank(rank, world, quick, steps):
    """One rank (`C.spawn` started it, in its gloo group): its step time, all-reduce calls and
    bytes of one step, and the parameter elements it holds."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    model, x, y = _setup(quick)
    pipe = pc.compile(model, (x,), devices=1, tensor_parallel=world, microbatches=M,
                      schedule="gpipe", loss_fn=zoo.lm_loss)
    times = _timed(pipe, x, y, steps)
    counted = {"calls": 0, "bytes": 0}
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counted["calls"] += 1
        counted["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        pipe.step(x, target=y)
    finally:
        dist.all_reduce = original
    local = sum(p.to_local().numel() for p in pipe.parameters())
    return rank, statistics.median(times), counted["calls"], counted["bytes"], local


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x, y = _setup(args.quick)
    whole = sum(p.numel() for p in model.parameters())
    single = statistics.median(_timed(pc.compile(model, (x,), devices=1, microbatches=M,
                                                 schedule="gpipe", loss_fn=zoo.lm_loss),
                                      x, y, args.steps))
    results = C.spawn(_rank, 2, args.quick, args.steps)
    s = _sizes(args.quick)
    per = s["batch"] // M * s["seq"] * s["dim"] * 4
    expected = 4 * s["layers"] * M
    print(f"GPT d={s['dim']} layers={s['layers']} seq={s['seq']} batch={s['batch']}, m={M}, "
          f"float32, gloo, 1 thread per process")
    print(f"unsplit, 1 process: {single * 1e3:.1f} ms/step, {whole:,} parameters")
    for rank, t, calls, nbytes, local in results:
        print(f"TP2 rank {rank}: {t * 1e3:.1f} ms/step ({t / single:.2f}x), {local:,} "
              f"parameter elements held, all-reduces per step {calls} ({nbytes / 1e6:.3f} MB)")
    print(f"Megatron's count: {expected} all-reduces of {per / 1e6:.3f} MB = "
          f"{expected * per / 1e6:.3f} MB per step (+ the loss's mean)")


if __name__ == "__main__":
    main()
