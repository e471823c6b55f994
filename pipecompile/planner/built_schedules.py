"""The schedules one planning search builds, each once, kept for the searches of the next
layouts: the built-in generators' schedules with their peak in-flight micro-batches per
stage, and the last schedules relowered with a placement's messages (their dependencies
computed only for a candidate that is simulated).

    built = BuiltSchedules(memo)
    schedule, peaks = built.get("1f1b", p=4, m=8, v=1)
    lowered, deps = built.lowered("1f1b", 4, 8, 1, links)   # deps() on first need
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from ..schedule.actions import Schedule
from ..schedule.lowering import add_communication, relower
from ..schedule.messages import Dataflow
from ..schedule.schedules import SCHEDULES, make_schedule
from ..schedule.simulate import inflight
from ..schedule.validate import dependencies

__all__ = ["BuiltSchedules"]

#: How many actions of relowered schedules (with their dependencies, about 0.3 kB an action)
#: a search keeps for the next candidates and layouts: the searches of layouts with as many
#: devices meet the same schedules again, in the same order, so a cache smaller than one
#: layout's schedules would miss every time.
_LOWERED_KEPT = 1_000_000


class BuiltSchedules:
    """The schedules one search builds, each once, with their peak in-flight micro-batches per
    stage; kept for that search (or the layout search's searches). A built-in generator's
    schedule is not validated here (its tests validate every generator; validating is most of
    the cost of building one with 80 stages): the schedule pass builds the chosen one with
    `make_schedule`, which does. A written schedule is validated (make_schedule)."""

    def __init__(self, memo: dict | None = None, written: Schedule | None = None) -> None:
        self._made: dict[tuple[str, int, int, int], tuple[Schedule, tuple[int, ...]]] = (
            {} if memo is None else memo)
        self._written = written
        # the last relowered schedules, shared like the schedules (in `memo`, under a key no
        # schedule has): the searches of layouts with as many devices meet the same ones
        self._low: OrderedDict[tuple, list] = self._made.setdefault(
            ("lowered",), OrderedDict())  # type: ignore[arg-type, assignment]

    def get(self, name: str, p: int, m: int, v: int) -> tuple[Schedule, tuple[int, ...]]:
        key = (name, p, m, v)
        if key not in self._made:
            written = self._written
            if name in SCHEDULES and (written is None or name != written.name):
                schedule = add_communication(SCHEDULES[name](p, m, virtual_stages=v))
            else:
                schedule = make_schedule(written if written is not None and name == written.name
                                         else name, p, m, virtual_stages=v)
            self._made[key] = schedule, inflight(schedule)
        return self._made[key]

    def lowered(self, name: str, p: int, m: int, v: int, links: Dataflow | None
                ) -> tuple[Schedule, Callable[[], dict]]:
        """The schedule relowered with `links`' messages, and a function giving its
        dependencies (computed on the first call: a candidate whose floor is over the step to
        beat is not simulated and never needs them). Both depend on which stages link (with
        or without a gradient), not on the values' names or bytes, so candidates whose cuts
        link the same stages share them."""
        shape = None if links is None else tuple((k.src, k.dst, bool(k.grads))
                                                   for k in links.links)
        key = (name, p, m, v, shape)
        low = self._low
        if key in low:
            low.move_to_end(key)
        else:
            schedule = self.get(name, p, m, v)[0]
            if links is not None:
                schedule = relower(schedule, links)
            low[key] = [schedule, None]
            while (sum(sum(map(len, s.actions)) for s, _ in low.values()) > _LOWERED_KEPT
                   and len(low) > 1):
                low.popitem(last=False)
        entry = low[key]

        def deps() -> dict:
            if entry[1] is None:
                entry[1] = dependencies(entry[0], links)
            return entry[1]

        return entry[0], deps
