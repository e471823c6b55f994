"""Step time with and without compile_stages=True (each stage graph through torch.compile).

A GPT on 2 device threads (one intra-op thread each), in one process. Per schedule: the first
compiled step (compilation included) and the graphs dynamo compiled, then the median step time
of both pipelines over alternating rounds (eager first in even rounds, compiled first in odd
ones, so drifting load on a shared machine hits both alike), the mean F, B, I and W action
times of the last step, and how far the compiled step's loss and gradients are from the
uncompiled one's (float32, relative to each gradient's largest entry).

    python bench/compile_stages.py            # d=128, 8 layers, batch 16x64, m=8
    python bench/compile_stages.py --quick    # smaller, fewer rounds
    python bench/compile_stages.py --cold     # inductor's graph caches off
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import pipecompile as pc  # noqa: E402
from pipecompile import zoo  # noqa: E402
from pipecompile.runtime.compiled import compiled_graphs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--schedules", default="1f1b,zb-h1")
    parser.add_argument("--cold", action="store_true",
                        help="inductor's graph caches off (C++ kernels already built on disk "
                             "are still loaded: not a first-ever compile)")
    opts = parser.parse_args()
    if opts.cold:
        import torch._inductor.config as inductor_config
        inductor_config.force_disable_caches = True
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dim, layers, seq, batch = (64, 4, 32, 16) if opts.quick else (128, 8, 64, 16)
    rounds, steps = (3, 2) if opts.quick else (5, 3)
    m = 8
    model = zoo.GPT(vocab=512, dim=dim, layers=layers, heads=4, seq=seq)
    x = torch.randint(0, 512, (batch, seq))
    y = torch.randint(0, 512, (batch, seq))
    print(f"GPT d={dim} layers={layers} batch {batch}x{seq}, m={m}, 2 devices (threads), "
          f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}, "
          f"{rounds} rounds x {steps} steps each, inductor caches "
          f"{'off' if opts.cold else 'on (a graph compiled before is loaded)'}")
    header = (f"{'schedule':<8}{'compile s':>10}{'graphs':>7}{'eager ms':>10}{'compiled ms':>12}"
              f"{'speedup':>8}{'loss rel':>10}{'grad rel':>10}  F/B/I/W ms eager -> compiled")
    print(header)
    print("-" * len(header))
    for name in opts.schedules.split(","):
        _row(name, model, x, y, m, rounds, steps)


def _row(name, model, x, y, m, rounds, steps) -> None:
    def build(flag):
        return pc.compile(copy.deepcopy(model), (x,), devices=["cpu", "cpu"], microbatches=m,
                          schedule=name, loss_fn=zoo.lm_loss, compile_stages=flag)

    eager, compiled = build(False), build(True)
    eager_loss = eager.step(x, target=y)
    graphs = compiled_graphs()
    began = time.perf_counter()
    loss = compiled.step(x, target=y)
    compile_s = time.perf_counter() - began
    graphs = compiled_graphs() - graphs
    loss_rel = abs(loss.item() - eager_loss.item()) / abs(eager_loss.item())
    grad_rel = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                   for p, q in zip(compiled.parameters(), eager.parameters())
                   if q.grad is not None and q.grad.abs().max() > 0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for flag in ((False, True) if r % 2 == 0 else (True, False)):
            pipe = compiled if flag else eager
            for _ in range(steps):
                began = time.perf_counter()
                pipe.step(x, target=y)
                times[flag].append(time.perf_counter() - began)
    a, b = statistics.median(times[False]), statistics.median(times[True])
    print(f"{name:<8}{compile_s:>10.1f}{graphs:>7}{a * 1e3:>10.1f}{b * 1e3:>12.1f}"
          f"{a / b:>7.2f}x{loss_rel:>10.1e}{grad_rel:>10.1e}  "
          f"{_actions(eager)} -> {_actions(compiled)}")


def _actions(pipe) -> str:
    """Mean duration (ms) of each compute action kind in the pipeline's last step."""
    spans: dict[str, list[float]] = {}
    for event in pipe.timeline().events:
        kind = event.action.kind.value
        if kind in ("F", "B", "I", "W"):
            spans.setdefault(kind, []).append(event.end - event.start)
    return "/".join(f"{statistics.mean(spans[k]) * 1e3:.1f}" if k in spans else "-"
                    for k in ("F", "B", "I", "W"))


if __name__ == "__main__":
    main()
