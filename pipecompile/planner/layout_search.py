"""The layout search: every (P, D, FSDP, placement) searched with the schedule search, the
fastest predicted step kept.

    search_layouts(layouts, run) -> (the winner's SearchResult, every LayoutCandidate)

`run(layout)` is the schedule search (schedule_search.py) of one layout: its P pipeline devices, the
replica's slice of the global batch, the bytes a device holds under it and its collectives
(layout.py). A layout where nothing fits records why; ties (within `search.TIE`) go to the
earlier layout in `layouts.layouts`' order (fewer pipeline stages first). When no layout fits,
the error says so, and that more tensor parallelism would be needed where even the
most stages with recomputation leave a stage too big.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence

from ..errors import PartitionError
from ..errors import PartitionMemoryError
from ..ir.formats import format_bytes
from ..ir.progress import Progress
from .layout import Layout, LayoutCandidate
from .schedule_search import NOT_SIMULATED, Outpaced

__all__ = ["search_layouts", "TENSOR_PARALLEL_NOTE", "StateTooLarge"]

log = logging.getLogger(__name__)

TENSOR_PARALLEL_NOTE = ("bound by tensor parallelism: a stage does not fit even with the most "
                        "pipeline stages and recomputation (try tensor_parallel='auto' or a "
                        "larger T)")


#: A layout's reason where some of its plans were not simulated (their bounds over a step found):
#: its step is the best of those simulated.
PARTLY = "its plans bounded over the best not simulated"


class StateTooLarge(PartitionMemoryError):
    """A layout refused before its search: the bytes its devices must hold whatever the plan
    (parameters, gradients and optimizer state over its P devices) exceed a device."""


def search_layouts(layouts: Sequence[Layout], run: Callable[..., Any],
                   tie: float = 1e-3, bound: Callable[[Layout], float] | None = None, *,
                   above: bool = False) -> tuple[Any, tuple[LayoutCandidate, ...]]:
    """The fastest layout's search result and every layout's candidate (winner first, then by
    step; those that fit nothing last, saying why). `bound(layout)`: a lower bound of its
    step (its compute spread over its pipeline, no bubble); a layout whose bound is above the
    best step found so far is not searched (its reason says so).

    With `bound`, the layouts are searched in the order of their bounds (the lowest first,
    `layouts`' order among equal ones), so that the fast ones are found first and prune the
    rest; which layout wins does not depend on that order: a layout is skipped only when its
    step, at least its bound, is above (1 + `tie`) times a step already found, so above the
    fastest's tie window, and ties still go to the earliest in `layouts`' order.

    With `above`, `run(layout, best)` is given the best step found so far (inf: none) and may
    skip the plans whose step is surely over (1 + `tie`) x it (the schedule search's `above`):
    raising `Outpaced` when nothing else fits (listed as not searched in full), else its
    result's best is the layout's step (exact where it beats `best`, else the best of the
    plans it simulated, which its reason says)."""
    seen: dict[int, LayoutCandidate] = {}
    results: dict[int, Any] = {}
    errors: list[tuple[float, str]] = []
    progress = Progress(log, "layout search", len(layouts), unit="layouts")
    floors = _floors(layouts, bound)
    for k in sorted(range(len(layouts)), key=lambda k: (floors[k], k)):
        layout = layouts[k]
        best = min((c.step for c in seen.values() if c.fits), default=math.inf)
        progress.advance(note=f"best so far {best * 1e3:.1f} ms" if math.isfinite(best) else "")
        floor = floors[k]
        if math.isfinite(best) and floor > best * (1 + tie):
            seen[k] = LayoutCandidate(layout, reason=(
                f"not searched: its compute alone takes {floor * 1e3:.1f} ms "
                f"(+{(floor / best - 1) * 100:.1f}% over the best)"))
            continue
        try:
            result = run(layout, best) if above else run(layout)
        except Outpaced as error:
            seen[k] = LayoutCandidate(layout, reason=(
                f"not searched in full: its plans take at least {error.floor * 1e3:.1f} ms "
                f"(+{(error.floor / best - 1) * 100:.1f}% over the best) or do not fit"))
            continue
        except PartitionMemoryError as error:
            need = error.memory_needed or math.inf
            errors.append((need, str(error)))
            least = "at least " if isinstance(error, StateTooLarge) else ""
            seen[k] = LayoutCandidate(layout, reason=f"does not fit: needs {least}"
                                       f"{format_bytes(need)} on a device" + (
                                           f"; {TENSOR_PARALLEL_NOTE}"
                                           if layout.data_parallel == 1 else ""))
            continue
        except PartitionError as error:
            seen[k] = LayoutCandidate(layout, reason=f"not valid: {str(error)[:80]}")
            continue
        partial = above and any(c.reason.startswith(NOT_SIMULATED) for c in result.candidates)
        best = result.best
        results[k] = result
        seen[k] = LayoutCandidate(layout, best.step, best.schedule, best.microbatches,
                                   best.virtual_stages, len(best.recomputed),
                                   max(best.memory, default=0.0), PARTLY if partial else "")
    progress.done()
    found = [seen[k] for k in range(len(layouts))]  # back in `layouts`' order
    order = {id(c): k for k, c in enumerate(found)}
    fitting = [c for c in found if c.fits]
    if not fitting and not results:
        deepest = max(layouts, key=lambda lay: lay.pipeline)
        detail = min(errors)[1] if errors else "no layout is valid"
        raise PartitionMemoryError(
            f"no layout of {deepest.devices} devices fits in memory (tried "
            f"{len(layouts)}, up to {deepest.pipeline} pipeline stages); "
            f"{TENSOR_PARALLEL_NOTE}. The closest: {detail} Each layout: "
            + "; ".join(f"{c.layout.pipeline} x {c.layout.data_parallel}"
                        + (f" x TP{c.layout.tensor_parallel}" if c.layout.tensor_parallel > 1
                           else "")
                        + f"{' FSDP' if c.layout.fsdp else ''}: {c.reason}" for c in found),
            memory_needed=min(errors)[0] if errors else 0.0, devices_needed=None)
    fastest = min(c.step for c in fitting)
    winner = min((c for c in fitting if c.step <= fastest * (1 + tie)), key=lambda c: order[id(c)])
    ranked = [winner] + sorted((c for c in found if c is not winner),
                               key=lambda c: (not c.fits, c.step, "not searched" in c.reason,
                                              order[id(c)]))
    labelled = [(_won(c) if c is winner else c if not c.fits else _lost(c, winner))
                for c in ranked]
    return results[order[id(winner)]], tuple(labelled)


def _floors(layouts: Sequence[Layout], bound: Callable[[Layout], float] | None
            ) -> list[float]:
    """Each layout's lower bound of its step (0: none known, so it is always searched)."""
    if bound is None:
        return [0.0] * len(layouts)
    return [bound(layout) for layout in layouts]


def _won(c: LayoutCandidate) -> LayoutCandidate:
    """The winner, without a note that some of its plans were not simulated (its step is
    exact: the plans skipped were bounded over a step it beats)."""
    from dataclasses import replace

    return replace(c, reason="") if c.reason == PARTLY else c


def _lost(c: LayoutCandidate, winner: LayoutCandidate) -> LayoutCandidate:
    from dataclasses import replace

    if c.step > winner.step * 1.001:
        return replace(c, reason=f"slower (+{(c.step / winner.step - 1) * 100:.1f}%)" + (
            f"; {PARTLY}" if c.reason == PARTLY else ""))
    return replace(c, reason="tie (later in order)")
