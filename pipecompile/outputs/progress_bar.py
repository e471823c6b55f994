"""Compile's progress on a stream: a progress bar on a terminal, plain log lines elsewhere.

`progress_handler(stream)` is the logging handler the CLI puts on the ``pipecompile`` logger.
When the stream is a terminal (``isatty()``), it draws one line, rewritten in place with
``\\r``: the passes done so far out of all of them, or, while a long loop runs (the layout
search, the schedule search, materialisation), that loop's count out of its total::

    pipecompile: [##########..........] 5/11 passes, partition 0.12 s
    pipecompile: [####................] 24/120 layouts, layout search (3.1 s)

Any other record is printed on a line of its own above the bar. `close()` ends the bar's line
with a newline. Elsewhere (a pipe, a file, a CI log) it writes each record as one plain line
(``pipecompile: pass capture: 1.23 s: ...``). The numbers come from the records'
``pipecompile_pass`` and ``pipecompile_progress`` fields (`pipecompile.ir.progress`).
"""

from __future__ import annotations

import logging
import shutil
import sys
from typing import Callable, TextIO

__all__ = ["progress_handler", "PlainLines", "ProgressBar", "BAR_WIDTH"]

BAR_WIDTH = 20  # characters between the brackets
_PREFIX = "pipecompile: "


class PlainLines(logging.StreamHandler):
    """One line per record, ``pipecompile: <message>``, on `stream()` as it is at each record
    (the CLI's stderr may be replaced between two runs in one process)."""

    def __init__(self, stream: Callable[[], TextIO]) -> None:
        super().__init__()
        self._current = stream
        self.setFormatter(logging.Formatter(_PREFIX + "%(message)s"))

    @property
    def stream(self) -> TextIO:
        return self._current()

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


class ProgressBar(PlainLines):
    """A bar rewritten in place for pass and loop records; other records above it (see the
    module docstring)."""

    def __init__(self, stream: Callable[[], TextIO]) -> None:
        super().__init__(stream)
        self.shown = ""  # the bar's text now on the terminal ("" when none is)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            bar = _bar_text(record)
            out = self.stream
            if bar is None:  # a line of its own, the bar drawn again below it
                out.write("\r\x1b[K" + self.format(record) + "\n" + self._fit(self.shown))
            else:
                self.shown = bar
                out.write("\r\x1b[K" + self._fit(bar))
            out.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)

    def close(self) -> None:
        """End the bar's line, so what follows starts on a fresh one."""
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""
        super().close()

    @staticmethod
    def _fit(text: str) -> str:
        """`text` cut to the terminal's width: a line that wraps cannot be rewritten by \\r."""
        if not text:
            return ""
        columns = shutil.get_terminal_size((80, 24)).columns
        line = _PREFIX + text
        return line if len(line) < columns else line[:max(columns - 4, 1)] + "..."


def progress_handler(stream: Callable[[], TextIO] = lambda: sys.stderr) -> PlainLines:
    """A `ProgressBar` when `stream()` is a terminal, else `PlainLines`."""
    target = stream()
    isatty = getattr(target, "isatty", None)
    return ProgressBar(stream) if callable(isatty) and isatty() else PlainLines(stream)


def _bar_text(record: logging.LogRecord) -> str | None:
    """The bar for a pass or loop record (None for any other record)."""
    looped = getattr(record, "pipecompile_progress", None)
    if looped is not None:
        what, count, total, unit, seconds = looped
        unit = f" {unit}" if unit else ""
        if total:
            return f"{_bar(count, total)} {count}/{total}{unit}, {what} ({seconds:.1f} s)"
        return f"{count}{unit}, {what} ({seconds:.1f} s)"
    done = getattr(record, "pipecompile_pass", None)
    if done is not None:
        name, seconds, index, count = done
        if index is not None and count:
            last = "all done" if name == "all" else name
            return f"{_bar(index, count)} {index}/{count} passes, {last} {seconds:.2f} s"
        return f"pass {name} {seconds:.2f} s"
    return None


def _bar(done: int, total: int) -> str:
    filled = min(BAR_WIDTH, max(0, round(BAR_WIDTH * done / total)))
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"
