"""Zero-bubble costs and schedules: the I+W / fused-backward ratio, then step times.

`ratio`: per stage of a small GPT and an MLP (captured by torch.export, as the runtime runs
them), the median time of I (input gradients) plus W (weight gradients) over the median of one
fused backward, measured in the same run, alternating: for the frontier split
(`split_backward`, kept for stages with convolutions) and for deferred linears (`weight_store`,
what the runtime runs otherwise). `steps`: 1f1b vs zb-h1 vs zb-v vs interleaved-zb step time and
measured bubble on device threads (one process) at m = 8, medians of alternating rounds.

    python bench/zero_bubble.py ratio
    python bench/zero_bubble.py steps --devices 4
    python bench/zero_bubble.py ranks --devices 2    # gloo ranks, one process per rank
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402
import pipecompile as pc  # noqa: E402
from pipecompile import zoo  # noqa: E402
from pipecompile.runtime.split_backward import backward_input, backward_weight  # noqa: E402
from pipecompile.runtime.weight_store import WeightGradStore, collecting, defer_weight_grads

SCHEDULES = ["1f1b", "zb-h1", "zb-v", "interleaved-zb"]


def _stages():
    """(name, module, input builder) per stage: GPT blocks and MLP chunks."""
    torch.manual_seed(0)
    dim, seq, batch = 128, 64, 2
    gpt = zoo.GPT(vocab=512, dim=dim, layers=4, heads=4, seq=seq)
    for i in range(0, 4, 2):
        yield f"gpt blocks {i}-{i + 1}", nn.Sequential(*gpt.layers[i:i + 2]), \
            lambda: torch.randn(batch, seq, dim)
    mlp = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.GELU())])
    yield "mlp 4x512", mlp, lambda: torch.randn(64, 512)


def _fused(module, x, grad) -> float:
    leaf = x.detach().requires_grad_(True)
    out = module(leaf)
    t0 = time.perf_counter()
    torch.autograd.backward([out], [grad])
    return time.perf_counter() - t0


def _frontier(module, x, grad) -> tuple[float, float]:
    """I then W by `split_backward` (the frontier walk: stages with convolutions)."""
    leaf = x.detach().requires_grad_(True)
    out = module(leaf)
    params = [p for p in module.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    _, work = backward_input([out], [grad], [leaf], params)
    t1 = time.perf_counter()
    backward_weight(work)
    return t1 - t0, time.perf_counter() - t1


def _deferred(module, x, grad) -> tuple[float, float]:
    """I then W through deferred linears (`weight_store`: what zero-bubble stages run)."""
    leaf = x.detach().requires_grad_(True)
    # the stage alone holds its parameters, as an untied stage's do: W adds into .grad itself
    store = WeightGradStore(frozenset(id(p) for p in module.parameters()))
    with collecting(store):
        out = module(leaf)
    t0 = time.perf_counter()
    torch.autograd.backward([out], [grad])
    t1 = time.perf_counter()
    store.flush()
    return t1 - t0, time.perf_counter() - t1


def ratio(rounds: int) -> None:
    """Per stage (captured by torch.export, as the runtime runs it): B, and I, W and (I+W)/B
    for the frontier split and for deferred linears, alternating in one run."""
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 intra-op thread, medians of {rounds} alternating rounds")
    print(f"{'stage':<18}{'B ms':>7} | {'frontier: I':>12}{'W':>6}{'(I+W)/B':>9} | "
          f"{'deferred: I':>12}{'W':>6}{'(I+W)/B':>9}")
    for name, module, make in _stages():
        x = make()
        graph = torch.export.export(module, (x,)).module()
        deferred = defer_weight_grads(graph)
        grad = torch.randn_like(graph(x))
        runs = {"B": lambda: (_fused(graph, x, grad), 0.0),
                "frontier": lambda: _frontier(graph, x, grad),
                "deferred": lambda: _deferred(deferred, x, grad)}
        times: dict = {what: [] for what in runs}
        for r in range(rounds + 2):
            for what, run in runs.items():
                graph.zero_grad(set_to_none=False)  # .grad exists, as after micro-batch 0
                t = run()
                if r >= 2:  # warm-up rounds
                    times[what].append(t)
        b = statistics.median(i for i, _ in times["B"])
        row = f"{name:<18}{b * 1e3:7.2f}"
        for what in ("frontier", "deferred"):
            i, w = (statistics.median(v[k] for v in times[what]) for k in (0, 1))
            both = statistics.median(a + c for a, c in times[what])
            row += f" | {i * 1e3:12.2f}{w * 1e3:6.2f}{both / b:9.3f}"
        print(row)


def _model():
    torch.manual_seed(0)
    dim, layers, seq, batch = 128, 8, 64, 16
    model = zoo.GPT(vocab=512, dim=dim, layers=layers, heads=4, seq=seq)
    x = torch.randint(0, 512, (batch, seq))
    y = torch.randint(0, 512, (batch, seq))
    return model, x, y


def steps(devices: int, rounds: int, m: int) -> None:
    """Step time and measured bubble per schedule on `devices` threads, alternating rounds."""
    torch.set_num_threads(1)
    model, x, y = _model()
    pipes = {name: pc.compile(model, (x,), devices=devices, microbatches=m, schedule=name,
                              loss_fn=zoo.lm_loss) for name in SCHEDULES}
    times: dict = {n: [] for n in SCHEDULES}
    bubbles: dict = {n: [] for n in SCHEDULES}
    for r in range(rounds + 1):
        for name, pipe in pipes.items():
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            if r:
                times[name].append(time.perf_counter() - t0)
                bubbles[name].append(pipe.timeline().bubble_fraction)
    print(f"GPT d=128 layers=8 batch 16x64, m={m}, {devices} device threads, "
          f"medians of {rounds} alternating rounds")
    print(f"{'schedule':<16}{'stages':>7}{'step ms':>9}{'bubble':>9}")
    for name, pipe in pipes.items():
        print(f"{name:<16}{pipe.schedule.num_stages:>7}{statistics.median(times[name]) * 1e3:9.1f}"
              f"{statistics.median(bubbles[name]):9.1%}")


def _rank(rank: int, world: int, rounds: int, m: int) -> tuple:
    """One rank's median step time and idle share per schedule (run by `_common.spawn`)."""
    model, x, y = _model()
    pipes = {name: pc.compile(model, (x,), devices=world, microbatches=m, schedule=name,
                              loss_fn=zoo.lm_loss) for name in SCHEDULES}
    times: dict = {n: [] for n in SCHEDULES}
    idle: dict = {n: [] for n in SCHEDULES}
    for r in range(rounds + 1):
        for name, pipe in pipes.items():
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            step = time.perf_counter() - t0
            if r:
                busy = sum(e.end - e.start for e in pipe.timeline().events)
                times[name].append(step)
                idle[name].append(1 - busy / step)
    return (rank, {n: statistics.median(t) for n, t in times.items()},
            {n: statistics.median(b) for n, b in idle.items()})


def ranks(world: int, rounds: int, m: int) -> None:
    """Step time per schedule on `world` gloo ranks (one process each), alternating rounds."""
    results = _common.spawn(_rank, world, rounds, m)
    print(f"GPT d=128 layers=8 batch 16x64, m={m}, {world} gloo ranks, 1 intra-op thread "
          f"each, medians of {rounds} alternating rounds (step: the slowest rank's median)")
    print(f"{'schedule':<16}{'step ms':>9}{'idle/rank':>12}")
    for name in SCHEDULES:
        step = max(t[name] for _, t, _ in results)
        idle = statistics.mean(b[name] for _, _, b in results)
        print(f"{name:<16}{step * 1e3:9.1f}{idle:12.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ratio", "steps", "ranks"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--devices", type=int, default=4, help="device threads or ranks")
    parser.add_argument("--m", type=int, default=8)
    opts = parser.parse_args()
    if opts.what == "ratio":
        ratio(opts.rounds)
    elif opts.what == "steps":
        steps(opts.devices, opts.rounds, opts.m)
    else:
        ranks(opts.devices, opts.rounds, opts.m)


if __name__ == "__main__":
    main()
