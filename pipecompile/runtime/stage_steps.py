"""The synchronous STEP actions, run where the schedule puts them: each stage's STEP in its
device's generated row, after that stage's last backward, not by the caller after every row.

STEP(s) completes the gradients of stage s's parameters, then applies compile's `optimizer=`
(one optimizer per stage, over the parameters it holds first):

- in one process a parameter held by several stages (one object read by stages of one device,
  or tied copies on several devices) has its final gradient only when every stage holding it
  has finished its backward: STEP(s) waits for those stages' STEPs (a device thread each; the
  one-thread stepwise rows poll `ready`), and a tie's first stage sums its copies' gradients
  into every copy. A stage that shares nothing updates at once, while other devices still
  compute (in 1F1B the last device finishes its backwards first);
- under torch.distributed a rank's last STEP reduces what crosses ranks (tied copies, and
  data-parallel replicas where torch's hooks did not reduce them in backward:
  `GradientSync.reduce`, the same collectives in the same order on every rank), then steps
  the rank's optimizers.

A row's STEPs before its last one only record that their stage arrived; the row's last STEP
(the row's last action) waits and updates every stage of the row, so a device holding two
stages (interleaved, zero-bubble V) never waits for itself. A schedule in which some stage
has no STEP, or a row does not end with one (hand-written), keeps the caller's order: after
the rows the gradients are completed and, if any STEP ran, every optimizer steps.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import StageExecutionError
from ..schedule.actions import Kind, Schedule
from .mailbox import Aborted

__all__ = ["StageSteps", "StepRound", "sharing_stages"]


def sharing_stages(program: Any, own_stages: Sequence[int]
                   ) -> tuple[dict[int, frozenset[int]], dict[int, list[list[torch.Tensor]]]]:
    """Per stage: the other stages whose backward its optimizer step must wait for (they hold
    a parameter object it holds first, or a copy of a tie it holds first), and the tied
    copies whose gradients it sums (ties whose first stage it is: every copy this process
    holds, an alias on its device or a copy on another)."""
    own = sorted(own_stages)
    holders: dict[int, list[int]] = defaultdict(list)
    for stage in program.stages:
        if stage.index in own:
            for p in {id(p): p for p in stage.module.parameters()}.values():
                holders[id(p)].append(stage.index)
    waits: dict[int, set[int]] = {s: set() for s in own}
    for stages in holders.values():
        waits[stages[0]].update(stages[1:])
    sums: dict[int, list[list[torch.Tensor]]] = {s: [] for s in own}
    for tie in program.ties:
        held = program.held(tie.names[0], own)
        copies = program.held_copies(tie.names[0], own)
        if len(copies) < 2:
            continue  # one object: autograd summed its gradient
        first = held[0][0]  # the owner stage, or the copy this process's others follow
        waits[first].update(s for s, _ in held if s != first)
        sums[first].append(copies)
    return {s: frozenset(w) for s, w in waits.items()}, sums


def _sum_copies(copies: Sequence[torch.Tensor]) -> None:
    """Each copy of a tied parameter gets the sum of every copy's gradient."""
    grads = [t.grad for t in copies if t.grad is not None]
    if not grads:
        return
    total = grads[0].clone()
    for g in grads[1:]:
        total += g.to(total.device)
    for t in copies:
        t.grad = total.to(t.device)


class StageSteps:
    """The STEPs of one process's stages: its optimizers (stage -> optimizer), what each
    stage waits for, and `reduce` (ranks: gradients across ranks, given `summed`)."""

    def __init__(self, program: Any, own_stages: Sequence[int],
                 optimizers: Mapping[int, torch.optim.Optimizer], *, timeout: float,
                 reduce: Callable[[bool], None] | None = None):
        self.own = tuple(sorted(own_stages))
        self.optimizers = dict(optimizers)
        self.waits, self.sums = sharing_stages(program, self.own)
        self.timeout = timeout
        self.reduce = reduce  # None: one process holds every stage
        self._rows: dict[int, tuple[Schedule, dict[int, tuple[int, ...]] | None]] = {}

    def round(self, schedule: Schedule, *, summed: bool = False) -> "StepRound":
        """The STEPs of one run of `schedule` (summed: replicas' gradients are summed)."""
        known = self._rows.get(id(schedule))
        if known is None or known[0] is not schedule:
            if len(self._rows) >= 16:
                self._rows.clear()
            known = self._rows[id(schedule)] = (schedule, _closing_steps(schedule))
        return StepRound(self, known[1], summed=summed)


def _closing_steps(schedule: Schedule) -> dict[int, tuple[int, ...]] | None:
    """Per device row, its last action's stage -> the stages whose STEPs the row holds, where
    every stage has a synchronous STEP and every row ends with one (so that a row waiting at
    its end holds back no work another row needs); else None: the caller's order."""
    closes: dict[int, tuple[int, ...]] = {}
    stepped: set[int] = set()
    for row in schedule.actions:
        stages = tuple(a.stage for a in row if a.kind is Kind.STEP and a.microbatch is None)
        if not stages:
            continue
        if row[-1].kind is not Kind.STEP or row[-1].microbatch is not None:
            return None
        closes[row[-1].stage] = stages
        stepped.update(stages)
    return closes if stepped == set(range(schedule.num_stages)) else None


class StepRound:
    """One step's STEPs: `finish(s)` in a device thread, or `arrive`, `ready`, `apply` in
    one-thread stepwise rows; `complete()` after the rows. A row's STEPs before its last one
    only arrive; its last waits for the stages sharing parameters with the row's stages,
    then completes their gradients and steps their optimizers."""

    def __init__(self, steps: StageSteps, closes: dict[int, tuple[int, ...]] | None, *,
                 summed: bool):
        self.steps, self.closes, self.summed = steps, closes, summed
        self.arrived: set[int] = set()
        self.failed: BaseException | None = None
        self._cond = threading.Condition()

    def __call__(self, stage: int) -> None:
        self.arrive(stage)
        if self.steps.reduce is None and not self.ready(stage):  # other threads' stages
            with self._cond:
                waited = self._cond.wait_for(lambda: self.failed is not None
                                             or self.ready(stage), self.steps.timeout)
            if self.failed is not None:
                raise Aborted(self.failed)
            if not waited:
                missing = sorted(self._waits(stage) - self.arrived)
                raise StageExecutionError(
                    f"stage {stage}'s optimizer step waited {self.steps.timeout:.0f} s for "
                    f"the backward of stages {missing}, which hold parameters it updates; "
                    f"raise compile(timeout=...) if their work takes that long")
        self.apply(stage)

    def arrive(self, stage: int) -> None:
        """Stage `stage` finished its backward work of this step."""
        with self._cond:
            self.arrived.add(stage)
            self._cond.notify_all()

    def ready(self, stage: int) -> bool:
        """Whether the STEP of `stage` can complete: every stage it waits for arrived."""
        return self._waits(stage) <= self.arrived

    def _waits(self, stage: int) -> set[int]:
        if self.closes is None or stage not in self.closes or self.steps.reduce is not None:
            return set()  # ranks: what crosses ranks is reduced by collectives
        row = self.closes[stage]
        return set().union(*(self.steps.waits[s] for s in row)) - set(row)

    def apply(self, stage: int) -> None:
        """At a row's last STEP: complete the gradients of the row's stages and step their
        optimizers (ranks: reduce across ranks first, then every optimizer of the rank)."""
        if self.closes is None or stage not in self.closes:
            return  # an earlier STEP of its row, or the caller's order (`complete`)
        steps = self.steps
        for s in self.closes[stage]:  # this process's copies first, then across ranks
            for copies in steps.sums.get(s, ()):
                _sum_copies(copies)
        if steps.reduce is not None:
            steps.reduce(self.summed)
        for s in self.closes[stage]:
            if s in steps.optimizers:
                steps.optimizers[s].step()

    def abort(self, error: BaseException) -> None:
        """Another row failed: a STEP waiting for its stages stops."""
        with self._cond:
            self.failed = error
            self._cond.notify_all()

    def complete(self) -> None:
        """After the rows: in the caller's order (some stage has no STEP, or a row does not
        end with one), complete every gradient and, if any STEP ran, step every optimizer."""
        if self.closes is not None:
            return  # the rows' last STEPs did it
        steps = self.steps
        for groups in steps.sums.values():  # this process's copies first, then across ranks
            for copies in groups:
                _sum_copies(copies)
        if steps.reduce is not None:
            steps.reduce(self.summed)
        if self.arrived:
            for opt in steps.optimizers.values():
                opt.step()
