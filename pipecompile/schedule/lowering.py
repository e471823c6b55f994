"""Lowering passes: functions from a schedule to a new schedule (the input is never changed).

- `add_communication(schedule, dataflow)`: a compute-only schedule → the same schedule with the
  messages that move, derived from the program's wiring (`messages.Dataflow`: for each link, a
  producer stage, a consumer stage and the values, some carrying gradients). For every link
  whose two stages sit on different devices, and every micro-batch i:
  ``SEND_F(src, i, >dst)`` right after ``F(src, i)`` and ``RECV_F(dst, i, <src)`` right before
  ``F(dst, i)``; if gradients flow back, ``SEND_B(dst, i, >src)`` right after ``B/I(dst, i)``
  and ``RECV_B(src, i, <dst)`` right before ``B/I(src, i)``. Stages on the same device hand
  values over directly (no message). A U-Net's long skip from stage 0 to stage 3 gives::

      dev0: 0F0 0SEND_F0>1 0SEND_F0>3 ...      dev3: 3RECV_F0<2 3RECV_F0<0 3F0 ...

  Without a dataflow, each stage reads from the one before it (`Dataflow.chain`), which is
  what a schedule printed before the split shows; the schedule that runs is lowered with the
  real wiring (`relower`). Each send sits right after its producer and each receive right
  before its consumer, so with buffered (non-blocking) sends and blocking receives every
  device waits for exactly what the compute-only schedule waited for: a schedule that
  validates keeps validating.
- `strip_communication`: the inverse, drops every SEND/RECV.
- `split_backward` / `merge_iw`: ``B(s, i)`` ⇄ ``I(s, i) W(s, i)``. `merge_iw` merges an I with
  the W of the same stage and micro-batch when only sends lie between them (sends wait for
  nothing, so moving them after the merged B delays them by the W's time and changes no order).
"""

from __future__ import annotations

import dataclasses
import functools

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.messages import Dataflow

__all__ = ["add_communication", "strip_communication", "relower", "split_backward", "merge_iw"]


def _with_rows(schedule: Schedule, rows: list[list[Action]]) -> Schedule:
    return dataclasses.replace(schedule, actions=tuple(map(tuple, rows)))


#: A message action by its fields: actions are frozen values, so the lowerings of the many
#: schedules a planning search builds share each one instead of constructing it again.
_message = functools.lru_cache(maxsize=1 << 20)(Action)


def add_communication(schedule: Schedule, dataflow: Dataflow | None = None) -> Schedule:
    """Insert the SEND/RECV actions of every message between stages on different devices."""
    if schedule.has_communication:
        raise ScheduleError(
            f"schedule {schedule.name!r} already has communication actions; "
            f"call strip_communication() first to lower it again (or use relower())"
        )
    flow = dataflow or Dataflow.chain(schedule.num_stages)
    if flow.num_stages != schedule.num_stages:
        raise ScheduleError(
            f"schedule {schedule.name!r} has {schedule.num_stages} stages but the dataflow has "
            f"{flow.num_stages}; lower it with the wiring of the program it runs")
    home = schedule.stage_to_device
    remote = [k for k in flow.links if home[k.src] != home[k.dst]]
    recv_f = {s: [k.src for k in remote if k.dst == s] for s in range(schedule.num_stages)}
    send_f = {s: [k.dst for k in remote if k.src == s] for s in range(schedule.num_stages)}
    recv_b = {s: [k.dst for k in remote if k.src == s and k.grads] for s in recv_f}
    send_b = {s: [k.src for k in remote if k.dst == s and k.grads] for s in recv_f}
    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        for action in row:
            s, i = action.stage, action.microbatch
            forward = action.kind is Kind.F
            backward = action.kind in (Kind.B, Kind.I)
            if forward:
                out += [_message(s, Kind.RECV_F, i, p) for p in recv_f[s]]
            if backward:
                out += [_message(s, Kind.RECV_B, i, p) for p in recv_b[s]]
            out.append(action)
            if forward:
                out += [_message(s, Kind.SEND_F, i, p) for p in send_f[s]]
            if backward:
                out += [_message(s, Kind.SEND_B, i, p) for p in send_b[s]]
        rows.append(out)
    return _with_rows(schedule, rows)


def relower(schedule: Schedule, dataflow: Dataflow) -> Schedule:
    """The same compute order with the messages of ``dataflow`` (e.g. after the split)."""
    return add_communication(strip_communication(schedule), dataflow)


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
