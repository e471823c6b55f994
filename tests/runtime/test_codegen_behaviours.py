"""The generated row names the behaviours it runs: each stage's binding line lists what its
worker was assembled with, and each forward, backward, I and W names the behaviour running
it (a recomputed stage, a zero-bubble split backward, PipeDream's weight versions)."""

from __future__ import annotations

import io
import tokenize

import pytest
import torch

import pipecompile as pc
from pipecompile.runtime.codegen import StageCode, emit


def _pipe(schedule: str, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(8, 8)
    pipe = pc.compile(model, (x,), devices=2, microbatches=4, schedule=schedule,
                      loss_fn=torch.nn.functional.mse_loss,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **options)
    pipe.step(x, target=x)
    return pipe


def _rows(pipe) -> list[str]:
    """Each device row, emitted with the stage codes of the workers that run it."""
    runtime = pipe.runtime
    produced = runtime.wiring.dataflow.producers()
    stages = {s: StageCode.of(w, fed=frozenset(n for n in w.input_names if n not in produced))
              for s, w in runtime.workers.items()}
    return [emit(pipe.schedule, d, stages, runtime.wiring.dataflow).source
            for d in range(pipe.schedule.num_devices)]


def _code_only(source: str) -> list[tuple[int, str]]:
    """The source's tokens without its comments: what runs."""
    return [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL)]


@pytest.mark.parametrize("schedule, options, forward, backward", [
    ("1f1b", {"checkpoint": True}, "RecomputedForward", "FusedBackward"),
    ("zb-h1", {}, "KeptForward", "SplitBackward"),
    ("pipedream", {}, "KeptForward", "VersionedBackward"),
])
def test_each_row_names_the_behaviours_its_stages_were_assembled_with(schedule, options,
                                                                      forward, backward):
    pipe = _pipe(schedule, **options)
    for worker in pipe.runtime.workers.values():
        assert worker.behaviours == (forward, backward)
    for device, source in enumerate(_rows(pipe)):
        lines = [line.strip() for line in source.splitlines()]
        for s, d in enumerate(pipe.schedule.stage_to_device):
            if d == device:
                assert (f"w{s}, d{s} = workers[{s}], devices[{s}]  # stage {s} runs "
                        f"{forward}, {backward}") in lines[2:]
        for action in pipe.schedule.actions[device]:
            comment = next(line for line in lines if line.startswith(f"# {action}:"))
            kind = action.kind.name
            if kind == "F":
                assert comment.endswith(f"({forward})"), comment
            elif kind in ("B", "I", "W") or (kind == "STEP" and action.microbatch is not None):
                assert comment.endswith(f"({backward})"), comment
            else:
                assert not comment.endswith(")"), comment
        # the names are annotations of the code that runs, not other code
        assert _code_only(source) == _code_only(pipe.runtime_code(device))


def test_zero_bubble_rows_run_i_and_w_and_pipedream_rows_update_in_place():
    zb = "\n".join(_rows(_pipe("zb-h1")))
    assert ".backward_input(" in zb and ".backward_weight(" in zb
    assert "input gradients (zero-bubble I) of micro-batch 0 (SplitBackward)" in zb
    pipedream = "\n".join(_rows(_pipe("pipedream")))
    assert ".apply_update()" in pipedream and "finish(" not in pipedream


def test_a_stage_code_without_behaviours_emits_no_names():
    pipe = _pipe("1f1b")
    runtime = pipe.runtime
    plain = {s: StageCode(s, w.input_names, frozenset(w.input_names) - {"linear_1"},
                          w.loss is not None) for s, w in runtime.workers.items()}
    source = emit(pipe.schedule, 0, plain, runtime.wiring.dataflow).source
    assert "runs" not in source and "Backward" not in source and "Forward" not in source


def test_a_workers_forward_code_is_the_forward_its_behaviours_run():
    zb, plain, pipedream = _pipe("zb-h1"), _pipe("1f1b"), _pipe("pipedream")
    # zero-bubble: the graph with deferred linears, through its direct calls
    assert "deferred_linear(" in zb.runtime.workers[1].forward_code()
    assert "deferred_linear(" not in zb.runtime.workers[0].forward_code()  # nothing to differentiate
    # 1F1B: the stage graph's direct calls, as pipe.stage_code shows them
    assert plain.runtime.workers[1].forward_code() == plain.stage_code(1)
    assert "read_" in plain.stage_code(1)
    # a weight version is passed to the module itself (functional_call): its own code
    worker = pipedream.runtime.workers[1]
    assert worker.forward_code() == worker.module.code
