"""Quiet export: keep torch's output for a failing export off the terminal, for one thread.

A failing torch.export logs warnings (symbolic shapes, guards) and prints the partial graph it
traced (up to thousands of lines, once per nested export call) to stderr; capture makes several
attempts, so a user would see each. `quiet()` collects, from the calling thread only and for
the length of the call:

    records below ERROR of torch's export loggers   a filter on the handlers they reach (torch
                                                    gives many of its loggers a handler of its
                                                    own); no logger's level changes
    the partial graph torch.export prints           torch.export's own module (`_trace`) sees,
                                                    as its `sys`, a stand-in whose `stderr` is
                                                    the quiet thread's buffer (any other thread:
                                                    sys.stderr itself)

Nothing replaces the process's `sys.stderr` or file descriptor 2: another thread's writes, and
this thread's own, go where they went. Python warnings are left to the `warnings` module and
the user's filters (`warnings.catch_warnings` changes them for every thread). The collected
text becomes the error's details (`compile(..., verbose=True)` shows it as it happens). With
``TORCH_LOGS`` set, the user asked torch to log: nothing is collected, and torch's loggers keep
the levels it gave them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from typing import Any, Iterator, TextIO

__all__ = ["quiet", "NOISY_LOGGERS"]

NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export",
                 "torch._dynamo", "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[io.StringIO]:
    """Collect what torch's export logs below ERROR and prints to stderr from this thread, into
    the buffer yielded (see the module docstring); with `verbose` or ``TORCH_LOGS`` set,
    collect nothing."""
    buffer = io.StringIO()
    if verbose or os.environ.get("TORCH_LOGS"):
        yield buffer
        return
    collect = _Collect(buffer, threading.get_ident())
    handlers = _handlers(NOISY_LOGGERS)
    for handler in handlers:
        handler.addFilter(collect)
    _ExportSys.install()
    held = _ExportSys.held()
    held.append(buffer)
    try:
        yield buffer
    finally:
        held.pop()
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


class _ExportSys:
    """`torch.export._trace`'s `sys`: the `sys` module in every respect but `stderr`, which for
    a thread inside `quiet()` is its innermost buffer. Installed once and left: outside
    `quiet()` it is `sys` (a thread-local stack, so threads never see each other's buffers)."""

    _local = threading.local()
    _lock = threading.Lock()

    @classmethod
    def held(cls) -> list[io.StringIO]:
        """This thread's buffers, innermost last."""
        if not hasattr(cls._local, "buffers"):
            cls._local.buffers = []
        return cls._local.buffers

    @property
    def stderr(self) -> TextIO:
        buffers = self.held()
        return buffers[-1] if buffers else sys.stderr

    def __getattr__(self, name: str) -> Any:
        return getattr(sys, name)

    @classmethod
    def install(cls) -> None:
        """Stand in for `sys` in torch.export's tracing module, when it imports `sys` as this
        torch does (another torch keeps printing its partial graph: harmless)."""
        from torch.export import _trace

        with cls._lock:
            if getattr(_trace, "sys", None) is sys:
                setattr(_trace, "sys", cls())
