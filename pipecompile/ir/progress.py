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
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["PROGRESS_EVERY_S", "Progress", "level", "pass_done"]

PROGRESS_EVERY_S = 5.0  # seconds between two progress lines of one loop

_log = logging.getLogger("pipecompile.passes")


def level(environ: "os._Environ[str] | dict[str, str] | None" = None) -> int:
    """The level progress lines are logged at on this rank: INFO on rank 0 (or without
    torchrun) and on the ranks ``PIPECOMPILE_LOG_RANKS`` names, DEBUG elsewhere."""
    env = os.environ if environ is None else environ
    rank = env.get("RANK", "0")
    ranks = env.get("PIPECOMPILE_LOG_RANKS", "0").replace(" ", "")
    shown = ranks == "all" or rank in ranks.split(",")
    return logging.INFO if shown else logging.DEBUG


def pass_done(name: str, seconds: float, summary: str) -> None:
    """Log the end of a compiler pass: ``pass capture: 1.23 s: <summary>``."""
    _log.log(level(), "pass %s: %.2f s%s", name, seconds, f": {summary}" if summary else "")


class Progress:
    """Counts of one long loop, logged to `logger` as it goes (see the module docstring)."""

    def __init__(self, logger: logging.Logger, what: str, total: int | None = None, *,
                 unit: str = "", every: float | None = None):
        self.logger, self.what, self.total, self.unit = logger, what, total, unit
        self.every = PROGRESS_EVERY_S if every is None else every
        self.count = 0
        self.start = self.last = time.perf_counter()
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
                        now - self.start, f", {note}" if note else "")
