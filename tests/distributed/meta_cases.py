"""Functions run on every rank by tests/distributed/test_meta_distributed.py (importable by spawned
processes): a model built on meta, materialised and initialised or loaded per rank."""

from __future__ import annotations

import torch

import pipecompile as pc
from pipecompile import zoo

SIZES = dict(vocab=64, dim=16, layers=4, heads=2, seq=8)


def ids(batch=8):
    return torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(1))


def meta_gpt_steps(rank, devices, weights):
    """`meta_gpt_step` initialised, then loaded from `weights`, in one process per rank."""
    return [meta_gpt_step(rank, devices), meta_gpt_step(rank, devices, weights)]


def meta_gpt_step(rank, devices, weights=None):
    """Build a GPT on meta, compile on `devices` ranks, to_empty, then init (seed 123) or
    load `weights`; one 1F1B step. Returns what the test compares with the eager model."""
    with torch.device("meta"):
        model = zoo.GPT(**SIZES).double()
    x = ids()
    pipe = pc.compile(model, example_inputs=(x,), devices=devices, loss_fn=zoo.lm_loss,
                      schedule="1f1b", microbatches=4, timeout=300)
    meta_before = all(p.is_meta for p in pipe.parameters())
    pipe.to_empty()
    if weights is None:
        torch.manual_seed(123)
        pipe.init_weights()
        missing: list[str] = []
    else:
        result = pipe.load_weights(weights)
        missing = result.missing_keys
    loss = pipe.step(x, target=x)
    own = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()
                                    if p.grad is not None},
            "params": own, "meta_before": meta_before, "still_meta": still_meta,
            "missing": missing, "own_stages": pipe.runtime.own_stages}
