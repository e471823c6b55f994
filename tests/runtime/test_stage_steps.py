"""Synchronous STEPs run in the device rows (runtime/stage_steps.py): a stage updates as soon
as every stage sharing its parameters finished its backward, tied copies summed first; the
result is the unsplit model's update; a failure or a stage that never arrives ends the wait."""

from __future__ import annotations

import copy
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import StageExecutionError
from pipecompile.runtime.assemble import _optimizers
from pipecompile.runtime.mailbox import Aborted
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.runtime.stage_steps import StageSteps, _closing_steps, sharing_stages
from pipecompile.ir.records import StagedProgram


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _gpt_case():
    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=16, layers=4, heads=2, seq=8).double()  # wte tied to lm_head
    x, y = torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))
    return model, x, y


def _reference_steps(model, x, y, m: int, steps: int) -> list[float]:
    opt = _sgd(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for xc, yc in zip(x.chunk(m), y.chunk(m)):
            loss = zoo.lm_loss(model(xc), yc) / m
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1"])
def test_steps_in_the_rows_give_the_unsplit_update_with_ties(schedule) -> None:
    model, x, y = _gpt_case()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, schedule=schedule, microbatches=4,
                      loss_fn=zoo.lm_loss, optimizer=_sgd)
    losses = [pipe.step(x, target=y).item() for _ in range(3)]
    assert losses == pytest.approx(_reference_steps(reference, x, y, 4, 3), abs=1e-12)
    expected = reference.state_dict()
    for name, value in pipe.state_dict().items():
        assert torch.allclose(value, expected[name], atol=1e-12), name
    assert "finish(" in pipe.runtime_code(0) and "finish(" in pipe.runtime_code(1)


def test_the_last_device_updates_while_the_first_still_computes() -> None:
    model, x, y = _gpt_case()
    pipe = pc.compile(model, (x,), devices=2, schedule="1f1b", microbatches=4,
                      loss_fn=zoo.lm_loss, optimizer=_sgd, split_points=["layers.2"])
    pipe.step(x, target=y)
    events = {str(e.action): e for e in pipe.last_step.events}
    # stage 1 holds only a copy of the tie (stage 0 sums it): it waits for nothing
    assert events["1STEP"].end < events["0B3"].end
    assert events["0STEP"].start >= events["0B3"].end


def test_who_waits_for_whom() -> None:
    model, x, y = _gpt_case()
    pipe = pc.compile(model, (x,), devices=2, schedule="1f1b", microbatches=4,
                      loss_fn=zoo.lm_loss, split_points=["layers.2"])
    waits, sums = sharing_stages(pipe.program, [0, 1])
    # stage 1 holds an alias of the tied weight (its own leaf over the same CPU memory): stage 0
    # (first) waits for it and sums the two gradients, its own first
    owner = pipe.program.tensors["wte.weight"][0][1]
    assert waits == {0: frozenset({1}), 1: frozenset()}
    (copies,) = sums[0]
    assert sums[1] == [] and copies[0] is owner and copies[1] is not owner
    assert copies[1].data_ptr() == owner.data_ptr()


class _Program(SimpleNamespace):
    """A two-stage program's tie, with the program's own rule of who owns it."""

    owner_stage = StagedProgram.owner_stage
    held = StagedProgram.held
    held_copies = StagedProgram.held_copies


def _tied_pair() -> tuple[nn.Linear, nn.Linear, SimpleNamespace]:
    """Two stages whose weights are one tie held as two copies, as on two GPUs."""
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    program = _Program(
        stages=[SimpleNamespace(index=0, module=first), SimpleNamespace(index=1, module=second)],
        ties=[SimpleNamespace(names=("a.weight", "b.weight"))],
        tensors={"a.weight": [(0, first.weight), (1, second.weight)]})
    return first, second, program


def test_tied_copies_on_two_devices_are_summed_by_their_first_stage() -> None:
    """As on two GPUs, where each device holds its own copy of a tied weight."""
    first, second, program = _tied_pair()
    steps = StageSteps(program, [0, 1], {0: _sgd(first.parameters())}, timeout=1.0)
    assert steps.waits == {0: frozenset({1}), 1: frozenset()}
    first.weight.grad, second.weight.grad = torch.ones(2, 2), torch.full((2, 2), 2.0)
    before = first.weight.detach().clone()
    schedule = SimpleNamespace(num_stages=2, actions=[[Action(0, Kind.STEP, None)],
                                                      [Action(1, Kind.STEP, None)]])
    round_ = steps.round(schedule)
    round_(1)
    round_(0)
    assert torch.equal(first.weight.grad, torch.full((2, 2), 3.0))
    assert torch.equal(second.weight.grad, torch.full((2, 2), 3.0))
    assert torch.allclose(first.weight, before - 0.3)


def test_a_schedule_without_every_step_updates_after_the_rows() -> None:
    model, x, y = _gpt_case()
    reference = copy.deepcopy(model)
    text = ("name: mine\nnum_stages: 2\nnum_microbatches: 2\nstage_to_device: 0 1\n"
            "0: 0F0 0F1 0B0 0B1 0STEP\n1: 1F0 1B0 1F1 1B1\n")
    pipe = pc.compile(model, (x,), devices=2, schedule=text, loss_fn=zoo.lm_loss,
                      optimizer=_sgd, split_points=["layers.2"])
    losses = [pipe.step(x, target=y).item() for _ in range(2)]
    assert losses == pytest.approx(_reference_steps(reference, x, y, 2, 2), abs=1e-12)


def _steps(timeout: float) -> StageSteps:
    model, x, y = _gpt_case()
    pipe = pc.compile(model, (x,), devices=2, schedule="1f1b", microbatches=4,
                      loss_fn=zoo.lm_loss, split_points=["layers.2"])
    return StageSteps(pipe.program, [0, 1], {}, timeout=timeout), pipe.schedule


def test_a_waiting_step_stops_when_another_row_fails() -> None:
    steps, schedule = _steps(timeout=30.0)
    round_ = steps.round(schedule)
    caught: list[BaseException] = []

    def first_stage() -> None:
        try:
            round_(0)  # waits for stage 1, which never arrives
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    thread = threading.Thread(target=first_stage)
    thread.start()
    time.sleep(0.1)
    round_.abort(RuntimeError("stage 1 failed"))
    thread.join(25.0)
    # stopped by the abort (an Aborted, not the timeout's StageExecutionError) before the 30 s
    # timeout: no clock is read, so a loaded machine cannot fail it
    assert not thread.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], Aborted)


def test_a_stage_that_never_arrives_is_named_after_the_timeout() -> None:
    steps, schedule = _steps(timeout=0.2)
    with pytest.raises(StageExecutionError, match=r"stage 0's optimizer step waited .* \[1\]"):
        steps.round(schedule)(0)


def test_one_thread_polls_the_stages_it_waits_for() -> None:
    steps, schedule = _steps(timeout=1.0)
    round_ = steps.round(schedule)
    round_.arrive(0)
    assert not round_.ready(0) and round_.ready(1)
    round_.arrive(1)
    assert round_.ready(0)


def test_a_row_holding_two_stages_updates_both_at_its_last_step() -> None:
    model, x, y = _gpt_case()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, schedule="zb-v", microbatches=4,
                      loss_fn=zoo.lm_loss, optimizer=_sgd)
    closes = _closing_steps(pipe.schedule)
    assert closes is not None and sorted(len(row) for row in closes.values()) == [2, 2]
    losses = [pipe.step(x, target=y).item() for _ in range(2)]
    assert losses == pytest.approx(_reference_steps(reference, x, y, 4, 2), abs=1e-12)
    text = ("name: mine\nnum_stages: 2\nnum_microbatches: 1\nstage_to_device: 0 1\n"
            "0: 0F0 0B0 0STEP\n1: 1F0 1B0\n")
    assert _closing_steps(Schedule.from_text(text)) is None  # stage 1 has no STEP


def test_a_tied_copy_follows_its_owner_instead_of_stepping() -> None:
    first, second, program = _tied_pair()
    optimizers = _optimizers(program, _sgd, [0, 1])
    stepped = {s: {id(p) for g in o.param_groups for p in g["params"]}
               for s, o in optimizers.items()}
    assert stepped == {0: {id(first.weight), id(first.bias)}, 1: {id(second.bias)}}
    # a rank holding only the second copy steps it (its gradient is reduced across ranks)
    assert id(second.weight) in {id(p) for g in _optimizers(program, _sgd, [1])[1].param_groups
                                 for p in g["params"]}
