"""Functions run on every rank by tests/distributed/test_tensor_parallel_weights.py: a model
built on the meta device compiled with tensor_parallel=T, its weights initialised or loaded
(each rank reading only its slice), a step, and a torch.distributed.checkpoint of the shards
(fused projections included) saved and loaded back."""

from __future__ import annotations

import os
from collections import defaultdict

import torch

import pipecompile as pc
from tests.distributed.tensor_parallel_cases import MODELS


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def state(pipe_or_model) -> dict:
    """Every state-dict tensor whole (a DTensor gathered), cloned."""
    return {k: _full(v).detach().clone() for k, v in pipe_or_model.state_dict().items()}


class _Recorder:
    """`safe_open` seen through: the bytes of every tensor or slice read out of a file."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.shapes: dict[str, list] = defaultdict(list)

    def wrap(self, opened):
        recorder = self

        class View:
            def __init__(self, key, view):
                self.key, self.view = key, view

            def get_shape(self):
                return self.view.get_shape()

            def get_dtype(self):
                return self.view.get_dtype()

            def __getitem__(self, index):
                got = self.view[index]
                recorder.bytes[self.key] += got.nbytes
                recorder.shapes[self.key].append(tuple(got.shape))
                return got

        class File:
            def __enter__(self):
                opened.__enter__()
                return self

            def __exit__(self, *exc):
                return opened.__exit__(*exc)

            def keys(self):
                return opened.keys()

            def get_slice(self, key):
                return View(key, opened.get_slice(key))

            def get_tensor(self, key):
                got = opened.get_tensor(key)
                recorder.bytes[key] += got.nbytes
                recorder.shapes[key].append(tuple(got.shape))
                return got

        return File()


def _zero(pipe) -> None:
    with torch.no_grad():
        for p in pipe.parameters():
            _local(p).zero_()


def load_counted(pipe, path: str) -> dict:
    """pipe.load_weights(path) from zeroed weights, the bytes read out of safetensors files
    recorded by key."""
    from pipecompile.weights import read

    recorder = _Recorder()
    opener = read._open
    read._open = lambda file, **kw: recorder.wrap(opener(file, **kw))
    try:
        _zero(pipe)
        pipe.load_weights(path)
    finally:
        read._open = opener
    return {"state": state(pipe), "bytes": dict(recorder.bytes),
            "shapes": dict(recorder.shapes)}


def family_case(name: str) -> tuple[tuple, dict, object, object]:
    """The real-model sweep's batch of family `name` (tests/support/real_models.py) with a
    float64 loss: a causal LM's `labels=` loss is computed by transformers in float32 (its
    `ForCausalLMLoss` upcasts the logits with `.float()`, here a cast down), so the labels
    become the target of the same shifted cross-entropy in float64; the rest keep their own
    loss. (args, kwargs, target, loss_fn)."""
    from tests.support.real_models import FAMILIES, own_loss

    args, kwargs = FAMILIES[name].batch()
    if name not in CAUSAL:
        return args, kwargs, None, own_loss
    kwargs = dict(kwargs)
    return args, kwargs, kwargs.pop("labels"), _shifted_loss


CAUSAL = ("gpt2", "llama", "qwen2")


def _shifted_loss(out, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1))


def run_families(families: dict) -> dict:
    """The real-model sweep's families at tensor_parallel = world size, the sweep's way: a
    language model built on meta and loaded (`load_weights`) from its `save_pretrained`
    shards (`families[name]`), any other seeded as the sweep seeds it; one 1f1b step of 2
    micro-batches: loss, full gradients, the parameters split."""
    import torch.distributed as dist

    from tests.support.real_models import FAMILIES

    results = {}
    for name, checkpoint in families.items():
        torch.manual_seed(0)
        with torch.device("meta" if FAMILIES[name].meta else "cpu"):
            model = FAMILIES[name].build().double()
        args, kwargs, target, loss_fn = family_case(name)
        pipe = pc.compile(model, args, kwargs, devices=1, tensor_parallel=dist.get_world_size(),
                          microbatches=2, schedule="1f1b", loss_fn=loss_fn, timeout=300)
        if FAMILIES[name].meta:
            pipe.to_empty()
            pipe.load_weights(checkpoint)
        loss = pipe.step(*args, target=target, **kwargs)
        results[name] = {
            "loss": loss.item(),
            "grads": {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters()
                      if p.grad is not None},
            "split": sorted(n for n, p in pipe.named_parameters()
                            if _local(p).numel() < p.numel()),
            "explain": pipe.explain()}
    return results


def plan_weights(names: list[str], families: list[str]) -> None:
    """`run_ranks(warm=...)` of `run_weights`: each model built as the ranks build it and
    planned once on one process (see ranks.plan_first)."""
    from tests.distributed.ranks import plan_first
    from tests.support.real_models import FAMILIES

    for name in names:
        with pc.meta_parameters():
            model, args, kwargs, _, loss_fn = MODELS[name]()
        plan_first(model, args, kwargs, devices=1, microbatches=2, loss_fn=loss_fn)
    for name in families:
        torch.manual_seed(0)
        with torch.device("meta" if FAMILIES[name].meta else "cpu"):
            model = FAMILIES[name].build().double()
        args, kwargs, _, loss_fn = family_case(name)
        plan_first(model, args, kwargs, devices=1, microbatches=2, loss_fn=loss_fn)


def run_weights(rank: int, names: list[str], paths: dict, out: str,
                families: dict | None = None) -> dict:
    """For each model: built on meta, compiled with tensor_parallel = world size and
    vocab_parallel=True (embeddings and output layer split along the vocabulary); init_weights
    (the model's own `_init_weights`); load_weights from each checkpoint of `paths[name]`; one
    step; DCP save of `pipe.state_dict()` into `out`, zeroed, DCP loaded back; an AdamW
    step and `get_state_dict(pipe, opt)` through DCP and back. Then the real-model sweep's
    `families` (`run_families`), under "families"."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    T = dist.get_world_size()
    results = {}
    for name in names:
        with pc.meta_parameters():
            model, args, kwargs, target, loss_fn = MODELS[name]()
        pipe = pc.compile(model, example_inputs=args, example_kwargs=kwargs, devices=1,
                          tensor_parallel=T, loss_fn=loss_fn, schedule="gpipe",
                          microbatches=2, timeout=300, vocab_parallel=True)
        pipe.to_empty()
        torch.manual_seed(0)
        pipe.init_weights(model._init_weights)
        found = {"init": state(pipe),
                 "local": {n: tuple(_local(p).shape) for n, p in pipe.named_parameters()},
                 "placements": {n: str(p.placements) for n, p in pipe.named_parameters()}}
        for kind, path in paths[name].items():
            found[kind] = load_counted(pipe, path)
        loss = pipe.step(*args, target=target, **kwargs)
        found["loss"] = loss.item()
        found["grads"] = {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters()
                          if p.grad is not None}
        saved = os.path.join(out, name)
        dcp.save(pipe.state_dict(), checkpoint_id=saved)
        _zero(pipe)
        loaded = pipe.state_dict()
        dcp.load(loaded, checkpoint_id=saved)
        found["dcp_round_trip"] = state(pipe)
        found["from_own_dcp"] = load_counted(pipe, saved)
        found["optim"] = _optimizer_round_trip(pipe, os.path.join(out, f"{name}-optim"))
        results[name] = found
    results["families"] = run_families(families or {})
    return results


def _optimizer_round_trip(pipe, path: str) -> dict:
    """One AdamW step, then model and optimizer (`get_state_dict`) saved with DCP, every
    tensor of both zeroed, loaded back: the largest difference, and which moments are
    DTensors of a fused projection."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    opt.step()
    model_sd, optim_sd = get_state_dict(pipe, opt)
    tree = {"model": model_sd, "optim": optim_sd}
    values = [*model_sd.values(), *(v for s in optim_sd["state"].values() for v in s.values())]
    before = [_full(v).clone() for v in values]
    fused = sorted(k for k, s in optim_sd["state"].items() if isinstance(s["exp_avg"], DTensor)
                   and "Strided" in str(s["exp_avg"].placements))
    dcp.save(tree, checkpoint_id=path)
    with torch.no_grad():
        for v in values:
            _local(v).zero_()
    dcp.load(tree, checkpoint_id=path)
    worst = max((_full(v) - b).abs().max().item() for v, b in zip(values, before))
    return {"worst": worst, "fused": fused, "count": len(values)}
