"""Training loops run on every rank by tests/runtime/test_training_distributed.py (importable by the
spawned processes): the user's optimizer and scheduler, global-norm clipping, eval_step,
eval mode and autocast over gloo ranks."""

from __future__ import annotations

import math

import torch

import pipecompile as pc
from tests.support.models import CASES


def _loop(params):
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def user_loop(rank, devices, data_parallel, steps=3):
    """`steps` steps of AdamW + StepLR over pipe.parameters(), clipping by the global norm
    (2-norm, then the inf-norm on the last step); what each rank holds afterwards."""
    torch.manual_seed(0)
    case = CASES["gpt"]()  # wte.weight is lm_head.weight: first and last stage
    replica = rank // devices
    x = case.args[0].chunk(data_parallel)[replica]
    y = case.target.chunk(data_parallel)[replica]
    pipe = pc.compile(case.model, (x,), devices=devices, microbatches=2, loss_fn=case.loss_fn,
                      data_parallel=data_parallel, schedule="1f1b", timeout=300)
    opt, sched = _loop(pipe.parameters())
    losses, norms = [], []
    for step in range(steps):
        losses.append(pipe.step(x, target=y))
        norms.append(pipe.clip_grad_norm_(0.05, math.inf if step == steps - 1 else 2.0))
        opt.step()
        sched.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    copies = {n: [t.detach().clone() for s, t in c if s in pipe.runtime.own_stages]
              for n, c in pipe.program.tensors.items()}
    return {"losses": losses, "norms": norms, "params": params, "copies": copies,
            "eval": pipe.eval_step(x, target=y)}


def autocast_step(rank):
    """A bf16 autocast step and call on 2 ranks: the loss, the output and its dtype."""
    torch.manual_seed(0)
    case = CASES["gpt"]()
    model = case.model.float()
    pipe = pc.compile(model, case.args, devices=2, microbatches=2, loss_fn=case.loss_fn,
                      schedule="1f1b", timeout=300)
    plain = pipe.step(*case.args, target=case.target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(*case.args, target=case.target)
        out = pipe(*case.args)
        val = pipe.eval_step(*case.args, target=case.target)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    return {"plain": plain, "loss": loss, "out": out, "eval": val, "grads": grads}


def autocast_bf16_boundary(rank):
    """An MLP cut after a tanh of a bf16 linear: the boundary value itself is bf16."""
    import torch.nn.functional as F

    from tests.runtime.test_autocast import MLP

    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=F.cross_entropy,
                      schedule="1f1b", timeout=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, target=y)
        out = pipe(x)
    return {"loss": loss, "out": out,
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}}


def eval_mode(rank):
    """Two training steps of a batch-norm + dropout model, then eval-mode outputs on 2 ranks."""
    import torch.nn.functional as F

    from tests.runtime.test_training_loop import BatchNormDropout

    torch.manual_seed(0)
    model = BatchNormDropout().double()
    x = torch.randn(8, 6, dtype=torch.float64) * 2 + 1
    y = torch.randint(0, 3, (8,))
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=F.cross_entropy,
                      split_points=["fc2"], timeout=300)
    for _ in range(2):
        pipe.step(x, target=y)
    val = pipe.eval_step(x, target=y)  # eval mode for this call only
    training = pipe.training
    pipe.eval()
    with torch.no_grad():
        out, again = pipe(x), pipe(x)
    return {"val": val, "out": out, "again": again, "training": training,
            "state": {k: v.clone() for k, v in pipe.state_dict().items()}}


def sequence_lengths(rank):
    """Steps and calls on 2 ranks at sequence lengths other than the example's (8): the loss,
    the gradients and the output at each length."""
    torch.manual_seed(0)
    case = CASES["gpt"]()
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=2, loss_fn=case.loss_fn,
                      schedule="1f1b", timeout=300, symbolic_sizes="all")
    results = {}
    for seq in (5, 8, 3):
        x, y = case.args[0][:, :seq], case.target[:, :seq]
        loss = pipe.step(x, target=y)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        results[seq] = {"loss": loss, "grads": grads, "out": pipe(x)}
    return results
