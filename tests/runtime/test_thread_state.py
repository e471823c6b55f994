"""A stage failing inside a `torch.no_grad()` region leaves the thread's grad mode and autocast
as they were (torch's `wrap_with_set_grad_enabled` sets the mode back without a `finally`), and
such a region's `.to(...)` under the caller's autocast runs as in the eager model (capture drops
torch.export's dtype checks inside higher-order-op bodies too)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile.runtime.thread_state import kept_thread_state

_FAIL = {"on": False}


@torch.library.custom_op("pctest_thread_state::maybe_fail", mutates_args=())
def maybe_fail(x: torch.Tensor) -> torch.Tensor:
    if _FAIL["on"]:
        raise RuntimeError("failing on purpose")
    return x.clone()


@maybe_fail.register_fake
def _(x):
    return torch.empty_like(x)


class NoGradRegion(nn.Module):
    """A rotary-embedding-like region: no grad, autocast off, an upcast of an autocast output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("f", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            with torch.autocast("cpu", enabled=False):
                # detached first: export would give `h.float()`'s value to later uses of h
                # (a no-op `.to` aliases its input while traced), detached under autocast
                c = maybe_fail(h.detach().float() * self.f).cos()
        return self.b(h * c)


def _compile(stages):
    torch.manual_seed(0)
    model = NoGradRegion()
    x = torch.randn(8, 8)
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=stages, microbatches=2, schedule="gpipe",
                      loss_fn=lambda out, _t: out.square().mean(), checkpoint=False,
                      **({"split_points": ["b"]} if stages == 2 else {}))
    return pipe, reference, x


def _reference_step(model, x):
    model.zero_grad(set_to_none=True)
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for xi in x.chunk(2):
            loss = model(xi).square().mean()
            (loss / 2).backward()
            losses.append(loss.detach())
    return torch.stack(losses).mean(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("stages", [1, 2])
def test_a_failure_inside_a_no_grad_region_keeps_grad_mode(stages):
    pipe, _, x = _compile(stages)
    _FAIL["on"] = True
    try:
        with pytest.raises(pc.errors.StageExecutionError, match="failing on purpose"):
            pipe.step(x)
    finally:
        _FAIL["on"] = False
    assert torch.is_grad_enabled()
    plain = nn.Linear(3, 1)
    plain(torch.randn(2, 3)).sum().backward()  # failed: "does not require grad"
    assert plain.weight.grad is not None
    loss = pipe.step(x)  # the pipeline itself trains again
    assert torch.isfinite(loss)


@pytest.mark.parametrize("stages", [1, 2])
def test_no_grad_region_under_autocast_equals_the_unsplit_model(stages):
    pipe, reference, x = _compile(stages)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    want, grads = _reference_step(reference, x)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_kept_thread_state_restores_after_an_exception():
    with pytest.raises(ValueError):
        with kept_thread_state(("cpu",)):
            torch.set_grad_enabled(False)
            torch.set_autocast_enabled("cpu", True)
            torch.set_autocast_dtype("cpu", torch.float16)
            raise ValueError
    assert torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16
