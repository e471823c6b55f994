"""The planning search against hand-picked configurations, measured in the same run.

For each model, device count and memory limit (none, and 70 % of the unlimited auto plan's
fullest device) this compiles the auto plan and a grid of hand-picked ones (4 synchronous
schedules x m in 2, 4, 8, 16), then measures every one's step time in alternating rounds (the
median, after a warm-up step each; one process, a worker thread per device), and prints the auto plan's rank among
them, its ratio to the best measured and to gpipe with m=4 (the old default).

    python bench/auto_plan.py            # a deep-narrow and a wide GPT, 2 and 4 devices
    python bench/auto_plan.py --quick    # GPT only, 2 devices, m in 2, 4, 8
    python bench/auto_plan.py --cnn      # a small residual CNN only, 2 devices, m in 2, 4, 8
"""

from __future__ import annotations

import argparse
import time

import _common
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import PipecompileError
from pipecompile.passes.partition import PartitionMemoryError
from pipecompile.ir.formats import format_bytes

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def _gpt(quick: bool):
    dim, layers, seq, batch = (64, 4, 32, 16) if quick else (128, 8, 64, 16)
    model = zoo.GPT(vocab=512, dim=dim, layers=layers, heads=4, seq=seq)
    x, y = torch.randint(0, 512, (batch, seq)), torch.randint(0, 512, (batch, seq))
    return f"GPT d={dim} L={layers} batch {batch}x{seq}", model, x, y, zoo.lm_loss


def _wide_gpt(quick: bool):
    model = zoo.GPT(vocab=256, dim=256, layers=4, heads=4, seq=32)
    x, y = torch.randint(0, 256, (32, 32)), torch.randint(0, 256, (32, 32))
    return "GPT d=256 L=4 batch 32x32", model, x, y, zoo.lm_loss


def _cnn(quick: bool):
    model = zoo.ResidualCNN(width=16, blocks=6)
    x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))
    return "ResidualCNN width 16, 6 blocks, batch 32x3x16x16", model, x, y, \
        torch.nn.functional.cross_entropy


def _measure(pipes: list, x, y, rounds: int) -> list[float]:
    """Each pipeline's median step time over `rounds` rounds that alternate between them (one
    warm-up step each first), so that the machine's load drifts over all of them alike."""
    times: list[list[float]] = [[] for _ in pipes]
    for pipe in pipes:
        pipe.step(x, target=y)
    for _ in range(rounds):
        for k, pipe in enumerate(pipes):
            start = time.perf_counter()
            pipe.step(x, target=y)
            times[k].append(time.perf_counter() - start)
    return [_common.med(t) for t in times]


def _run(name, model, x, y, loss_fn, devices: int, limit, ms, steps: int) -> float | None:
    """Print one table; returns the auto plan's fullest device (bytes) for the limit case."""
    auto = pc.compile(model, (x,), devices=devices, loss_fn=loss_fn, memory_limit=limit)
    best = auto.plan.search.best
    labels = ["auto: " + f"{best.schedule} m={best.microbatches} v={best.virtual_stages} "
              f"recompute {list(best.recomputed) or '-'}"]
    pipes: list = [auto]
    failed = []
    for schedule in SCHEDULES:
        for m in ms:
            try:
                pipe = pc.compile(model, (x,), devices=devices, loss_fn=loss_fn,
                                  schedule=schedule, microbatches=m, memory_limit=limit)
            except PartitionMemoryError:
                failed.append((f"{schedule} m={m}", None, None))
                continue
            except PipecompileError as error:  # e.g. interleaving constraints
                failed.append((f"{schedule} m={m} ({str(error)[:40]})", None, None))
                continue
            labels.append(f"{schedule} m={m}")
            pipes.append(pipe)
    rows = [(label, t, pipe.predicted.makespan)
            for label, t, pipe in zip(labels, _measure(pipes, x, y, steps), pipes)] + failed
    measured = sorted(r[1] for r in rows if r[1] is not None)
    auto_time = rows[0][1]
    gpipe4 = next((r[1] for r in rows if r[0] == "gpipe m=4"), None)
    print(f"\n{name}, {devices} devices, memory limit "
          f"{'none' if limit is None else format_bytes(limit)} "
          f"(load {_common.loadavg()})")
    print(_common.table([(label, "-" if t is None else _common.fmt_ms(t),
                          "-" if p is None else _common.fmt_ms(p)) for label, t, p in rows],
                        ["plan", "measured ms (median of alternating rounds)", "predicted ms"]))
    print(f"auto plan: rank {measured.index(auto_time) + 1} of {len(measured)}, "
          f"{auto_time / measured[0]:.2f}x the best measured"
          + ("" if gpipe4 is None else f", {auto_time / gpipe4:.2f}x gpipe m=4"))
    return max(best.memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cnn", action="store_true", help="the small residual CNN only")
    opts = parser.parse_args()
    opts.quick = opts.quick or opts.cnn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(_common.machine())
    models = [_cnn] if opts.cnn else [_gpt] if opts.quick else [_gpt, _wide_gpt]
    ms = (2, 4, 8) if opts.quick else (2, 4, 8, 16)
    for make in models:
        name, model, x, y, loss_fn = make(opts.quick)
        for devices in (2,) if opts.quick else (2, 4):
            fullest = _run(name, model, x, y, loss_fn, devices, None, ms, 5 if opts.quick else 7)
            if fullest is not None:
                _run(name, model, x, y, loss_fn, devices, 0.7 * fullest, ms,
                     5 if opts.quick else 7)


if __name__ == "__main__":
    main()
