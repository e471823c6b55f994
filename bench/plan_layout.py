"""The layout of a Llama-3 shape on an H100 cluster, chosen by the search (planned, not run).

For each case, the model (`examples/factories.py`, on the meta device, bfloat16) is compiled
for `pipecompile.cluster("h100", nodes=N, per_node=8)` with `data_parallel="auto"`,
`fsdp="auto"`, AdamW state counted and every other option "auto", from the global batch; the
table lists every layout the search compared (P x D, sharding, what a node holds), its best
plan's predicted step, tokens/s per GPU, MFU and its fullest device. MFU uses the issue's
FLOP count, (6 N + 12 L h s) per token at the BF16 dense peak 989.4 TFLOP/s; the winner's own
report (`print(pipe)`) uses 3 x the counted forward FLOPs. Each case runs in a fresh
subprocess so its peak RSS and time are its own.

    python bench/plan_layout.py                     # 70B on 64 GPUs, 8B on 8 and 64 GPUs
    python bench/plan_layout.py --case 70b-64
    python bench/plan_layout.py --case 70b-64-tp    # tensor_parallel="auto" too
    python bench/plan_layout.py --case 70b-64-tp-sp # and sequence_parallel="auto"
    python bench/plan_layout.py --case 70b-64-recipe  # NVIDIA's recipe, given (below)

`70b-64-recipe` is not searched: NVIDIA's Llama-3-70B recipe on 64 H100 given by hand,
`data_parallel=2, tensor_parallel=4, sequence_parallel=True, schedule="interleaved-1f1b",
virtual_stages=5, microbatches=64, checkpoint="auto"` (P = 8 follows; `fsdp=False`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import _common as C

CASES = {  # name: factory, layers, hidden, nodes, global batch, sequence
    "70b-64": ("llama3_70b", 80, 8192, 8, 128, 8192),
    "70b-64-tp": ("llama3_70b", 80, 8192, 8, 128, 8192),  # tensor_parallel="auto"
    "70b-64-tp-sp": ("llama3_70b", 80, 8192, 8, 128, 8192),  # and sequence_parallel="auto"
    "70b-64-recipe": ("llama3_70b", 80, 8192, 8, 128, 8192),  # NVIDIA's recipe (RECIPE)
    "8b-8": ("llama3_8b", 32, 4096, 1, 16, 8192),
    "8b-64": ("llama3_8b", 32, 4096, 8, 128, 8192),
}
PEAK = 989.4e12
RECIPE = dict(data_parallel=2, tensor_parallel=4, sequence_parallel=True,
              schedule="interleaved-1f1b", virtual_stages=5, microbatches=64,
              checkpoint="auto", fsdp=False)


def one(name: str) -> dict:
    """Plan one case in this process; what the parent prints (JSON)."""
    factory_name, layers, hidden, nodes, batch, seq = CASES[name]
    sys.path.insert(0, os.path.join(C.ROOT, "examples"))
    import torch

    import factories
    import pipecompile as pc

    model, args, kwargs = getattr(factories, factory_name)(layers=layers, batch=batch, seq=seq)
    n = sum(p.numel() for p in model.parameters())
    start, cpu = time.perf_counter(), time.process_time()
    searched = dict(data_parallel="auto", fsdp="auto",
                    tensor_parallel="auto" if "-tp" in name else 1)
    if name.endswith("-sp"):
        searched["sequence_parallel"] = "auto"
    pipe = pc.compile(model, args, kwargs, devices=pc.cluster("h100", nodes=nodes, per_node=8),
                      **(RECIPE if name.endswith("-recipe") else searched),
                      optimizer=lambda p: torch.optim.AdamW(p))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    devices = nodes * 8
    flops = (6 * n + 12 * layers * hidden * seq) * batch * seq
    rows = [dict(layout=str(c.layout), step=c.step, fits=c.fits, plan=(
        f"{c.schedule} m={c.microbatches} v={c.virtual_stages}" + (
            f" recompute {c.recomputed}" if c.recomputed else "")) if c.fits else "-",
        memory=c.memory, reason=c.reason or "chosen",
        tokens=batch * seq / c.step / devices if c.fits else 0.0,
        mfu=flops / (c.step * devices * PEAK) if c.fits else 0.0)
        for c in pipe.plan.search.layouts]
    return dict(name=name, params=n, wall=wall, cpu=cpu,
                rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                passes={r.name: r.seconds for r in pipe.plan.passes}, rows=rows,
                report=str(pipe))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=list(CASES), action="append")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        print(json.dumps(one(opts.one)))
        return
    print(f"# layouts chosen by the search; {C.machine()}, load {C.loadavg()}")
    for name in opts.case or [c for c in CASES if not c.endswith(("-tp", "-recipe"))]:
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                              text=True)
        if done.returncode != 0:
            print(f"{name} failed:\n{done.stderr[-3000:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"\n## {name}: {r['params'] / 1e9:.1f}B parameters; compile {r['wall']:.0f} s "
              f"wall, {r['cpu']:.0f} s CPU (capture {r['passes'].get('capture', 0):.0f} s, "
              f"search {r['passes'].get('search', 0):.0f} s), peak RSS "
              f"{r['rss'] / 2**30:.2f} GiB")
        print(C.table([(x["layout"], x["plan"], f"{x['step']:.2f}" if x["fits"] else "-",
                        f"{x['tokens']:,.0f}" if x["fits"] else "-",
                        f"{x['mfu']:.1%}" if x["fits"] else "-",
                        f"{x['memory'] / 2**30:.1f} GiB" if x["fits"] else "-", x["reason"])
                       for x in r["rows"]],
                      ("layout", "plan", "step s", "tokens/s/GPU", "MFU", "max memory",
                       "verdict")))
        print("\n" + r["report"].splitlines()[-2] + "\n" + r["report"].splitlines()[-1])


if __name__ == "__main__":
    main()
