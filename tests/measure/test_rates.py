"""measure/rates.py: this machine's matmul rate agrees with a matmul timed here, the fixed cost of
a pipeline action is a plausible per-action time, and a cache measures each once."""

from __future__ import annotations

import time

import torch

from pipecompile.ir.compile_cache import CompileCache
from pipecompile.measure import rates


def _timed_rate(n: int, repeats: int = 5) -> float:
    """FLOP/s of the fastest of a few n x n x n fp32 matmuls, timed independently."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    best = min(_clock(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _clock(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_matmul_rate_agrees_with_a_matmul_timed_here():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no intra-op threads spinning against another test's processes
    try:
        best = max(rates.matmul_rate("cpu", 256, 5) for _ in range(3))
        here = _timed_rate(256)
    finally:
        torch.set_num_threads(threads)
    # the best of three medians against our fastest run, on a shared machine: within a factor
    # of a few (a formula off by a factor n = 256, or timing the wrong thing, is far outside)
    assert here / 20 < best < here * 5, (best, here)
    assert 1e8 < best < 1e14  # a CPU core to a large accelerator, in FLOP/s


def test_a_cache_measures_each_setting_once():
    cache = CompileCache(maxsize=8)
    first = rates.matmul_rate("cpu", 128, 3, cache=cache)
    assert rates.matmul_rate("cpu", 128, 3, cache=cache) == first  # kept, not measured again
    assert (cache.hits, cache.misses) == (1, 1)
    rates.matmul_rate("cpu", 64, 3, cache=cache)  # another size: measured
    assert cache.misses == 2


def test_action_overhead_is_a_plausible_per_action_time():
    cache = CompileCache(maxsize=8)
    overhead = rates.action_overhead("cpu", 3, cache=cache)
    # Python dispatch, autograd set-up and a thread hand-off per action: between a microsecond
    # and a tenth of a second, even on a loaded 2-core machine
    assert 1e-6 < overhead < 0.1, overhead
    assert rates.action_overhead("cpu", 3, cache=cache) == overhead
