"""The action IR: what one device does, step by step, during one training step.

Terms
-----
- **stage**: a contiguous piece of the model, numbered 0..p-1 in forward order. Stage ``s`` runs
  on device ``stage_to_device[s]``; an interleaved schedule puts several stages on one device
  (stage ``s`` on device ``s % D``).
- **action**: one step of one stage, written ``<stage><KIND><micro-batch>``::

      1F3        stage 1, forward of micro-batch 3
      0B2        stage 0, full backward of micro-batch 2
      2I0 / 2W0  stage 2, backward for inputs / for weights of micro-batch 0 (zero bubble)
      0SEND_F3>2 stage 0 sends stage 2 the values stage 2 reads from it (micro-batch 3)
      2RECV_F3<0 stage 2 receives that message from stage 0
      2SEND_B3>0 stage 2 sends stage 0 the gradients of those values that carry one
      0RECV_B3<2 stage 0 receives that message from stage 2
      2STEP      optimizer step of stage 2 after the flush (synchronous schedules)
      2STEP5     update of stage 2 applied right after micro-batch 5's backward
                 (asynchronous schedules: PipeDream, 2BW)

  ``str(action)`` gives that text and ``Action.parse(text)`` gives the action back.
- **message**: a send or receive names its **peer** stage after ``>`` (to) or ``<`` (from):
  one per (producer stage, consumer stage, micro-batch, direction) across devices, derived
  from the program's wiring by `pipecompile.schedule.lowering`. Without a peer (``1SEND_F3``)
  it is the neighbour: ``SEND_F``/``RECV_B`` talk to stage s+1, ``RECV_F``/``SEND_B`` to s-1.
- **schedule**: one list of actions per device, in execution order, plus the placement of stages
  on devices. A schedule is pure data: it can be printed, written to text or CSV, validated
  (`pipecompile.schedule.validate`) and simulated (`pipecompile.schedule.simulate`).

Text format (``Schedule.to_text`` / ``Schedule.from_text``)
----------------------------------------------------------
One ``key: value`` line per header field, then one ``<device>: <actions>`` line per device,
actions separated by spaces; blank lines and ``#`` comments are ignored::

    name: 1f1b
    num_stages: 2
    num_microbatches: 3
    stage_to_device: 0 1
    0: 0F0 0F1 0B0 0F2 0B1 0B2 0STEP
    1: 1F0 1B0 1F1 1B1 1F2 1B2 1STEP

Every header line is optional, and device lines may omit the ``<device>:`` prefix (then the n-th
such line is device n); missing fields are inferred: ``num_stages`` and ``num_microbatches`` from
the largest numbers used, ``stage_to_device`` from the line each stage appears on, ``name`` is
``"custom"``. So a hand-written schedule can be as short as ``"0F0 0B0\\n1F0 1B0"``.

CSV format (``to_csv`` / ``from_csv``) is the same table: the first cell of a row is the key
(``name``, ``num_stages``, ``num_microbatches``, ``stage_to_device``) or the device number, the
other cells are the values; a row whose first cell is an action is an unnumbered device row, and
empty cells (spreadsheet padding) are skipped.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

from pipecompile.errors import ScheduleError

__all__ = ["Kind", "Action", "Schedule", "COMPUTE_KINDS", "COMM_KINDS"]


class Kind(str, Enum):
    """What an action does."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  backward for inputs only (zero bubble, Qi et al. 2024)
    W = "W"  # backward for weights only
    SEND_F = "SEND_F"  # send forward values to a consumer stage (the peer)
    RECV_F = "RECV_F"  # receive forward values from a producer stage
    SEND_B = "SEND_B"  # send input gradients back to the producer stage
    RECV_B = "RECV_B"  # receive output gradients from a consumer stage
    STEP = "STEP"  # optimizer step of the stage

    def __repr__(self) -> str:
        return f"Kind.{self.name}"


#: Kinds that use the device (everything but communication).
COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP})
#: Point-to-point communication kinds.
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})

# Longest kinds first: a regex alternation takes the first branch that matches.
_KIND_PATTERN = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"([0-9]+)({_KIND_PATTERN})([0-9]*)(?:([<>])([0-9]+))?")
# The neighbour a send or receive talks to when no peer is written, and its arrow in text.
_NEIGHBOUR = {"SEND_F": +1, "RECV_B": +1, "RECV_F": -1, "SEND_B": -1}
_ARROW = {"SEND_F": ">", "SEND_B": ">", "RECV_F": "<", "RECV_B": "<"}


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage: ``Action(1, Kind.F, 3)`` is ``1F3``; a send or receive also
    names its peer stage: ``Action(0, Kind.SEND_F, 3, peer=2)`` is ``0SEND_F3>2``."""

    stage: int
    kind: Kind
    microbatch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        # Fast path: schedules build many actions, almost all well formed.
        mb = self.microbatch
        if type(self.kind) is Kind and type(self.stage) is int and self.stage >= 0:
            if self.kind in COMM_KINDS:
                self._check_peer()
            elif self.peer is not None:
                raise ScheduleError(f"action {self.stage}{self.kind.value}: only sends and "
                                    f"receives have a peer, got peer={self.peer!r}")
            if (type(mb) is int and mb >= 0) or (self.kind is Kind.STEP and mb is None):
                return
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                known = ", ".join(k.value for k in Kind)
                raise ScheduleError(
                    f"unknown action kind {self.kind!r}; expected one of {known}"
                ) from None
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0:
            raise ScheduleError(f"action stage must be an int >= 0, got {self.stage!r}")
        if self.kind in COMM_KINDS:
            self._check_peer()
        elif self.peer is not None:
            raise ScheduleError(f"action {self.stage}{self.kind.value}: only sends and "
                                f"receives have a peer, got peer={self.peer!r}")
        if self.kind is Kind.STEP and self.microbatch is None:
            return
        if (
            isinstance(self.microbatch, bool)
            or not isinstance(self.microbatch, int)
            or self.microbatch < 0
        ):
            raise ScheduleError(
                f"action {self.stage}{self.kind.value} needs a micro-batch int >= 0, "
                f"got {self.microbatch!r}"
            )

    def _check_peer(self) -> None:
        """A send or receive without a peer talks to its neighbour (see the module docstring)."""
        if self.peer is None:
            peer = self.stage + _NEIGHBOUR[self.kind.value]
            if peer < 0:
                raise ScheduleError(
                    f"action {self.stage}{self.kind.value}{self.microbatch} has no previous "
                    f"stage to talk to; name the peer, e.g. "
                    f"{self.stage}{self.kind.value}{self.microbatch}{_ARROW[self.kind.value]}1")
            object.__setattr__(self, "peer", peer)
        elif isinstance(self.peer, bool) or not isinstance(self.peer, int) or self.peer < 0:
            raise ScheduleError(f"action {self.stage}{self.kind.value}: peer must be a stage "
                                f"int >= 0, got {self.peer!r}")
        elif self.peer == self.stage:
            raise ScheduleError(f"action {self.stage}{self.kind.value}{self.microbatch}: a "
                                f"stage cannot send to or receive from itself")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        peer = "" if self.peer is None else f"{_ARROW[self.kind.value]}{self.peer}"
        return f"{self.stage}{self.kind.value}{mb}{peer}"

    def __repr__(self) -> str:
        return f"Action.parse({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("0SEND_F3>2") == Action(0, Kind.SEND_F, 3, 2)``."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><kind><micro-batch> such as "
                f"'1F3', '0SEND_F2>3' or '2STEP' (kinds: {', '.join(k.value for k in Kind)})"
            )
        stage, kind, mb, arrow, peer = match.groups()
        if arrow is not None and _ARROW.get(kind) != arrow:
            expected = f"'{_ARROW[kind]}'" if kind in _ARROW else "no peer"
            raise ScheduleError(f"cannot parse action {text!r}: {kind} takes {expected} "
                                f"('>' sends to a stage, '<' receives from one)")
        if kind == Kind.STEP.value and not mb:
            return cls(int(stage), Kind.STEP)
        if not mb:
            raise ScheduleError(f"cannot parse action {text!r}: {kind} needs a micro-batch")
        return cls(int(stage), Kind(kind), int(mb), None if peer is None else int(peer))

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


_HEADER_KEYS = ("name", "num_stages", "num_microbatches", "stage_to_device")


@dataclass(frozen=True)
class Schedule:
    """Per-device action lists for one training step of ``num_microbatches`` micro-batches."""

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_device: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)

    def __post_init__(self) -> None:
        # Accept lists from hand-written code; store tuples so the value stays hashable.
        object.__setattr__(self, "stage_to_device", tuple(self.stage_to_device))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        if self.num_stages < 1:
            raise ScheduleError(f"schedule {self.name!r}: num_stages must be >= 1")
        if self.num_microbatches < 1:
            raise ScheduleError(f"schedule {self.name!r}: num_microbatches must be >= 1")
        if len(self.stage_to_device) != self.num_stages:
            raise ScheduleError(
                f"schedule {self.name!r}: stage_to_device has {len(self.stage_to_device)} "
                f"entries but num_stages is {self.num_stages}; give one device per stage"
            )
        for stage, device in enumerate(self.stage_to_device):
            if not 0 <= device < self.num_devices:
                raise ScheduleError(
                    f"schedule {self.name!r}: stage {stage} is placed on device {device} but "
                    f"there are action lists for {self.num_devices} devices only"
                )
        for row in self.actions:
            for action in row:
                if not isinstance(action, Action):
                    raise ScheduleError(
                        f"schedule {self.name!r}: expected Action, got {action!r}; "
                        f"use Action.parse() for text"
                    )

    @property
    def num_devices(self) -> int:
        return len(self.actions)

    @property
    def has_communication(self) -> bool:
        return any(a.is_comm for row in self.actions for a in row)

    # The schedule's properties are read from its actions, here only: the runtime, the
    # pricing and the option checks all ask the schedule (`schedules.properties_of` for a
    # built-in schedule known only by name).

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into input (I) and weight (W) gradients (zero-bubble)."""
        return any(a.kind in (Kind.I, Kind.W) for row in self.actions for a in row)

    @property
    def asynchronous(self) -> bool:
        """Whether weights are updated during the step (a STEP after a micro-batch: PipeDream,
        2BW), so each stage keeps the weight versions its in-flight micro-batches saw."""
        return any(a.kind is Kind.STEP and a.microbatch is not None
                   for row in self.actions for a in row)

    def __str__(self) -> str:
        """An action grid: one row per device, one column per action slot."""
        cells = [[str(a) for a in row] for row in self.actions]
        width = max([len(c) for row in cells for c in row] + [len("slot"), 2])
        slots = max((len(row) for row in cells), default=0)
        label = max(len(f"dev {self.num_devices - 1}"), len("slot"))
        lines = [
            f"{self.name}: {self.num_stages} stages on {self.num_devices} devices, "
            f"{self.num_microbatches} micro-batches",
            "slot".ljust(label) + " " + " ".join(str(i).rjust(width) for i in range(slots)),
        ]
        for device, row in enumerate(cells):
            lines.append(
                f"dev {device}".ljust(label) + " " + " ".join(c.rjust(width) for c in row)
            )
        return "\n".join(line.rstrip() for line in lines)

    # -- text and CSV ----------------------------------------------------------------------

    def to_text(self) -> str:
        lines = [
            f"name: {self.name}",
            f"num_stages: {self.num_stages}",
            f"num_microbatches: {self.num_microbatches}",
            "stage_to_device: " + " ".join(map(str, self.stage_to_device)),
        ]
        for device, row in enumerate(self.actions):
            lines.append(f"{device}: " + " ".join(map(str, row)))
        return "\n".join(line.rstrip() for line in lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        rows: list[tuple[int, str | None, list[str]]] = []
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if ":" in line:
                key, rest = line.split(":", 1)
                key = key.strip()
                cells = [rest.strip()] if key == "name" else rest.split()
                rows.append((number, key, cells))
            else:
                rows.append((number, None, line.split()))
        return _from_rows(rows, source="text")

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["name", self.name])
        writer.writerow(["num_stages", self.num_stages])
        writer.writerow(["num_microbatches", self.num_microbatches])
        writer.writerow(["stage_to_device", *self.stage_to_device])
        for device, row in enumerate(self.actions):
            writer.writerow([device, *map(str, row)])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> Schedule:
        rows: list[tuple[int, str | None, list[str]]] = []
        for number, record in enumerate(csv.reader(io.StringIO(text)), start=1):
            cells = [c.strip() for c in record]
            while cells and not cells[-1]:
                cells.pop()
            if not cells or cells[0].startswith("#"):
                continue
            head = cells[0]
            if head in _HEADER_KEYS or head.isdigit():
                rows.append((number, head, [c for c in cells[1:] if c]))
            else:
                rows.append((number, None, [c for c in cells if c]))
        return _from_rows(rows, source="CSV")


def _from_rows(rows: Iterable[tuple[int, str | None, list[str]]], *, source: str) -> Schedule:
    """Build a Schedule from (line number, key or device or None, cells) rows; infer the rest."""
    header: dict[str, list[str]] = {}
    numbered: dict[int, list[Action]] = {}
    unnumbered: list[list[Action]] = []
    for number, key, cells in rows:
        where = f"{source} line {number}"
        if key in _HEADER_KEYS:
            if key in header:
                raise ScheduleError(f"{where}: {key!r} given twice")
            header[key] = cells
            continue
        if key is not None and not key.isdigit():
            raise ScheduleError(
                f"{where}: unknown key {key!r}; expected a device number or one of "
                f"{', '.join(_HEADER_KEYS)}"
            )
        try:
            actions = [Action.parse(c) for c in cells]
        except ScheduleError as error:
            raise ScheduleError(f"{where}: {error}") from None
        if key is None:
            unnumbered.append(actions)
        elif int(key) in numbered:
            raise ScheduleError(f"{where}: device {key} has two lines")
        else:
            numbered[int(key)] = actions
    if numbered and unnumbered:
        raise ScheduleError(
            f"{source}: some device lines start with a device number and some do not; "
            f"number all of them or none"
        )

    def ints(key: str) -> list[int] | None:
        if key not in header:
            return None
        try:
            return [int(v) for v in header[key]]
        except ValueError:
            raise ScheduleError(f"{source}: {key} must be integers, got {header[key]}") from None

    placement = ints("stage_to_device")
    used = [len(unnumbered)] + [d + 1 for d in numbered] + [d + 1 for d in placement or []]
    num_devices = max(used)
    table = [numbered.get(d, []) if numbered else [] for d in range(num_devices)]
    for d, row in enumerate(unnumbered):
        table[d] = row
    every = [a for row in table for a in row]

    stages = ints("num_stages")
    num_stages = (
        stages[0]
        if stages
        else max([len(placement or [])] + [a.stage + 1 for a in every], default=0)
    )
    if placement is None:
        placement = []
        for stage in range(num_stages):
            devices = sorted({d for d, row in enumerate(table) for a in row if a.stage == stage})
            if len(devices) != 1:
                problem = "has no actions" if not devices else f"appears on devices {devices}"
                raise ScheduleError(
                    f"{source}: stage {stage} {problem}, so its device cannot be inferred; "
                    f"add a 'stage_to_device' line"
                )
            placement.append(devices[0])
    mbs = ints("num_microbatches")
    num_microbatches = (
        mbs[0]
        if mbs
        else max((a.microbatch + 1 for a in every if a.microbatch is not None), default=0)
    )
    name = " ".join(header.get("name", [])) or "custom"
    return Schedule(name, num_stages, num_microbatches, tuple(placement), tuple(map(tuple, table)))
