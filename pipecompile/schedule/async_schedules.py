"""Asynchronous schedules: PipeDream (weight stashing) and PipeDream-2BW, as action lists.

Both are 1F1B without a flush: stage s keeps p - s - 1 forwards ahead of its backwards over a
whole stream of micro-batches, so the pipeline never drains between updates.

    pipedream  an update after every backward: ``sB(i)`` is followed by ``sSTEP(i)``, which
               applies micro-batch i's gradient (PipeDream, Narayanan et al., SOSP 2019).
    2bw        gradients accumulate over the m micro-batches of a batch; ``sSTEP(i)`` follows
               the backward of each batch's last micro-batch (Narayanan et al., ICML 2021).

p = 2, m = 2 micro-batches per batch, 2 batches (a `fit` stream), pipedream:

    dev0  0F0 0F1 0B0 0STEP0 0F2 0B1 0STEP1 0F3 0B2 0STEP2 0B3 0STEP3
    dev1  1F0 1B0 1STEP0 1F1 1B1 1STEP1 1F2 1B2 1STEP2 1F3 1B3 1STEP3

Which weights each forward uses (weight versions) is the runtime's business
(`runtime/versions.py`); the order above is what makes PipeDream's formula hold: stage s runs
micro-batch i's forward after exactly max(0, i - p + s + 1) of its own updates.
"""

from __future__ import annotations

from .actions import Action, Kind, Schedule

__all__ = ["pipedream", "two_bw", "ASYNC_SCHEDULES"]


def _rows(p: int, total: int, step_after) -> list[list[Action]]:
    rows = []
    for s in range(p):
        warmup = min(p - s - 1, total)
        row = [Action(s, Kind.F, i) for i in range(warmup)]

        def backward(k: int) -> list[Action]:
            return [Action(s, Kind.B, k)] + ([Action(s, Kind.STEP, k)] if step_after(k) else [])

        for k in range(total - warmup):
            row += [Action(s, Kind.F, warmup + k)] + backward(k)
        for k in range(total - warmup, total):
            row += backward(k)
        rows.append(row)
    return rows


def pipedream(num_devices: int, num_microbatches: int, *, virtual_stages: int = 1,
              batches: int = 1) -> Schedule:
    """1F1B without flush, one update per micro-batch, over `batches` × m micro-batches."""
    _one_stage_per_device("pipedream", virtual_stages)
    total = num_microbatches * batches
    rows = _rows(num_devices, total, lambda k: True)
    return Schedule("pipedream", num_devices, total, tuple(range(num_devices)),
                    tuple(tuple(r) for r in rows))


def two_bw(num_devices: int, num_microbatches: int, *, virtual_stages: int = 1,
           batches: int = 1) -> Schedule:
    """1F1B without flush, one update per batch of m micro-batches (double-buffered weights)."""
    _one_stage_per_device("2bw", virtual_stages)
    m = num_microbatches
    rows = _rows(num_devices, m * batches, lambda k: k % m == m - 1)
    return Schedule("2bw", num_devices, m * batches, tuple(range(num_devices)),
                    tuple(tuple(r) for r in rows))


def _one_stage_per_device(name: str, virtual_stages: int) -> None:
    from ..errors import ScheduleError

    if virtual_stages != 1:
        raise ScheduleError(f"{name} runs one stage per device; got virtual_stages={virtual_stages}")


ASYNC_SCHEDULES = {"pipedream": pipedream, "2bw": two_bw}
