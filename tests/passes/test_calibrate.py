"""profile=True measures the split stages (passes/calibrate.py); compile refines the granularity
when whole layers cannot balance the stages."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import pipecompile as pc
from pipecompile.planner import decisions
from pipecompile import zoo
from pipecompile.ir.records import StageTimes
from pipecompile.passes.calibrate import Calibration, calibrate_blocks, fit_calibration
from tests.support.models import CASES
from tests.support.reference import assert_grads_equal, reference_step


def _heavy_head_gpt(layers=2, vocab=2048):
    torch.manual_seed(0)
    model = zoo.GPT(vocab=vocab, dim=64, layers=layers, heads=4, seq=16).double()
    x = torch.randint(0, vocab, (8, 16))
    y = torch.randint(0, vocab, (8, 16))
    return model, x, y


def test_fit_calibration_takes_the_median_ratio_and_the_measured_loss():
    model, x, _ = _heavy_head_gpt()
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=zoo.lm_loss,
                      granularity="layer")
    costs = pipe_costs(pipe)
    n = len(costs.blocks)
    unit = dataclasses.replace(costs.blocks[0], forward_time=1.0, backward_input_time=1.0,
                               backward_weight_time=1.0)
    costs = dataclasses.replace(costs, blocks=(unit,) * n)  # every block: 3 s
    bounds = (0, 2, 4, n)
    measured = {  # stage 0: x2, stage 1: x1.5, stage 2: x3 after its 4 s of loss
        0: StageTimes(6.0, 6.0, 3.0, 3.0),
        1: StageTimes(4.5, 4.5, 2.0, 2.5),
        2: StageTimes((9 * (n - 4) + 4) / 2, (9 * (n - 4) + 4) / 2, 0, 0, loss=4.0),
    }
    fit = fit_calibration(costs, bounds, measured)
    assert fit == Calibration(factor=2.0, loss_time=4.0)  # the median of 2, 1.5 and 3
    scaled = calibrate_blocks(costs, fit)
    assert [b.time for b in scaled.blocks[:-1]] == [6.0] * (n - 1)
    assert scaled.blocks[-1].time == pytest.approx(10.0)  # 6 + the loss's 4
    assert scaled.blocks[-1].forward_time == pytest.approx(4.0)
    assert "block times x2.00, loss 4000.000 ms/mb" in scaled.notes[-1]


def pipe_costs(pipe):
    """The annotate pass's cost table for the pipeline's linear graph."""
    from pipecompile.passes.annotate import annotate

    return annotate(pipe.program.linear, microbatch_size=4)


def test_profile_measures_the_stages_and_the_loss_and_leaves_the_model_as_it_was():
    model, x, y = _heavy_head_gpt(layers=2, vocab=4096)
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="zb-h1",
                      loss_fn=zoo.lm_loss, profile=True, example_target=y)
    log = pipe.explain()
    assert "calibrate" in log and "threads" in log
    note = next(line for line in log.splitlines() if line.startswith("calibrate"))
    loss_ms = float(note.split("loss ")[1].split(" ms/mb")[0])
    assert loss_ms > 0  # cross-entropy over 4096 classes was timed on the last stage
    for costs in pipe.plan.stage_costs:  # measured, not summed from blocks
        assert costs.forward > 0 and costs.backward > 0 and costs.backward_weight > 0
    assert pipe.plan.stage_costs[1].backward_input > 0
    assert 0 < pipe.plan.efficiency <= 1
    assert all(p.grad is None for p in pipe.parameters())
    # measuring changed nothing: a step still equals the unsplit model's
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, zoo.lm_loss, 2)
    assert torch.allclose(loss, ref_loss, rtol=1e-12)
    assert_grads_equal(pipe, ref_grads)


def test_profile_restores_batchnorm_statistics():
    case = CASES["residual_cnn"]()
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    pc.compile(case.model, case.args, devices=2, microbatches=2, loss_fn=case.loss_fn,
               profile=True, example_target=case.target)
    for key, value in case.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_refines_the_granularity_when_layers_cannot_balance(monkeypatch):
    # The analytic costs depend on the matmul rate compile measures; pin it so that the head
    # is ~1.5 layers (at 100 GFLOP/s the layer-level optimum is ~25 % above the lower bound).
    monkeypatch.setattr(decisions, "matmul_rate", lambda *args, **kwargs: 100e9)
    model, x, y = _heavy_head_gpt(layers=2, vocab=2048)
    reference = copy.deepcopy(model)
    coarse = pc.compile(copy.deepcopy(model), (x,), devices=2, microbatches=2,
                        loss_fn=zoo.lm_loss, granularity="layer")
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=zoo.lm_loss)
    assert coarse.program.linear.granularity == "layer"
    assert pipe.program.linear.granularity != "layer"
    refine = next(line for line in pipe.explain().splitlines() if line.startswith("refine"))
    before, after = (float(v) for v in refine.split("bottleneck ")[1].split(" ms/mb")[0]
                     .split(" -> "))
    assert after <= 0.9 * before
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, zoo.lm_loss, 2)
    assert torch.allclose(loss, ref_loss, rtol=1e-12)
    assert_grads_equal(pipe, ref_grads)
