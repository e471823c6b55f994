"""runtime/local_runtime.py: every stage in this process; the forward-only path calls the
stages in order and gives the model's outputs; a batch's loss is its micro-batches' mean."""

from __future__ import annotations

import torch
import torch.nn as nn

from pipecompile.capture.capture import capture
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime.local_runtime import LocalRuntime
from pipecompile.runtime.mailbox import Mailbox
from pipecompile.runtime.spec import RuntimeSpec
from pipecompile.schedule.schedules import make_schedule


def _case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    linear = linearize(capture(model, (x,), method="fx"), granularity="layer")
    program = split(linear, (0, 2, linear.num_blocks), ["cpu", "cpu"])
    return LocalRuntime(program, make_schedule("gpipe", 2, 2), RuntimeSpec(microbatches=2)), \
        model, x


def test_forward_gives_the_models_outputs():
    runtime, model, x = _case()
    assert runtime.own_stages == (0, 1)
    with torch.no_grad():
        torch.testing.assert_close(runtime.call((x,), {}), model(x), rtol=1e-12, atol=0)


def test_a_batch_loss_is_the_mean_or_the_sum_of_its_microbatch_losses():
    runtime, _, _ = _case()
    losses = [torch.tensor(1.0), torch.tensor(3.0)]
    assert runtime.mean_loss(losses).item() == 2.0
    assert runtime.mean_loss(losses, summed=True).item() == 4.0
    assert isinstance(runtime.transport([]), Mailbox)
