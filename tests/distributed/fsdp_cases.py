"""Functions run on every rank by tests/runtime/test_fsdp.py (importable by spawned processes):
pipeline x data parallel on 4 gloo ranks, each replica given its half of the global batch."""

from __future__ import annotations

import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.ir.tensors import local_tensor

SIZES = dict(vocab=64, dim=16, layers=4, heads=2, seq=8)
BATCH, STEPS, LR, CLIP = 8, 3, 1e-2, 0.05


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (BATCH, 8), generator=g), torch.randint(0, 64, (BATCH, 8),
                                                                        generator=g)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.GPT(**SIZES).double()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a DTensor's all-gather is collective)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def plan_model(tokens: bool = False, devices: int = 2, replicas: int = 2,
               microbatches: int = 2) -> None:
    """`run_ranks(warm=...)` of these jobs: `model()` planned once on one process on each
    replica's batch (`padded_batch` with `token_loss` for `tokens`; see ranks.plan_first)."""
    from tests.distributed.ranks import plan_first

    x = padded_batch()[0] if tokens else batch(0)[0]
    for part in x.chunk(replicas):  # a slice's offset is part of a capture's key
        plan_first(model(), (part,), devices=devices, microbatches=microbatches,
                   loss_fn=token_loss if tokens else zoo.lm_loss)


def train(rank: int, fsdp: bool, steps: int = STEPS) -> dict:
    """Three steps of the user's AdamW with pipe.clip_grad_norm_ on pipeline 2 x data 2."""
    replica = rank // 2
    x, y = batch(0)
    pipe = pc.compile(model(), example_inputs=(x.chunk(2)[replica],), devices=2,
                      data_parallel=2, fsdp=fsdp, loss_fn=zoo.lm_loss, schedule="1f1b",
                      microbatches=2, timeout=300)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        losses.append(pipe.step(x.chunk(2)[replica], target=y.chunk(2)[replica]).item())
        norms.append(pipe.clip_grad_norm_(CLIP).item())
        opt.step()
        opt.zero_grad()
    x, y = batch(0)
    evaluated = pipe.eval_step(x.chunk(2)[replica], target=y.chunk(2)[replica]).item()
    with torch.no_grad():
        out = pipe(x.chunk(2)[replica])
    params = {n: full(p).detach().clone() for n, p in pipe.named_parameters()}
    reducers = [w.sync for w in pipe.runtime.workers.values()]
    buckets = sum(getattr(r, "buckets", 0) for r in reducers)
    local = sum(local_tensor(p).numel() for p in pipe.parameters())
    whole = sum(full(p).numel() for p in pipe.parameters())
    return {"losses": losses, "norms": norms, "params": params, "local": local,
            "whole": whole, "dtensor": type(next(pipe.parameters())).__name__,
            "buckets": buckets, "after_step": pipe.runtime.sync.replicas_reduced,
            "eval": evaluated, "out": out,
            "explain": pipe.explain()}


def token_loss(logits, target, num_items_in_batch):
    """Summed token cross entropy over the valid tokens, divided by the global count."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
        reduction="sum") / num_items_in_batch


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """A batch whose padding (-100 targets) falls unevenly: row i has i padded tokens (the
    last rows, one replica's, are mostly padding)."""
    x, y = batch(7)
    for i in range(BATCH):
        y[i, 8 - i:] = -100
    return x, y, int((y != -100).sum())


def train_tokens(rank: int, fsdp: bool) -> dict:
    """One step with num_items_in_batch on pipeline 2 x data 2; the loss and gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    replica = rank // 2
    x, y, n = padded_batch()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")) if fsdp else None
    pipe = pc.compile(model(), example_inputs=(x.chunk(2)[replica],), devices=2,
                      data_parallel=2, fsdp=fsdp, mesh=mesh, loss_fn=token_loss,
                      schedule="1f1b", microbatches=2, timeout=300)
    loss = pipe.step(x.chunk(2)[replica], target=y.chunk(2)[replica], num_items_in_batch=n)
    grads = {name: full(p.grad).clone() for name, p in pipe.named_parameters()}
    return {"loss": loss.item(), "grads": grads}


def meta_fsdp_train_and_save(rank: int, weights: str, directory: str) -> dict:
    """Built on meta, sharded, materialised and loaded from `weights`; STEPS steps of AdamW with
    clipping, then a DCP checkpoint of model and optimizer (DTensor shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.distributed.checkpoint_cases import OPTIONS

    replica = rank // 2
    with torch.device("meta"):
        net = zoo.GPT(**SIZES).double()
    x, _ = batch(0)
    pipe = pc.compile(net, example_inputs=(x.chunk(2)[replica],), devices=2, data_parallel=2,
                      fsdp=True, loss_fn=zoo.lm_loss, schedule="1f1b", microbatches=2,
                      timeout=300)
    pipe.to_empty()
    missing = pipe.load_weights(weights).missing_keys
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        losses.append(pipe.step(x.chunk(2)[replica], target=y.chunk(2)[replica]).item())
        pipe.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(pipe, opt, options=OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    return {"losses": losses, "missing": missing}


def resume_without_data_parallel(rank: int, directory: str) -> dict:
    """4 pipeline ranks, no data parallelism: load the FSDP checkpoint, take the next step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tests.distributed.checkpoint_cases import OPTIONS

    x, y = batch(STEPS)
    pipe = pc.compile(model(), example_inputs=(x,), devices=4, loss_fn=zoo.lm_loss,
                      schedule="1f1b", microbatches=4, timeout=300)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(pipe, opt, options=OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(pipe, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=OPTIONS)
    loss = pipe.step(x, target=y).item()
    norm = pipe.clip_grad_norm_(CLIP).item()
    opt.step()
    return {"loss": loss, "norm": norm,
            "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}


def bad_options(rank: int) -> dict:
    """On 2 ranks (1 stage x 2 replicas): the option combinations fsdp=True refuses."""
    from torch.distributed.device_mesh import init_device_mesh

    x, _ = batch(0)
    tries = {
        "pipedream": dict(schedule="pipedream", optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),
        "zb": dict(schedule="zb-h1"),
        "world": dict(devices=2),
        "mesh": dict(mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("replicas",))),
    }
    errors = {}
    for name, options in tries.items():
        options = {"devices": 1, "data_parallel": 2, "fsdp": True, "loss_fn": zoo.lm_loss,
                   "microbatches": 2, **options}
        try:
            pc.compile(model(), example_inputs=(x.chunk(2)[rank],), timeout=300, **options)
        except pc.PipecompileError as exc:
            errors[name] = str(exc)
    return errors
