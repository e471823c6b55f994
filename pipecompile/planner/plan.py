"""The plan record the compiler's passes advance, the passes' declared contracts, and the helper
that runs, checks and records them.

`compile` starts from `Plan(options)` (what the user asked: `plan.asked`) and runs a list of
`Pass` records; each holds a function

    run(plan: Plan, example: Example) -> (new plan, one-line summary) | None (not applicable)

that returns a new record (`dataclasses.replace`), never changing its input, and declares the
plan fields it `requires`, `produces` (every field has exactly one producing pass) and
`updates` (fields an earlier pass produced that it rewrites: a finer linearization, corrected
costs). `run_passes` checks the contract around each pass (a missing requirement, an output
left None, or a field changed without being declared raises `PassContractError`), times it and
appends a `PassRecord` to `plan.passes`, which `pipe.explain()` prints. Inside a pass,
`plan.ready.<field>` reads a required field with its type (not None: the contract checked it).
The finished plan is what a `Pipeline` runs and what `pipe.save` writes:

    asked -> captured -> probe -> choices -> schedule -> linear -> costs -> placement
          -> program -> stage_costs -> predicted
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .resolved import Choices, Resolved, merged_options, resolve
from .options import CompileOptions
from ..ir.progress import pass_done, passes_done
from ..ir.records import Example

if TYPE_CHECKING:
    from ..ir.records import CapturedModel, CostTable, LinearGraph
    from ..passes.annotate import DeviceModel
    from ..passes.calibrate import Calibration
    from ..ir.records import StageTimes
    from ..measure.probe import Probe
    from ..ir.devices import DeviceSpec
    from ..passes.partition import Partition
    from ..ir.records import StagedProgram
    from ..schedule.actions import Schedule
    from ..schedule.simulate import StageCosts, Timeline
    from .request import Request
    from .schedule_search import SearchResult

__all__ = ["PassRecord", "Plan", "Pass", "PassContractError", "Ready", "check_contracts",
           "run_passes"]


@dataclass(frozen=True)
class PassRecord:
    """What one compiler pass did: its name, wall time and a one-line summary."""

    name: str
    seconds: float
    summary: str


class PassContractError(RuntimeError):
    """A compiler pass broke its declared contract (an internal error, not the user's)."""


@dataclass(frozen=True)
class Plan:
    """Everything compile decided, filled in pass by pass (None: not yet, or not applicable).

    `asked` is what the user asked (validated, "auto" at its starting value), `choices` what
    the search chose and `resolved` what the join, search and ranks passes resolved (a
    `Resolved`: layout, devices, ranks, schedule, counts, recomputation); a setting nothing
    resolves is read from `asked`. `captured`, `linear` and `costs` describe the model; `probe`,
    `device_model`, `overhead`, `calibration`, `efficiency` and `split_ratio` what was measured
    of this machine; `schedule` and `inflight` the action lists and the micro-batches each
    stage holds at peak; `placement` the partitioner's choice; `program` the split stages;
    `stage_costs`, `cores` and `efficiency` what the simulator needs to produce `predicted`.
    `produced` names the fields the passes run so far produced. A loaded plan has no `costs`
    or `placement`.
    """

    asked: CompileOptions
    # what the join, search and ranks passes resolved (resolved.py): the asked starting
    # values until they run; never None once built
    resolved: Resolved = None  # type: ignore[assignment]
    request: "Request | None" = field(default=None, compare=False)  # what the user asked
    captured: "CapturedModel | None" = None
    probe: "Probe | None" = None  # the planning probe's measurements (None: not probed)
    search: "SearchResult | None" = None  # the candidates the search pass costed (None: none)
    choices: Choices | None = None  # the options as resolved (given, or chosen by the search)
    overhead: float = 0.0  # fixed seconds per action and message (measure.rates.action_overhead)
    schedule: "Schedule | None" = None
    inflight: tuple[int, ...] = ()
    device_model: "DeviceModel | None" = None
    linear: "LinearGraph | None" = None
    costs: "CostTable | None" = None
    placement: "Partition | None" = None
    calibration: "Calibration | None" = None
    program: "StagedProgram | None" = None
    # tensor_parallel=T: the program before the tensor pass lowered this rank's stages (what
    # `pipe.save` writes, the sharding re-chosen from its graphs)
    unsharded: "StagedProgram | None" = None
    measured: "Mapping[int, StageTimes] | None" = None  # profile=True: each stage's times
    stage_costs: "tuple[StageCosts, ...]" = ()
    cores: int | None = None  # compute actions the devices run at once (None: one per device)
    efficiency: float = 1.0  # their speed when several run at once (see schedule/simulate)
    split_ratio: float | None = None  # measured (I + W) / B (None: search.SPLIT_BACKWARD_RATIO)
    predicted: "Timeline | None" = None
    transfers: "Mapping[tuple[int, int, str], float] | None" = None  # seconds per message link
    passes: tuple[PassRecord, ...] = ()
    produced: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.resolved is None:  # nothing resolved yet: the asked starting values
            start = Resolved.start(self.asked)
            if self.choices is not None:  # a plan built with its choices (tests, loading)
                start = resolve(start, self.choices)
            object.__setattr__(self, "resolved", start)

    @property
    def options(self) -> CompileOptions:
        """Deprecated: `plan.resolved` (what the passes resolved) and `plan.asked` (every
        other setting); this merges the two into the old single record."""
        warnings.warn("Plan.options is deprecated; read plan.resolved (the layout, devices, "
                      "schedule and counts as resolved) or plan.asked (every other setting)",
                      DeprecationWarning, stacklevel=2)
        return merged_options(self.asked, self.resolved)

    @property
    def ready(self) -> "Ready":
        """Typed access to the fields a pass requires (see `Ready`)."""
        return Ready(self)

    @property
    def stage_specs(self) -> "tuple[DeviceSpec, ...]":
        """The device of every stage (several per device with virtual stages)."""
        return tuple(self.resolved.devices[d] for d in self.ready.schedule.stage_to_device)


# fields for which None is a result a pass may produce (not measured, nothing searched, ...)
_MAY_BE_NONE = frozenset({"probe", "search", "calibration", "measured", "cores", "split_ratio"})


class Ready:
    """A plan's fields with their types, not None: a pass reads what it `requires` through
    `plan.ready`, which run_passes has checked is there; a field that is not raises."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def _get(self, name: str) -> Any:
        value = getattr(self._plan, name)
        if value is None:
            raise PassContractError(
                f"plan.{name} is read before a pass produced it: add {name!r} to the reading "
                f"pass's `requires` (run_passes then names the pass that produces it)")
        return value

    @property
    def captured(self) -> "CapturedModel":
        return self._get("captured")

    @property
    def choices(self) -> Choices:
        return self._get("choices")

    @property
    def device_model(self) -> "DeviceModel":
        return self._get("device_model")

    @property
    def schedule(self) -> "Schedule":
        return self._get("schedule")

    @property
    def linear(self) -> "LinearGraph":
        return self._get("linear")

    @property
    def costs(self) -> "CostTable":
        return self._get("costs")

    @property
    def placement(self) -> "Partition":
        return self._get("placement")

    @property
    def program(self) -> "StagedProgram":
        return self._get("program")

    @property
    def predicted(self) -> "Timeline":
        return self._get("predicted")


@dataclass(frozen=True)
class Pass:
    """A compiler pass and its contract: the plan fields it reads (`requires`), sets
    (`produces`: it is their one producer) and rewrites after an earlier pass (`updates`)."""

    name: str
    run: Callable[[Plan, Example], "tuple[Plan, str] | None"]
    requires: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()
    updates: tuple[str, ...] = ()


# set by compile and run_passes, not by a pass ("resolved" starts as "asked"; the resolver's
# passes update it)
_BOOKKEEPING = ("asked", "request", "passes", "produced")
_STARTED = ("asked", "resolved")


def check_contracts(passes: Sequence[Pass], produced: frozenset[str] = frozenset()) -> None:
    """Raise `PassContractError` unless `passes` can run in this order on a plan whose
    `produced` fields are set: every field a pass requires or updates is produced by an
    earlier one (or already), every declared name is a plan field, and no field has two
    producing passes."""
    known = {f.name for f in fields(Plan)}
    producer: dict[str, str] = dict.fromkeys(produced, "(earlier)")
    for p in passes:
        for name in (*p.requires, *p.produces, *p.updates):
            if name not in known or name in _BOOKKEEPING[1:]:
                raise PassContractError(f"pass {p.name!r} declares {name!r}, which is not a "
                                        f"field a pass can read or set on Plan")
        for name in (*p.requires, *p.updates):
            if name not in _STARTED and name not in producer:
                later = next((q.name for q in passes if name in q.produces), None)
                raise PassContractError(
                    f"pass {p.name!r} requires plan.{name}, which "
                    + (f"the {later!r} pass produces after it" if later
                       else "no pass produces"))
        for name in p.produces:
            if name in producer:
                raise PassContractError(f"plan.{name} is produced by both the "
                                        f"{producer[name]!r} and the {p.name!r} pass")
            producer[name] = p.name


def run_passes(plan: Plan, passes: Sequence[Pass], example: Example) -> Plan:
    """Run `passes` in order on `plan`, checking each one's contract; each one that applies
    is timed and recorded."""
    check_contracts(passes, plan.produced)
    producer = {name: p.name for p in passes for name in p.produces}
    began, ran = time.perf_counter(), 0
    for index, p in enumerate(passes, 1):
        for name in (*p.requires, *p.updates):
            if name not in _STARTED and name not in plan.produced:
                raise PassContractError(
                    f"pass {p.name!r} requires plan.{name}, which the "
                    f"{producer.get(name, '(none)')!r} pass produces, but it has not run")
        start = time.perf_counter()
        result = p.run(plan, example)
        if result is None:
            continue
        advanced, summary = result
        _check_outputs(p, plan, advanced)
        record = PassRecord(p.name, time.perf_counter() - start, summary)
        pass_done(record.name, record.seconds, summary, index=index, count=len(passes))
        ran += 1
        plan = replace(advanced, passes=(*plan.passes, record),
                       produced=plan.produced | set(p.produces))
    passes_done(ran, len(passes), time.perf_counter() - began)
    return plan


def _check_outputs(p: Pass, before: Plan, after: Plan) -> None:
    """What `p` returned keeps its contract: its outputs set, nothing undeclared changed."""
    for name in p.produces:
        if getattr(after, name) is None and name not in _MAY_BE_NONE:
            raise PassContractError(f"pass {p.name!r} declares it produces plan.{name} but "
                                    f"left it None")
    declared = {*p.produces, *p.updates, "passes", "produced"}
    if after.asked is not before.asked or after.request is not before.request:
        raise PassContractError(f"pass {p.name!r} rewrote what was asked; a pass resolves an "
                                f"option into plan.resolved")
    for f in fields(Plan):
        if f.name not in declared and getattr(after, f.name) is not getattr(before, f.name):
            raise PassContractError(f"pass {p.name!r} changed plan.{f.name}, which it does "
                                    f"not declare in `produces` or `updates`")
