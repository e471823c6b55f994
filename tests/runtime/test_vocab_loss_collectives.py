"""runtime/vocab_loss.py: the vocabulary-parallel cross entropy (on one gloo rank it is the
whole cross entropy: values and gradients against torch's), the logits output gathered or
left local, and how `VocabLoss` runs a loss_fn on local logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipecompile import zoo
from pipecompile.passes.vocab_loss import lower_loss
from pipecompile.runtime.vocab_loss import (VocabLoss, cross_entropy_over, local_outputs,
                                            output_over)


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_the_parallel_cross_entropy_is_torchs_with_ignored_tokens(group, reduction):
    ce = cross_entropy_over(group, 1, 0)
    logits = torch.randn(12, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(1))
    target[::4] = -100
    mine, want = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = ce(mine, target, reduction, -100)
    ref = F.cross_entropy(want, target, reduction=["none", "mean", "sum"][reduction])
    assert torch.allclose(got, ref, rtol=1e-14, atol=1e-14)
    weights = torch.rand_like(got)
    (got * weights).sum().backward()
    (ref * weights).sum().backward()
    assert torch.allclose(mine.grad, want.grad, rtol=1e-13, atol=1e-15)


def test_a_logits_output_is_gathered_except_in_a_last_stages_training_forward():
    out = output_over(lambda x, dim: torch.cat([x, x], dim))
    x = torch.ones(2, 3)
    assert out(x, 1).shape == (2, 6)
    with local_outputs():
        assert out(x, 1) is x
    assert out(x, 1).shape == (2, 6)


def test_vocab_loss_lowers_a_cross_entropy_and_gathers_any_other_loss(group):
    """On local logits: the pipeline's cross entropy runs lowered (torch's value), a loss
    not reading them runs as it is, any other loss on the gathered logits."""
    ce = cross_entropy_over(group, 1, 0)
    gathered = []

    def gather(x, dim):
        gathered.append(dim)
        return x

    vocab = {"cross_entropy": ce, "output": None}
    loss = VocabLoss({0: 2}, gather, lambda gm, split: lower_loss(gm, split, 1, vocab), 1)
    logits = torch.randn(2, 4, 8, dtype=torch.float64)
    target = torch.randint(0, 8, (2, 4))
    got = loss((logits,), target, zoo.lm_loss, lambda flat: flat[0])
    assert torch.allclose(got, zoo.lm_loss(logits, target), rtol=1e-14)
    assert loss.forms == ("lowered",) and not gathered
    square = loss((logits,), target, lambda x, t: x.pow(2).mean(), lambda flat: flat[0])
    assert torch.allclose(square, logits.pow(2).mean()) and gathered == [2]
    unread = VocabLoss({1: 2}, gather, lambda gm, split: None, 1)
    assert unread((torch.tensor(3.0), logits), None, lambda out, t: out[0],
                  lambda flat: tuple(flat)) == 3.0
    assert unread.forms == ("unread",) and gathered == [2]


class _TwoRanks:
    """A fake 2-way split in one process: two threads, one a rank, whose all-reduces meet at
    a barrier (each adds or maxes both ranks' tensors in place)."""

    def __init__(self) -> None:
        import threading

        self.barrier = threading.Barrier(2)
        self.slots: list = [None, None]
        self.calls = [0, 0]

    def all_reduce(self, rank: int):
        def reduce(tensor, op):
            self.calls[rank] += 1
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            both = torch.stack(self.slots)
            tensor.copy_(both.amax(0) if op == dist.ReduceOp.MAX else both.sum(0))
            self.barrier.wait()
        return reduce

    def run(self, fn):
        """fn(rank) on two threads; their results in rank order."""
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return [f.result() for f in [pool.submit(fn, r) for r in range(2)]]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("options", [{"label_smoothing": 0.1}, {"weight": True},
                                     {"weight": True, "label_smoothing": 0.3}])
def test_label_smoothing_and_class_weights_split_two_ways_are_torchs(reduction, options):
    """The traced loss lowered (passes/vocab_loss.py) onto each half of the vocabulary, run on
    two fake ranks: loss and the logits' gradient equal `F.cross_entropy` of the whole logits
    in float64 (ignored tokens included); the smoothing's sum joins the same all-reduce
    (two a rank, as without it)."""
    V = 10
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, V, dtype=torch.float64, generator=gen)
    target = torch.randint(0, V, (3, 4), generator=gen)
    target[0, ::3] = -100
    kwargs = dict(options, reduction=reduction)
    if kwargs.get("weight"):
        kwargs["weight"] = torch.rand(V, dtype=torch.float64, generator=gen) + 0.5

    def loss_fn(x, t):
        return F.cross_entropy(x.reshape(-1, V), t.reshape(-1), **kwargs)

    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(loss_fn, tracing_mode="fake", pre_dispatch=True,
                     _allow_non_fake_inputs=True)(logits, target)
    ranks = _TwoRanks()
    seed = torch.randn(3 * 4, dtype=torch.float64, generator=gen)

    def rank(r):
        vocab = {"cross_entropy": cross_entropy_over(None, 2, r, all_reduce=ranks.all_reduce(r)),
                 "output": None}
        lowered = lower_loss(traced, {0: 2}, 2, vocab)
        local = logits[..., r * V // 2:(r + 1) * V // 2].clone().requires_grad_()
        loss = lowered(local, target)
        (loss * seed).sum().backward() if reduction == "none" else loss.backward()
        return loss.detach(), local.grad

    got = ranks.run(rank)
    whole = logits.clone().requires_grad_()
    want = loss_fn(whole, target)
    (want * seed).sum().backward() if reduction == "none" else want.backward()
    for loss, _ in got:
        assert torch.allclose(loss, want.detach(), rtol=1e-13, atol=1e-15), (loss, want)
    grad = torch.cat([g for _, g in got], dim=-1)
    assert torch.allclose(grad, whole.grad, rtol=1e-12, atol=1e-15)
    assert ranks.calls == [2, 2]
