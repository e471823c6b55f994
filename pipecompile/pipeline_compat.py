"""Public names of `Pipeline` that moved: each still answers, for one release, with a
`DeprecationWarning` that names where the value lives now.

An earlier restructuring removed these properties without a warning, which broke scripts that
read them; the contract is that a public name warns for a release before it goes.

    pipe.stage_costs      # DeprecationWarning: use pipe.plan.stage_costs
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

__all__ = ["DeprecatedNames", "MOVED", "is_model_name", "model_attribute"]

_NONE = object()


def model_attribute(pipe: Any, name: str) -> Any:
    """The model's own submodule, parameter or buffer called `name` as `pipe` mirrors it, or
    a sentinel (`is_model_name`): a model's names win over the Pipeline's properties, as an
    `nn.Module`'s registered names do."""
    for table in ("_modules", "_parameters", "_buffers"):
        found = pipe.__dict__.get(table, {}).get(name, _NONE)
        if found is not _NONE:
            return found
    return _NONE


def is_model_name(value: Any) -> bool:
    """Whether `model_attribute` found the model's own name."""
    return value is not _NONE

# old name -> (where it lives now, as the warning says it, how to read it from a Pipeline)
MOVED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "microbatches": ("pipe.plan.resolved.microbatches", lambda p: p.plan.resolved.microbatches),
    "stage_costs": ("pipe.plan.stage_costs", lambda p: p.plan.stage_costs),
    "cores": ("pipe.plan.cores", lambda p: p.plan.cores),
    "efficiency": ("pipe.plan.efficiency", lambda p: p.plan.efficiency),
    "passes": ("pipe.plan.passes", lambda p: p.plan.passes),
    "executor": ("pipe.runtime.executor", lambda p: p.runtime.executor),
    "own_stages": ("pipe.runtime.own_stages", lambda p: p.runtime.own_stages),
    "last_schedule": ("pipe.last_step.schedule", lambda p: p.last_step.schedule),
    "peak_inflight": ("pipe.last_step.peak_inflight", lambda p: p.last_step.peak_inflight),
    "weight_versions": ("pipe.runtime.weight_versions()", lambda p: p.runtime.weight_versions()),
}


def _warn(name: str) -> None:
    warnings.warn(f"Pipeline.{name} is deprecated and will be removed in the next release; "
                  f"use {MOVED[name][0]}", DeprecationWarning, stacklevel=3)


def _moved(name: str) -> property:
    """A property that warns, then reads the value where it lives now."""
    def get(self: Any) -> Any:
        own = model_attribute(self, name)
        if is_model_name(own):
            return own
        _warn(name)
        return MOVED[name][1](self)

    get.__name__ = name
    get.__doc__ = f"Deprecated: use {MOVED[name][0]}."
    return property(get)


def _moved_method(name: str) -> Callable[[Any], Any]:
    """A method (the old name was one) that warns, then reads the value where it lives now."""
    def call(self: Any) -> Any:
        _warn(name)
        return MOVED[name][1](self)

    call.__name__ = name
    call.__doc__ = f"Deprecated: use {MOVED[name][0]}."
    return call


class DeprecatedNames:
    """Mixed into `Pipeline`: the moved names (properties, and the two that were methods),
    each warning at every read."""

    microbatches = _moved("microbatches")
    stage_costs = _moved("stage_costs")
    cores = _moved("cores")
    efficiency = _moved("efficiency")
    passes = _moved("passes")
    executor = _moved("executor")
    own_stages = _moved("own_stages")
    last_schedule = _moved("last_schedule")
    peak_inflight = _moved_method("peak_inflight")
    weight_versions = _moved_method("weight_versions")
