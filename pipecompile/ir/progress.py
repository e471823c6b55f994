"""Progress: what compile is doing while it runs, through `logging`.

Each pass logs one line at INFO as it ends (`pass_done`: its name, seconds and summary); a long
loop (the layout search's layouts, the schedule search's candidates, materialisation's modules)
counts its items with a `Progress`, which logs ``what: k/n unit (s)`` at most every
`PROGRESS_EVERY_S` seconds, so a fast compile stays at one line per pass. Loggers are
``pipecompile.<module>`` and lines carry no prefix: the application's handler formats them
(the CLI prints them on stderr).

Under torchrun every rank compiles the same plan, so by default only rank 0 (the ``RANK``
environment variable torchrun sets; no process group is needed) logs these at INFO; the other
ranks log them at DEBUG. ``PIPECOMPILE_LOG_RANKS=all`` (or a comma-separated list of ranks)
gives those ranks INFO too. A library adds no handler: ``logging.basicConfig(level="INFO")``
shows the lines.

Each record also carries its numbers for a handler drawing a progress bar (the CLI's, on a
terminal): a pass's record ``record.pipecompile_pass = (name, seconds, index, count)`` (its
place among the passes compile runs), a loop's ``record.pipecompile_progress = (what, count,
total, unit, seconds)``. `reporting_every` shortens the interval between a loop's lines for
such a handler; within it a loop's first item is shown at once, so a bar names every loop
compile runs, however fast the machine.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from typing import Iterator

__all__ = ["PROGRESS_EVERY_S", "Progress", "level", "pass_done", "passes_done", "reporting_every"]

PROGRESS_EVERY_S = 5.0  # seconds between two progress lines of one loop

_log = logging.getLogger("pipecompile.passes")
_log_all = logging.getLogger("pipecompile.compile")
_every: contextvars.ContextVar[float | None] = contextvars.ContextVar("every", default=None)


@contextlib.contextmanager
def reporting_every(seconds: float) -> Iterator[None]:
    """Within this block (in this thread or task), loops log their counts every `seconds`
    instead of `PROGRESS_EVERY_S`: a progress bar wants frequent updates, a log file few."""
    token = _every.set(seconds)
    try:
        yield
    finally:
        _every.reset(token)


def level(environ: "os._Environ[str] | dict[str, str] | None" = None) -> int:
    """The level progress lines are logged at on this rank: INFO on rank 0 (or without
    torchrun) and on the ranks ``PIPECOMPILE_LOG_RANKS`` names, DEBUG elsewhere."""
    env = os.environ if environ is None else environ
    rank = env.get("RANK", "0")
    ranks = env.get("PIPECOMPILE_LOG_RANKS", "0").replace(" ", "")
    shown = ranks == "all" or rank in ranks.split(",")
    return logging.INFO if shown else logging.DEBUG


def pass_done(name: str, seconds: float, summary: str, *, index: int | None = None,
              count: int | None = None) -> None:
    """Log the end of a compiler pass: ``pass capture: 1.23 s: <summary>``; `index` (from 1)
    of `count` passes, when known, rides on the record for a progress bar."""
    _log.log(level(), "pass %s: %.2f s%s", name, seconds, f": {summary}" if summary else "",
             extra={"pipecompile_pass": (name, seconds, index, count)})


def passes_done(ran: int, count: int, seconds: float) -> None:
    """Log the end of compile's passes: ``passes: 14 of 16 ran in 4.80 s`` (the others did
    not apply to this plan); a progress bar shows all `count` done."""
    _log_all.log(level(), "passes: %d of %d ran in %.2f s", ran, count, seconds,
                 extra={"pipecompile_pass": ("all", seconds, count, count)})


class Progress:
    """Counts of one long loop, logged to `logger` as it goes (see the module docstring)."""

    def __init__(self, logger: logging.Logger, what: str, total: int | None = None, *,
                 unit: str = "", every: float | None = None):
        self.logger, self.what, self.total, self.unit = logger, what, total, unit
        chosen = every if every is not None else _every.get()
        self.every: float = PROGRESS_EVERY_S if chosen is None else chosen
        self.count = 0
        self.start = self.last = time.perf_counter()
        if every is None and chosen is not None:  # a bar: its first item shows the loop
            self.last = float("-inf")
        self.level = level()

    def advance(self, n: int = 1, note: str = "") -> None:
        """`n` more items done; logs when `every` seconds passed since the last line."""
        self.count += n
        now = time.perf_counter()
        if now - self.last >= self.every and self.logger.isEnabledFor(self.level):
            self.last = now
            self._line(now, note)

    def done(self, note: str = "") -> None:
        """The loop ended: one last line when it took long enough to have reported before."""
        now = time.perf_counter()
        if now - self.start >= self.every and self.logger.isEnabledFor(self.level):
            self._line(now, note or "done")

    def _line(self, now: float, note: str) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        unit = f" {self.unit}" if self.unit else ""
        self.logger.log(self.level, "%s: %d%s%s (%.1f s)%s", self.what, self.count, of, unit,
                        now - self.start, f", {note}" if note else "",
                        extra={"pipecompile_progress": (self.what, self.count, self.total,
                                                        self.unit, now - self.start)})
