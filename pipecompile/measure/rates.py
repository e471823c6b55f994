"""This machine's rates: the matmul FLOP rate the analytic cost model divides FLOPs by, and the
fixed cost of one pipeline action as the runtime pays it. Measured once per `CompileCache`
(keyed by the device and the measurement's settings); without a cache, every call measures."""

from __future__ import annotations

import time

import torch

from ..ir.compile_cache import CompileCache
from .clock import kernel_seconds
from ..passes.linearize import linearize
from ..schedule.schedules import make_schedule
from ..schedule.simulate import StageCosts, simulate

__all__ = ["matmul_rate", "action_overhead"]


def matmul_rate(device: str, n: int = 512, repeats: int = 5, *,
                cache: CompileCache | None = None) -> float:
    """FLOP/s of an n×n×n fp32 matmul on `device`: the median run by
    `torch.utils.benchmark.Timer` (`clock.kernel_seconds`) over 20 ms per repeat (about 0.1 s
    on a CPU, with torch's threads)."""
    if cache is not None:
        return cache.get(("matmul_rate", device, n, repeats),
                         lambda: matmul_rate(device, n, repeats))
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    return 2 * n**3 / kernel_seconds(lambda: a @ b, min_run_time=0.02 * repeats)


def action_overhead(device: str, repeats: int = 7, *, cache: CompileCache | None = None) -> float:
    """Fixed seconds of one pipeline action on `device`, as the runtime pays it: executor
    dispatch, Python, autograd set-up, a device thread handing a message to another.

    Measured on a program whose compute is negligible: two tiny stages on two `device` workers
    run by the real runtime (threads, mailbox, executor) with gpipe and m = 8. The median step
    time over the simulator's makespan of that schedule when every action and message costs
    one unit is the overhead the simulator then charges per action and message (about 0.3 s
    of compile time, once per `cache`). On a small model this is a large part of every
    action's time, so fewer micro-batches win. Timed by hand, not by torch.utils.benchmark: a
    step is many actions on several device threads, whose wall time (not one kernel's) is
    the point."""
    if cache is not None:
        return cache.get(("action_overhead", device, repeats),
                         lambda: action_overhead(device, repeats))
    from ..capture.capture import capture
    from ..passes.split import split
    from ..runtime.assemble import LocalRuntime
    from ..runtime.spec import RuntimeSpec
    from ..runtime.microbatch import split_microbatches

    m = 8
    # on `device`: split keeps the tensors where they are (placing them is the compiler's pass)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 4)).to(device)
    x = torch.randn(2 * m, 4, device=device)
    linear = linearize(capture(model, (x,), method="fx"), granularity="layer")
    devices = [torch.device(device)] * 2
    program = split(linear, (0, 1, linear.num_blocks), devices)
    schedule = make_schedule("gpipe", 2, m)
    spec = RuntimeSpec(microbatches=m, loss_fn=lambda out, y: (out - y).pow(2).mean())
    runtime = LocalRuntime(program, schedule, spec)
    mbs = split_microbatches((x,), {}, torch.zeros(2 * m, 4, device=device), m)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        runtime.run(schedule, mbs, batches=1)
        if devices[0].type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    units = simulate(schedule, [StageCosts(0.0, 0.0)] * 2, overhead=1.0).makespan
    return sorted(times[1:])[repeats // 2] / units
