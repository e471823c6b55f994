"""measure/clock.py: a kernel timed by torch.utils.benchmark with torch's thread count, one call
timed by the wall clock on a CPU and by CUDA events (milliseconds to seconds) on a CUDA
device."""

from __future__ import annotations

import time

import torch

from pipecompile.measure import clock


def test_kernel_seconds_runs_the_kernel_with_torchs_threads_and_gives_its_median():
    threads = torch.get_num_threads()
    seen: list[int] = []

    def kernel() -> None:
        seen.append(torch.get_num_threads())
        time.sleep(0.002)

    torch.set_num_threads(2)
    try:
        seconds = clock.kernel_seconds(kernel, min_run_time=0.02)
    finally:
        torch.set_num_threads(threads)
    assert set(seen) == {2}  # Timer's own default would be one thread
    assert len(seen) >= 5  # warm-up and block-size estimate, then blocks until 0.02 s
    assert seconds >= 0.002  # the median of one call, not of a block of several


def test_elapsed_on_the_cpu_is_the_wall_clock_and_uses_no_cuda_event(monkeypatch):
    def no_events(*args, **kwargs):
        raise AssertionError("a CUDA event on the CPU path")

    monkeypatch.setattr(torch.cuda, "Event", no_events)
    assert clock.elapsed(lambda: time.sleep(0.01), torch.device("cpu")) >= 0.01
    assert clock.elapsed(lambda: time.sleep(0.01)) >= 0.01


def test_elapsed_on_a_cuda_device_reads_two_events_around_the_call(monkeypatch):
    calls: list[str] = []
    made: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.name = "end" if made else "start"  # the first one made opens the span
            made.append(self.name)

        def record(self, stream=None):
            assert stream == "stream of cuda:1"
            calls.append(f"record {self.name}")

        def synchronize(self):
            calls.append(f"synchronize {self.name}")

        def elapsed_time(self, other):
            assert (self.name, other.name) == ("start", "end")
            return 250.0  # milliseconds, as torch gives them

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: calls.append(f"synchronize {device}"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    seconds = clock.elapsed(lambda: calls.append("fn"), "cuda:1")
    assert seconds == 0.25
    assert calls == ["synchronize cuda:1", "record start", "fn", "record end", "synchronize end"]
