"""Train a small transformers Llama (random weights, random token data) as a pipeline.

    torchrun --nproc-per-node 2 examples/train_llm.py --steps 20       # one stage per rank
    python examples/train_llm.py --steps 20 --devices 2                # one process, 2 workers
    torchrun --nproc-per-node 2 examples/train_llm.py --steps 40 --ckpt-every 10 --resume
    torchrun --nproc-per-node 2 examples/train_llm.py --meta --weights DIR   # big-model recipe

`--meta` builds the model with its parameters on the meta device (no weights anywhere), compiles
it, and gives each rank memory for its own stages only (`pipe.to_empty()`), then loads them from
`--weights` (a transformers `save_pretrained` directory, one .safetensors file or a DCP
checkpoint) or initialises them (`pipe.init_weights`, seeded per module name: the same weights
on any number of ranks).

A complete training loop over a `Pipeline`: your AdamW over `pipe.parameters()`, linear warmup
then cosine decay (LambdaLR), global-norm clipping with `pipe.clip_grad_norm_`, bf16 autocast
around `pipe.step` (`--no-autocast` for float32), validation with `pipe.eval_step` on a held-out
batch, and torch.distributed.checkpoint saves of model, optimizer, scheduler and step that
`--resume` continues from exactly: batch `s` is drawn from a generator seeded by `s`, so a
resumed run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.optim.lr_scheduler import LRScheduler
from transformers import LlamaConfig, LlamaForCausalLM

import pipecompile as pc

# Each rank's optimizer holds only its own stages' parameters: flattened, the optimizer state
# is keyed by parameter name and loads on any stage count.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
VAL_SEED = 2**40  # the held-out batch; training step s uses seed * 1_000_003 + s, far below


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="train until this step (1-based)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step (default: the library's)")
    p.add_argument("--devices", type=int, default=2,
                   help="pipeline stages without torchrun (with torchrun: one per rank)")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=5, help="linear warmup steps")
    p.add_argument("--no-autocast", action="store_true", help="float32, no bf16 autocast")
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--ckpt-dir", default="checkpoints/llm")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--meta", action="store_true",
                   help="build on meta; each rank materialises only its stages")
    p.add_argument("--weights", default=None,
                   help="with --meta: load from this checkpoint (else initialise)")
    return p.parse_args(argv)


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """A small Llama: no KV cache (capture needs use_cache=False), no dropout."""
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim,
                       intermediate_size=4 * args.dim, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
                       max_position_embeddings=args.seq, use_cache=False,
                       attn_implementation="sdpa")


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """The same random initial weights on every rank (seeded); with --meta, parameters on the
    meta device and buffers real (the RoPE table), as transformers checkpoints expect."""
    torch.manual_seed(args.seed)
    if args.meta:
        with pc.meta_parameters():
            return LlamaForCausalLM(llama_config(args))
    return LlamaForCausalLM(llama_config(args))


def materialise(args: argparse.Namespace, pipe: pc.Pipeline, model: LlamaForCausalLM) -> str:
    """--meta: this rank's stages get memory, then weights from --weights or initialised."""
    pipe.to_empty()
    if args.weights:
        result = pipe.load_weights(args.weights)
        if result.missing_keys:
            raise SystemExit(f"{args.weights} lacks {result.missing_keys[:5]}")
        return f"loaded this rank's tensors from {args.weights}"
    torch.manual_seed(args.seed)
    pipe.init_weights(fn=model._init_weights)  # transformers' own per-module initialisation
    return "initialised this rank's tensors (seeded per module name)"


def causal_lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; `target` is the input shifted by one token."""
    logits = out.logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(args: argparse.Namespace, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random sequences with a learnable rule (a random start and stride per sequence), drawn
    from a generator seeded by `seed`: step s always gets the same batch."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 4, (args.batch, 1), generator=g)
    tokens = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup to 1 over `warmup` steps, then cosine decay to `floor` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def checkpoint_path(args: argparse.Namespace, step: int) -> str:
    """One directory per saved step: a failed save leaves the older ones intact."""
    return os.path.join(args.ckpt_dir, f"step_{step:06d}")


def latest_checkpoint(args: argparse.Namespace) -> int | None:
    """The highest step with a complete checkpoint (DCP writes `.metadata` last)."""
    if not os.path.isdir(args.ckpt_dir):
        return None
    steps = [int(name[5:]) for name in os.listdir(args.ckpt_dir)
             if name.startswith("step_") and name[5:].isdigit()
             and os.path.exists(os.path.join(args.ckpt_dir, name, ".metadata"))]
    return max(steps, default=None)


def training_state(pipe: pc.Pipeline, opt: torch.optim.Optimizer, sched: LRScheduler,
                   step: int) -> dict:
    """What a checkpoint holds: model and optimizer (each rank its own stages' tensors, keyed by
    the model's parameter names), the scheduler's state and the step."""
    model_sd, optim_sd = get_state_dict(pipe, opt, options=STATE_OPTIONS)
    return {"model": model_sd, "optim": optim_sd,
            "trainer": {"step": step, "scheduler": sched.state_dict()}}


def save(args: argparse.Namespace, pipe: pc.Pipeline, opt: torch.optim.Optimizer,
         sched: LRScheduler, step: int) -> str:
    """Every rank writes its own stages' tensors (a key held by several ranks once)."""
    path = checkpoint_path(args, step)
    dcp.save(training_state(pipe, opt, sched, step), checkpoint_id=path,
             no_dist=not dist.is_initialized())
    return path


def load(path: str, pipe: pc.Pipeline, opt: torch.optim.Optimizer, sched: LRScheduler) -> int:
    """Load the checkpoint at `path` into pipe, opt and sched; returns its step."""
    state = training_state(pipe, opt, sched, step=-1)  # the structure dcp.load fills in
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(pipe, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=STATE_OPTIONS)
    sched.load_state_dict(state["trainer"]["scheduler"])
    return int(state["trainer"]["step"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ  # torchrun
    devices = int(os.environ["WORLD_SIZE"]) if distributed else args.devices
    rank = int(os.environ.get("RANK", 0))
    log = print if rank == 0 else (lambda *a, **k: None)
    if not distributed:  # dcp warns that it saves and loads in one process: that is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled")

    model = build_model(args)
    example, _ = batch(args, seed=0)
    options = {} if args.microbatches is None else {"microbatches": args.microbatches}
    pipe = pc.compile(model, (example,), devices=devices, schedule=args.schedule,
                      loss_fn=causal_lm_loss, **options)
    log(pipe)
    if args.meta:
        log(materialise(args, pipe, model))

    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.warmup, args.steps))
    step = 0
    if args.resume:
        saved = latest_checkpoint(args)
        if saved is None:
            log(f"no checkpoint in {args.ckpt_dir}: starting at step 0")
        else:
            step = load(checkpoint_path(args, saved), pipe, opt, sched)
            log(f"resumed from {checkpoint_path(args, saved)} at step {step}")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=not args.no_autocast)
    val_x, val_y = batch(args, seed=VAL_SEED)
    pipe.train()
    while step < args.steps:
        step += 1
        x, y = batch(args, seed=args.seed * 1_000_003 + step)
        start = time.perf_counter()
        with autocast:
            loss = pipe.step(x, target=y)
        norm = pipe.clip_grad_norm_(1.0)
        lr = opt.param_groups[0]["lr"]  # the rate this step is taken with
        opt.step()
        sched.step()
        opt.zero_grad()
        seconds = time.perf_counter() - start
        log(f"step {step:4d}/{args.steps} | loss {loss.item():.8f} | lr {lr:.3e} | "
            f"grad norm {norm.item():.4f} | {x.numel() / seconds:,.0f} tok/s", flush=True)
        if args.val_every and step % args.val_every == 0:
            with autocast:
                val = pipe.eval_step(val_x, target=val_y)
            log(f"val  {step:4d}/{args.steps} | loss {val.item():.8f}", flush=True)
        if args.ckpt_every and step % args.ckpt_every == 0:
            log(f"saved {save(args, pipe, opt, sched, step)}", flush=True)


if __name__ == "__main__":
    main()
