"""Lowering passes: functions from a schedule to a new schedule (the input is never changed).

- `add_communication`: a compute-only schedule → the same schedule with explicit transfers.
  After ``F(s, i)`` whose next stage lives on another device comes ``SEND_F(s, i)``, and right
  before ``F(s+1, i)`` comes ``RECV_F(s+1, i)``; after ``B(s, i)`` (or ``I(s, i)`` in a split
  backward) whose previous stage lives on another device comes ``SEND_B(s, i)``, and right before
  ``B/I(s-1, i)`` comes ``RECV_B(s-1, i)``. Stages on the same device hand values over directly::

      dev0: 0F0 0F1 0B0 0B1              dev0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 ...
      dev1: 1F0 1B0 1F1 1B1      →       dev1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 ...

  Each send sits right after its producer and each receive right before its consumer, so with
  buffered (non-blocking) sends and blocking receives every device waits for exactly what the
  compute-only schedule waited for: a schedule that validates keeps validating.
- `strip_communication`: the inverse, drops every SEND/RECV.
- `split_backward` / `merge_iw`: ``B(s, i)`` ⇄ ``I(s, i) W(s, i)``. `merge_iw` merges an I with
  the W of the same stage and micro-batch when only sends lie between them (sends wait for
  nothing, so moving them after the merged B delays them by the W's time and changes no order).
"""

from __future__ import annotations

import dataclasses

from pipecompile.errors import ScheduleError
from pipecompile.runtime.actions import Action, Kind, Schedule

__all__ = ["add_communication", "strip_communication", "split_backward", "merge_iw"]


def _with_rows(schedule: Schedule, rows: list[list[Action]]) -> Schedule:
    return dataclasses.replace(schedule, actions=tuple(map(tuple, rows)))


def add_communication(schedule: Schedule) -> Schedule:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B between stages on different devices."""
    if schedule.has_communication:
        raise ScheduleError(
            f"schedule {schedule.name!r} already has communication actions; "
            f"call strip_communication() first to lower it again"
        )
    p, home = schedule.num_stages, schedule.stage_to_device

    def crosses(a: int, b: int) -> bool:
        return 0 <= min(a, b) and max(a, b) < p and home[a] != home[b]

    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        for action in row:
            s, i = action.stage, action.microbatch
            forward = action.kind is Kind.F
            backward = action.kind in (Kind.B, Kind.I)
            if forward and crosses(s - 1, s):
                out.append(Action(s, Kind.RECV_F, i))
            if backward and crosses(s, s + 1):
                out.append(Action(s, Kind.RECV_B, i))
            out.append(action)
            if forward and crosses(s, s + 1):
                out.append(Action(s, Kind.SEND_F, i))
            if backward and crosses(s - 1, s):
                out.append(Action(s, Kind.SEND_B, i))
        rows.append(out)
    return _with_rows(schedule, rows)


def strip_communication(schedule: Schedule) -> Schedule:
    """Drop every send and receive, leaving the compute-only schedule."""
    return _with_rows(schedule, [[a for a in row if not a.is_comm] for row in schedule.actions])


def split_backward(schedule: Schedule) -> Schedule:
    """Replace each ``B(s, i)`` by ``I(s, i) W(s, i)`` (a zero-bubble schedule's raw form)."""
    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        for a in row:
            if a.kind is Kind.B:
                i = a.microbatch
                out += [Action(a.stage, Kind.I, i), Action(a.stage, Kind.W, i)]
            else:
                out.append(a)
        rows.append(out)
    return _with_rows(schedule, rows)


def merge_iw(schedule: Schedule) -> Schedule:
    """Turn ``I(s, i)`` followed by ``W(s, i)`` (only sends in between) into ``B(s, i)``."""
    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        skip: set[int] = set()
        for index, a in enumerate(row):
            if index in skip:
                continue
            if a.kind is Kind.I:
                j = index + 1
                while j < len(row) and row[j].kind in (Kind.SEND_F, Kind.SEND_B):
                    j += 1
                if j < len(row) and row[j] == Action(a.stage, Kind.W, a.microbatch):
                    out.append(Action(a.stage, Kind.B, a.microbatch))
                    skip.add(j)
                    continue
            out.append(a)
        rows.append(out)
    return _with_rows(schedule, rows)
