"""Which plan runs a call: the one plan of a compiled pipeline, or one made from the calls.

    Plans(plan=p)          compiled with example inputs: p runs every call its capture accepts
    Plans(planner=...)     compiled without: the first call captures and plans; a later call no
                           kept plan can run (`deferred.cannot_run`) is planned again

    plans.choose(args, kwargs, target, where="pipe.step()")  -> (Plan, Runtime) that runs them

Each plan is assembled into its runtime once (`assembly.assemble_plan`) and kept with it, so a
call that returns to an earlier plan's inputs runs on that plan again. Re-planning is refused
where it cannot be done safely: under torch.distributed (every rank would have to re-plan at
the same step) and with compile's `optimizer=` (the new stages would get new optimizers).
"""

from __future__ import annotations

from typing import Any, Mapping

from .planner.assembly import assemble_plan
from .deferred import Planner, cannot_run, fixed_size_changed
from .errors import ConfigError
from .capture.inputs import check_inputs
from .planner.plan import Plan
from .runtime.assemble import Runtime

__all__ = ["Plans", "NOT_PLANNED"]

NOT_PLANNED = ("not planned yet: compiled without example inputs, it captures and plans on "
               "its first pipe.step(...) or pipe(...) call")


class Plans:
    """The plans a pipeline has made, each with its runtime (the first: a compiled one's)."""

    def __init__(self, *, plan: Plan | None = None, planner: Planner | None = None):
        assert (plan is None) != (planner is None), "a plan, or a planner for a lazy pipeline"
        self.planner = planner
        self.kept: list[tuple[Plan, Runtime]] = []  # in the order made; a call takes the first
        if plan is not None:
            self.kept.append((plan, assemble_plan(plan)))

    def choose(self, args: tuple, kwargs: Mapping[str, Any], target: Any, *, where: str,
               microbatched: bool = True) -> tuple[Plan, Runtime]:
        """The first kept plan that runs these inputs, else a new one made from them. Raises a
        `ConfigError` naming the input where no plan can run them (`where` names the call;
        `microbatched`: the call splits the batch into micro-batches)."""
        if self.planner is None:
            check_inputs(self.kept[0][0].ready.program.captured, args, kwargs, where=where)
            return self.kept[0]
        reason = None
        for kept in self.kept:
            reason = cannot_run(kept[0], args, kwargs, where=where, microbatched=microbatched)
            if reason is None:
                return kept
        if reason is not None:  # a plan exists but cannot run these: may a new one be made?
            _check_can_replan(self.kept[-1][0], reason)
        grow = any(fixed_size_changed(p, args, kwargs) for p, _ in self.kept)
        plan = self.planner.plan(args, kwargs, target, where=where, all_sizes=grow)
        self.kept.append((plan, assemble_plan(plan)))
        check_inputs(plan.ready.program.captured, args, kwargs, where=where)
        return self.kept[-1]


def _check_can_replan(plan: Plan, reason: str) -> None:
    if plan.resolved.ranks.distributed:
        raise ConfigError(
            f"these inputs need a new plan ({reason}), but under torch.distributed every "
            f"rank would have to re-plan at the same step; pass inputs the first plan runs "
            f"(any size capture kept symbolic may vary)")
    if plan.asked.optimizer is not None:
        raise ConfigError(
            f"these inputs need a new plan ({reason}), whose stages would get new "
            f"optimizers from optimizer=...; pass inputs the first plan runs, or use your "
            f"own optimizer over pipe.parameters(), which every plan shares")
