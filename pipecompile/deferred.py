"""Lazy compilation: plan from the first call's inputs, and again for inputs a plan cannot run.

`pipecompile.compile(model, devices=4, loss_fn=...)` without example inputs returns a
`Pipeline` that has no plan yet. Its first `step(...)` or call captures the model with those
inputs and runs the compiler's passes (`Planner.plan`); the step itself then runs on the new
plan, so the first result is exact like any other. A later call whose inputs the current plan
cannot run (`cannot_run`: another set of inputs, a size the capture fixed, a batch that does not
split into the plan's micro-batches) is planned again; plans are kept, and a call runs on the
first kept plan that can run it:

    pipe.step(x[8, 12])   -> no plan: capture + plan A (the batch symbolic), run on A
    pipe.step(x[8, 40])   -> A fixed the length at 12: plan B with every size symbolic, run on B
    pipe.step(x[3, 12])   -> A splits 8 into 4 micro-batches, not 3: plan C, run on C
    pipe.step(x[8, 16])   -> A cannot, B can (the length is a symbol): run on B

With `symbolic_sizes="auto"` (the default) a plan made for a size an earlier plan fixed
captures every size symbolic (`Example.all_sizes`), as torch.compile's automatic dynamic shapes
recompile once with the changed size dynamic; `"batch"` never does, `"all"` always does.

Every plan places the model's tensors through one shared `placed` table, so all plans train the
same tensor objects: an optimizer over `pipe.parameters()` keeps working across plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import sympy
import torch

from .capture.capture import batch_size_of
from .errors import ConfigError
from .capture.inputs import check_inputs
from .ir.records import Example
from .planner.plan import Plan

__all__ = ["Planner", "cannot_run", "check_same_tensors", "fixed_size_changed"]


@dataclass(frozen=True)
class Planner:
    """What a lazily compiled pipeline plans with: the model and compile's passes, run on a
    call's inputs (`plan_for`), and the device copies every plan shares."""

    model: torch.nn.Module
    plan_for: Callable[[Example], Plan]
    placed: dict = field(default_factory=dict)  # (id(tensor), device) -> the stages' copy

    def plan(self, args: tuple, kwargs: Mapping[str, Any], target: Any, *, where: str,
             all_sizes: bool = False) -> Plan:
        """The plan compile makes for a call with these inputs (`where` names the call);
        `all_sizes`: capture every size symbolic (see the module docstring)."""
        try:
            batch_size_of(args, kwargs)
        except ConfigError:
            given = ", ".join([*(type(a).__name__ for a in args),
                               *(f"{k}={type(v).__name__}" for k, v in kwargs.items())])
            raise ConfigError(
                f"{where} got no tensor with a batch dimension ({given or 'no inputs'}); the "
                f"pipeline plans from its first call's inputs and splits them into micro-batches "
                f"along dimension 0: pass at least one tensor whose first dimension is the batch "
                f"size") from None
        return self.plan_for(Example(self.model, tuple(args), dict(kwargs), target,
                                     placed=self.placed, all_sizes=all_sizes))


def cannot_run(plan: Plan, args: tuple, kwargs: Mapping[str, Any], *, where: str,
               microbatched: bool = True) -> str | None:
    """Why `plan` cannot run a call with these inputs, or None if it can. `microbatched`: the
    call splits the batch into the plan's micro-batches (a step; `pipe(x)` does not)."""
    program = plan.program
    assert program is not None, "a finished plan"
    captured = program.captured
    try:
        check_inputs(captured, args, kwargs, where=where)
        batch = batch_size_of(args, kwargs)
    except ConfigError as exc:
        return str(exc)
    if not microbatched:
        return None
    m = plan.resolved.microbatches
    size = -(-batch // m)  # torch.chunk's piece size; it makes ceil(batch / size) pieces
    if batch < m or -(-batch // size) != m:
        return f"a batch of {batch} does not split into its {m} micro-batches"
    if not captured.dynamic_batch and size != captured.captured_batch_size:
        return (f"it was captured with static shapes for micro-batches of "
                f"{captured.captured_batch_size}, not {size}")
    return None


def fixed_size_changed(plan: Plan, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether an input has another size than `plan`'s capture fixed, in a dimension past the
    batch (a lazy pipeline then captures every size symbolic: `Planner.plan(all_sizes=True)`)."""
    assert plan.program is not None, "a finished plan"
    captured = plan.program.captured
    try:
        flat = captured.flatten_inputs(args, kwargs)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError):
        return False  # another structure of inputs: not a size
    for name, value in zip(captured.input_names, flat):
        shape = captured.values[name].shape
        if not isinstance(value, torch.Tensor) or value.dim() != len(shape):
            continue
        if any(isinstance(dim, (int, sympy.Integer)) and int(dim) != size
               for dim, size in list(zip(shape, value.shape))[1:]):
            return True
    return False


def check_same_tensors(before: Mapping[str, torch.Tensor],
                        after: Mapping[str, torch.Tensor | None]) -> None:
    """A lazy pipeline's parameters, read before its first plan, must be the tensors the plan
    trains: an optimizer built over them would otherwise update tensors no stage uses."""
    moved = [n for n, t in before.items() if after.get(n) is not t]
    if moved:
        raise ConfigError(
            f"pipe.parameters() was read before the pipeline was planned, and the plan keeps "
            f"{moved[0]!r}{f' and {len(moved) - 1} more' if len(moved) > 1 else ''} as another "
            f"tensor (a copy on its stage's device, or on another rank); an optimizer built "
            f"then would update tensors no stage uses. Create the optimizer after the first "
            f"pipe.step(...), or pass example_inputs to compile so that it plans at once")
