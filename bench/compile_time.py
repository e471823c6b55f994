"""Compile time: seconds of every compiler pass and of the whole `pc.compile`, by model depth.

Models: zoo.GPT (d=128, 4 heads, vocab 512, seq 64, untied) with 12, 24, 48 and 96 layers, and
transformers GPT-2 (same sizes) with 12 and 24 layers; batch 16, 8 micro-batches, 4 devices,
1f1b, analytic costs. Each model is built fresh and compiled `--reps` times (the median per
column is printed, and the spread of the total). "wall" is the wall time of the `pc.compile`
call; the pass columns come from `pipe.plan.passes` (their sum can be below wall: the rest is
argument checks, building the Pipeline and the simulated schedule). Annotate's per-process
cache of symbolic costs is cleared before each compile: every rep is a first compile.

    python bench/compile_time.py           # 12/24/48/96-layer GPT, 12/24-layer GPT-2
    python bench/compile_time.py --quick   # 12/24/48-layer GPT, 12-layer GPT-2, one run each
    python bench/compile_time.py --symbolic-sizes batch   # sequence length fixed
"""

from __future__ import annotations

import argparse
import time

import _common as C
import torch

import pipecompile as pc
from pipecompile.ir.compile_cache import CompileCache

PASSES = ["capture", "probe", "search", "linearize", "annotate", "partition", "split", "schedule"]


def _model(kind: str, layers: int):
    torch.manual_seed(0)
    if kind == "zoo.GPT":
        return C.gpt(vocab=512, dim=128, layers=layers, heads=4, seq=64, tied=False), C.ce
    return C.gpt2(layers=layers, dim=128, heads=4, vocab=512, seq=64, tied=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--symbolic-sizes", choices=["all", "batch"], default="all",
                        help="compile's symbolic_sizes: 'batch' keeps the sequence length fixed")
    opts = parser.parse_args()
    reps = opts.reps or (1 if opts.quick else 3)
    torch.set_num_threads(1)
    cases = ([("zoo.GPT", n) for n in (12, 24, 48)] + [("GPT-2", 12)] if opts.quick else
             [("zoo.GPT", n) for n in (12, 24, 48, 96)] + [("GPT-2", n) for n in (12, 24)])
    rows, load = [], C.loadavg()
    for kind, layers in cases:
        walls, per_pass, summary = [], {p: [] for p in PASSES}, ""
        for _ in range(reps):
            model, loss_fn = _model(kind, layers)
            x = torch.randint(0, 512, (16, 64))
            cache = CompileCache()  # a first compile: nothing kept from the last rep
            t0 = time.perf_counter()
            pipe = pc.compile(model, (x,), devices=4, microbatches=8, schedule="1f1b",
                              loss_fn=loss_fn, symbolic_sizes=opts.symbolic_sizes, cache=cache)
            walls.append(time.perf_counter() - t0)
            for record in pipe.plan.passes:
                if record.name in per_pass:
                    per_pass[record.name].append(record.seconds)
            summary = next(r.summary for r in pipe.plan.passes if r.name == "linearize")
        rows.append((kind, layers, summary.split(",")[0],
                     *[f"{C.med(per_pass[p]):.3f}" if per_pass[p] else "-" for p in PASSES],
                     f"{C.med(walls):.2f}", C.spread(walls)))
        print(f"done: {kind} {layers} layers", flush=True)
    print(f"\n# Compile time (seconds)\n{C.machine()}, 1 intra-op thread; median of {reps} "
          f"compile(s), 4 devices, 1f1b, analytic costs, symbolic_sizes={opts.symbolic_sizes!r}; "
          f"load average {load} at start\n")
    print(C.table(rows, ("model", "layers", "blocks", *PASSES, "wall s", "spread")))


if __name__ == "__main__":
    main()
