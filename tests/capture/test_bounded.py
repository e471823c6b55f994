"""bounded.py: a call run in a forked child, killed at its deadline; nothing comes back."""

from __future__ import annotations

import os
import signal
import time

from pipecompile.capture.bounded import Outcome, finishes_within


def test_a_call_that_returns_in_time_finished_and_changed_nothing_here():
    seen: list[int] = []
    assert finishes_within(30, lambda: seen.append(1)) is Outcome.FINISHED
    assert seen == []  # the child's memory, not ours


def test_a_call_that_raises_in_time_finished_too():
    def fail() -> None:
        raise RuntimeError("export failed")

    assert finishes_within(30, fail) is Outcome.FINISHED


def test_a_call_past_the_deadline_is_killed_and_reaped(monkeypatch):
    forked: list[int] = []
    fork = os.fork

    def recording_fork() -> int:
        pid = fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", recording_fork)
    start = time.monotonic()
    assert finishes_within(0.3, lambda: time.sleep(60)) is Outcome.TIMED_OUT
    assert time.monotonic() - start < 30
    assert len(forked) == 1
    try:  # the child is gone: neither running nor a zombie left to reap
        os.waitpid(forked[0], os.WNOHANG)
        gone = False
    except ChildProcessError:
        gone = True
    assert gone


def test_a_child_killed_by_a_signal_died():
    assert finishes_within(30, lambda: os.kill(os.getpid(), signal.SIGKILL)) is Outcome.DIED


def test_the_fork_warning_is_silenced_by_one_narrow_filter_not_catch_warnings():
    import inspect
    import warnings

    from pipecompile.capture import bounded

    assert finishes_within(30, lambda: None) is Outcome.FINISHED
    message = ("This process (pid=12) is multi-threaded, use of fork() may lead to deadlocks "
               "in the child.")
    assert any(action == "ignore" and text is not None and text.match(message)
               and category is DeprecationWarning and module is not None
               and module.match(bounded.__name__)
               for action, text, category, module, _ in warnings.filters)
    assert "catch_warnings" not in inspect.getsource(bounded.finishes_within)
