"""From a finished plan to its runtime: the one place what was asked (`plan.asked`) and what was
resolved (`plan.resolved`) become a `RuntimeSpec`.

    Plan ──runtime_spec──▶ RuntimeSpec ──assemble (runtime/assemble.py)──▶ Runtime

The runtime never sees `CompileOptions`: `runtime_spec` picks what it needs and resolves it
(per-stage recomputation as a set of stages, this rank's topology), and the graph pass it may
need at run time (eval-mode graphs) is handed in with it: runtime/ imports no pass.
"""

from __future__ import annotations

from ..passes.eval_mode import eval_graph
from .plan import Plan
from ..runtime.assemble import Runtime, assemble
from ..runtime.spec import RuntimeSpec

__all__ = ["runtime_spec", "assemble_plan"]


def runtime_spec(plan: Plan) -> RuntimeSpec:
    """What the runtime needs of `plan`: its settings as asked, its layout, schedule, counts
    and recomputation as resolved."""
    asked, resolved, program = plan.asked, plan.resolved, plan.program
    assert program is not None, "a finished plan has its program"
    stages = range(program.num_stages)
    return RuntimeSpec(
        microbatches=resolved.microbatches, loss_fn=asked.loss_fn, optimizer=asked.optimizer,
        checkpoint=frozenset(s for s in stages if resolved.stage_checkpoint(s)),
        rng=asked.rng, vertical_sync=asked.vertical_sync,
        compile_stages=asked.compile_stages, fsdp=resolved.fsdp, timeout=asked.timeout,
        topology=resolved.topology, eval_graph=eval_graph)


def assemble_plan(plan: Plan) -> Runtime:
    """The runtime of a finished `plan` for this process."""
    assert plan.program is not None and plan.schedule is not None, "a finished plan"
    return assemble(plan.program, plan.schedule, runtime_spec(plan))
