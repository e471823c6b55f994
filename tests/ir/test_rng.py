"""rng="per-microbatch": each random op draws from (seed, micro-batch, node name), so one seed
gives one step whatever the stage count, schedule or recomputation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.errors import ConfigError
from pipecompile.capture.capture import capture
from pipecompile.ir.rng import derive_seed, microbatch, module_seed, seed_random_ops, seeded_call
from tests.support.capture_models import NoisyMLP

MICROBATCHES = 4


def _step(model, x, y, *, devices, schedule="gpipe", seed=0, **options):
    model = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=["cpu"] * devices, microbatches=MICROBATCHES,
                      schedule=schedule, loss_fn=F.mse_loss, rng="per-microbatch",
                      rng_seed=seed, granularity="layer+1", **options)
    loss = pipe.step(x, target=y)
    return loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}, pipe


def _case():
    torch.manual_seed(0)
    return (NoisyMLP().double(), torch.randn(16, 6, dtype=torch.float64),
            torch.randn(16, 6, dtype=torch.float64))


def test_derived_seeds_differ_by_each_part_and_are_stable():
    assert derive_seed(0, 1, "dropout") == derive_seed(0, 1, "dropout")
    seeds = {derive_seed(s, i, n, step=k) for s in (0, 1) for i in (0, 1) for n in ("a", "b")
             for k in (0, 1)}
    assert len(seeds) == 16
    assert derive_seed(0, 0, "dropout") == 2223426449254709234  # pinned: not Python's salted hash()


def test_seeded_call_redraws_the_same_mask_and_leaves_the_global_stream_alone():
    x = torch.ones(1000, dtype=torch.float64)
    drop = torch.ops.aten.dropout.default
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    with microbatch(3):
        a = seeded_call(drop, "dropout_1", 0, x, 0.5, True)
        b = seeded_call(drop, "dropout_1", 0, x, 0.5, True)
        c = seeded_call(drop, "dropout_2", 0, x, 0.5, True)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("devices,schedule", [(2, "gpipe"), (2, "zb-h1"), (4, "1f1b"),
                                              (4, "interleaved-1f1b")])
def test_same_seed_same_step_on_any_split_and_schedule(devices, schedule):
    model, x, y = _case()
    ref_loss, ref_grads, pipe = _step(model, x, y, devices=1)
    assert any("random ops seeded per micro-batch" in line for line in pipe.explain().splitlines())
    loss, grads, _ = _step(model, x, y, devices=devices, schedule=schedule)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-14, msg=name)


def test_each_step_draws_new_masks_the_same_on_any_split():
    model, x, y = _case()
    losses = []
    for devices, schedule in [(1, "gpipe"), (2, "1f1b")]:
        pipe = pc.compile(copy.deepcopy(model), (x,), devices=["cpu"] * devices,
                          microbatches=MICROBATCHES, schedule=schedule, loss_fn=F.mse_loss,
                          rng="per-microbatch", granularity="layer+1")
        losses.append([pipe.step(x, target=y) for _ in range(2)])  # no optimizer: same weights
    (first, second), (first_split, second_split) = losses
    assert not torch.equal(first, second)
    torch.testing.assert_close(first_split, first, rtol=1e-12, atol=0)
    torch.testing.assert_close(second_split, second, rtol=1e-12, atol=0)


def test_recomputation_redraws_the_same_masks():
    model, x, y = _case()
    ref_loss, ref_grads, _ = _step(model, x, y, devices=2)
    loss, grads, _ = _step(model, x, y, devices=2, schedule="1f1b", checkpoint=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-14, msg=name)


def test_masks_are_random_and_follow_the_seed():
    model, x, y = _case()
    zero, _, _ = _step(model, x, y, devices=2, seed=0)
    again, _, _ = _step(model, x, y, devices=2, seed=0)
    other, _, _ = _step(model, x, y, devices=2, seed=1)
    eval_model = copy.deepcopy(model).eval()  # no dropout: what a mask-free step would give
    plain = torch.stack([F.mse_loss(eval_model(a), b) for a, b in
                         zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]).mean()
    assert torch.equal(zero, again)
    assert not torch.equal(zero, other) and not torch.allclose(zero, plain)


def test_unknown_rng_mode_is_refused():
    model, x, y = _case()
    with pytest.raises(ConfigError, match="rng='per-stage'.*per-microbatch"):
        pc.compile(model, (x,), devices=2, rng="per-stage", loss_fn=F.mse_loss)


def test_a_recomputation_restoring_its_state_waits_for_another_threads_seeded_draw():
    """A checkpointed stage puts the generator back while another device thread is between its
    seed and its draw: the restore must wait, or that thread draws from the restored state."""
    import threading

    from pipecompile.runtime.stage_worker import _RngState

    seeded = threading.Event()
    restored = threading.Event()

    def draw(n):
        seeded.set()
        restored.wait(timeout=0.5)  # with the lock held by this draw, the restore cannot come
        return torch.rand(n, dtype=torch.float64)

    def recompute():
        with _RngState.capture([]).restored():
            seeded.wait(timeout=5)  # its exit puts back the state from before it
        restored.set()

    thread = threading.Thread(target=recompute)
    thread.start()
    with microbatch(2, step=1):
        drawn = seeded_call(draw, "rand_1", 7, 8)
    thread.join(timeout=5)
    torch.manual_seed(derive_seed(7, 2, "rand_1", step=1))
    assert torch.equal(drawn, torch.rand(8, dtype=torch.float64))


class _DroppedScale(torch.nn.Module):
    """Three dropouts, then a scale: the output is linear in the weight."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(32, dtype=torch.float64) + 0.5)

    def forward(self, x):
        for _ in range(3):
            x = F.dropout(x, 0.5, self.training)
        return x * self.w


def test_global_stream_recomputation_redraws_the_forwards_masks_while_other_stages_draw():
    """rng="global", two device threads drawing dropout masks at once: a checkpointed stage's
    recomputation must use its forward's masks. The loss is linear in each weight w, so
    loss == w . dloss/dw holds exactly when backward saw the forward's masks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_DroppedScale() for _ in range(4)])
    x = torch.rand(64, 32, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=["cpu"] * 2, microbatches=8, schedule="gpipe",
                      loss_fn=lambda out, _: out.sum(), checkpoint=True, granularity="layer+1")
    for _ in range(3):
        pipe.zero_grad()
        loss = pipe.step(x, target=None)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close((p.detach() * p.grad).sum(), loss, rtol=1e-10, atol=1e-10,
                                       msg=name)


def test_attention_without_dropout_is_not_seeded():
    class Attention(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, dropout_p=self.p)

    q = torch.rand(2, 2, 4, 4)
    names = [seed_random_ops(torch.export.export(Attention(p), (q,)).module(), 0)[1]
             for p in (0.0, 0.1)]
    assert names == [(), ("scaled_dot_product_attention",)]


class _Jitter(torch.autograd.Function):
    """PhiMoE's router in small: random numbers drawn inside a custom autograd Function (so
    capture keeps the module applying it opaque)."""

    @staticmethod
    def forward(ctx, x):
        noise = 1 + 0.5 * torch.rand_like(x)
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad):
        (noise,) = ctx.saved_tensors
        return grad * noise


class _JitterLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        return torch.tanh(_Jitter.apply(self.linear(x)))


def _jitter_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_JitterLayer() for _ in range(4)]).double()


@pytest.mark.parametrize("devices,schedule", [(2, "1f1b"), (4, "gpipe")])
def test_random_ops_inside_an_opaque_module_draw_the_microbatch_stream(devices, schedule):
    """The opaque modules (a custom Function applied) run seeded as a whole: one step on 1, 2
    and 4 stages gives the same loss and gradients, and explain() lists them as seeded."""
    model, x = _jitter_net(), torch.randn(16, 6, dtype=torch.float64)
    y = torch.randn(16, 6, dtype=torch.float64)
    ref_loss, ref_grads, pipe = _step(model, x, y, devices=1)
    seeded = next(line for line in pipe.explain().splitlines() if "random ops seeded" in line)
    assert "4 random ops seeded per micro-batch (0, 1, 2, ...)" in seeded, seeded
    loss, grads, _ = _step(model, x, y, devices=devices, schedule=schedule)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-14, msg=name)
    again, _, _ = _step(model, x, y, devices=devices, schedule=schedule, seed=1)
    assert not torch.equal(again, loss)  # another seed, other draws: the draws are random


def test_seeding_an_opaque_module_leaves_the_input_graph_alone():
    model, x = _jitter_net(), torch.randn(4, 6, dtype=torch.float64)
    gm = capture(model, (x,), {}).module
    seeded, names = seed_random_ops(gm, 7)
    assert names == ("0", "1", "2", "3")
    assert all(module_seed(gm.get_submodule(n)) is None for n in names)
    assert all(module_seed(seeded.get_submodule(n)) == 7 for n in names)
    a, b = gm.get_submodule("0"), seeded.get_submodule("0")
    assert a is not b and a.linear.weight is b.linear.weight
    with microbatch(0):
        first, second = seeded(x), seeded(x)
    assert torch.equal(first[0], second[0])  # the same micro-batch: the same draws
