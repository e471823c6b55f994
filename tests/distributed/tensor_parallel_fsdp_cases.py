"""Functions run on every rank by tests/distributed/test_tensor_parallel_fsdp.py: tensor
parallelism with FSDP (fsdp=True: FSDP2 over "dp" of the (dp, pp, tp) mesh) and with
recomputation (checkpoint=True) on gloo in float64, against the unsplit model on the global
batch."""

from __future__ import annotations

import torch

import pipecompile as pc
from pipecompile.ir.tensors import local_tensor
from tests.distributed.tensor_parallel_cases import replica_case


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _placements(tensor: torch.Tensor) -> tuple:
    """(mesh dimension names, placements) of a DTensor parameter, as strings."""
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    return tuple(mesh.mesh_dim_names), tuple(str(p) for p in tensor.placements)  # type: ignore


def _zero(pipe) -> None:
    with torch.no_grad():
        for p in pipe.parameters():
            local_tensor(p).zero_()


def _saved(pipe, directory: str, case: tuple, batch: tuple) -> dict:
    """After the AdamW step: `dcp.save(pipe.state_dict())`; `pipe.save` (every rank) and
    `pc.load` under the same ranks, the loaded pipeline's placements and one step of it on
    `batch`; then its weights zeroed and the DCP checkpoint loaded into it (TP2 x FSDP2 again):
    the largest difference from the saved weights."""
    import os

    import torch.distributed.checkpoint as dcp

    args, kwargs, target, loss_fn = batch
    name = "-".join(map(str, case[:3]))
    before = {k: _full(v).detach().clone() for k, v in pipe.state_dict().items()}
    dcp.save(pipe.state_dict(), checkpoint_id=os.path.join(directory, f"{name}-dcp"))
    loaded = pc.load(pipe.save(os.path.join(directory, f"{name}-plan")), loss_fn=loss_fn)
    placements = {n: _placements(p) for n, p in loaded.named_parameters()} == \
        {n: _placements(p) for n, p in pipe.named_parameters()}
    loss = loaded.step(*args, target=target, **kwargs).item()
    grads = {n: _full(p.grad).detach().clone() for n, p in loaded.named_parameters()
             if p.grad is not None}
    _zero(loaded)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(directory, f"{name}-dcp"))
    worst = max((_full(v) - before[k]).abs().max().item()
                for k, v in loaded.state_dict().items())
    return {"placements": placements, "loss": loss, "grads": grads, "dcp_worst": worst,
            "keys": sorted(before), "layout": str(loaded.layout)}


def _loaded(name: str, paths: dict, rank: int) -> dict:
    """Model `name` built on meta, compiled TP2 x FSDP2 (vocabulary split too), load_weights
    from each checkpoint of `paths` (kind -> path) after zeroing, the bytes read by key; the
    bytes this rank holds of each key; one step's loss and full gradients."""
    import torch.distributed as dist

    from tests.distributed.tensor_parallel_weights_cases import load_counted

    with pc.meta_parameters():
        T, (model, args, kwargs, target, loss_fn) = replica_case(
            name, 1, 2, rank, dist.get_world_size())
    pipe = pc.compile(model, example_inputs=args, example_kwargs=kwargs, devices=1,
                      tensor_parallel=T, data_parallel=2, fsdp=True, loss_fn=loss_fn,
                      schedule="gpipe", microbatches=2, timeout=300, vocab_parallel=True)
    pipe.to_empty()
    found: dict = {kind: load_counted(pipe, path) for kind, path in paths.items()}
    found["held"] = {n: local_tensor(t).nbytes for n, t in pipe.state_dict(keep_vars=True).items()}
    found["split"] = sorted(n for n, p in pipe.named_parameters()
                            if local_tensor(p).numel() * 2 * T == p.numel())
    found["loss"] = pipe.step(*args, target=target, **kwargs).item()
    found["grads"] = {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters()
                      if p.grad is not None}
    return found


def run_cases(rank: int, cases: list[tuple], directory: str | None = None,
              saved: tuple = (), loads: dict | None = None) -> dict:
    """Each case (model, pipeline devices P, schedule, options: (key, value) pairs given to
    compile, e.g. data_parallel=D, fsdp=True, checkpoint=True) on P x D x T ranks (each
    replica taking its 1/D of the global batch): one step's loss and full gradients, each
    parameter's local and whole size and placements, the clipped norm, the user's AdamW step,
    the next step's loss, eval_step after it, and state_dict()'s values (full_tensor()).
    Cases in `saved` are also saved and loaded after the AdamW step (`_saved`, into
    `directory`), the next step's gradients kept beside. Each model of `loads` (name -> {kind:
    checkpoint path}) is also built on meta and loaded (`_loaded`), under "loaded"."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    results = {}
    for case in cases:
        name, P, schedule, options = case[0], case[1], case[2], dict(case[3])
        replicas = options.get("data_parallel", 1)
        T, (model, args, kwargs, target, loss_fn) = replica_case(
            name, P, replicas, rank, dist.get_world_size())
        pipe = pc.compile(model, example_inputs=args, example_kwargs=kwargs, devices=P,
                          tensor_parallel=T, loss_fn=loss_fn, schedule=schedule,
                          microbatches=2, timeout=300,
                          **{"vocab_parallel": False, **options})  # tables whole, as asserted
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        loss = pipe.step(*args, target=target, **kwargs)
        grads = {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters()
                 if p.grad is not None}
        sizes = {n: (local_tensor(p).numel(), p.numel(), _placements(p))
                 for n, p in pipe.named_parameters()}
        values = {n: _full(p).detach().clone() for n, p in pipe.named_parameters()}
        norm = pipe.clip_grad_norm_(1e9).item()
        opt.step()
        opt.zero_grad()
        stored = (_saved(pipe, directory, case, (args, kwargs, target, loss_fn))
                  if directory is not None and tuple(case) in saved else None)
        loss2 = pipe.step(*args, target=target, **kwargs)
        if stored is not None:  # the step the loaded pipeline took, in the original
            stored["grads2"] = {n: _full(p.grad).detach().clone()
                                for n, p in pipe.named_parameters() if p.grad is not None}
        evaluated = pipe.eval_step(*args, target=target, **kwargs).item()
        state = {k: _full(v).detach().clone() for k, v in pipe.state_dict().items()}
        results[tuple(case)] = {
            "loss": loss.item(), "grads": grads, "sizes": sizes, "values": values,
            "norm": norm, "loss2": loss2.item(), "eval": evaluated, "state": state,
            "saved": stored,
            "explain": pipe.explain(),
            "layout": (pipe.layout.pipeline, pipe.layout.data_parallel,
                       pipe.layout.tensor_parallel, pipe.layout.fsdp),
            "recomputed": sorted(pipe.runtime.spec.checkpoint),
            "dtensor": all(isinstance(p, DTensor) for p in pipe.parameters())}
        dist.barrier()
    results["loaded"] = {name: _loaded(name, paths, rank) for name, paths in (loads or {}).items()}
    return results
