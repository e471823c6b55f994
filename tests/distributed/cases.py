"""Functions run on every rank by tests/runtime/test_distributed.py (importable by spawned processes)."""

from __future__ import annotations

import os

import torch

import pipecompile as pc
from tests.support.models import CASES


def _shard(case, replica, replicas):
    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == 8:
            return x.chunk(replicas)[replica]
        return x
    args = tuple(cut(a) for a in case.args)
    kwargs = {k: cut(v) for k, v in case.kwargs.items()}
    return args, kwargs, cut(case.target)


def plan_case(name, devices, data_parallel=1, microbatches=4):
    """`run_ranks(warm=...)` of `train`: model `name` planned once on one process on each
    replica's batch (see ranks.plan_first)."""
    from tests.distributed.ranks import plan_first

    for replica in range(data_parallel):  # a slice's offset is part of a capture's key
        torch.manual_seed(0)
        case = CASES[name]()
        args, kwargs, _ = _shard(case, replica, data_parallel)
        plan_first(case.model, args, kwargs, devices=devices, microbatches=microbatches,
                   loss_fn=case.loss_fn)


def train(rank, name, schedules, devices, data_parallel=1, microbatches=4, steps=1,
          optimizer=None):
    """For each schedule: compile, run `steps` steps; return losses, own grads, outputs."""
    results = {}
    for schedule in schedules:
        torch.manual_seed(0)
        case = CASES[name]()
        replica = rank // devices
        args, kwargs, target = _shard(case, replica, data_parallel)
        opt = (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) if optimizer else None
        pipe = pc.compile(case.model, args, kwargs, devices=devices, microbatches=microbatches,
                          schedule=schedule, loss_fn=case.loss_fn, data_parallel=data_parallel,
                          optimizer=opt, timeout=300)
        losses = [pipe.step(*args, target=target, **kwargs) for _ in range(steps)]
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        with torch.no_grad():
            out = pipe(*args, **kwargs)
        flat_out = torch.utils._pytree.tree_leaves(out)
        results[schedule] = {"losses": losses, "grads": grads, "params": params,
                             "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                             "out": flat_out, "own": pipe.runtime.own_stages}
    return results


def _step_with(loss_fn):
    torch.manual_seed(0)
    case = CASES["gpt"]()
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=2, loss_fn=loss_fn,
                      schedule="1f1b", timeout=300)
    pipe.step(*case.args, target=case.target)
    return {"ok": True}


def fail_in_loss(rank):
    def loss_fn(out, y):
        raise RuntimeError("loss exploded")

    return _step_with(loss_fn)


def die_in_loss(rank):
    def loss_fn(out, y):
        os._exit(3)  # the process vanishes mid-step, sockets close

    return _step_with(loss_fn)


def different_models(rank):
    torch.manual_seed(0)  # same weights, but each rank builds a different number of layers
    from pipecompile import zoo
    model = zoo.GPT(vocab=32, dim=16, layers=2 + rank, heads=2, seq=8)
    x = torch.randint(0, 32, (8, 8))
    pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=zoo.lm_loss, timeout=300)
    return {"ok": True}


def train_async(rank, schedule, steps=2):
    """PipeDream/2BW on 2 ranks: own parameters after `steps` steps, and the losses."""
    from tests.runtime.test_async import OPTIMIZERS, _batch, _model
    from pipecompile import zoo

    model = _model()
    x, _ = _batch(0)
    pipe = pc.compile(model, (x,), devices=2, microbatches=4, schedule=schedule,
                      loss_fn=zoo.lm_loss, optimizer=OPTIMIZERS["adamw"], timeout=300)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        losses.append(pipe.step(x, target=y))
    return {"params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
            "names": [list(s.parameter_names) for s in pipe.program.stages], "losses": losses,
            "versions": pipe.runtime.weight_versions()}


def other_batch_size(rank):
    """Compile with a batch of 8, train on a batch of 12: shapes come from the symbolic plan."""
    torch.manual_seed(0)
    case = CASES["gpt"]()
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=4, schedule="1f1b",
                      loss_fn=case.loss_fn, timeout=300)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (12, 8), generator=g)
    y = torch.randint(0, 64, (12, 8), generator=g)
    loss = pipe.step(x, target=y)
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}}
