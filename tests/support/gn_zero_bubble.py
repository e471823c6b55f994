"""Run in a subprocess by test_split_backward_safety: a zb-h1 step through a GroupNorm on a
permuted activation (a crash in torch's CPU kernel would end this process, not pytest's)."""

import copy

import torch
import torch.nn.functional as F

import pipecompile as pc
from tests.support.capture_models import PermutedGroupNormNet
from tests.support.reference import assert_grads_equal, reference_step


def main() -> None:
    torch.manual_seed(0)
    model = PermutedGroupNormNet().double()
    x = torch.randn(4, 4, 4, 8, dtype=torch.float64)
    y = torch.randn(4, 4, 4, 8, dtype=torch.float64)
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), loss_fn=F.mse_loss, devices=["cpu"] * 2, microbatches=2,
                      schedule="zb-h1", split_points=["layers.1"])
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, F.mse_loss, 2)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-12)) == 8
    print("ok")


if __name__ == "__main__":
    main()
