"""assembly: a plan's options become the runtime's `RuntimeSpec` in one function, resolved
(per-stage recomputation as a set of stages), and `assemble_plan` builds the runtime from it."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile.planner.assembly import assemble_plan, runtime_spec
from pipecompile.runtime.assemble import LocalRuntime


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _plan(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    return pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=_mse, **options).plan


def test_the_spec_holds_what_the_runtime_reads_of_the_options():
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    plan = _plan(schedule="1f1b", optimizer=sgd, timeout=42.0)
    spec = runtime_spec(plan)
    assert (spec.microbatches, spec.loss_fn, spec.optimizer) == (2, _mse, sgd)
    assert (spec.checkpoint, spec.rng, spec.timeout, spec.topology) == (frozenset(), "global",
                                                                        42.0, None)
    assert spec.data_parallel == 1 and not (spec.fsdp or spec.compile_stages)


def test_per_stage_recomputation_reaches_the_workers():
    plan = _plan(schedule="1f1b")
    assert plan.choices is not None
    mixed = replace(plan, resolved=replace(plan.resolved, checkpoint=(True, False)))
    assert runtime_spec(mixed).checkpoint == frozenset({0})
    runtime = assemble_plan(mixed)
    assert isinstance(runtime, LocalRuntime)
    assert [runtime.workers[s].checkpoint for s in (0, 1)] == [True, False]
