"""Training loops on 2 gloo ranks equal the unsplit model's: the user's AdamW + scheduler with a
tie across the ranks, clip_grad_norm_ over the pipeline (and over data-parallel replicas),
eval_step, autocast."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.cases import plan_case
from tests.distributed.ranks import run_ranks
from tests.distributed.training_cases import (
    _loop,
    autocast_bf16_boundary,
    autocast_step,
    eval_mode,
    user_loop,
)
from tests.support.models import CASES
from tests.support.reference import reference_step


def _reference_loop(steps=3):
    torch.manual_seed(0)
    case = CASES["gpt"]()
    model = copy.deepcopy(case.model)
    opt, sched = _loop(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        loss, _ = reference_step(model, case.args, {}, case.target, case.loss_fn, 2)
        losses.append(loss)
        norms.append(torch.nn.utils.clip_grad_norm_(
            model.parameters(), 0.05, math.inf if step == steps - 1 else 2.0))
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        val = torch.stack([case.loss_fn(model(xi), yi) for xi, yi in
                           zip(case.args[0].chunk(2), case.target.chunk(2))]).mean()
    return losses, norms, dict(model.named_parameters()), val


@pytest.mark.parametrize("devices,data_parallel", [(2, 1), (1, 2)])
def test_user_optimizer_scheduler_and_clipping_on_two_ranks(devices, data_parallel):
    results = run_ranks(user_loop, 2, devices, data_parallel,
                        warm=functools.partial(plan_case, "gpt", devices, data_parallel, 2))
    losses, norms, params, val = _reference_loop()
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        for got, want in zip(r["norms"], norms):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
        if data_parallel == 1:  # replicas' losses are their shard's; the norms are global
            for got, want in zip(r["losses"], losses):
                torch.testing.assert_close(got, want.double(), rtol=1e-10, atol=0)
            torch.testing.assert_close(r["eval"], val.double(), rtol=1e-10, atol=0)
        for name, p in r["params"].items():
            torch.testing.assert_close(p, params[name], rtol=1e-8, atol=1e-10, msg=name)
        for name, copies in r["copies"].items():  # a tie's copies on both ranks follow
            want = params.get(name)
            for t in copies:
                if want is not None:
                    torch.testing.assert_close(t, want, rtol=1e-8, atol=1e-10, msg=name)
    if devices == 2:  # the tie crosses the ranks: each holds a copy, updated identically
        assert all(r["copies"]["lm_head.weight"] for r in results)
        torch.testing.assert_close(results[1]["params"]["wte.weight"],
                                   results[0]["params"]["wte.weight"], rtol=0, atol=0)


def test_autocast_applies_on_every_rank():
    results = run_ranks(autocast_step, 2)
    torch.manual_seed(0)
    case = CASES["gpt"]()
    model = copy.deepcopy(case.model).float()
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for xi, yi in zip(case.args[0].chunk(2), case.target.chunk(2)):
            loss = case.loss_fn(model(xi), yi)
            (loss / 2).backward()
            losses.append(loss.detach())
        out = model(*case.args)
    grads = dict((n, p.grad) for n, p in model.named_parameters())
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        assert r["out"].dtype == torch.bfloat16
        torch.testing.assert_close(r["out"], out, rtol=1e-5, atol=1e-6)
        assert r["loss"] != r["plain"]
        torch.testing.assert_close(r["loss"], torch.stack(losses).mean().double(),
                                   rtol=1e-5, atol=1e-6)
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_autocast_with_a_bf16_value_between_ranks():
    """A bf16 boundary value travels in its captured dtype (float32, an exact upcast); the
    receiving stage's autocast casts it back where the model would: the same output and loss;
    the gradient sent back is float32 where the model's is bf16, so gradients differ by bf16
    rounding: less than one bf16 step (2**-7) of each gradient's largest element (0.53 % here,
    on the first stage's weights; the last stage's are identical)."""
    from tests.runtime.test_autocast import _reference_step, _setup

    results = run_ranks(autocast_bf16_boundary, 2)
    _, reference, x, y = _setup()
    want, grads = _reference_step(reference, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = reference(x)
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        assert r["out"].dtype == torch.bfloat16
        torch.testing.assert_close(r["out"], out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["loss"], want.double(), rtol=1e-5, atol=1e-6)
        for name, g in r["grads"].items():
            scale = grads[name].abs().max().item()
            torch.testing.assert_close(g, grads[name], rtol=0, atol=2**-7 * scale, msg=name)


def test_eval_mode_and_eval_step_on_two_ranks():
    from tests.runtime.test_training_loop import _bn_pipe

    results = run_ranks(eval_mode, 2)
    _, reference, x, y = _bn_pipe()
    for _ in range(2):  # running statistics advance per micro-batch
        reference_step(reference, (x,), {}, y, F.cross_entropy, 2)
    reference.eval()
    with torch.no_grad():
        out = reference(x)
        val = torch.stack([F.cross_entropy(reference(xi), yi)
                           for xi, yi in zip(x.chunk(2), y.chunk(2))]).mean()
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        assert r["training"]  # eval_step left train mode on
        torch.testing.assert_close(r["val"], val, rtol=1e-12, atol=0)
        torch.testing.assert_close(r["out"], out, rtol=1e-12, atol=1e-12)
        assert torch.equal(r["out"], r["again"])
    state = reference.state_dict()
    for key in state:  # every buffer is on some rank, equal to the reference's
        held = [r["state"][key] for r in results if key in r["state"]]
        assert held, key
        for value in held:
            torch.testing.assert_close(value, state[key], rtol=1e-12, atol=0, msg=key)
