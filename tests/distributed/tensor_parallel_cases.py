"""Functions run on every rank by tests/distributed/test_tensor_parallel_exact.py: pipeline x
tensor parallelism on gloo in float64, against the unsplit model on the same batch."""

from __future__ import annotations

import contextlib

import torch

import pipecompile as pc
from pipecompile.ir.tensors import local_tensor

BATCH, SEQ = 4, 8


def _ids(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def gpt() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, object]:
    from pipecompile import zoo

    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=16, layers=2, heads=2, seq=SEQ).double()
    return model, (_ids(64, 1),), {}, _ids(64, 2), zoo.lm_loss


def gpt4() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, object]:
    """4 heads: attention splits over T = 4."""
    from pipecompile import zoo

    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=16, layers=2, heads=4, seq=SEQ).double()
    return model, (_ids(64, 1),), {}, _ids(64, 2), zoo.lm_loss


def llama() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, object]:
    """GQA: 4 query heads over 2 key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=32, vocab_size=64,
                      max_position_embeddings=16, use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double()
    return model, (_ids(64, 1),), {}, _ids(64, 2), _logits_loss


def gpt2() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, object]:
    """GPT-2: fused c_attn (Conv1D [h, 3h]), tied embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).double(), (_ids(64, 1),), {}, _ids(64, 2), _logits_loss


def llama_labels() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, object]:
    """The Llama trained from `labels=` (its own shifted cross entropy inside the graph, a
    quarter of the labels -100), the loss in float64: transformers' `ForCausalLMLoss` casts
    the logits with `.float()` (down from float64), so its loss function keeps float64."""
    model, args, _, target, _ = llama()
    labels = target.masked_fill(_ids(4, 3) == 0, -100)
    model._loss_function = _causal_lm_loss  # the property `loss_function` reads it first
    return model, args, {"labels": labels}, None, _own_loss


def _causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                    **kwargs):
    """transformers' ForCausalLMLoss with `.double()` for its `.float()`."""
    logits = logits.double()
    labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(logits.view(-1, vocab_size),
                                             shift_labels.view(-1), ignore_index=ignore_index)


def gpt_square() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, object]:
    """The test GPT with a loss that is not only cross entropy (it reads the logits'
    squares too): its logits are gathered."""
    model, args, kwargs, target, _ = gpt()
    return model, args, kwargs, target, _square_loss


def _square_loss(logits, target):
    from pipecompile import zoo

    return zoo.lm_loss(logits, target) + 1e-3 * logits.pow(2).mean()


def gpt_smoothed() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, object]:
    """The test GPT with label smoothing in its cross entropy (Megatron's smoothed form)."""
    model, args, kwargs, target, _ = gpt()
    return model, args, kwargs, target, _smoothed_loss


def _smoothed_loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             target.reshape(-1), label_smoothing=0.1)


def llama_weighted() -> tuple[torch.nn.Module, tuple, dict, torch.Tensor, object]:
    """The Llama with class weights in its cross entropy (a constant of the loss)."""
    model, args, kwargs, target, _ = llama()
    return model, args, kwargs, target, _weighted_loss


_CLASS_WEIGHTS = torch.linspace(0.5, 1.5, 64, dtype=torch.float64)


def _weighted_loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                             target.reshape(-1), weight=_CLASS_WEIGHTS)


def _own_loss(out, _target):
    return out.loss


def _logits_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             target.reshape(-1))


MODELS = {"gpt": gpt, "gpt4": gpt4, "llama": llama, "gpt2": gpt2, "llama_labels": llama_labels,
          "gpt_square": gpt_square, "gpt_smoothed": gpt_smoothed,
          "llama_weighted": llama_weighted}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _comm_counts(pipe, args, kwargs) -> dict:
    """Collectives of the first stage's graph alone (TP only: the whole model), forward, then
    forward and backward, counted by torch's CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode

    module = pipe.runtime.workers[0].module
    with torch.no_grad(), CommDebugMode() as forward:
        module(*args, *kwargs.values())
    with CommDebugMode() as both:
        sum(o.sum() for o in module(*args, *kwargs.values()) if o.is_floating_point()).backward()
    pipe.zero_grad(set_to_none=True)
    return {"forward": {str(k): v for k, v in forward.get_comm_counts().items()},
            "both": {str(k): v for k, v in both.get_comm_counts().items()}}


def _vocab_forms(pipe) -> tuple:
    """How the last stage's loss read its split logits this far ("lowered": a cross entropy
    on the slices, "unread", "gathered"), and whether its graph holds a vocabulary-parallel
    cross entropy; () where this rank holds no last stage with split logits."""
    last = pipe.runtime.workers.get(pipe.runtime.program.num_stages - 1)
    vocab = getattr(last, "loss_vocab", None) if last is not None else None
    if vocab is None:
        return ()
    in_graph = any(getattr(n.target, "__name__", "") == "cross_entropy"
                   for n in last.module.graph.nodes if n.op == "call_function")
    return (*vocab.forms, *(("in graph",) if in_graph else ()))


class _Counting:
    """The all-gathers and all-reduces torch.distributed runs while entered (every thread)."""

    def __init__(self, enabled: bool):
        self.enabled, self.counts = enabled, {"all_gather": 0, "all_reduce": 0}

    def __enter__(self):
        import torch.distributed as dist

        if self.enabled:
            self.saved = {n: getattr(dist, n) for n in self.counts}
            for name, call in self.saved.items():
                setattr(dist, name, self._counted(name, call))
        return self

    def _counted(self, name, call):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return call(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, call in getattr(self, "saved", {}).items():
            setattr(dist, name, call)


def _checkpoint(pipe, opt, directory: str, case: tuple) -> dict:
    """DCP checkpoint of model and optimizer (DTensor shards, original keys); then
    `pipe.save` (every rank) and `pc.load` under the same ranks: the loaded pipeline's
    weights and placements, and one step of it on `case`'s batch (loss, full gradients)."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.distributed.checkpoint_cases import OPTIONS

    model_sd, optim_sd = get_state_dict(pipe, opt, options=OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    args, kwargs, target, loss_fn = case
    path = pipe.save(os.path.join(directory, "plan"))
    loaded = pc.load(path, loss_fn=loss_fn)
    same = {n: str(p.placements) for n, p in loaded.named_parameters()} == \
        {n: str(p.placements) for n, p in pipe.named_parameters()}
    state = {k: _full(v).detach().clone() for k, v in loaded.state_dict().items()}
    loss = loaded.step(*args, target=target, **kwargs).item()
    grads = {n: _full(p.grad).detach().clone() for n, p in loaded.named_parameters()
             if p.grad is not None}
    return {"keys": sorted(model_sd), "loaded": {"state": state, "loss": loss, "grads": grads,
                                                 "placements": same,
                                                 "layout": str(loaded.layout)}}


def run_cases(rank: int, cases: list[tuple], replicas: int = 1,
              directory: str | None = None) -> dict:
    """Each case (model, pipeline devices P, schedule[, "sp": sequence_parallel=True][,
    "vocab": vocab_parallel=True, else False]) on
    P x D x T ranks (D = `replicas`, each taking its 1/D of the batch's rows): one step's loss and full gradients, the local
    and whole sizes of each parameter, the clipped norm, then the user's AdamW step and the
    next step's loss. With `directory`, the first Llama case's model and optimizer after that
    step go to a torch.distributed.checkpoint there, and the pipeline to `pipe.save`, loaded
    back with `pc.load` and stepped (`_checkpoint`)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    results = {}
    for case in cases:
        name, P, schedule = case[:3]
        sp = "sp" in case[3:]  # sequence_parallel=True
        vocab = "vocab" in case[3:]  # vocab_parallel=True (else False: as the other cases)
        T, (model, args, kwargs, target, loss_fn) = replica_case(
            name, P, replicas, rank, dist.get_world_size())
        pipe = pc.compile(model, example_inputs=args, example_kwargs=kwargs, devices=P,
                          data_parallel=replicas, tensor_parallel=T, loss_fn=loss_fn,
                          schedule=schedule, microbatches=2, timeout=300,
                          sequence_parallel=sp, vocab_parallel=vocab)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        comms = _comm_counts(pipe, args, kwargs) if P == 1 and replicas == 1 else None
        with _Counting("vocab" in case[3:]) as stepping:
            loss = pipe.step(*args, target=target, **kwargs)
        grads = {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters()
                 if p.grad is not None}
        sizes = {n: (local_tensor(p).numel(), p.numel(), type(p).__name__)
                 for n, p in pipe.named_parameters()}
        values = {n: _full(p).detach().clone() for n, p in pipe.named_parameters()}
        placements = {n: list(getattr(p, "placements", ())) for n, p in pipe.named_parameters()}
        state = {k: _full(v).detach().clone() for k, v in pipe.state_dict().items()}
        norm = pipe.clip_grad_norm_(1e9).item()
        torch_norm = (_full(torch.nn.utils.clip_grad_norm_(pipe.parameters(), 1e9)).item()
                      if P == 1 and replicas == 1 else None)
        opt.step()
        opt.zero_grad()
        saved = None
        if directory is not None and name == "llama" and not any(
                r["saved"] for r in results.values()):
            saved = _checkpoint(pipe, opt, directory, (args, kwargs, target, loss_fn))
        loss2 = pipe.step(*args, target=target, **kwargs)
        if saved is not None:  # the step the loaded pipeline took, in the original
            saved["grads2"] = {n: _full(p.grad).detach().clone()
                               for n, p in pipe.named_parameters() if p.grad is not None}
        evaluated = pipe.eval_step(*args, target=target, **kwargs).item()
        with torch.no_grad():  # this replica's rows: the global loss with one replica only
            forward = loss_fn(pipe(*args, **kwargs), target).item() if replicas == 1 else None
        results[tuple(case)] = {
            "loss": loss.item(), "grads": grads, "sizes": sizes, "values": values,
            "state": state, "placements": placements, "norm": norm, "torch_norm": torch_norm, "comms": comms,
            "step_comms": stepping.counts if stepping.enabled else None,
            "vocab_loss": _vocab_forms(pipe),
            "loss2": loss2.item(), "eval": evaluated, "forward": forward, "saved": saved,
            "explain": pipe.explain(),
            "layout": (pipe.layout.pipeline, pipe.layout.data_parallel,
                       pipe.layout.tensor_parallel),
            "sp": pipe.layout.sequence_parallel,
            "dtensor": all(isinstance(p, DTensor) for p in pipe.parameters())}
        dist.barrier()
    return results


def replica_case(name: str, P: int, replicas: int, rank: int, world: int):
    """T for `world` ranks of P x replicas x T, and model `name`'s case with this rank's
    replica's share of the global batch (args and target chunked over the replicas)."""
    T = world // (P * replicas)
    model, args, kwargs, target, loss_fn = MODELS[name]()
    replica = rank // (P * T)
    args = tuple(a.chunk(replicas)[replica] for a in args)
    return T, (model, args, kwargs,
               target.chunk(replicas)[replica] if target is not None else None, loss_fn)


def plan_once(models: list[tuple[str, int, int]],
              meta: tuple[tuple[str, int], ...] = ()) -> None:
    """`run_ranks(warm=...)` of a tensor-parallel job: each (model, pipeline devices P,
    replicas D) planned once on one process, on each replica's batch in 2 micro-batches over P
    devices (and each (model, D) of `meta` built on meta, on one device), so that the ranks forked
    after find its capture and symbolic costs in `pipecompile.default_cache`. Nothing runs:
    a plan, no pipeline (no thread is left to fork)."""
    from tests.distributed.ranks import plan_first

    wanted = {(name, P, D, False) for name, P, D in models}
    wanted |= {(name, 1, D, True) for name, D in meta}
    for name, P, D, on_meta in sorted(wanted):
        for replica in range(D):  # a slice's offset is part of a capture's key
            with pc.meta_parameters() if on_meta else contextlib.nullcontext():
                _, (model, args, kwargs, _, loss_fn) = replica_case(name, P, D, replica * P,
                                                                    P * D)
            plan_first(model, args, kwargs, devices=P, loss_fn=loss_fn, microbatches=2,
                       schedule="gpipe")
