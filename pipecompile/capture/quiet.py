"""Quiet export: keep torch's output for a failing export off the terminal, for one thread.

A failing torch.export logs warnings (symbolic shapes, guards) and prints the partial graph it
traced (up to thousands of lines) to stderr; capture makes several attempts, so a user would
see each. `quiet()` collects, from the calling thread only and for the length of the call:

    records below ERROR of torch's export loggers   a filter on the handlers they reach (torch
                                                    gives many of its loggers a handler of its
                                                    own); no logger's level changes
    what the thread writes to sys.stderr            one routing stream shared by every quiet
                                                    thread: each one's writes go to its own
                                                    buffer, every other thread's to the stream
                                                    that was there before

The collected text becomes the error's details (`compile(..., verbose=True)` shows it as it
happens). With ``TORCH_LOGS`` set, the user asked torch to log: nothing is collected.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from typing import Iterator, TextIO

__all__ = ["quiet", "NOISY_LOGGERS"]

NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export",
                 "torch._dynamo", "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[io.StringIO]:
    """Collect what torch's export logs below ERROR and writes to stderr from this thread,
    into the buffer yielded (see the module docstring); with `verbose` or ``TORCH_LOGS`` set,
    collect nothing."""
    buffer = io.StringIO()
    if verbose or os.environ.get("TORCH_LOGS"):
        yield buffer
        return
    thread = threading.get_ident()
    collect = _Collect(buffer, thread)
    handlers = _handlers(NOISY_LOGGERS)
    for handler in handlers:
        handler.addFilter(collect)
    _Routed.enter(thread, buffer)
    try:
        yield buffer
    finally:
        _Routed.leave(thread)
        for handler in handlers:
            handler.removeFilter(collect)


class _Collect(logging.Filter):
    """A handler filter keeping one thread's records below ERROR from `NOISY_LOGGERS` (and
    their children) in a buffer instead."""

    def __init__(self, buffer: io.StringIO, thread: int):
        super().__init__()
        self.buffer, self.thread = buffer, thread

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread or record.levelno >= logging.ERROR or not any(
                record.name == n or record.name.startswith(n + ".") for n in NOISY_LOGGERS):
            return True
        self.buffer.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")
        return False


def _handlers(names: tuple[str, ...]) -> list[logging.Handler]:
    """The handlers the records of loggers `names` and their children reach."""
    known = [n for n, lg in list(logging.Logger.manager.loggerDict.items())
             if isinstance(lg, logging.Logger)]
    found: list[logging.Handler] = []
    for name in [n for n in known if any(n == m or n.startswith(m + ".") for m in names)]:
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            found += [h for h in logger.handlers if h not in found]
            logger = logger.parent if logger.propagate else None
    return found


class _Routed(io.TextIOBase):
    """sys.stderr while some thread is quiet: each quiet thread's writes go to its buffer, the
    others' to the stream that was sys.stderr before the first quiet thread came."""

    _lock = threading.Lock()
    _buffers: dict[int, list[io.StringIO]] = {}  # per thread, innermost quiet call last
    _installed: "_Routed | None" = None

    def __init__(self, original: TextIO):
        super().__init__()
        self.original = original

    def write(self, text: str) -> int:
        buffers = self._buffers.get(threading.get_ident())
        return (buffers[-1] if buffers else self.original).write(text)

    def flush(self) -> None:
        self.original.flush()

    @classmethod
    def enter(cls, thread: int, buffer: io.StringIO) -> None:
        with cls._lock:
            cls._buffers.setdefault(thread, []).append(buffer)
            if cls._installed is None or sys.stderr is not cls._installed:
                cls._installed = cls(sys.stderr)
                sys.stderr = cls._installed

    @classmethod
    def leave(cls, thread: int) -> None:
        with cls._lock:
            held = cls._buffers.get(thread, [])
            if held:
                held.pop()
            if not held:
                cls._buffers.pop(thread, None)
            if not cls._buffers and cls._installed is not None:
                if sys.stderr is cls._installed:
                    sys.stderr = cls._installed.original
                cls._installed = None
