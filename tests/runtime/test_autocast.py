"""torch.autocast around step / __call__ / eval_step applies in every stage's device thread,
and equals the unsplit model under the same autocast (bf16 on the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.runtime.training import AutocastState
from tests.support.reference import reference_step


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _setup(**options):
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=F.cross_entropy,
                      **options)
    return pipe, reference, x, y


def _reference_step(model, x, y):
    """The unsplit model, everything (forward, loss, backward) under bf16 autocast."""
    model.zero_grad(set_to_none=True)
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for xi, yi in zip(x.chunk(2), y.chunk(2)):
            loss = F.cross_entropy(model(xi), yi)
            (loss / 2).backward()
            losses.append(loss.detach())
    return torch.stack(losses).mean(), {n: p.grad for n, p in model.named_parameters()}


def test_state_is_captured_and_reentered_in_another_thread():
    assert AutocastState.current(["cpu"]) is None  # off: nothing to enter
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        state = AutocastState.current(["cpu"])
    assert state == AutocastState((("cpu", torch.bfloat16),), cache=False)
    seen = []

    def worker():
        with state.entered():
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                         torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype))

    import threading
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [(True, torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("options", [dict(schedule="gpipe"), dict(schedule="1f1b"),
                                     dict(schedule="1f1b", checkpoint=True),
                                     dict(schedule="zb-h1")])
def test_step_under_autocast_equals_the_unsplit_model(options):
    pipe, reference, x, y = _setup(**options)
    float_loss = pipe.step(x, target=y)
    assert AutocastState.current(["cpu"]) is None  # autocast off: no context entered per row
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, target=y)
    want, grads = _reference_step(reference, x, y)
    assert loss != float_loss  # bf16 really ran in the device threads
    # the same bf16 arithmetic as the unsplit model (identical here; bf16-sized tolerance)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, p in pipe.named_parameters():
        assert p.dtype == torch.float32  # parameters keep their dtype
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_call_and_eval_step_under_autocast():
    pipe, reference, x, y = _setup()
    float_out = pipe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
        want = reference(x)
        loss = pipe.eval_step(x, target=y)
        want_loss = torch.stack([F.cross_entropy(reference(xi), yi)
                                 for xi, yi in zip(x.chunk(2), y.chunk(2))]).mean()
    assert out.dtype == torch.bfloat16 and float_out.dtype == torch.float32
    assert not torch.equal(out.float(), float_out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)


def test_bf16_parameters_train():
    """bf16 parameters train: every parameter moves, the losses fall, and three SGD steps
    follow the unsplit bf16 model's within one bf16 rounding (2**-8 relative; identical here,
    while three steps move every parameter tensor by more than that)."""
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    x, y = torch.randn(8, 16, dtype=torch.bfloat16), torch.randint(0, 4, (8,))
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=F.cross_entropy,
                      schedule="1f1b")  # a fixed order of bf16 gradient sums
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, want = [], []
    for _ in range(3):
        losses.append(pipe.step(x, target=y))
        opt.step()
        opt.zero_grad()
        want.append(reference_step(reference, (x,), {}, y, F.cross_entropy, 2)[0])
        ref_opt.step()
    assert all(loss.dtype == torch.bfloat16 for loss in losses)
    assert all(p.dtype == torch.bfloat16 for p in pipe.parameters())
    assert losses[2] < losses[1] < losses[0], losses  # descent on the batch it trains on
    torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=2**-8, atol=1e-5)
    params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        assert not torch.equal(p, before[name]), f"{name}: unchanged by training"
        torch.testing.assert_close(p, params[name], rtol=2**-8, atol=1e-5, msg=name)


class Upcast(nn.Module):
    """The pattern of transformers' norms and losses: `.float()` on a linear's output (float32
    while traced, bfloat16 under autocast), a norm in float32, a linear again."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.b(h).float()


def test_upcasts_traced_in_float32_run_under_autocast():
    """torch.export checks, before each `.to(...)`, the dtype its input had while traced;
    capture drops those checks (capture/graph.py), so the conversion runs as the eager model
    runs it: the same loss and gradients as the unsplit model under the same autocast."""
    torch.manual_seed(0)
    model = Upcast()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=F.cross_entropy,
                      schedule="1f1b", split_points=["b"])
    assert not any("_assert_tensor_metadata" in stage.module.code for stage in pipe.stages)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, target=y)
    want, grads = _reference_step(reference, x, y)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)
