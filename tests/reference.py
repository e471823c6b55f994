"""The reference every synchronous schedule is checked against: the unsplit model on the same
micro-batches, loss = mean of the micro-batch losses, gradients of that mean."""

from __future__ import annotations

import torch

from pipecompile.runtime.microbatch import split_microbatches


def reference_step(model, args, kwargs, target, loss_fn, microbatches):
    """(mean loss, {name: grad}) of the unsplit model; leaves model's grads set."""
    model.zero_grad(set_to_none=True)
    losses = []
    for mb in split_microbatches(args, kwargs, target, microbatches):
        loss = loss_fn(model(*mb.args, **mb.kwargs), mb.target) / microbatches
        loss.backward()
        losses.append(loss.detach() * microbatches)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses).mean(), grads


def assert_grads_equal(pipe, ref_grads, rtol=1e-10):
    """Every parameter's gradient equals the reference's, relative to the gradient's scale."""
    names = []
    for name, p in pipe.named_parameters():
        ref = ref_grads.get(name)
        if ref is None:
            assert p.grad is None or p.grad.abs().max() == 0, f"{name}: unexpected gradient"
            continue
        assert p.grad is not None, f"{name}: no gradient"
        scale = ref.abs().max().item() or 1.0
        err = (p.grad.to(ref.device) - ref).abs().max().item() / scale
        assert err <= rtol, f"{name}: gradient differs by {err:.3e} relative"
        names.append(name)
    assert names, "no gradients compared"
    return names
