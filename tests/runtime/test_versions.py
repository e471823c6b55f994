"""runtime/versions: which weight version a micro-batch's forward sees, and what is kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from pipecompile.schedule.actions import Kind
from pipecompile.schedule.schedules import make_schedule
from pipecompile.runtime.versions import VersionRule, WeightVersions


def _rule(schedule, p, s, m, vertical_sync=False) -> VersionRule:
    return VersionRule(schedule, stages=p, stage=s, microbatches=m, vertical_sync=vertical_sync)


def test_pipedream_by_hand():
    # p = 3: stage 0 runs 3 forwards before its first update, then one update per backward
    assert [_rule("pipedream", 3, 0, 6)(0, j) for j in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [_rule("pipedream", 3, 1, 6)(0, j) for j in range(6)] == [0, 0, 1, 2, 3, 4]
    assert [_rule("pipedream", 3, 2, 6)(0, j) for j in range(6)] == [0, 1, 2, 3, 4, 5]
    # a second call starts from the updates already made (here 6)
    assert [_rule("pipedream", 3, 0, 6)(6, j) for j in range(4)] == [6, 6, 6, 7]


def test_pipedream_vertical_sync_uses_stage_0s_version_everywhere():
    for s in range(3):
        assert [_rule("pipedream", 3, s, 6, True)(0, j) for j in range(6)] == [0, 0, 0, 1, 2, 3]


def test_2bw_batch_t_uses_the_weights_of_batch_t_minus_1():
    rule = _rule("2bw", 2, 0, 2)
    # batches of 2: batches 0 and 1 both see W0 (no update is a batch old yet), batch 2 sees W1
    assert [rule(0, j) for j in range(6)] == [0, 0, 0, 0, 1, 1]
    assert [rule(3, j) for j in range(4)] == [2, 2, 3, 3]  # a call after 3 updates
    assert [_rule("2bw", 4, 3, 2)(0, j) for j in range(6)] == [0, 0, 0, 0, 1, 1]  # any stage


@pytest.mark.parametrize("p, m", [(2, 5), (3, 6), (4, 9)])
def test_pipedream_version_is_the_updates_before_the_forward_in_the_schedule(p, m):
    """The rule agrees with the generated action lists: stage s's forward of micro-batch j runs
    after exactly rule(0, j) of stage s's own STEPs."""
    schedule = make_schedule("pipedream", p, m)
    for s, row in enumerate(schedule.actions):
        steps, seen = 0, {}
        for action in row:
            if action.kind is Kind.STEP:
                steps += 1
            elif action.kind is Kind.F:
                seen[action.microbatch] = steps
        assert seen == {j: _rule("pipedream", p, s, m)(0, j) for j in range(m)}, s


def test_loss_scale():
    assert _rule("pipedream", 2, 0, 4).loss_scale == 1.0  # an update per micro-batch loss
    assert _rule("2bw", 2, 0, 4).loss_scale == 0.25  # an update per batch mean


def _versions(rule: VersionRule) -> tuple[nn.Linear, WeightVersions]:
    torch.manual_seed(0)
    layer = nn.Linear(2, 1, bias=False).double()
    return layer, WeightVersions(layer, rule, lambda params: torch.optim.SGD(params, lr=1.0))


def test_weight_stashing_pipedream_stage_0_of_2():
    layer, versions = _versions(_rule("pipedream", 2, 0, 3))
    w0 = layer.weight.detach().clone()
    versions.begin_call()
    v0 = versions.acquire(0)
    assert versions.acquire(1) is v0  # micro-batch 1 starts before the first update
    assert torch.equal(v0["weight"], w0) and v0["weight"] is not layer.weight
    grad = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    versions.accumulate({"weight": grad})
    versions.release(0)
    versions.update()  # SGD, lr 1: w1 = w0 - grad
    torch.testing.assert_close(layer.weight.detach(), w0 - grad, rtol=0, atol=0)
    assert torch.equal(v0["weight"], w0)  # the stashed version did not move with the live one
    v1 = versions.acquire(2)
    torch.testing.assert_close(v1["weight"], w0 - grad, rtol=0, atol=0)
    assert sorted(versions.versions) == [0, 1]  # micro-batch 1 still holds version 0
    versions.accumulate({"weight": grad})
    versions.release(1)
    assert sorted(versions.versions) == [1]  # no one holds 0 and no later forward needs it
    versions.update()
    versions.release(2)
    assert sorted(versions.versions) == [2] and versions.peak_versions == 2
    torch.testing.assert_close(layer.weight.detach(), w0 - 2 * grad, rtol=0, atol=0)


def test_2bw_keeps_at_most_two_versions():
    layer, versions = _versions(_rule("2bw", 2, 0, 2))
    versions.begin_call()
    grad = torch.ones(1, 2, dtype=torch.float64)
    order = []
    for j in range(6):  # one micro-batch at a time, an update after each batch of 2
        weights = versions.acquire(j)
        order.append(next(k for k, v in versions.versions.items() if v is weights))
        versions.accumulate({"weight": grad})
        versions.release(j)
        if j % 2 == 1:
            versions.update()
    assert order == [0, 0, 0, 0, 1, 1]
    assert versions.peak_versions <= 2 and versions.updates == 3


def test_missing_version_names_the_stage_and_schedule():
    _, versions = _versions(_rule("pipedream", 2, 0, 4))
    versions.begin_call()
    versions.acquire(0)
    with pytest.raises(RuntimeError, match=r"stage 0: micro-batch 3 needs weight version 2 but "
                                           r"only \[0\] exist after 0 updates"):
        versions.acquire(3)
