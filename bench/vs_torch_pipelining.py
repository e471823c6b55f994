"""pipecompile vs torch.distributed.pipelining: same model, micro-batches and schedule, 2 gloo ranks.

Both systems run in the same two spawned processes (gloo on loopback, one intra-op thread per
rank), one after the other, alternating which goes first in each repetition; a repetition times
`--steps` training steps (forward + backward of every micro-batch, no optimizer) between two
barriers, after one warm-up step. Reported: median samples/s over the repetitions, the spread
(min/max around the median), the ratio pipecompile / peer of the medians and of the fastest
repetitions ("best runs": less sensitive to other work on the machine), each rank's process CPU
time per step, and the split each system used.

Cases
  same-split   zoo.GPT, untied, both cut before layers.<L/2> (pipecompile: split_points)
  heavy-ends   zoo.GPT with a large vocabulary and untied embedding/LM head (heavy first and
               last stage): the peer's equal split of the layers vs pipecompile's automatic
               partition (analytic costs; profile=True with example_target=, which also times
               the loss; both let the compiler pick the block granularity), plus pipecompile on
               the equal split
  gpt2         transformers GPT2LMHeadModel (small config, random weights, use_cache=False,
               untied), both cut before transformer.h.<L/2>; the peer traces it with pipeline()

The peer is torch.distributed.pipelining's own front end: `pipeline(model, mb_args,
split_spec={name: SplitPoint.BEGINNING})` traces and splits the model, `build_stage` gives each
rank its stage, and `ScheduleGPipe` / `Schedule1F1B` run it (loss_fn on the last stage, gradients
scaled by 1/m, `return_outputs=False`).

    python bench/vs_torch_pipelining.py            # d=128, 8 layers, batch 16x64, m=8
    python bench/vs_torch_pipelining.py --quick    # smaller, fewer repetitions (< 1 minute)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import _common as C
import torch
import torch.distributed as dist

import pipecompile as pc


@dataclass(frozen=True)
class Runner:
    label: str
    system: str  # "pipecompile" | "peer"
    split: str  # a block/module name to cut before, or "auto" / "auto+profile" (pipecompile)
    granularity: str | None = None  # pipecompile's block granularity (None: its default)


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "gpt" | "gpt2"
    vocab: int
    runners: tuple[Runner, ...]


def _cases(opts) -> list[Case]:
    half = opts.layers // 2
    gpt_cut, gpt2_cut = f"layers.{half}", f"transformer.h.{half}"
    same = (Runner("pipecompile", "pipecompile", gpt_cut), Runner("torch.pipelining", "peer", gpt_cut))
    heavy = (Runner("pipecompile auto", "pipecompile", "auto"),
             Runner("pipecompile auto+profile", "pipecompile", "auto+profile"),
             Runner("pipecompile equal", "pipecompile", gpt_cut),
             Runner("torch.pipelining equal", "peer", gpt_cut))
    g2 = (Runner("pipecompile", "pipecompile", gpt2_cut), Runner("torch.pipelining", "peer", gpt2_cut))
    cases = {"same-split": Case("same-split", "gpt", opts.vocab, same),
             "heavy-ends": Case("heavy-ends", "gpt", opts.heavy_vocab, heavy),
             "gpt2": Case("gpt2", "gpt2", opts.vocab, g2)}
    return [cases[c] for c in opts.cases]


def _build_model(case: Case, opts):
    torch.manual_seed(0)  # identical weights on both ranks and for both systems
    kw = dict(vocab=case.vocab, dim=opts.dim, layers=opts.layers, heads=opts.heads, seq=opts.seq)
    if case.model == "gpt":
        return C.gpt(**kw, tied=False), C.ce
    return C.gpt2(**kw, tied=False)


def _pipecompile(runner: Runner, case: Case, schedule: str, x, y, opts):
    model, loss_fn = _build_model(case, opts)
    pipe = pc.compile(model, (x,), devices=2, microbatches=opts.microbatches, schedule=schedule,
                      loss_fn=loss_fn, profile=runner.split == "auto+profile", example_target=y,
                      granularity=runner.granularity,
                      split_points=None if runner.split.startswith("auto") else [runner.split])
    split = " | ".join(C.block_names(pipe))

    def step():
        pipe.step(x, target=y)

    return step, split


def _peer(runner: Runner, case: Case, schedule: str, x, y, opts, rank: int):
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, SplitPoint,
                                              pipeline)

    model, loss_fn = _build_model(case, opts)
    m = opts.microbatches
    pipe = pipeline(model, mb_args=(x.chunk(m)[0],),
                    split_spec={runner.split: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=loss_fn)
    split = f"..{runner.split} | {runner.split}.."

    def step():
        stage.submod.zero_grad(set_to_none=True)  # pipecompile's step starts from zero grads
        if rank == 0:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=[], return_outputs=False)

    return step, split


def _timed(step, steps: int) -> tuple[float, float]:
    """(wall, this process's CPU) seconds per step: `steps` steps between barriers, after one
    warm-up step."""
    step()
    return C.timed(step, steps)


def _rank(rank: int, world: int, opts) -> list[dict]:
    dist.barrier()  # every rank is up
    g = torch.Generator().manual_seed(1)
    results = []
    for case in _cases(opts):
        x = torch.randint(0, case.vocab, (opts.batch, opts.seq), generator=g)
        y = torch.randint(0, case.vocab, (opts.batch, opts.seq), generator=g)
        for schedule in opts.schedules:
            steps, splits, errors = {}, {}, {}
            for r in case.runners:
                try:
                    if r.system == "pipecompile":
                        steps[r.label], splits[r.label] = _pipecompile(r, case, schedule, x, y, opts)
                    else:
                        steps[r.label], splits[r.label] = _peer(r, case, schedule, x, y, opts, rank)
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    errors[r.label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            # Both ranks must agree on who runs (a failure is deterministic: the same on both).
            labels = [r.label for r in case.runners if r.label in steps]
            times = {label: [] for label in labels}
            cpu = {label: [] for label in labels}
            for rep in range(opts.reps):
                order = labels if rep % 2 == 0 else labels[::-1]
                for label in order:
                    wall, used = _timed(steps[label], opts.steps)
                    times[label].append(wall)
                    cpu[label].append(used)
            results.append({"case": case.name, "schedule": schedule, "times": times,
                            "cpu": {k: C.med(v) for k, v in cpu.items()},
                            "splits": splits, "errors": errors})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", nargs="+", default=["same-split", "heavy-ends", "gpt2"])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--heavy-vocab", type=int, default=None)
    opts = parser.parse_args()
    opts.dim = opts.dim or (64 if opts.quick else 128)
    opts.layers = opts.layers or (4 if opts.quick else 8)
    opts.heavy_vocab = opts.heavy_vocab or (4096 if opts.quick else 8192)
    opts.reps = opts.reps or (3 if opts.quick else 7)
    opts.steps = opts.steps or (2 if opts.quick else 4)
    opts.heads, opts.seq, opts.batch, opts.microbatches = 4, (32 if opts.quick else 64), 16, 8
    if opts.quick and opts.cases == ["same-split", "heavy-ends", "gpt2"]:
        opts.cases = ["same-split", "heavy-ends"]
        opts.schedules = ["1f1b"]

    load = C.loadavg()
    per_rank = C.spawn(_rank, 2, opts)
    results = per_rank[0]
    print("# pipecompile vs torch.distributed.pipelining, 2 gloo ranks, 1 intra-op thread each")
    print(f"{C.machine()}")
    print(f"model d={opts.dim}, {opts.layers} layers, {opts.heads} heads, batch "
          f"{opts.batch}x{opts.seq}, m={opts.microbatches}, vocab {opts.vocab} (heavy-ends "
          f"{opts.heavy_vocab}), untied; {opts.reps} alternating repetitions of {opts.steps} "
          f"steps; samples/s = batch / step time (median over repetitions; spread = min/max "
          f"around it); CPU = each rank's process CPU time per step (all its threads), rank 0 / "
          f"rank 1; load average {load} before, {C.loadavg()} after\n")
    rows = []
    for res, other in zip(results, per_rank[1]):
        times = res["times"]
        peer = next((l for l in times if l.startswith("torch.pipelining")), None)
        base = C.med(times[peer]) if peer else None
        base_min = min(times[peer]) if peer else None
        for label, ts in times.items():
            t = C.med(ts)
            ratio = f"{base / t:.2f}x" if base and not label.startswith("torch") else "1.00x" if base else "-"
            best = f"{base_min / min(ts):.2f}x" if base else "-"
            cpu = f"{res['cpu'][label] * 1e3:.0f}/{other['cpu'][label] * 1e3:.0f}"
            rows.append((res["case"], res["schedule"], label, f"{opts.batch / t:.1f}", C.fmt_ms(t),
                         C.spread(ts), ratio, best, cpu, res["splits"][label]))
        for label, err in res["errors"].items():
            rows.append((res["case"], res["schedule"], label, "-", "-", "-", "-", "-", "-",
                         f"FAILED: {err}"))
    print(C.table(rows, ("case", "schedule", "system", "samples/s", "ms/step", "spread",
                         "vs peer", "vs peer (best runs)", "CPU ms/step", "split (stage 0 | stage 1)")))


if __name__ == "__main__":
    main()
