"""torch.distributed.checkpoint on gloo ranks, run by tests/distributed/test_checkpoint.py (importable by
the spawned processes): AdamW steps then `dcp.save` of `get_state_dict(pipe, opt)`, and a
pipeline of another stage count resumed with `dcp.load` + `set_state_dict`."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

import pipecompile as pc
from tests.support.models import CASES

# Each rank holds only its stages' parameters, so each rank's optimizer has its own param
# group: flattened, the optimizer state is keyed by parameter name only and reshards.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _pipeline(devices):
    torch.manual_seed(0)
    case = CASES["gpt"]()  # float64; wte.weight is lm_head.weight: first and last stage
    pipe = pc.compile(case.model, case.args, devices=devices, microbatches=2,
                      loss_fn=case.loss_fn, schedule="1f1b", timeout=300)
    return case, pipe, optimizer(pipe.parameters())


def train_and_save(rank, directory, steps=2):
    """`steps` AdamW steps of a 2-stage pipeline, then a checkpoint of model and optimizer."""
    case, pipe, opt = _pipeline(2)
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(*case.args, target=case.target))
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(pipe, opt, options=OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    return {"losses": losses, "keys": sorted(model_sd)}


def resume(rank, directory, devices):
    """A `devices`-stage pipeline loads the checkpoint and takes one more step."""
    case, pipe, opt = _pipeline(devices)
    model_sd, optim_sd = get_state_dict(pipe, opt, options=OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(pipe, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=OPTIONS)
    loss = pipe.step(*case.args, target=case.target)
    opt.step()
    return {"loss": loss, "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}
