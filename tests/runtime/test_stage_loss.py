"""runtime/stage_loss: the last stage's loss of its flat outputs, and the gradient backward
starts from (the loss scale)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipecompile.errors import LossError
from pipecompile.runtime.stage_loss import LossSpec, StageLoss


def test_the_loss_of_a_single_output_and_of_a_structure():
    out, target = torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0])
    single = StageLoss(LossSpec(lambda flat: flat[0], F.mse_loss, 0.5))
    assert single.computes
    assert single((out,), target).item() == pytest.approx(2.5)  # (1 + 4) / 2
    pair = StageLoss(LossSpec(lambda flat: {"a": flat[0], "b": flat[1]},
                              lambda r, t: (r["a"] * r["b"]).sum() - t, 1.0))
    assert pair((out, out), torch.tensor(1.0)).item() == 9.0  # 1 + 9 - 1


def test_num_items_is_passed_to_the_loss_function():
    seen = []

    def loss_fn(result, target, num_items_in_batch=None):
        seen.append(num_items_in_batch)
        return result.sum() / num_items_in_batch

    loss = StageLoss(LossSpec(lambda flat: flat[0], loss_fn, 1.0, num_items=4))
    assert loss((torch.ones(2),), None).item() == 0.5 and seen == [4]


def test_the_seed_is_the_scale_made_once_per_scale_dtype_and_device():
    loss = StageLoss(LossSpec(lambda flat: flat[0], None, 0.25))
    value = torch.tensor(2.0, dtype=torch.float64)
    seed = loss.seed(value)
    assert seed.item() == 0.25 and seed.dtype == torch.float64 and seed.dim() == 0
    assert loss.seed(value) is seed
    loss.spec = LossSpec(lambda flat: flat[0], None, 0.5)  # a step's loss scale
    assert loss.seed(value).item() == 0.5


def test_a_non_scalar_loss_names_its_source_and_the_fix():
    loss = StageLoss(LossSpec(lambda flat: flat[0], None, 1.0))
    with pytest.raises(LossError, match=r"the model \(no loss_fn given\) returned a tensor of "
                                        r"shape \(2,\).*pass loss_fn=\.\.\."):
        loss((torch.ones(2),), None)
    assert not StageLoss(None).computes
