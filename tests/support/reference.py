"""The reference every synchronous schedule is checked against: the unsplit model on the same
micro-batches, loss = mean of the micro-batch losses, gradients of that mean."""

from __future__ import annotations

import torch


def _chunks(value, batch, microbatches):
    """`microbatches` pieces of `value`: `torch.chunk` along dim 0 if it is a tensor whose first
    dimension is the batch size, else `value` itself each time."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        pieces = torch.chunk(value, microbatches)
        assert len(pieces) == microbatches, (
            f"torch.chunk splits {batch} rows into {len(pieces)} pieces, not {microbatches}")
        return pieces
    return [value] * microbatches


def reference_step(model, args, kwargs, target, loss_fn, microbatches):
    """(mean loss, {name: grad}) of the unsplit model; leaves model's grads set.

    The batch size is dim 0 of the first tensor argument (positional first, then keyword);
    every tensor argument and the target with that first dimension is split with
    `torch.chunk(microbatches)` along dim 0, other values are given unchanged."""
    values = [*args, *kwargs.values()]
    batch = next(v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0)
    arg_chunks = [_chunks(a, batch, microbatches) for a in args]
    kwarg_chunks = {k: _chunks(v, batch, microbatches) for k, v in kwargs.items()}
    target_chunks = _chunks(target, batch, microbatches)
    model.zero_grad(set_to_none=True)
    losses = []
    for i in range(microbatches):
        mb_args = [c[i] for c in arg_chunks]
        mb_kwargs = {k: c[i] for k, c in kwarg_chunks.items()}
        loss = loss_fn(model(*mb_args, **mb_kwargs), target_chunks[i]) / microbatches
        loss.backward()
        losses.append(loss.detach() * microbatches)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses).mean(), grads


def assert_grads_equal(pipe, ref_grads, rtol=1e-10, floor=0.0):
    """Every parameter's gradient equals the reference's, relative to the gradient's scale.

    `floor` is the least scale, as a fraction of the largest reference gradient: a gradient
    that is zero in exact arithmetic (an attention key's bias under softmax) is rounding noise,
    which summing the same terms in another order changes completely."""
    names = []
    least = floor * max((g.abs().max().item() for g in ref_grads.values()), default=0.0)
    for name, p in pipe.named_parameters():
        ref = ref_grads.get(name)
        if ref is None:
            assert p.grad is None or p.grad.abs().max() == 0, f"{name}: unexpected gradient"
            continue
        assert p.grad is not None, f"{name}: no gradient"
        scale = max(ref.abs().max().item(), least) or 1.0
        err = (p.grad.to(ref.device) - ref).abs().max().item() / scale
        assert err <= rtol, f"{name}: gradient differs by {err:.3e} relative"
        names.append(name)
    assert names, "no gradients compared"
    return names
