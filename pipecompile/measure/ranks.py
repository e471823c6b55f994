"""Agreement between the ranks of one distributed compile, in one place.

Every rank runs `compile` on its own, yet all must plan the same pipeline: measurements differ
between processes, so the numbers a plan depends on are rank 0's, and the finished plans are
compared. `Ranks` holds this process's place (`Topology`, or None for a single process, where
every method returns its argument and checks nothing):

    rate(flops)          the analytic cost model's matmul rate         broadcast from rank 0
    shared(value)        any other measurement a plan depends on       broadcast from rank 0
    block_times(costs)   measured block times (profile=True)           broadcast from rank 0
    stage_times(times)   each rank times its own stages                gathered from all ranks
    check(program, sch)  the plan digests of all ranks                 compared, error if not equal
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from ..runtime.distributed import Topology, check_same_plan, local_device, plan_digest

if TYPE_CHECKING:
    from ..ir.records import CostTable
    from ..ir.records import StagedProgram
    from ..schedule.actions import Schedule

__all__ = ["Ranks"]

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's ranks for planning: `topology` None means one process, no agreement."""

    topology: Topology | None = None

    @property
    def distributed(self) -> bool:
        return self.topology is not None

    def own_stages(self, schedule: "Schedule") -> tuple[int, ...]:
        """The stages this process runs: all of them, or those of its pipeline position."""
        if self.topology is None:
            return tuple(range(schedule.num_stages))
        return self.topology.own_stages(schedule)

    def rate(self, flops: float) -> float:
        """Rank 0's measured matmul rate (every rank plans with the same analytic costs)."""
        return _broadcast(flops) if self.distributed else flops

    def shared(self, value: T) -> T:
        """Rank 0's `value` of a measurement every rank made (e.g. the planning probe)."""
        return _broadcast(value) if self.distributed else value

    def block_times(self, costs: "CostTable") -> "CostTable":
        """`costs` with rank 0's measured block times (measurements differ between processes)."""
        if not self.distributed:
            return costs
        from ..passes.annotate import with_measured_times

        times = _broadcast([[b.forward_time, b.backward_input_time, b.backward_weight_time]
                            for b in costs.blocks])
        return with_measured_times(costs, {i: tuple(t) for i, t in enumerate(times)})

    def stage_times(self, measured: Mapping[int, Any]) -> dict[int, Any]:
        """Every stage's measured times: each rank timed its own, the first replica's count."""
        result = dict(measured)
        if self.topology is None:
            return result
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.topology.world_size
        dist.all_gather_object(gathered, result)
        for part in gathered[: self.topology.pipeline_size]:
            result.update(part)
        return result

    def check(self, program: "StagedProgram", schedule: "Schedule") -> str | None:
        """Raise on every rank if the ranks planned differently; a summary, None if one process."""
        if self.topology is None:
            return None
        check_same_plan(plan_digest(program, schedule), local_device())
        t = self.topology
        return (f"same plan on all {t.world_size} ranks; this is rank {t.rank} (position "
                f"{t.position}, replica {t.replica})")


def _broadcast(value: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
