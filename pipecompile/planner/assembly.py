"""From a finished plan to its runtime: the one place compile's options become a `RuntimeSpec`.

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
    """What the runtime needs of `plan`'s options."""
    options, program = plan.resolved, plan.program
    assert program is not None, "a finished plan has its program"
    stages = range(program.num_stages)
    return RuntimeSpec(
        microbatches=options.microbatches, loss_fn=options.loss_fn, optimizer=options.optimizer,
        checkpoint=frozenset(s for s in stages if options.stage_checkpoint(s)),
        rng=options.rng, vertical_sync=options.vertical_sync,
        compile_stages=options.compile_stages, fsdp=options.fsdp, timeout=options.timeout,
        topology=options.ranks.topology, eval_graph=eval_graph)


def assemble_plan(plan: Plan) -> Runtime:
    """The runtime of a finished `plan` for this process."""
    assert plan.program is not None and plan.schedule is not None, "a finished plan"
    return assemble(plan.program, plan.schedule, runtime_spec(plan))
