"""The communication IR: which values move between stages, and the messages that carry them.

Terms
-----
- **link**: a (producer stage, consumer stage) pair and the boundary values the consumer reads
  from that producer; ``grads`` are those of them a gradient flows back through (floating
  point values). A skip connection is a link between stages that are not neighbours.
- **dataflow**: every link of a program: a pure, hashable record that lowering, validation and
  simulation read without a model (`Dataflow.of(program)` builds it from a `StagedProgram`,
  `Dataflow.chain(p)` is the neighbour-only default of schedules without a program).
- **message**: what one ``SEND``/``RECV`` pair moves: a link's values for one micro-batch
  forward, or its gradients backward. `message_of` maps either action of the pair to it::

      0SEND_F3>2, 2RECV_F3<0   Message(src=0, dst=2, microbatch=3, backward=False, values=...)
      2SEND_B3>0, 0RECV_B3<2   Message(src=2, dst=0, microbatch=3, backward=True, values=...)

Message costs are keyed ``(sender stage, receiver stage, direction)``, direction ``"F"`` or
``"B"``: `runtime.values.message_bytes` gives the bytes of each message of a program at a
micro-batch size and `transfer_seconds` turns them into seconds for `simulate(...,
transfers=...)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule

__all__ = ["Link", "Dataflow", "Message", "MessageKey", "message_of", "gradient_values",
           "link_bytes", "transfer_seconds"]

MessageKey = tuple[int, int, str]  # (sender stage, receiver stage, "F" or "B")


@dataclass(frozen=True)
class Link:
    """Values stage ``dst`` reads from stage ``src``; ``grads``: those carrying a gradient."""

    src: int
    dst: int
    values: tuple[str, ...]
    grads: tuple[str, ...]


@dataclass(frozen=True)
class Dataflow:
    """Every link of a program, sorted by (src, dst)."""

    num_stages: int
    links: tuple[Link, ...]

    @classmethod
    def from_wiring(cls, producer: Mapping[str, int], consumers: Mapping[str, tuple[int, ...]],
                    grad_values: frozenset[str] | set[str], num_stages: int) -> Dataflow:
        """Links from each value's producer and consumer stages (``program.producer`` etc.)."""
        reads: dict[tuple[int, int], list[str]] = {}
        for name, readers in consumers.items():
            for dst in readers:
                if dst != producer[name]:
                    reads.setdefault((producer[name], dst), []).append(name)
        links = tuple(Link(src, dst, tuple(names), tuple(n for n in names if n in grad_values))
                      for (src, dst), names in sorted(reads.items()))
        return cls(num_stages, links)

    @classmethod
    def of(cls, program: Any) -> Dataflow:
        """The dataflow of a `StagedProgram` (whose producer and consumer stages come from
        `passes.split.BlockWiring`, the one source of a program's wiring)."""
        return cls.from_wiring(program.producer, program.consumers, gradient_values(program),
                               program.num_stages)

    @classmethod
    def chain(cls, num_stages: int) -> Dataflow:
        """Each stage reads one value (with a gradient) from the stage before it."""
        links = tuple(Link(s - 1, s, (f"out{s - 1}",), (f"out{s - 1}",))
                      for s in range(1, num_stages))
        return cls(num_stages, links)

    @classmethod
    def infer(cls, schedule: Schedule) -> Dataflow:
        """What a schedule without a program says: neighbour links on one device, and the
        links its sends and receives name across devices (gradients where a SEND_B/RECV_B
        pair exists)."""
        home = schedule.stage_to_device
        forward = {(s - 1, s) for s in range(1, schedule.num_stages) if home[s - 1] == home[s]}
        backward = set(forward)
        if not schedule.has_communication:
            forward = backward = {(s - 1, s) for s in range(1, schedule.num_stages)}
        for action in (a for row in schedule.actions for a in row if a.is_comm):
            pair = _pair(action)
            (backward if action.kind in (Kind.SEND_B, Kind.RECV_B) else forward).add(pair)
        links = tuple(Link(src, dst, (f"out{src}",), (f"out{src}",) if (src, dst) in backward
                           else ()) for src, dst in sorted(forward | backward))
        return cls(schedule.num_stages, links)

    def producers(self) -> dict[str, int]:
        """Every value a link carries -> the stage that produces it."""
        return {name: k.src for k in self.links for name in k.values}

    def link(self, src: int, dst: int) -> Link | None:
        return next((k for k in self.links if k.src == src and k.dst == dst), None)

    def readers(self, stage: int) -> tuple[Link, ...]:
        """Links out of ``stage``: the stages that read its values."""
        return tuple(k for k in self.links if k.src == stage)

    def sources(self, stage: int) -> tuple[Link, ...]:
        """Links into ``stage``: the stages whose values it reads."""
        return tuple(k for k in self.links if k.dst == stage)


@dataclass(frozen=True)
class Message:
    """The values one SEND/RECV pair moves for one micro-batch."""

    src: int  # sending stage
    dst: int  # receiving stage
    microbatch: int
    backward: bool  # False: activations, producer -> consumer; True: gradients, back
    values: tuple[str, ...]

    @property
    def key(self) -> MessageKey:
        return (self.src, self.dst, "B" if self.backward else "F")

    def __str__(self) -> str:
        what = "gradients" if self.backward else "values"
        return (f"{what} {', '.join(map(repr, self.values))} of micro-batch "
                f"{self.microbatch} from stage {self.src} to stage {self.dst}")


def _pair(action: Action) -> tuple[int, int]:
    """(producer, consumer) of the link a send or receive belongs to."""
    s, p = action.stage, action.peer
    assert p is not None, action  # every send and receive has a peer
    return (s, p) if action.kind in (Kind.SEND_F, Kind.RECV_B) else (p, s)


def message_of(action: Action, dataflow: Dataflow) -> Message:
    """The message a SEND or RECV action moves (both actions of a pair give the same one)."""
    src, dst = _pair(action)
    link = dataflow.link(src, dst)
    backward = action.kind in (Kind.SEND_B, Kind.RECV_B)
    if link is None or (backward and not link.grads):
        problem = (f"stage {dst} reads no value from stage {src}" if link is None else
                   f"no gradient flows back from stage {dst} to stage {src}")
        raise ScheduleError(
            f"action {action}: {problem} in the program's wiring; lower the schedule with "
            f"add_communication(schedule, dataflow) to get the real messages")
    if backward:
        return Message(dst, src, action.microbatch, True, link.grads)  # type: ignore[arg-type]
    return Message(src, dst, action.microbatch, False, link.values)  # type: ignore[arg-type]


def gradient_values(program: Any, names: Iterable[str] | None = None) -> frozenset[str]:
    """Boundary values (`names`, default: the program's) that are floating point: gradients
    flow back through them. `program`: anything with the `captured` model."""
    values = program.captured.values
    return frozenset(n for n in (program.producer if names is None else names)
                     if values[n].dtype is not None and values[n].dtype.is_floating_point)


def link_bytes(dataflow: Dataflow, size: Callable[[str], float]) -> dict[MessageKey, float]:
    """Bytes of every message of `dataflow`'s links, ``size(name)`` being one value's bytes:
    its values forward, its gradients back."""
    result: dict[MessageKey, float] = {}
    for link in dataflow.links:
        result[(link.src, link.dst, "F")] = sum(size(n) for n in link.values)
        if link.grads:
            result[(link.dst, link.src, "B")] = sum(size(n) for n in link.grads)
    return result


def transfer_seconds(nbytes: Mapping[MessageKey, float],
                     bandwidth: float | Callable[[int], float],
                     latency: float | Callable[[int], float] = 0.0) -> dict[MessageKey, float]:
    """Seconds per message: its bytes over the sending stage's bandwidth (bytes/s; inf: free)
    plus the sending stage's latency (seconds per message; `DeviceSpec.latency`)."""
    def rate(stage: int) -> float:
        return bandwidth(stage) if callable(bandwidth) else bandwidth

    def delay(stage: int) -> float:
        return latency(stage) if callable(latency) else latency

    return {key: (0.0 if math.isinf(rate(key[0])) else n / rate(key[0])) + delay(key[0])
            for key, n in nbytes.items()}
