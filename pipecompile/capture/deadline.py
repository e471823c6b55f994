"""deadline: run a call for at most a number of seconds, in whatever thread calls it.

torch.export can spend unbounded time in sympy (every size of a MaxViT-style model's input
symbolic: over 15 minutes), and a Python thread cannot be killed. `within` runs the call in
the calling thread and, once the time is up, a watchdog thread raises `Expired` *inside* it
(CPython's `PyThreadState_SetAsyncExc`): it arrives at the next bytecode the thread runs, so
pure-Python work such as sympy's stops within milliseconds, and every `finally` and `with`
on the way out runs as for any other exception. Unlike `signal.alarm` this works in any
thread, not only the main one.

    within(seconds, fn)   fn()'s result, or `TimeUp` when fn was stopped at the deadline

`Expired` derives from `BaseException`, so code that handles `Exception` lets it through; if
something swallows it anyway, it is raised again every `_AGAIN` seconds until fn returns. A
call blocked inside one long C function is stopped only when that function returns.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

__all__ = ["Expired", "TimeUp", "within"]

T = TypeVar("T")
_AGAIN = 1.0  # seconds between raises, where a raise was swallowed


class Expired(BaseException):
    """Raised inside the thread running `within`'s call when its time is up."""


class TimeUp(Exception):
    """`within`'s call was stopped at its deadline."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"did not finish within {seconds:g} s")
        self.seconds = seconds


def within(seconds: float, fn: Callable[[], T]) -> T:
    """`fn()`, stopped after `seconds` (then `TimeUp`, with fn's exception as its cause)."""
    watch = _Watch(threading.get_ident(), seconds)
    watch.start()
    try:
        try:
            return fn()
        finally:
            watch.stop()
    except BaseException as exc:
        watch.stop()  # again: a raise may have cut the first stop short
        if watch.fired:
            raise TimeUp(seconds) from exc
        raise


class _Watch:
    """The watchdog of one `within` call: raises `Expired` in `target` from `seconds` on."""

    def __init__(self, target: int, seconds: float) -> None:
        self.target, self.seconds = target, seconds
        self.fired = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipecompile-deadline",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No raise after this returns; one raised but not yet delivered is withdrawn."""
        while True:
            try:
                with self._lock:
                    self._stopped.set()
                    if self.fired:
                        _raise_in(self.target, None)
                return
            except Expired:  # delivered while stopping: stop again, the watchdog has not
                continue

    def _run(self) -> None:
        wait = self.seconds
        while not self._stopped.wait(wait):
            with self._lock:
                if self._stopped.is_set():
                    return
                self.fired = True
                _raise_in(self.target, Expired)
            wait = _AGAIN


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Have `thread_id` raise `exc` at its next bytecode (None withdraws a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)
