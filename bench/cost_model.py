"""Cost model: predicted step time (`pipe.predicted.makespan`) vs measured, per schedule and stage count.

For every schedule and device count the GPT is compiled twice, with the analytic cost model
(FLOPs, bytes, op count) and with `profile=True` (measured block times), and each pipeline is
stepped `--steps` times (after a warm-up), the two alternating step by step. Reported:

  predicted   pipe.predicted.makespan: the simulated timeline of one step
  measured    median wall time of pipe.step (spread: min/max around it)
  error       (predicted - measured) / measured
  busy p/m    the busiest device's compute, predicted / measured (F, B, I, W action durations
              of the last step): separates a wrong block time from a wrong schedule/overhead

In one process the executor runs one thread per device: with 3 or 4 devices on this 2-core
machine the threads share cores (marked "oversubscribed"), which the cost model does not model.
The 2-rank rows run 1f1b over gloo (spawned processes, 1 intra-op thread each): each rank's
step between barriers, the slower rank's median.

    python bench/cost_model.py            # GPT d=128, 8 layers, batch 16x64, m=8; 2-4 devices
    python bench/cost_model.py --quick
"""

from __future__ import annotations

import argparse
import os
import time

import _common as C
import torch
import torch.distributed as dist

import pipecompile as pc
from pipecompile.schedule.actions import Kind

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
M = 8
_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)


def _setup(quick: bool):
    torch.manual_seed(0)
    dim, layers, seq = (64, 4, 32) if quick else (128, 8, 64)
    model = C.gpt(vocab=512, dim=dim, layers=layers, heads=4, seq=seq, tied=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (16, seq), generator=g)
    y = torch.randint(0, 512, (16, seq), generator=g)
    return model, x, y


def _busy(timeline) -> float:
    """The busiest device's compute seconds in a timeline."""
    per: dict[int, float] = {}
    for e in timeline.events:
        if e.action.kind in _COMPUTE:
            per[e.device] = per.get(e.device, 0.0) + e.duration
    return max(per.values()) if per else 0.0


def _measure(pipes: dict, x, y, steps: int) -> dict:
    """Median step time (and samples) of each pipeline; steps alternate between pipelines."""
    times = {k: [] for k in pipes}
    busy = {k: [] for k in pipes}
    for p in pipes.values():
        p.step(x, target=y)
    for _ in range(steps):
        for k, p in pipes.items():
            t0 = time.perf_counter()
            p.step(x, target=y)
            times[k].append(time.perf_counter() - t0)
            busy[k].append(_busy(p.timeline()))
    return {k: (times[k], C.med(busy[k])) for k in pipes}


def _row(label, schedule, devices, stages, how, pipe, samples, busy, note=""):
    pred, meas = pipe.predicted.makespan, C.med(samples)
    return (schedule, devices, stages, label, how, C.fmt_ms(pred), C.fmt_ms(meas), C.spread(samples),
            f"{(pred - meas) / meas * 100:+.0f}%",
            f"{_busy(pipe.predicted) * 1e3:.1f}/{busy * 1e3:.1f}", note)


def _rank(rank: int, world: int, quick: bool, steps: int) -> list:
    out = []
    for profile in (False, True):
        model, x, y = _setup(quick)
        pipe = pc.compile(model, (x,), devices=world, microbatches=M, schedule="1f1b",
                          loss_fn=C.ce, profile=profile, example_target=y)
        pipe.step(x, target=y)
        times, busy = [], []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            times.append(time.perf_counter() - t0)
            busy.append(_busy(pipe.timeline()))
        out.append((profile, times, C.med(busy), pipe.predicted))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--devices", type=int, nargs="+", default=None)
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--no-ranks", action="store_true", help="skip the 2-rank 1f1b rows")
    opts = parser.parse_args()
    devices = opts.devices or ([2] if opts.quick else [2, 3, 4])
    steps = opts.steps or (3 if opts.quick else 9)
    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    load = C.loadavg()
    rows = []
    for schedule in opts.schedules:
        for d in devices:
            pipes, err = {}, None
            for profile in (False, True):
                model, x, y = _setup(opts.quick)
                try:
                    pipes["profile" if profile else "analytic"] = pc.compile(
                        model, (x,), devices=d, microbatches=M, schedule=schedule,
                        loss_fn=C.ce, profile=profile, example_target=y)
                except Exception as exc:  # noqa: BLE001 - e.g. m not a multiple of d
                    err = f"{type(exc).__name__}: {str(exc)[:90]}"
            if err:
                rows.append((schedule, d, "-", "threads", "-", "-", "-", "-", "-", "-", err))
                continue
            got = _measure(pipes, x, y, steps)
            note = f"oversubscribed ({d} threads, {cores} cores)" if d > cores else ""
            for how, pipe in pipes.items():
                samples, busy = got[how]
                rows.append(_row("threads", schedule, d, pipe.program.num_stages, how, pipe,
                                 samples, busy, note))
            print(f"done: {schedule}, {d} devices", flush=True)
    if not opts.no_ranks and "1f1b" in opts.schedules:
        per_rank = C.spawn(_rank, 2, opts.quick, steps)
        for i, (profile, _, _, predicted) in enumerate(per_rank[0]):
            # the slower rank's median step time, and the busier rank's compute
            slow = max(per_rank, key=lambda r: C.med(r[i][1]))[i][1]
            busy = max(r[i][2] for r in per_rank)
            pred = predicted.makespan
            meas = C.med(slow)
            rows.append(("1f1b", 2, 2, "2 ranks", "profile" if profile else "analytic",
                         C.fmt_ms(pred), C.fmt_ms(meas), C.spread(slow),
                         f"{(pred - meas) / meas * 100:+.0f}%",
                         f"{_busy(predicted) * 1e3:.1f}/{busy * 1e3:.1f}", "gloo"))
    dim, layers, seq = (64, 4, 32) if opts.quick else (128, 8, 64)
    print(f"\n# Cost model: predicted vs measured step time\n{C.machine()}\n"
          f"GPT d={dim}, {layers} layers, vocab 512 untied, batch 16x{seq}, m={M}; median of "
          f"{steps} steps (after a warm-up), 1 intra-op thread per device thread / rank; load "
          f"average {load} at start, {C.loadavg()} at end\n")
    print(C.table(rows, ("schedule", "devices", "stages", "run", "costs", "predicted ms",
                         "measured ms", "spread", "error", "busy ms p/m", "note")))


if __name__ == "__main__":
    main()
