"""Profiling: every runtime action as a named `torch.profiler.record_function` range.

A profiled step shows each stage's operators under the action that ran them::

    with torch.profiler.profile() as prof:
        pipe.step(x, target=y)
    # ranges PP:0F0, PP:0SEND_F0>1, PP:1RECV_F0<0, PP:1F0, PP:1B0, ..., PP:0STEP, each holding
    # the aten:: operators (aten::addmm, aten::mm of the backward, ...) its action ran

Names follow torch.distributed.pipelining's convention (`schedules._get_profiler_function_name`:
``f"PP:{action}"``) with pipecompile's action text (`schedule.actions`), whose sends and
receives also name their peer stage (``PP:0SEND_F3>2``): one range per action, unique per step.

Threads. torch.profiler records only the thread that entered it (its state is thread-local;
Python offers no way to hand it to a thread started later), so in one process a profiled step
runs every device row in the calling thread, interleaved as the schedule allows (the
executor's one-thread mode: the same actions, in the same order per device, the same values).
A profiler entered with ``experimental_config=_ExperimentalConfig(profile_all_threads=True)``
records every thread: then the device threads run as usual. Under torchrun each rank runs its
row in the calling thread and is recorded as is.

Cost when nothing profiles: entering a `record_function` costs tens of microseconds even with
the profiler off (it builds a RecordFunction through the dispatcher), so `span` first reads
torch's flag for an active profiler (a module attribute) and hands back one shared no-op
context otherwise.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
import torch.autograd.profiler as _autograd_profiler

__all__ = ["range_name", "span", "profiling", "thread_local_session"]

_NOTHING: ContextManager[None] = contextlib.nullcontext()


def range_name(action: object) -> str:
    """The profiler range of an action: ``PP:`` and its text, e.g. ``PP:1F3``."""
    return f"PP:{action}"


def profiling() -> bool:
    """Whether a torch profiler is active anywhere in the process (torch's own flag, set while
    `torch.profiler.profile` / `torch.autograd.profiler.profile` is entered)."""
    return bool(_autograd_profiler._is_profiler_enabled)


def thread_local_session() -> bool:
    """Whether the calling thread runs a profiler that records this thread only (the default):
    threads this thread starts would not be recorded."""
    return torch._C._autograd._profiler_enabled()


def span(name: str) -> ContextManager[object]:
    """A `record_function` range named `name` while a profiler is active, else a no-op."""
    if _autograd_profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NOTHING
