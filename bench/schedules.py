"""Schedules side by side on a balanced 2-device GPT (m = 8), in one process.

Prints, per schedule: measured step time (median), measured bubble (idle share of the two
device threads between the step's first and last action), the simulator's predicted bubble from
profiled block costs, and their ratio; plus the unsplit model doing the same micro-batches in
one thread as the baseline. Each device thread uses one intra-op thread (2 cores here).

    python bench/schedules.py            # 8 layers, d=128, batch 16x64
    python bench/schedules.py --quick    # smaller model, fewer repetitions
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pipecompile as pc
from pipecompile import zoo

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--plot", default=None, help="write a Gantt PNG per schedule with this prefix")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dim, layers, seq, batch = (64, 4, 32, 16) if opts.quick else (128, 8, 64, 16)
    steps = opts.steps or (3 if opts.quick else 8)
    m = 8
    model = zoo.GPT(vocab=512, dim=dim, layers=layers, heads=4, seq=seq)
    x = torch.randint(0, 512, (batch, seq))
    y = torch.randint(0, 512, (batch, seq))

    base = _baseline(model, x, y, m, steps)
    print(f"GPT d={dim} layers={layers} batch {batch}x{seq}, m={m}, 2 devices (threads), "
          f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread per device")
    print(f"unsplit model, one thread, same micro-batches: {base * 1e3:.1f} ms/step\n")
    header = f"{'schedule':<18}{'step ms':>9}{'vs unsplit':>11}{'bubble':>9}{'predicted':>11}{'ratio':>7}"
    print(header)
    print("-" * len(header))
    for name in SCHEDULES:
        pipe = pc.compile(model, (x,), devices=2, microbatches=m, schedule=name,
                          loss_fn=zoo.lm_loss, profile=True)
        times, bubbles = [], []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            if i:  # the first step warms up
                times.append(time.perf_counter() - t0)
                bubbles.append(pipe.timeline().bubble_fraction)
        step = statistics.median(times)
        measured = statistics.median(bubbles)
        predicted = pipe.predicted.bubble_fraction
        print(f"{name:<18}{step * 1e3:9.1f}{base / step:10.2f}x{measured:9.1%}{predicted:11.1%}"
              f"{measured / predicted if predicted else float('nan'):7.2f}")
        if opts.plot:
            pipe.plot_timeline(f"{opts.plot}{name}.png")


def _baseline(model, x, y, m, steps) -> float:
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        model.zero_grad()
        for xc, yc in zip(x.chunk(m), y.chunk(m)):
            (zoo.lm_loss(model(xc), yc) / m).backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    main()
