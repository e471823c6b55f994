"""runtime/split_backward: I then W gives autograd's gradients, and W recomputes nothing of I."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from pipecompile.runtime.split_backward import WeightWork, backward_input, backward_weight


def _params(*shapes, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(True)
            for s in shapes]


def _chain(x, w1, b1, w2, w3):
    """Three matmuls; w3 is also read a second time (a weight used twice, like a tie)."""
    h = torch.tanh(torch.nn.functional.linear(x, w1, b1))
    h = torch.relu(h @ w2)
    return h @ w3 + (x @ w3.t()).sum(-1, keepdim=True)


def _reference(x, params, grad):
    """(input grad, parameter grads) from one plain autograd call."""
    leaf = x.detach().requires_grad_(True)
    out = _chain(leaf, *params)
    grads = torch.autograd.grad(out, [leaf, *params], grad)
    return grads[0], grads[1:]


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    grad = torch.randn(5, 4, generator=g, dtype=torch.float64)
    return x, grad


def test_input_then_weight_gradients_equal_autograd():
    params = _params((6, 4), (6,), (6, 4), (4, 4))
    x, grad = _inputs()
    want_input, want_params = _reference(x, params, grad)
    leaf = x.detach().requires_grad_(True)
    out = _chain(leaf, *params)
    (got_input,), work = backward_input([out], [grad], [leaf], params)
    torch.testing.assert_close(got_input, want_input, rtol=1e-14, atol=0)
    assert all(p.grad is None for p in params)  # I leaves the weight gradients to W
    assert work.groups  # frontier nodes were recorded
    backward_weight(work)
    for p, want in zip(params, want_params, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-14, atol=0)


def test_weight_pass_accumulates_like_backward():
    params = _params((6, 4), (6,), (6, 4), (4, 4))
    x, grad = _inputs()
    _, want = _reference(x, params, grad)
    for _ in range(2):  # two micro-batches: W adds to .grad like two backward calls
        leaf = x.detach().requires_grad_(True)
        _, work = backward_input([_chain(leaf, *params)], [grad], [leaf], params)
        backward_weight(work)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, 2 * w, rtol=1e-14, atol=0)


def test_weight_pass_does_not_recompute_the_input_gradient_chain():
    params = _params((6, 4), (6,), (6, 4), (4, 4))
    x, grad = _inputs()
    with FlopCounterMode(display=False) as counter:
        leaf = x.detach().requires_grad_(True)
        torch.autograd.grad(_chain(leaf, *params), [leaf, *params], grad)
        full = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        leaf = x.detach().requires_grad_(True)
        out = _chain(leaf, *params)
        forward = counter.get_total_flops()
        _, work = backward_input([out], [grad], [leaf], params)
        after_input = counter.get_total_flops()
        backward_weight(work)
        after_weight = counter.get_total_flops()
    assert full > forward > 0
    # I + W together cost exactly one backward; two plain autograd.grad calls would not
    assert after_weight - forward == full - forward
    assert 0 < after_input - forward < full - forward


def test_first_stage_w_is_the_whole_backward():
    params = _params((6, 4), (6,), (6, 4), (4, 4))
    x, grad = _inputs()
    _, want = _reference(x, params, grad)
    out = _chain(x, *params)  # a model input: nothing to send back
    result, work = backward_input([out], [grad], [], params)
    assert result == [] and all(p.grad is None for p in params)
    backward_weight(work)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-14, atol=0)


def test_an_output_of_the_parameters_alone_goes_to_w_whole():
    (w,) = _params((3, 3))
    x, _ = _inputs()
    leaf = x[:, :3].detach().requires_grad_(True)
    outs = [leaf @ w, (w * w).sum()]  # the second output never reaches the input
    grads = [torch.ones(5, 3, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)]
    want = torch.autograd.grad(outs, [leaf, w], grads, retain_graph=True)
    (got_input,), work = backward_input(outs, grads, [leaf], [w])
    backward_weight(work)
    torch.testing.assert_close(got_input, want[0], rtol=1e-14, atol=0)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-14, atol=0)


def test_no_parameters_means_no_weight_work():
    x, grad = _inputs()
    leaf = x.detach().requires_grad_(True)
    (got,), work = backward_input([torch.sin(leaf)], [grad], [leaf], [])
    torch.testing.assert_close(got, grad * torch.cos(x), rtol=1e-14, atol=0)
    assert work == WeightWork()
