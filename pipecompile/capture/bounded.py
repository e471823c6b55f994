"""bounded: whether a call finishes within a time budget, found out in a child process.

torch.export can spend unbounded time in sympy (every size of a MaxViT-style model's input
symbolic: over 15 minutes, against seconds with the batch alone). A thread cannot be stopped
safely from outside: an exception raised into it asynchronously lands at whatever bytecode it
runs next (a gc callback, a `finally` block, torch's dispatcher state, after the call has
returned). A child process can be killed. So a call that may not finish is first run in a
forked child, which the caller kills at the deadline:

    finishes_within(seconds, fn) -> Outcome.FINISHED   fn returned or raised in time: the caller
                                                       runs fn itself, knowing it ends (export is
                                                       deterministic: the same work again)
                                 -> Outcome.TIMED_OUT  killed at the deadline
                                 -> Outcome.DIED       the child ended by a signal (e.g. a lock a
                                                       thread of this process held at the fork)
                                 -> Outcome.UNBOUNDED  no fork on this platform: not tried

Nothing of the child's work comes back; it shares nothing the caller uses afterwards, and it
leaves by `os._exit` (no atexit handlers, no buffered output written twice). The child limits
torch to one thread, as torch's DataLoader workers do: a forked OpenMP pool is not safe to use.
"""

from __future__ import annotations

import enum
import os
import signal
import time
import warnings
from typing import Callable

__all__ = ["Outcome", "finishes_within"]

_POLL = 0.02  # seconds between checks of the child

_FORK_WARNING = r"This process .* is multi-threaded, use of fork\(\)"


class Outcome(enum.Enum):
    """How a bounded call ended in the child (see the module docstring)."""

    FINISHED = "finished"
    TIMED_OUT = "timed out"
    DIED = "died"
    UNBOUNDED = "unbounded"


def finishes_within(seconds: float, fn: Callable[[], object]) -> Outcome:
    """Run `fn()` in a forked child for at most `seconds`; how it ended (see the docstring)."""
    if not hasattr(os, "fork"):
        return Outcome.UNBOUNDED
    _ignore_fork_warning()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _run_child(fn)
    return _wait(pid, seconds)


def _ignore_fork_warning() -> None:
    """Python 3.12+ warns on a fork while threads run (the child here only exports and exits).
    One filter for that message from this module, added when missing: wrapping the fork in
    `warnings.catch_warnings()` would swap the filters of every thread for its duration."""
    if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern == _FORK_WARNING
               for f in warnings.filters):
        warnings.filterwarnings("ignore", message=_FORK_WARNING, category=DeprecationWarning,
                                module=__name__.replace(".", r"\."))


def _run_child(fn: Callable[[], object]) -> None:
    code = 0
    try:
        import torch

        torch.set_num_threads(1)
        fn()
    except BaseException:  # noqa: BLE001 - an exception is an ending too: the caller sees it
        code = 1
    finally:
        os._exit(code)


def _wait(pid: int, seconds: float) -> Outcome:
    """The child's outcome; it is killed at the deadline, and reaped in every case."""
    deadline = time.monotonic() + seconds
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return Outcome.DIED if os.WIFSIGNALED(status) else Outcome.FINISHED
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
    except BaseException:  # the caller was interrupted: the child must not outlive it
        _kill(pid)
        raise
    _kill(pid)
    return Outcome.TIMED_OUT


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):  # already ended and reaped
        pass
