"""The plan record the compiler's passes advance, and the helper that runs and records them.

`compile` starts from `Plan(options)` and runs a list of passes; each pass is a function

    pass(plan: Plan, example: Example) -> (new plan, one-line summary) | None (not applicable)

that returns a new record (`dataclasses.replace`), never changing its input. `run_passes` times
each and appends a `PassRecord` to `plan.passes`, which `pipe.explain()` prints. The finished
plan is what a `Pipeline` runs and what `pipe.save` writes:

    options -> captured -> schedule -> linear -> costs -> placement -> program -> stage_costs
                                                                          -> predicted
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TypeVar

from .options import CompileOptions, Example

if TYPE_CHECKING:
    from .ir import CapturedModel, CostTable, LinearGraph
    from .passes.annotate import DeviceModel
    from .passes.calibrate import Calibration
    from .ir import StageTimes
    from .passes.partition import DeviceSpec, Partition
    from .passes.split import StagedProgram
    from .schedule.actions import Schedule
    from .schedule.simulate import StageCosts, Timeline
    from .search import SearchResult

__all__ = ["PassRecord", "Plan", "Pass", "need", "run_passes"]

T = TypeVar("T")


@dataclass(frozen=True)
class PassRecord:
    """What one compiler pass did: its name, wall time and a one-line summary."""

    name: str
    seconds: float
    summary: str


@dataclass(frozen=True)
class Plan:
    """Everything compile decided, filled in pass by pass (None: not yet, or not applicable).

    `captured`, `linear` and `costs` describe the model; `schedule` and `inflight` the action
    lists and the micro-batches each stage holds at peak; `placement` the partitioner's choice;
    `program` the split stages; `stage_costs`, `cores` and `efficiency` what the simulator
    needs to produce `predicted`. A loaded plan has no `costs` or `placement`.
    """

    options: CompileOptions
    captured: "CapturedModel | None" = None
    search: "SearchResult | None" = None  # the candidates the search pass costed (None: none)
    overhead: float = 0.0  # fixed seconds per action and message (measure.rates.action_overhead)
    schedule: "Schedule | None" = None
    inflight: tuple[int, ...] = ()
    device_model: "DeviceModel | None" = None
    linear: "LinearGraph | None" = None
    costs: "CostTable | None" = None
    placement: "Partition | None" = None
    calibration: "Calibration | None" = None
    program: "StagedProgram | None" = None
    measured: "Mapping[int, StageTimes] | None" = None  # profile=True: each stage's times
    stage_costs: "tuple[StageCosts, ...]" = ()
    cores: int | None = None  # compute actions the devices run at once (None: one per device)
    efficiency: float = 1.0  # their speed when several run at once (see schedule/simulate)
    split_ratio: float | None = None  # measured (I + W) / B (None: search.SPLIT_BACKWARD_RATIO)
    predicted: "Timeline | None" = None
    transfers: "Mapping[tuple[int, int, str], float] | None" = None  # seconds per message link
    passes: tuple[PassRecord, ...] = ()

    @property
    def stage_specs(self) -> "tuple[DeviceSpec, ...]":
        """The device of every stage (several per device with virtual stages)."""
        schedule = need(self.schedule, "schedule")
        return tuple(self.options.devices[d] for d in schedule.stage_to_device)


def need(value: T | None, set_by: str) -> T:
    """A plan field a later pass reads: `value`, which the `set_by` pass has set by then."""
    assert value is not None, f"a plan field is read before the {set_by} pass set it"
    return value


Pass = Callable[[Plan, Example], "tuple[Plan, str] | None"]


def run_passes(plan: Plan, passes: Sequence[tuple[str, Pass]], example: Example) -> Plan:
    """Run `passes` in order on `plan`; each one that applies is timed and recorded."""
    for name, run in passes:
        start = time.perf_counter()
        result = run(plan, example)
        if result is None:
            continue
        advanced, summary = result
        record = PassRecord(name, time.perf_counter() - start, summary)
        plan = replace(advanced, passes=(*plan.passes, record))
    return plan
