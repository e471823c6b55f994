"""Check that a schedule is complete, ordered and cannot deadlock.

Terms
-----
- **data dependency**: an action that must have finished before another may start. Along the
  links of the program's dataflow (`pipecompile.schedule.messages.Dataflow`; the neighbour
  chain by default): ``F(s, i)`` needs ``F(src, i)`` of every stage it reads from,
  ``B/I(s, i)`` needs ``F(s, i)`` and ``B/I(dst, i)`` of every stage that sends it a gradient,
  ``W(s, i)`` needs ``I(s, i)``, ``STEP(s)`` needs every backward of stage ``s``, and an
  asynchronous ``STEP(s, i)`` needs ``B(s, i)``.
- **explicit / implicit communication**: a schedule with ``SEND_*``/``RECV_*`` actions states its
  messages, and then every dependency across devices must go through a ``SEND`` on the
  producer's device and the matching ``RECV`` on its peer's (``0SEND_F3>2`` matches
  ``2RECV_F3<0``, ``2SEND_B3>0`` matches ``0RECV_B3<2``). A compute-only schedule leaves them
  implicit: a dependency on another device is met once the producer has run. Without a
  dataflow, the links of an explicit schedule are those its messages name (plus neighbours on
  one device); with one, every message must belong to one of its links.
- **deadlock**: with sends buffered (they never wait) and receives blocking, every device runs its
  list in order; if at some point no device can start its next action, the schedule hangs.

``validate(schedule)`` returns None or raises `ScheduleError` naming the device, the action's
index in that device's list and what is wrong, e.g.::

    device 0, action 2 (0B1): comes before 0F1 (action 3) on the same device; the backward of
    a micro-batch needs its forward first
"""

from __future__ import annotations

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.messages import Dataflow, message_of

__all__ = ["validate", "dependencies"]

_Position = tuple[int, int]  # (device, index in that device's list)


def validate(schedule: Schedule, dataflow: Dataflow | None = None) -> None:
    """Raise `ScheduleError` unless ``schedule`` is complete, well ordered and deadlock free
    (and, given the program's ``dataflow``, moves exactly its messages)."""
    where = _index(schedule)
    flow = dataflow or Dataflow.infer(schedule)
    if schedule.has_communication:
        _check_messages(schedule, where, flow)
    _check_complete(schedule, where)
    deps = dependencies(schedule, flow)
    _check_local_order(schedule, where, deps)
    _check_deadlock(schedule, where, deps)


def dependencies(schedule: Schedule,
                 dataflow: Dataflow | None = None) -> dict[Action, tuple[Action, ...]]:
    """The data dependencies of every action in ``schedule`` (see the module docstring).

    A dependency whose stage runs on another device is a transfer; `simulate` charges it.
    Dependencies may name actions missing from the schedule; `validate` reports those.
    """
    present = {a for row in schedule.actions for a in row}
    explicit = schedule.has_communication
    flow = dataflow or Dataflow.infer(schedule)
    sources = {s: [k.src for k in flow.sources(s)] for s in range(schedule.num_stages)}
    grads = {s: [k.dst for k in flow.readers(s) if k.grads] for s in sources}

    def crosses(a: int, b: int) -> bool:
        return schedule.stage_to_device[a] != schedule.stage_to_device[b]

    def backward_input(stage: int, mb: int) -> Action:
        split = Action(stage, Kind.I, mb)
        return split if split in present else Action(stage, Kind.B, mb)

    backwards: dict[int, list[Action]] = {}  # each stage's B and W actions (a STEP's needs)
    for a in present:
        if a.kind is Kind.B or a.kind is Kind.W:
            backwards.setdefault(a.stage, []).append(a)
    deps: dict[Action, tuple[Action, ...]] = {}
    for action in present:
        s, kind, i, peer = action.stage, action.kind, action.microbatch, action.peer
        need: list[Action] = []
        if kind is Kind.F:
            need += [Action(s, Kind.RECV_F, i, src) if explicit and crosses(src, s)
                     else Action(src, Kind.F, i) for src in sources[s]]
        elif kind in (Kind.B, Kind.I):
            need.append(Action(s, Kind.F, i))
            need += [Action(s, Kind.RECV_B, i, dst) if explicit and crosses(s, dst)
                     else backward_input(dst, i) for dst in grads[s]]  # type: ignore[arg-type]
        elif kind is Kind.W:
            need.append(Action(s, Kind.I, i))
        elif kind is Kind.SEND_F:
            need.append(Action(s, Kind.F, i))
        elif kind is Kind.SEND_B:
            need.append(backward_input(s, i))  # type: ignore[arg-type]
        elif kind is Kind.RECV_F and peer < schedule.num_stages:  # type: ignore[operator]
            need.append(Action(peer, Kind.SEND_F, i, s))  # type: ignore[arg-type]
        elif kind is Kind.RECV_B and peer < schedule.num_stages:  # type: ignore[operator]
            need.append(Action(peer, Kind.SEND_B, i, s))  # type: ignore[arg-type]
        elif kind is Kind.STEP and i is not None:  # asynchronous: right after that backward
            need.append(Action(s, Kind.W, i) if Action(s, Kind.W, i) in present
                        else Action(s, Kind.B, i))
        elif kind is Kind.STEP:
            need.extend(sorted(backwards.get(s, ())))
        deps[action] = tuple(need)
    return deps


def _at(action: Action, position: _Position) -> str:
    device, index = position
    return f"device {device}, action {index} ({action})"


def _index(schedule: Schedule) -> dict[Action, _Position]:
    """Map each action to its position; check ranges, placement and duplicates."""
    where: dict[Action, _Position] = {}
    p, m = schedule.num_stages, schedule.num_microbatches
    for device, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            at = f"device {device}, action {index}"  # cheap; the action is named below
            if action.stage >= p:
                raise ScheduleError(
                    f"{at} ({action}): stage {action.stage} does not exist (stages 0..{p - 1})"
                )
            if action.microbatch is not None and action.microbatch >= m:
                raise ScheduleError(
                    f"{at} ({action}): micro-batch {action.microbatch} does not exist "
                    f"(micro-batches 0..{m - 1})"
                )
            home = schedule.stage_to_device[action.stage]
            if home != device:
                raise ScheduleError(
                    f"{at} ({action}): stage {action.stage} runs on device {home}, not on "
                    f"device {device}; "
                    f"move the action to device {home}'s list"
                )
            if action in where:
                raise ScheduleError(
                    f"{at} ({action}): duplicate; {action} already runs at action "
                    f"{where[action][1]}"
                )
            where[action] = (device, index)
    return where


# A send or receive pairs with the action of this kind on its peer stage.
_PARTNER = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F,
            Kind.SEND_B: Kind.RECV_B, Kind.RECV_B: Kind.SEND_B}


def _check_messages(schedule: Schedule, where: dict[Action, _Position], flow: Dataflow) -> None:
    """Every send has its receive on the peer's device and the other way round, only between
    devices, and each belongs to a link of the dataflow."""
    for action, position in sorted(where.items(), key=lambda item: item[1]):
        if action.kind not in _PARTNER:
            continue
        peer = action.peer
        assert peer is not None, "Action gives every send and receive a peer"
        at = _at(action, position)  # only comm actions get here
        if peer >= schedule.num_stages:
            raise ScheduleError(f"{at}: stage {action.stage} has no stage {peer} to talk to")
        device = schedule.stage_to_device[peer]
        if device == position[0]:
            raise ScheduleError(
                f"{at}: stages {action.stage} and {peer} both run on device {device}; "
                f"values stay on the device, remove the {action.kind.value}"
            )
        try:
            message_of(action, flow)
        except ScheduleError as error:
            raise ScheduleError(f"{at}: {error}") from None
        partner = Action(peer, _PARTNER[action.kind], action.microbatch, action.stage)
        if partner not in where:
            raise ScheduleError(f"{at}: no matching {partner} on device {device}")


def _check_complete(schedule: Schedule, where: dict[Action, _Position]) -> None:
    """Every stage runs F and either B or the I+W pair exactly once per micro-batch."""
    for stage, device in enumerate(schedule.stage_to_device):
        for mb in range(schedule.num_microbatches):
            have = {k for k in (Kind.F, Kind.B, Kind.I, Kind.W) if Action(stage, k, mb) in where}
            name = f"device {device}: stage {stage}, micro-batch {mb}"
            if Kind.F not in have:
                raise ScheduleError(f"{name}: no forward {stage}F{mb}")
            if Kind.B in have and have & {Kind.I, Kind.W}:
                raise ScheduleError(
                    f"{name}: has both {stage}B{mb} and a split backward ({stage}I{mb}/"
                    f"{stage}W{mb}); use B or the I+W pair, not both"
                )
            if Kind.B in have:
                continue
            if not have & {Kind.I, Kind.W}:
                raise ScheduleError(
                    f"{name}: no backward (expected {stage}B{mb}, or {stage}I{mb} and {stage}W{mb})"
                )
            if Kind.I not in have:
                raise ScheduleError(f"{name}: {stage}W{mb} without {stage}I{mb}")
            if Kind.W not in have:
                raise ScheduleError(
                    f"{name}: {stage}I{mb} without {stage}W{mb}; the weight gradient of "
                    f"micro-batch {mb} would never be computed"
                )


def _why(action: Action, dep: Action) -> str:
    if dep.kind is Kind.RECV_F:
        return "a forward needs its input received first"
    if dep.kind is Kind.RECV_B:
        return "a backward needs its output gradient received first"
    if action.kind is Kind.STEP and action.microbatch is not None:
        return "an asynchronous update comes after the backward whose gradient it applies"
    if action.kind is Kind.STEP:
        return "the optimizer step comes after every backward of its stage"
    if action.kind is Kind.W:
        return "W of a micro-batch needs its I first"
    if action.kind in (Kind.SEND_F, Kind.SEND_B):
        return "a send comes after the action that computes what it sends"
    if action.kind is Kind.F:
        return "a forward needs the forward of each stage it reads from"
    if dep.kind is Kind.F:
        return "the backward of a micro-batch needs its forward first"
    return "a backward needs the backward of each stage that reads its outputs"


def _check_local_order(
    schedule: Schedule, where: dict[Action, _Position], deps: dict[Action, tuple[Action, ...]]
) -> None:
    """Dependencies exist, and those on the same device come earlier in its list."""
    for action, position in sorted(where.items(), key=lambda item: item[1]):
        for dep in deps[action]:
            if dep not in where:
                at = _at(action, position)
                hint = ""
                if dep.kind in (Kind.RECV_F, Kind.RECV_B):
                    hint = " (the schedule has explicit communication, so it needs a receive)"
                raise ScheduleError(f"{at}: needs {dep}, which is not in the schedule{hint}")
            dep_device, dep_index = where[dep]
            if dep_device == position[0] and dep_index > position[1]:
                raise ScheduleError(
                    f"{_at(action, position)}: comes before {dep} (action {dep_index}) on the "
                    f"same device; "
                    f"{_why(action, dep)}"
                )


def _check_deadlock(
    schedule: Schedule, where: dict[Action, _Position], deps: dict[Action, tuple[Action, ...]]
) -> None:
    """Run every device in order with buffered sends and blocking waits until all finish."""
    done: set[Action] = set()
    pcs = [0] * schedule.num_devices
    progress = True
    while progress:
        progress = False
        for device, row in enumerate(schedule.actions):
            while pcs[device] < len(row) and all(d in done for d in deps[row[pcs[device]]]):
                done.add(row[pcs[device]])
                pcs[device] += 1
                progress = True
    if all(pc == len(row) for pc, row in zip(pcs, schedule.actions)):
        return
    lines = []
    for device, row in enumerate(schedule.actions):
        if pcs[device] == len(row):
            lines.append(f"  device {device}: finished")
            continue
        action = row[pcs[device]]
        waits = ", ".join(
            f"{d} (device {where[d][0]}, action {where[d][1]})"
            for d in deps[action]
            if d not in done
        )
        lines.append(f"  {_at(action, (device, pcs[device]))}: blocked, waits for {waits}")
    raise ScheduleError(
        f"schedule {schedule.name!r} deadlocks: no device can start its next action\n"
        + "\n".join(lines)
    )
