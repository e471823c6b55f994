"""runtime/assemble and runtime/spec: a runtime built from a `RuntimeSpec` alone runs a split
program exactly, and each run returns a `StepResult` (losses, the measured events of the actions
that ran, the schedule, in-flight peaks) instead of leaving attributes behind."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import pipecompile
from pipecompile.capture.capture import capture
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.passes.eval_mode import eval_graph
from pipecompile.runtime.assemble import LocalRuntime, assemble
from pipecompile.runtime.microbatch import split_microbatches
from pipecompile.runtime.spec import RuntimeSpec, StepResult
from pipecompile.schedule.actions import Kind
from pipecompile.schedule.schedules import make_schedule

M = 4  # micro-batches


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _case():
    """A float64 MLP, a copy of it as the reference, and its program split into two stages."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    linear = linearize(capture(model, (x,), method="fx"), granularity="layer")
    program = split(linear, (0, 2, linear.num_blocks), ["cpu", "cpu"])
    return program, reference, x, y


def _reference(model, x, y, loss_fn=_mse):
    """Each micro-batch's loss (torch.chunk) and the gradients of their mean."""
    losses = [loss_fn(model(xc), yc) for xc, yc in zip(torch.chunk(x, M), torch.chunk(y, M))]
    torch.stack(losses).mean().backward()
    return losses, {n: p.grad for n, p in model.named_parameters()}


def _grads(program):
    return {n: copies[0][1].grad for n, copies in program.tensors.items()
            if isinstance(copies[0][1], nn.Parameter)}


@pytest.mark.parametrize("name, peaks", [("gpipe", (M, M)), ("1f1b", (2, 1))])
def test_run_returns_the_losses_events_and_peaks_of_its_step(name, peaks):
    program, reference, x, y = _case()
    schedule = make_schedule(name, 2, M)
    runtime = assemble(program, schedule, RuntimeSpec(microbatches=M, loss_fn=_mse))
    assert isinstance(runtime, LocalRuntime)  # no topology: every stage in this process
    result = runtime.run(schedule, split_microbatches((x,), {}, y, M), batches=1)
    assert isinstance(result, StepResult) and result.schedule is schedule
    losses, grads = _reference(reference, x, y)
    torch.testing.assert_close(result.losses[0], torch.stack(losses).mean(), rtol=1e-12, atol=0)
    for n, g in _grads(program).items():
        torch.testing.assert_close(g, grads[n], rtol=1e-12, atol=0, msg=n)
    ran = sorted((e.device, str(e.action)) for e in result.events)
    assert ran == sorted((d, str(a)) for d, row in enumerate(schedule.actions) for a in row)
    assert any(a.kind is Kind.STEP for row in schedule.actions for a in row)  # timed in rows
    assert result.timeline.num_devices == 2 and result.timeline.makespan > 0
    assert result.summed is False
    # a Mailbox counts what moved between the devices: each send's tensors
    sends = [a for row in schedule.actions for a in row if a.kind.value.startswith("SEND")]
    assert result.communication["messages"] == len(sends) > 0
    # each carries the cut's one value or its gradient: a micro-batch's rows of 8 float64s
    assert result.communication["bytes"] == len(sends) * (x.shape[0] // M) * 8 * 8
    assert result.peak_inflight == peaks


def test_num_items_sums_losses_and_says_so():
    program, reference, x, y = _case()

    def total(out, target, num_items_in_batch=None):
        return ((out - target) ** 2).sum() / num_items_in_batch

    schedule = make_schedule("1f1b", 2, M)
    runtime = assemble(program, schedule, RuntimeSpec(microbatches=M, loss_fn=total))
    result = runtime.run(schedule, split_microbatches((x,), {}, y, M), batches=1,
                         num_items=y.numel())
    assert result.summed
    torch.testing.assert_close(result.losses[0], ((reference(x) - y) ** 2).sum() / y.numel(),
                               rtol=1e-12, atol=0)


def test_evaluate_returns_the_forward_only_run():
    program, reference, x, y = _case()
    schedule = make_schedule("1f1b", 2, M)
    runtime = assemble(program, schedule, RuntimeSpec(microbatches=M, loss_fn=_mse, eval_graph=eval_graph))
    result = runtime.evaluate(split_microbatches((x,), {}, y, M))
    with torch.no_grad():
        losses = [_mse(reference(xc), yc) for xc, yc in zip(torch.chunk(x, M), torch.chunk(y, M))]
    torch.testing.assert_close(result.losses[0], torch.stack(losses).mean(), rtol=1e-12, atol=0)
    assert {e.action.kind for e in result.events} <= {Kind.F, Kind.SEND_F, Kind.RECV_F}
    assert len([e for e in result.events if e.action.kind is Kind.F]) == 2 * M
    assert all(p.grad is None for p in runtime.parameters)  # nothing kept for a backward


def test_the_spec_chooses_recomputation_per_stage_and_the_optimizers():
    program, _, x, y = _case()
    schedule = make_schedule("gpipe", 2, M)
    spec = RuntimeSpec(microbatches=M, loss_fn=_mse, checkpoint=frozenset({1}),
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    runtime = assemble(program, schedule, spec)
    assert [runtime.workers[s].checkpoint for s in (0, 1)] == [False, True]
    before = [p.detach().clone() for p in runtime.parameters]
    runtime.run(schedule, split_microbatches((x,), {}, y, M), batches=1)
    assert len(runtime.optimizers) == 2  # one per stage, stepped at the end of the step
    assert all(not torch.equal(b, p) for b, p in zip(before, runtime.parameters))


def test_a_stream_of_batches_runs_as_one_asynchronous_schedule():
    program, _, x, y = _case()
    schedule = make_schedule("pipedream", 2, M)
    spec = RuntimeSpec(microbatches=M, loss_fn=_mse,
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
    runtime = assemble(program, schedule, spec)
    result = runtime.run_stream([((x,), {}, y), ((x * 2,), {}, y)])
    assert len(result.losses) == 2 and result.schedule.num_microbatches == 2 * M
    with pytest.raises(pipecompile.ConfigError, match="no step gradients to clip"):
        runtime.clip_grad_norm(1.0, 2.0, False)


def test_the_runtime_reads_no_compile_options():
    """runtime/ sits below the planner: none of its modules imports the options, the plan or
    anything that does."""
    above = {"options", "plan", "compiler", "pipeline", "lazy", "assembly", "resolved", "request",
             "recipe", "ranks", "search", "persist"}
    runtime = Path(pipecompile.__file__).parent / "runtime"
    for path in sorted(runtime.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                assert node.module.split(".")[0] not in above, (path.name, node.module)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.startswith(f"pipecompile.{m}") for n in names for m in above)


def test_eval_mode_needs_the_eval_graph_pass_handed_in():
    """runtime/ imports no pass: a spec without `eval_graph` cannot switch to eval mode."""
    program, _, _, _ = _case()
    runtime = assemble(program, make_schedule("1f1b", 2, M),
                       RuntimeSpec(microbatches=M, loss_fn=_mse))
    with pytest.raises(pipecompile.ConfigError, match="eval_graph"):
        runtime.set_training(False)
