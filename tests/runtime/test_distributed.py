"""Tier 3: real gloo processes on loopback; gradients equal the unsplit model's (float64)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.distributed.ranks import run_ranks
from tests.distributed.cases import (different_models, die_in_loss, fail_in_loss, plan_case,
                                    train)
from tests.support.models import CASES
from tests.support.reference import reference_step

SYNC = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def _reference(name, microbatches):
    torch.manual_seed(0)
    case = CASES[name]()
    model = copy.deepcopy(case.model)
    loss, grads = reference_step(model, case.args, case.kwargs, case.target, case.loss_fn,
                                 microbatches)
    with torch.no_grad():
        out = torch.utils._pytree.tree_leaves(model(*case.args, **case.kwargs))
    return loss, grads, model, out


def _check(results, name, schedules, microbatches):
    ref_loss, ref_grads, model, ref_out = _reference(name, microbatches)
    for rank, result in enumerate(results):
        assert "error" not in result and "died" not in result, (rank, result)
        for schedule in schedules:
            r = result[schedule]
            assert torch.allclose(r["losses"][0], ref_loss.double(), rtol=1e-12), (schedule, rank)
            assert r["grads"], (schedule, rank)
            for n, g in r["grads"].items():
                scale = ref_grads[n].abs().max().item() or 1.0
                err = (g - ref_grads[n]).abs().max().item() / scale
                assert err <= 1e-10, (schedule, rank, n, err)
            for got, want in zip(r["out"], ref_out):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # together the ranks hold every parameter
    for schedule in schedules:
        names = set().union(*(set(r[schedule]["grads"]) for r in results))
        assert names == set(ref_grads), schedule


@pytest.mark.parametrize("name", ["gpt2", "unet", "keyword_tuple"])
def test_two_ranks_every_schedule(name):
    """keyword_tuple reads `encode.weight` on both ranks under one name: its copies' gradients
    are summed as a tie's (before, each rank stepped its own part: 78 % off)."""
    results = run_ranks(train, 2, name, SYNC, 2, warm=functools.partial(plan_case, name, 2))
    _check(results, name, SYNC, 4)


def test_four_ranks_every_schedule_gpt2_tied():
    results = run_ranks(train, 4, "gpt2", SYNC, 4,
                        warm=functools.partial(plan_case, "gpt2", 4))
    _check(results, "gpt2", SYNC, 4)


def test_data_parallel_two_by_two_equals_one_replica_on_all_shards():
    results = run_ranks(train, 4, "residual_cnn", ["1f1b"], 2, 2, 2,
                        warm=functools.partial(plan_case, "residual_cnn", 2, 2, 2))
    # 2 replicas x 2 micro-batches each = the unsplit model on 4 micro-batches of the full batch
    ref_loss, ref_grads, _, _ = _reference("residual_cnn", 4)
    for rank, result in enumerate(results):
        assert "error" not in result, result
        r = result["1f1b"]
        assert torch.allclose(r["losses"][0], ref_loss.double(), rtol=1e-12), rank
        for n, g in r["grads"].items():
            err = (g - ref_grads[n]).abs().max().item() / (ref_grads[n].abs().max().item() or 1)
            assert err <= 1e-10, (rank, n, err)


def test_tied_copies_stay_bit_identical_with_an_optimizer():
    results = run_ranks(train, 2, "gpt2", ["1f1b"], 2, 1, 4, 3, True,
                        warm=functools.partial(plan_case, "gpt2", 2))
    first, last = results[0]["1f1b"], results[1]["1f1b"]
    name = "transformer.wte.weight"  # = lm_head.weight: listed once, under its first name
    assert name in first["params"] and name in last["params"]  # each rank holds a copy
    assert first["own"] == (0,) and last["own"] == (1,)
    torch.manual_seed(0)  # the initial weights every rank started from
    start = CASES["gpt2"]().model.transformer.wte.weight
    assert not torch.equal(first["params"][name], start.detach())  # 3 updates happened
    assert torch.equal(first["params"][name], last["params"][name])


def test_exception_in_one_rank_stops_every_rank_with_its_name():
    results = run_ranks(fail_in_loss, 2)
    for result in results:
        assert "error" in result, result
        assert "rank 1" in result["error"] and "1F0" in result["error"], result["error"]
        assert "loss exploded" in result["error"]


def test_killed_rank_makes_the_others_fail_naming_both():
    results = run_ranks(die_in_loss, 2)
    assert results[1].get("died") == 3, results[1]
    assert "error" in results[0], results[0]  # an error, not {"died": "hung"}
    assert "rank 0" in results[0]["error"] and "rank 1" in results[0]["error"]


def test_ranks_with_different_plans_are_named():
    results = run_ranks(different_models, 2)
    for result in results:
        assert "error" in result, result
        assert "different pipeline plans" in result["error"], result["error"]
        assert "ranks [0]" in result["error"] and "ranks [1]" in result["error"]


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_asynchronous_schedules_on_two_ranks_match_reference(schedule):
    from pipecompile import zoo
    from pipecompile.runtime.microbatch import split_microbatches
    from tests.support.async_reference import AsyncReference
    from tests.distributed.cases import train_async
    from tests.runtime.test_async import OPTIMIZERS, _batch, _model

    results = run_ranks(train_async, 2, schedule)
    for r in results:
        assert "error" not in r, r
    reference = AsyncReference(_model(), results[0]["names"], OPTIMIZERS["adamw"],
                               schedule=schedule, microbatches=4)
    for step in range(2):
        x, y = _batch(step)
        mbs = [(mb.args, mb.kwargs, mb.target) for mb in split_microbatches((x,), {}, y, 4)]
        ref_losses = reference.run(mbs, zoo.lm_loss)
        for r in results:
            assert torch.allclose(r["losses"][step], torch.stack(ref_losses).mean().double(),
                                  rtol=1e-10)
    ref = reference.parameters()
    for r in results:
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref[name], rtol=1e-10, atol=1e-12)
    assert set().union(*(r["params"] for r in results)) == set(ref)


def test_another_batch_size_than_the_example_works_across_ranks():
    from tests.distributed.cases import other_batch_size

    results = run_ranks(other_batch_size, 2)
    torch.manual_seed(0)
    case = CASES["gpt"]()
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (12, 8), generator=g)
    y = torch.randint(0, 64, (12, 8), generator=g)
    ref_loss, ref_grads = reference_step(case.model, (x,), {}, y, case.loss_fn, 4)
    for r in results:
        assert "error" not in r, r
        assert torch.allclose(r["loss"], ref_loss.double(), rtol=1e-12)
        for n, grad in r["grads"].items():
            err = (grad - ref_grads[n]).abs().max().item() / (ref_grads[n].abs().max().item() or 1)
            assert err <= 1e-10, (n, err)
