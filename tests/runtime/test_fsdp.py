"""Pipeline x data parallel on 4 gloo ranks (2 stages x 2 replicas), with FSDP2 sharding
(`fsdp=True`) and replicated: three steps of AdamW with clipping equal the unsplit model on
the global batch (float64)."""

from __future__ import annotations

import functools

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from tests.distributed.ranks import run_ranks
from tests.distributed.fsdp_cases import (
    CLIP,
    LR,
    STEPS,
    bad_options,
    batch,
    meta_fsdp_train_and_save,
    model,
    padded_batch,
    plan_model,
    resume_without_data_parallel,
    token_loss,
    train,
    train_tokens,
)
from tests.support.reference import assert_grads_equal, reference_step


def _reference(steps=STEPS, evaluate=False):
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        loss, _ = reference_step(net, (x,), {}, y, zoo.lm_loss, 4)
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    if not evaluate:
        return losses, norms, dict(net.named_parameters())
    x, y = batch(0)
    with torch.no_grad():
        evaluated = sum(zoo.lm_loss(net(a), b) for a, b in zip(x.chunk(4), y.chunk(4))) / 4
        out = net(x)
    return losses, norms, dict(net.named_parameters()), evaluated.item(), out


@pytest.mark.parametrize("fsdp", [True, False])
def test_pipeline_x_data_parallel_equals_the_unsplit_model(fsdp):
    results = run_ranks(train, 4, fsdp, warm=plan_model)
    losses, norms, params, evaluated, out = _reference(evaluate=True)
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        assert abs(r["eval"] - evaluated) < 1e-12, (rank, r["eval"], evaluated)  # eval mode
        assert (r["out"] - out.chunk(2)[rank // 2]).abs().max().item() < 1e-10, rank
        for got, want in zip(r["losses"], losses):
            assert abs(got - want) < 1e-12, (rank, r["losses"], losses)
        for got, want in zip(r["norms"], norms):
            assert abs(got - want) < 1e-10 * want, (rank, r["norms"], norms)
        for n, p in r["params"].items():
            assert (p - params[n].detach()).abs().max().item() < 1e-8, (rank, n)
        assert r["after_step"]  # no reduction loop after the step: torch's hooks did it
        if fsdp:
            assert r["dtensor"] == "DTensor" and "fully_shard" in r["explain"]
            assert r["local"] * 2 == r["whole"], rank  # half of its stages' parameters
        else:  # DDP's reducer all-reduced buckets during each step's last backward
            assert r["dtensor"] == "Parameter" and r["buckets"] >= STEPS, rank


def _token_reference():
    x, y, n = padded_batch()
    net = model()
    loss = token_loss(net(x), y, n)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in net.named_parameters()}


@pytest.mark.parametrize("fsdp", [True, False])
def test_num_items_in_batch_sums_to_the_global_token_loss(fsdp):
    loss, grads = _token_reference()
    for rank, r in enumerate(run_ranks(train_tokens, 4, fsdp,
                                                 warm=functools.partial(plan_model, True))):
        assert "error" not in r and "died" not in r, (rank, r)
        assert abs(r["loss"] - loss) < 1e-12, (rank, r["loss"], loss)
        for name, g in r["grads"].items():
            scale = grads[name].abs().max().item()
            assert (g - grads[name]).abs().max().item() <= 1e-10 * scale, (rank, name)


def test_num_items_in_batch_in_one_process():
    x, y, n = padded_batch()
    pipe = pc.compile(model(), example_inputs=(x,), devices=2, loss_fn=token_loss,
                      schedule="1f1b", microbatches=4)
    loss, grads = _token_reference()
    assert abs(pipe.step(x, target=y, num_items_in_batch=n).item() - loss) < 1e-12
    assert_grads_equal(pipe, grads)
    with pytest.raises(pc.ConfigError, match="positive count"):
        pipe.step(x, target=y, num_items_in_batch=0)
    plain = pc.compile(model(), example_inputs=(x,), devices=2, loss_fn=zoo.lm_loss,
                       schedule="1f1b", microbatches=4)
    with pytest.raises(pc.ConfigError, match=r"lm_loss\(logits.*does not take it"):
        plain.step(x, target=y, num_items_in_batch=n)


def test_bad_data_parallel_options():
    x, _ = batch(0)
    with pytest.raises(pc.ConfigError, match="timeout must be a positive"):
        pc.compile(model(), example_inputs=(x,), devices=2, timeout=-5)
    with pytest.raises(pc.ConfigError, match="fsdp=True shards each stage"):
        pc.compile(model(), example_inputs=(x,), devices=2, fsdp=True)


def test_meta_fsdp_checkpoint_loads_unsplit_and_resumes_on_four_pipeline_ranks(tmp_path):
    """Built on meta, sharded and loaded per rank; its DCP checkpoint (DTensor shards) loads
    into the unsplit model and into 4 pipeline ranks without data parallelism, whose next
    step equals the unsplit model's."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    state = {k: v for k, v in model().state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "w.safetensors"))
    saved = run_ranks(meta_fsdp_train_and_save, 4, str(tmp_path / "w.safetensors"),
                      str(tmp_path / "ckpt"))
    losses, norms, params = _reference(STEPS + 1)
    for rank, r in enumerate(saved):
        assert "error" not in r and "died" not in r, (rank, r)
        assert r["missing"] == []
        assert all(abs(a - b) < 1e-12 for a, b in zip(r["losses"], losses)), (rank, r)
    after = _reference(STEPS)[2]
    fresh = model()
    loaded = {"model": fresh.state_dict()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    fresh.load_state_dict(loaded["model"])
    for name, p in fresh.named_parameters():
        assert (p - after[name].detach()).abs().max().item() < 1e-8, name
    seen = set()
    resumed = run_ranks(resume_without_data_parallel, 4, str(tmp_path / "ckpt"),
                        warm=functools.partial(plan_model, devices=4, replicas=1,
                                               microbatches=4))
    for rank, r in enumerate(resumed):
        assert "error" not in r and "died" not in r, (rank, r)
        assert abs(r["loss"] - losses[STEPS]) < 1e-10, (rank, r["loss"], losses[STEPS])
        assert abs(r["norm"] - norms[STEPS]) < 1e-8 * norms[STEPS], rank
        for name, p in r["params"].items():
            assert (p - params[name].detach()).abs().max().item() < 1e-8, (rank, name)
            seen.add(name)
    assert seen == set(params)


def test_fsdp_refuses_what_it_cannot_run_on_every_rank():
    for rank, errors in enumerate(run_ranks(bad_options, 2)):
        assert "error" not in errors and "died" not in errors, (rank, errors)
        assert "fsdp=True with pipedream/2bw is not supported" in errors["pipedream"]
        assert "zero-bubble" in errors["zb"] and "'1f1b'" in errors["zb"]
        assert "devices=2 × data_parallel=2 = 4" in errors["world"]
        assert "needs one named 'dp'" in errors["mesh"] and "'replicas'" in errors["mesh"]


def test_clip_norm_in_float32_for_bf16_parameters():
    """bf16 gradients: the norm is taken in float32 (what the cut placement cannot change)."""
    x, y = batch(0)
    torch.manual_seed(0)
    net = zoo.GPT(vocab=64, dim=16, layers=4, heads=2, seq=8).to(torch.bfloat16)
    pipe = pc.compile(net, example_inputs=(x,), devices=2, loss_fn=zoo.lm_loss,
                      schedule="1f1b", microbatches=2)
    pipe.step(x, target=y)
    grads = [p.grad for p in pipe.parameters()]
    exact = torch.cat([g.double().flatten() for g in grads]).norm()
    norm = pipe.clip_grad_norm_(1e9)  # nothing clipped: the norm alone
    assert norm.dtype == torch.float32
    assert abs(norm.item() - exact.item()) <= 1e-6 * exact.item()
