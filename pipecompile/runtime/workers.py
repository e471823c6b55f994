"""Assembly of the stages this process runs: one `StageWorker` per stage, with every behaviour
chosen here once, and one optimizer per stage over the parameters it owns.

    stage_workers(program, schedule, spec, own, grad_values, hooks) -> {stage: StageWorker}
    stage_optimizers(program, optimizer, own)                        -> {stage: Optimizer}

`spec` is the `RuntimeSpec` (spec.py); the runtime that holds the result is step_driver.py's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError
from ..ir.records import StagedProgram
from ..ir.rng import seed_random_ops
from ..schedule.actions import Schedule
from .compiled import compile_stage
from .data_parallel import MicrobatchSync
from .spec import RuntimeSpec
from .stage_worker import LossSpec, StageWorker
from .versions import VersionRule, WeightVersions

__all__ = ["stage_workers", "stage_optimizers"]


def stage_workers(program: StagedProgram, schedule: Schedule, spec: RuntimeSpec,
                  own: Sequence[int], grad_values: frozenset[str],
                  hooks: Callable[[int], Any] | None = None) -> dict[int, StageWorker]:
    """One worker per stage in `own`; the last computes the loss. Its behaviours are chosen
    here, once (`StageWorker`): recomputation for the stages in `spec.checkpoint`, weight
    versions and their optimizer under the asynchronous schedules, the split backward under
    the zero-bubble ones, a compiled stage's fused backward, and the data-parallel gradient
    hooks (FSDP's per micro-batch; DDP's, `hooks`, where the replicas reduce in backward)."""
    m, last = spec.microbatches, program.num_stages - 1
    asynchronous = schedule.asynchronous
    scale = (VersionRule(schedule.name, program.num_stages, 0, m).loss_scale
             if asynchronous else 1.0 / m)
    loss = LossSpec(program.captured.unflatten_outputs, spec.loss_fn, scale)
    if asynchronous and spec.compile_stages:
        raise ConfigError(
            f"compile_stages=True with schedule={schedule.name!r} is not supported (its stashed "
            f"weight versions run the uncompiled graph); use a synchronous schedule or "
            f"compile_stages=False")
    splits = schedule.splits_backward
    holders = Counter(id(p) for s in program.stages if s.index in own
                      for p in s.module.parameters())
    exclusive = frozenset(i for i, n in holders.items() if n == 1)
    workers = {}
    for s in program.stages:
        if s.index not in own:
            continue
        versions = None
        if asynchronous:
            rule = VersionRule(schedule.name, program.num_stages, s.index, m, spec.vertical_sync)
            assert spec.optimizer is not None, "resolve_options requires it for async"
            versions = WeightVersions(s.module, rule, spec.optimizer)
        module, own_streams = s.module, False
        recompute = s.index in spec.checkpoint
        if spec.rng == "global" and recompute:
            seeded, names = seed_random_ops(s.module, 0)
            module, own_streams = (seeded, True) if names else (module, False)
        workers[s.index] = StageWorker(
            s.index, compile_stage(module, s.index) if spec.compile_stages else module,
            s.inputs, s.outputs, frozenset(n for n in s.inputs if n in grad_values),
            loss if s.index == last else None, recompute, versions=versions,
            fused_backward=spec.compile_stages, own_streams=own_streams,
            split_weights=splits, exclusive_params=exclusive,
            sync=(MicrobatchSync(s.module, m, spec.data_parallel) if spec.fsdp
                  else hooks(s.index) if hooks is not None else None),
            vocab_loss=getattr(s.module, "vocab_loss", None))
    return workers


def stage_optimizers(program: StagedProgram, optimizer: Callable | None,
                     own_stages: Sequence[int]) -> dict[int, torch.optim.Optimizer]:
    """One optimizer per stage over the parameters it owns: a shared object by its first
    stage; a tied weight's copy on another device not at all, where this process holds the
    tie's first copy (the copies follow it: `TiedCopies`), so no copy steps before its
    gradient is summed (`stage_steps.py`)."""
    if optimizer is None:
        return {}
    owned: set[int] = set()
    for tie in program.ties:
        if program.owner_stage(tie.names[0]) in own_stages:
            owned.update(id(t) for t in program.held_copies(tie.names[0], own_stages)[1:])
    result = {}
    for stage in program.stages:
        if stage.index not in own_stages:
            continue
        params = []
        for p in stage.module.parameters():
            if p.requires_grad and id(p) not in owned:
                owned.add(id(p))
                params.append(p)
        if params:
            result[stage.index] = optimizer(params)
    return result
