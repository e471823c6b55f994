"""clock: how every measurement here reads time.

    kernel_seconds(fn)      one repeatable kernel or block (fn() again and again, nothing in
                            between): torch.utils.benchmark.Timer.blocked_autorange, which warms
                            up, picks a block size, synchronises CUDA and gives the median
    elapsed(fn, device)     one call that cannot simply repeat (a forward whose backward comes
                            next, a backward that frees its graph): CUDA events around it on a
                            CUDA device, the wall clock elsewhere

Timer runs with one thread unless told; `kernel_seconds` gives it torch's current count, so a
measurement sees the threads the work will run with.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.utils.benchmark as benchmark

__all__ = ["kernel_seconds", "elapsed", "sync_device"]


def kernel_seconds(fn: Callable[[], object], *, min_run_time: float = 0.1) -> float:
    """Median seconds of one `fn()`, timed by `torch.utils.benchmark.Timer.blocked_autorange`
    for at least `min_run_time` seconds, with torch's current number of threads."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn},
                            num_threads=torch.get_num_threads())
    return float(timer.blocked_autorange(min_run_time=min_run_time).median)


def elapsed(fn: Callable[[], object], device: torch.device | str | None = None) -> float:
    """Seconds `fn()` takes, its device work included. On a CUDA `device`: the span between two
    CUDA events on that device's current stream, recorded around the call once the device is
    idle (so the first is stamped as the call starts, the second after its last kernel).
    Elsewhere the wall clock, with any GPU's queued work waited for before and after."""
    if device is not None and torch.device(device).type == "cuda":
        cuda = torch.device(device)
        torch.cuda.synchronize(cuda)
        stream = torch.cuda.current_stream(cuda)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # milliseconds
    sync_device()
    began = time.perf_counter()
    fn()
    sync_device()
    return time.perf_counter() - began


def sync_device() -> None:
    """Wait for queued GPU work, so that a wall-clock interval measures it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
