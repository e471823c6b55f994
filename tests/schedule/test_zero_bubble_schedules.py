"""ZB-V and interleaved zero bubble: valid schedules, bounded memory, smaller simulated bubbles,
and steps exactly equal to the unsplit model (float64) in one process and on gloo ranks; plus
the split backward's nested-weight case."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import pipecompile as pc
from pipecompile.errors import ScheduleError
from pipecompile.schedule.actions import Kind
from pipecompile.schedule.lowering import strip_communication
from pipecompile.schedule.schedules import make_schedule
from pipecompile.schedule.simulate import StageCosts, simulate
from pipecompile.runtime.split_backward import backward_input, backward_weight
from pipecompile.schedule.zero_bubble import interleaved_zb, zb_v, zb_v_placement
from tests.distributed.ranks import run_ranks
from tests.distributed.cases import plan_case, train
from tests.support.models import CASES
from tests.support.reference import assert_grads_equal, reference_step

UNIT = StageCosts(forward=1.0, backward=2.0)  # F = I = W = 1
SIZES = [(d, m) for d in (1, 2, 3, 4) for m in (1, 2, 4, 8)]


def _bubble(name: str, d: int, m: int, v: int = 1) -> float:
    schedule = make_schedule(name, d, m, virtual_stages=v)
    return simulate(schedule, [UNIT] * schedule.num_stages).bubble_fraction


def _peak_chunks(schedule, device: int) -> int:
    """Most chunks device `device` holds (F run, W not yet) along its action order."""
    held = peak = 0
    for a in schedule.actions[device]:
        held += {Kind.F: 1, Kind.W: -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize(("d", "m"), SIZES)
@pytest.mark.parametrize("name", ["zb-v", "interleaved-zb"])
def test_every_stage_and_microbatch_runs_f_i_w_once(name: str, d: int, m: int) -> None:
    schedule = make_schedule(name, d, m)  # validates: complete, ordered, deadlock free
    plain = strip_communication(schedule)
    actions = [a for row in plain.actions for a in row if a.kind is not Kind.STEP]
    want = {(s, k, i) for s in range(2 * d) for k in (Kind.F, Kind.I, Kind.W) for i in range(m)}
    assert sorted((a.stage, a.kind, a.microbatch) for a in actions) == sorted(want)
    assert not any(a.kind is Kind.B for a in actions)


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_zb_v_places_stages_in_a_v(d: int) -> None:
    assert zb_v_placement(d) == (*range(d), *reversed(range(d)))
    schedule = zb_v(d, 4)
    assert schedule.stage_to_device == zb_v_placement(d)
    assert schedule.stage_to_device[0] == schedule.stage_to_device[2 * d - 1] == 0


@pytest.mark.parametrize(("d", "m"), SIZES)
def test_zb_v_holds_at_most_one_f_one_b_peak(d: int, m: int) -> None:
    # 1F1B's stage 0 holds d micro-batches of a stage twice a ZB-V chunk: 2d chunks
    schedule = zb_v(d, m)
    assert max(_peak_chunks(schedule, k) for k in range(d)) == min(2 * d, 2 * m)


@pytest.mark.parametrize(("d", "m"), SIZES)
def test_interleaved_zb_holds_at_most_interleaved_1f1b_peak(d: int, m: int) -> None:
    schedule = interleaved_zb(d, m, virtual_stages=2)
    for k in range(d):  # Megatron's warm-up forwards + 1
        assert _peak_chunks(schedule, k) <= min(2 * m, 2 * (d - k - 1) + d + 1)


@pytest.mark.parametrize(("d", "m"), [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_simulated_bubbles_below_1f1b_and_interleaved_1f1b(d: int, m: int) -> None:
    zbv, izb = _bubble("zb-v", d, m, 2), _bubble("interleaved-zb", d, m, 2)
    assert zbv < _bubble("1f1b", d, m) and zbv < _bubble("interleaved-1f1b", d, m, 2)
    assert izb < _bubble("interleaved-1f1b", d, m, 2)
    assert zbv <= _bubble("zb-h1", d, m)


def test_zb_v_needs_two_stages_per_device() -> None:
    with pytest.raises(ScheduleError, match="virtual_stages=3"):
        make_schedule("zb-v", 2, 4, virtual_stages=3)


@pytest.mark.parametrize("name", ["zb-v", "interleaved-zb"])
def test_step_equals_unsplit_model_on_two_devices(name: str) -> None:
    torch.manual_seed(0)
    case = CASES["gpt"]()  # the zoo GPT (float64); the gloo test runs HF GPT-2 with ties
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, case.kwargs, devices=2, microbatches=4,
                      schedule=name, loss_fn=case.loss_fn)
    assert len(pipe.program.stages) == 4  # virtual_stages=2 implied
    assert pipe.schedule.stage_to_device == ((0, 1, 1, 0) if name == "zb-v" else (0, 1, 0, 1))
    loss = pipe.step(*case.args, target=case.target, **case.kwargs)
    ref_loss, ref_grads = reference_step(reference, case.args, case.kwargs, case.target,
                                         case.loss_fn, 4)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-12)) == len(ref_grads)


def test_two_gloo_ranks_equal_unsplit_model() -> None:
    from tests.runtime.test_distributed import _check

    schedules = ["zb-v", "interleaved-zb"]
    results = run_ranks(train, 2, "gpt2", schedules, 2,
                        warm=functools.partial(plan_case, "gpt2", 2))
    _check(results, "gpt2", schedules, 4)


def test_weight_used_twice_in_a_row_is_counted_once() -> None:
    # tanh(x @ w) @ w: W from the outer use must not run into the inner one
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    x, grad = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    leaf = x.clone().requires_grad_(True)
    want = torch.autograd.grad(torch.tanh(leaf @ w) @ w, [leaf, w], grad)
    leaf = x.clone().requires_grad_(True)
    (got,), work = backward_input([torch.tanh(leaf @ w) @ w], [grad], [leaf], [w])
    backward_weight(work)
    torch.testing.assert_close(got, want[0], rtol=1e-14, atol=0)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-14, atol=0)
